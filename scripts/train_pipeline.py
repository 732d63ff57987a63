"""Pipeline-parallel training of a small classifier with mlfabric.pipeline, one stage per rank.

    mpirun -n 4 python scripts/train_pipeline.py --schedule flush --microbatches 4
    mpirun -n 4 python scripts/train_pipeline.py --schedule interleaved --microbatches 4 --chunks 2
    mpirun -n 4 python scripts/train_pipeline.py --schedule 1f1b --vertical-sync
    mpirun -n 3 python scripts/train_pipeline.py --schedule 1f1b --replicas 2,1

Schedules: gpipe, flush (PipeDream-Flush), 2bw (PipeDream-2BW), interleaved (Megatron's 1F1B with
--chunks model pieces per rank), 1f1b (PipeDream with weight stashing, a step per microbatch;
--vertical-sync, --replicas for 1F1B-RR). The model is an MLP (--model mlp) or a small conv body
with a fully connected head (--model convnet), cut into p * v pieces of whole layers; the data are
scikit-learn's digits or seeded Gaussian blobs (--dataset synthetic). One run of the schedule
covers one epoch: its batches (--batch-size, each cut into --microbatches microbatches) in a
seeded shuffled order; 1f1b steps after every microbatch. The last stage reports the mean
microbatch loss per epoch (a progress bar, one line per epoch) and a final line starting with
"RESULT " (JSON: losses per epoch, weight versions and stashed activations per rank).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# mlfabric before mpi4py: importing it sets its Open MPI defaults (osc ^ucx where no UCX device
# exists, so no UCX one-sided errors are printed), which must be in place before MPI starts.
import mlfabric  # noqa: E402,F401

SCHEDULES = ("gpipe", "flush", "1f1b", "2bw", "interleaved")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=SCHEDULES, default="flush")
    p.add_argument("--microbatches", type=int, default=4, help="per batch (m)")
    p.add_argument("--chunks", type=int, default=None,
                   help="model pieces per rank, interleaved only (default 2 there)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
    p.add_argument("--dataset", choices=("digits", "synthetic"), default="digits")
    p.add_argument("--samples", type=int, default=2000, help="synthetic dataset size")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 0.1; 0.02 for 1f1b, which steps per microbatch)")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--vertical-sync", action="store_true", help="1f1b: vertical sync")
    p.add_argument("--replicas", default=None,
                   help="1f1b: ranks per stage, e.g. 2,1 (1F1B-RR; they must add up to the ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.microbatches < 1:
        p.error("--epochs, --batch-size and --microbatches must be >= 1")
    if args.batch_size % args.microbatches:
        p.error("--batch-size (%d) must be a multiple of --microbatches (%d)"
                % (args.batch_size, args.microbatches))
    if args.chunks is not None and args.schedule != "interleaved":
        p.error("--chunks is for --schedule interleaved")
    if args.chunks is None:
        args.chunks = 2 if args.schedule == "interleaved" else 1
    if args.chunks < 1:
        p.error("--chunks must be >= 1")
    if (args.vertical_sync or args.replicas) and args.schedule != "1f1b":
        p.error("--vertical-sync and --replicas are for --schedule 1f1b")
    if args.replicas:
        try:
            args.replicas = tuple(int(x) for x in args.replicas.split(","))
        except ValueError:
            p.error("--replicas takes ints separated by commas, e.g. 2,1")
    if args.lr is None:
        args.lr = 0.02 if args.schedule == "1f1b" else 0.1
    return args


def build_layers(args, in_features, classes, pieces):
    """The model as a list of layers (blocks), at least `pieces` of them, seeded."""
    import torch
    nn = torch.nn
    torch.manual_seed(args.seed)
    hidden = 64
    if args.model == "mlp":
        blocks = [nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU())]
        extra = max(pieces, 4) - 2
    else:
        side = int(round(in_features ** 0.5))
        if side * side != in_features:
            raise SystemExit("convnet needs square images, got %d features" % in_features)
        blocks = [nn.Sequential(nn.Unflatten(1, (1, side, side)), nn.Conv2d(1, 8, 3, padding=1),
                                nn.ReLU()),
                  nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
                  nn.Sequential(nn.Flatten(), nn.Linear(16 * (side // 2) ** 2, hidden),
                                nn.ReLU())]
        extra = max(pieces, 4) - 4
    blocks += [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(extra)]
    blocks.append(nn.Linear(hidden, classes))
    return blocks


def load_data(args):
    from mlfabric.workloads import data
    if args.dataset == "digits":
        return data.digits(seed=args.seed)
    return data.synthetic_classification(args.samples, 64, 10, args.seed)


def epoch_data(X, y, args, epoch):
    """The epoch's batches in their seeded order, concatenated (the last partial batch dropped):
    the schedule cuts them into microbatches, m consecutive ones per batch."""
    import numpy as np
    import torch
    from mlfabric.workloads import data
    xs, ys = [], []
    for xb, yb in data.batches(X, y, args.batch_size, args.seed, epoch, drop_last=True):
        xs.append(xb)
        ys.append(yb)
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def main(argv=None):
    args = parse(argv)
    import torch
    torch.set_num_threads(1)  # ranks share the machine's cores
    from mpi4py import MPI
    from mlfabric.pipeline.stage import PipelineModel, make_schedule
    from mlfabric._core.progress import Progress
    comm = MPI.COMM_WORLD
    X, y, _, _ = load_data(args)
    batches = len(X) // args.batch_size
    if batches < 1:
        raise SystemExit("--batch-size %d is larger than the %d training samples"
                         % (args.batch_size, len(X)))
    try:
        sched = make_schedule(args.schedule, comm.Get_size(), args.microbatches, args.chunks,
                              batches, replicas=args.replicas, vertical_sync=args.vertical_sync)
    except ValueError as e:
        raise SystemExit("train_pipeline.py: %s" % e)
    layers = build_layers(args, X.shape[1], 10, sched.pieces)
    model = PipelineModel(
        layers, schedule=sched, loss_fn=torch.nn.CrossEntropyLoss(),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=args.lr, momentum=args.momentum))
    reporter = model.is_last and model.replica == 0
    bar = Progress(args.epochs, "pipeline %s" % args.schedule,
                   enabled=reporter and not args.quiet)
    losses = []
    t0 = time.monotonic()
    for epoch in range(args.epochs):
        xe, ye = epoch_data(X, y, args, epoch)
        loss = model.train_step(xe, ye)
        if reporter:
            losses.append(loss)
            bar.update(1, loss=loss)
            print("epoch %d loss %.4f" % (epoch, loss), flush=True)
    wall = time.monotonic() - t0
    ex = model.executor
    peaks = comm.gather((ex.peak_versions, ex.peak_stash), root=0)
    peaks = comm.bcast(peaks, root=0)
    if reporter:
        line = dict(schedule=args.schedule, policy=sched.policy, ranks=comm.Get_size(),
                    p=sched.p, m=sched.m, v=sched.v, replicas=list(sched.replicas),
                    microbatches_per_epoch=sched.microbatches, epochs=args.epochs,
                    steps_per_epoch=ex.steps // args.epochs, losses=losses,
                    first_loss=losses[0], final_loss=losses[-1],
                    peak_versions=[pk[0] for pk in peaks], peak_stash=[pk[1] for pk in peaks],
                    model=args.model, dataset=args.dataset, wall_s=wall)
        print("RESULT " + json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
