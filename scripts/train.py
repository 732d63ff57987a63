"""mlfabric's main job: data-parallel or parameter-server training of a small model, out of the box.

    mpirun -n 4 python scripts/train.py                       # allreduce (Horovod-style), digits
    mpirun -n 4 python scripts/train.py --mode ps-async --tau-max 4
    mpirun -n 6 python scripts/train.py --mode ps-sync --stragglers C2 --network N1 --plot acc.png
    mpirun -n 4 python scripts/train.py --device cuda          # a GPU per rank, over NCCL
    mpirun --with-ft ulfm --mca mpi_ft_detector true -n 4 python scripts/train.py --elastic \\
        --kill-rank 1@3                                      # rank 1 dies; the others go on

Modes: allreduce (mlfabric.torch.DistributedOptimizer: every rank trains), ps-async (mlfabric-A:
scheduled, aggregated, bounded staleness tau_max), ps-sync (mlfabric-S), ssp (slack --slack),
vanilla (a plain asynchronous parameter server). In the parameter-server modes rank 0 schedules,
rank 1 serves (ranks 1..S with --servers S), then --replicas replica ranks, and the rest are
workers: `-n 4` gives 2 workers. Data: scikit-learn's digits (8x8 images, 10 classes) split 80/20,
or --dataset synthetic (seeded blobs, no dependency); each worker trains on its own shard.
--stragglers C1..C3 stretch workers' steps as in the paper (on top of --compute-ms of emulated
compute per step); --network N1..N3 paces the parameter-server data plane at emulated NIC rates
(--base-rate bytes/s stands for the paper's 10 Gbps).
The allreduce mode trains on the GPUs when every rank has one of its own (--device auto, the
default; cuda insists, cpu declines); the parameter-server modes train on the CPU. With
--elastic (allreduce mode, under ULFM) the epochs run inside mlfabric.torch.elastic.run, committed
after each: when a rank dies the survivors redo the epoch it died in on shards re-split among
them, and carry on; --kill-rank R@E makes rank R SIGKILL itself as epoch E starts, to watch it;
--replace N spawns new processes in place of the dead (up to N over the job), which join at
their hvd.init() and take the survivors' state, so the job goes on at its full size.
Every worker takes the same steps per epoch (the largest shard's batches; a shorter shard
repeats a batch), so the modes that wait for every worker's step never wait for one not taken.
Output: a progress bar on the reporting rank (rank 0, or the first worker in the PS modes), one
JSON line per epoch (--metrics FILE), a final summary line (RESULT: steps and test_accuracy are
the reporting rank's; in the PS modes pushed / applied / dropped are the job's, and
final_test_accuracy is the server's model once every worker is done, with one server), and
--plot FILE.png (test accuracy vs time).
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# mlfabric before mpi4py: importing it sets its Open MPI defaults (osc ^ucx where no UCX device
# exists, so no UCX one-sided errors are printed), which must be in place before MPI starts.
import mlfabric  # noqa: E402,F401


PS_MODES = {"ps-async": "async", "ps-sync": "sync", "ssp": "ssp", "vanilla": "vanilla"}
# Options of the parameter-server modes alone, and their defaults: they default to None in the
# parser, so that the allreduce mode can tell one given from the default and refuse it.
PS_DEFAULTS = {"replicas": 0, "servers": 1, "batch_interval": 0.005, "base_rate": 50e6}
MODES = ("allreduce",) + tuple(PS_MODES)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="allreduce",
                   help="allreduce (DistributedOptimizer) or a parameter-server mode (above)")
    p.add_argument("--model", choices=("mlp", "convnet", "logreg"), default="mlp")
    p.add_argument("--dataset", choices=("digits", "synthetic"), default="digits")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 0.1 for allreduce and ps-sync, 0.06 / workers "
                        "for the asynchronous modes, whose updates are applied one by one); "
                        "epoch e of E uses lr * (1 + cos(pi e / E)) / 2")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--tau-max", type=float, default=None,
                   help="ps-async: staleness bound, >= 1 (default: none)")
    p.add_argument("--div-max", type=float, default=None,
                   help="with --replicas: the replicas' divergence bound (default: none)")
    p.add_argument("--slack", type=int, default=None, help="ssp: K (default 2)")
    # (PS_DEFAULTS' options default to None here, filled in by parse())
    p.add_argument("--batch-interval", type=float, default=None,
                   help="parameter-server modes: the scheduler plans every this many seconds "
                        "(default 0.005: the paper's 0.1 s suits its 100 ms steps; these steps "
                        "take ~ms)")
    p.add_argument("--servers", type=int, default=None,
                   help="parameter-server modes: server ranks (the model sharded over them; "
                        "default 1)")
    p.add_argument("--replicas", type=int, default=None,
                   help="parameter-server modes: replica ranks of the servers (default 0)")
    p.add_argument("--stragglers", choices=("C1", "C2", "C3"), default=None,
                   help="the paper's straggler presets")
    p.add_argument("--network", choices=("N0", "N1", "N2", "N3"), default=None,
                   help="N0 (constant base rate), N1, N2 or N3: pace the parameter-server data "
                        "plane (default: not paced)")
    p.add_argument("--base-rate", type=float, default=None,
                   help="with --network: bytes/s for 10 Gbps (default 50e6)")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="emulated compute per step (default 0, or 20 with --stragglers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", default=None, help="write per-epoch JSON lines here")
    p.add_argument("--plot", default=None, help="write test accuracy vs time here (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--elastic", action="store_true",
                   help="allreduce mode: survive ranks that die (run under mpirun --with-ft ulfm "
                   "--mca mpi_ft_detector true)")
    p.add_argument("--kill-rank", default=None, metavar="R@E",
                   help="with --elastic: rank R SIGKILLs itself as epoch E starts")
    p.add_argument("--replace", type=int, default=None, metavar="N",
                   help="with --elastic: spawn up to N new processes over the job's life to "
                   "replace ranks that die, so training goes on at its full size (sets "
                   "MLFABRIC_ELASTIC_REPLACE)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="allreduce mode: train on GPU local_rank over NCCL (cuda), or on the CPU; "
                   "auto takes the GPUs when every rank has one of its own")
    args = p.parse_args(argv)
    if args.network and args.mode == "allreduce":
        p.error("--network emulates NIC rates on the parameter-server data plane; the allreduce "
                "mode runs on the shared-memory engine, which is not paced")
    for name in PS_DEFAULTS:
        if getattr(args, name) is not None and args.mode == "allreduce":
            p.error(f"--{name.replace('_', '-')} is for the parameter-server modes")
    if args.base_rate is not None and not args.network:
        p.error("--base-rate sets the pace of --network's links: without --network the data "
                "plane is not paced")
    if args.device == "cuda" and args.mode != "allreduce":
        p.error("--device cuda is for --mode allreduce: the parameter-server modes train on the "
                "CPU (their updates travel through the host data plane)")
    if args.elastic and args.mode != "allreduce":
        p.error("--elastic is for --mode allreduce")
    if args.kill_rank is not None:
        try:
            args.kill_rank = tuple(int(v) for v in args.kill_rank.split("@"))
            assert len(args.kill_rank) == 2
        except (ValueError, AssertionError):
            p.error(f"--kill-rank takes RANK@EPOCH, got {args.kill_rank!r}")
        if not args.elastic:
            p.error("--kill-rank is for trying --elastic")
        # (a rank beyond the job's size is refused in main(), once the size is known)
        if args.kill_rank[0] < 0 or not 0 <= args.kill_rank[1] < args.epochs:
            p.error(f"--kill-rank {args.kill_rank[0]}@{args.kill_rank[1]}: no such rank or "
                    f"epoch (ranks from 0, epochs 0..{args.epochs - 1}), so no rank would die")
    if args.replace is not None and (not args.elastic or args.replace < 0):
        p.error("--replace N (N >= 0) is for --elastic")
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be >= 1")
    # Checked here, before any rank starts MPI: a value only some roles read (the workers'
    # optimizer, the reporting rank's files) would fail there alone and leave the others
    # waiting for MLFABRIC_TIMEOUT.
    for name in ("lr", "momentum", "div_max", "compute_ms", "slack", "replicas"):
        value = getattr(args, name)
        if value is not None and not value >= 0:  # (NaN too)
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.tau_max is not None and not args.tau_max >= 1:
        p.error(f"--tau-max must be >= 1, got {args.tau_max}: an update's delay is 1 at least "
                "(the version it makes minus the one it was computed from), so a smaller bound "
                "would drop every update")
    if args.servers is not None and args.servers < 1:
        p.error(f"--servers must be >= 1, got {args.servers}")
    if args.batch_interval is not None and not 0 < args.batch_interval < math.inf:
        p.error(f"--batch-interval must be a positive number of seconds, got "
                f"{args.batch_interval}")
    if args.base_rate is not None and not args.base_rate > 0:
        p.error(f"--base-rate must be > 0 bytes/s, got {args.base_rate}")
    for name, needs in (("tau_max", ("ps-async",)), ("slack", ("ssp",))):
        if getattr(args, name) is not None and args.mode not in needs:
            p.error(f"--{name.replace('_', '-')} is for --mode {' / '.join(needs)} (the other "
                    "modes do not bound it)")
    if args.div_max is not None and not args.replicas:
        p.error("--div-max bounds the replicas' divergence: it needs --replicas")
    if args.compute_ms == 0 and args.stragglers:
        p.error("--stragglers stretch the emulated compute: --compute-ms 0 leaves none")
    for name in ("metrics", "plot"):
        path = getattr(args, name)
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if path and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            p.error(f"--{name} {path}: {folder} is not a folder this process can write to")
        # else only the reporting rank would fail, at open, and the others wait for it
        if path and os.path.isdir(path):
            p.error(f"--{name} {path} is a folder: give a file name")
        if path and os.path.exists(path) and not os.access(path, os.W_OK):
            p.error(f"--{name} {path}: this process cannot write to that file")
    if args.plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib (pip install matplotlib)")
    args.tau_max = math.inf if args.tau_max is None else args.tau_max
    args.div_max = math.inf if args.div_max is None else args.div_max
    args.slack = 2 if args.slack is None else args.slack
    for name, default in PS_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.compute_ms is None:
        args.compute_ms = 20.0 if args.stragglers else 0.0
    return args


def emulation(args):
    from mlfabric.emulate import Emulation
    # without --network the data plane is not paced: links as fast as this machine's
    return Emulation(compute=args.stragglers or "C0", network=args.network or "N0",
                     base_rate=args.base_rate if args.network else None, seed=args.seed)


class Reporter:
    """Per-epoch metrics on the reporting rank: JSON lines, the progress bar, the plot."""

    def __init__(self, args, steps, active):
        from mlfabric._core.progress import Progress
        self.args, self.active, self.rows = args, active, []
        self.bar = Progress(steps, "train %s" % args.mode, enabled=active and not args.quiet)
        self.out = open(args.metrics, "w") if active and args.metrics else None
        self.t0 = time.monotonic()

    def take_over(self, active):
        """--elastic, after a rank died: whoever is rank 0 now reports. A new reporter appends
        to the metrics file the dead one began, so every epoch and the summary end up in it."""
        if active and not self.out and self.args.metrics:
            self.out = open(self.args.metrics, "a")
        elif not active and self.out:
            self.out.close()
            self.out = None
        self.active = active
        self.bar.enabled = active and not self.args.quiet  # (every rank counts its steps)

    def step(self, loss):
        self.bar.update(1, loss=float(loss))

    def epoch(self, epoch, step, loss, acc):
        row = dict(mode=self.args.mode, epoch=epoch, step=step, time=time.monotonic() - self.t0,
                   loss=float(loss), test_accuracy=float(acc))
        self.rows.append(row)
        if self.out:
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()

    def final(self, **summary):
        if not self.active:
            return
        line = dict(final=True, mode=self.args.mode, model=self.args.model, **summary)
        if self.out:
            self.out.write(json.dumps(line) + "\n")
            self.out.close()
        print("RESULT " + json.dumps(line), flush=True)
        if self.args.plot:
            plot(self.rows, self.args)


def plot(rows, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["time"] for r in rows], [r["test_accuracy"] for r in rows], marker="o")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("%s, %s on %s" % (args.mode, args.model, args.dataset))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


def load_data(args):
    from mlfabric.workloads import data
    if args.dataset == "digits":
        return data.digits(seed=args.seed)
    return data.synthetic_classification(2000, 64, 10, args.seed)


def pick_device(args, comm, hvd):
    """The allreduce mode's device: GPU local_rank when --device cuda (every rank must have one),
    or auto and every rank has one of its own and NCCL loads; else the CPU. Agreed by all ranks:
    a mix would make the first collective a MismatchError."""
    import torch
    from mpi4py import MPI
    from mlfabric._core import config as _config
    if args.device == "cpu":
        return torch.device("cpu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    own = n > 0 and hvd.nccl_built() and (hvd.local_rank() < n or _config.nccl_share_gpu())
    if comm.allreduce(int(own), op=MPI.MIN):
        dev = torch.device("cuda", hvd.local_rank() % n)
        torch.cuda.set_device(dev)
        return dev
    if args.device == "cuda":
        raise SystemExit("train.py: --device cuda needs a GPU for every rank on its host "
                         "(MLFABRIC_NCCL_SHARE_GPU=1 lets ranks share one) and libnccl, on "
                         "every rank; rank %d has %d GPU(s), NCCL %s" % (
                             comm.rank, n, "found" if hvd.nccl_built() else "not found"))
    return torch.device("cpu")


def train_loop(args, model, opt, shard, test, worker, steps, report, compute, device="cpu"):
    """The same loop in every mode: epochs of `steps` steps over this worker's shard, emulated
    compute per step."""
    step, loss, acc = 0, float("nan"), float("nan")
    base_lr = [g["lr"] for g in opt.param_groups]
    for epoch in range(args.epochs):
        step, loss, acc = train_epoch(args, model, opt, shard, test, worker, report, compute,
                                      device, epoch, step, base_lr, steps)
    return step, loss, acc


def train_epoch(args, model, opt, shard, test, worker, report, compute, device, epoch, step,
                base_lr, steps):
    """One epoch over this worker's shard, in `steps` steps (every worker the same: ps-sync,
    ssp and allreduce wait for every worker's step); (steps so far, last loss, test
    accuracy)."""
    import torch
    from mlfabric.workloads import data, models
    X, y = shard
    loss_fn = torch.nn.CrossEntropyLoss()
    loss = float("nan")
    # cosine decay per epoch: the last epochs take small steps, so the final accuracy is the
    # plateau's and not one noisy (stale, in the asynchronous modes) step's
    for g, lr in zip(opt.param_groups, base_lr):
        g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))
    model.train()
    order = list(data.batches(X, y, args.batch_size, args.seed + worker, epoch))
    # shards differ by a sample at most, batch counts by one: a shorter one repeats its first
    # batch (as torch's DistributedSampler pads), so no worker waits for steps never taken
    for xb, yb in (order + order)[:steps]:
        opt.zero_grad()
        out = loss_fn(model(torch.from_numpy(xb).to(device)),
                      torch.from_numpy(yb).long().to(device))
        out.backward()
        if compute is not None:
            time.sleep(compute.time(worker, step))
        opt.step()
        loss = out.item()
        step += 1
        report.step(loss)
    model.eval()
    with torch.no_grad():
        acc = models.accuracy(model, *test)
    report.epoch(epoch, step, loss, acc)
    return step, loss, acc


def train_elastic(args, model, opt, data_xy, test, report, compute, device, hvd):
    """--elastic: the epochs inside hvd.elastic.run, each on this rank's shard of the ranks
    alive, committed after it. Returns (steps, last loss, test accuracy, ranks at the end)."""
    import signal
    from mpi4py import MPI
    from mlfabric.comm import respawn
    from mlfabric.workloads import data
    # a replacement for a dead rank (--replace) runs this program from its start, but never
    # plays the victim of --kill-rank
    me = None if respawn.joining else MPI.COMM_WORLD.rank
    base_lr = [g["lr"] for g in opt.param_groups]
    state = hvd.elastic.TorchState(model, opt, epoch=0, step=0, loss=float("nan"),
                                   acc=float("nan"))

    def on_reset():
        report.take_over(hvd.rank() == 0)  # the summary comes from whoever is rank 0 now
        if report.active:
            print(f"train.py: a rank died; {hvd.size()} rank(s) go on from epoch {state.epoch}"
                  f"{' (replacements included)' if respawn.spawned else ''}", flush=True)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def epochs(state):
        while state.epoch < args.epochs:
            if args.kill_rank == (me, state.epoch):
                os.kill(os.getpid(), signal.SIGKILL)
            shard = data.shard(*data_xy, hvd.rank(), hvd.size())
            state.step, state.loss, state.acc = train_epoch(
                args, model, opt, shard, test, hvd.rank(), report, compute, device, state.epoch,
                state.step, base_lr, epoch_steps(len(data_xy[0]), hvd.size(), args.batch_size))
            state.epoch += 1
            state.commit()
        return state.step, state.loss, state.acc, hvd.size()

    return epochs(state)


def epoch_steps(n, workers, batch_size):
    """Every worker's steps per epoch over n samples: the largest shard's batches."""
    largest = -(-n // workers)  # data.shard's shards differ by one sample at most
    return -(-largest // batch_size)


def main(argv=None):
    args = parse(argv)
    if args.replace is not None:  # read by mlfabric when a rank dies (respawn.py)
        os.environ["MLFABRIC_ELASTIC_REPLACE"] = str(args.replace)
    import torch
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # ranks share the machine's cores
    from mpi4py import MPI
    from mlfabric.workloads import data, models
    comm = MPI.COMM_WORLD
    X, y, Xt, yt = load_data(args)
    in_shape = X.shape[1:]
    model = models.build(args.model, in_shape, 10, args.seed)   # the same on every rank
    try:
        emu = emulation(args)
    except ValueError as e:  # every rank alike: one line each, not a traceback
        raise SystemExit(f"train.py: {e}")
    t0 = time.monotonic()

    if args.mode == "allreduce":
        import mlfabric.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        from mlfabric.comm import respawn
        # every rank knows the size: all refuse alike, before the first collective (not a
        # replacement for a dead rank, which joins a job already past this check)
        if args.kill_rank and args.kill_rank[0] >= size and not respawn.joining:
            raise SystemExit(f"train.py: --kill-rank {args.kill_rank[0]}@{args.kill_rank[1]}: "
                             f"this job has ranks 0..{size - 1}, so no rank would die")
        lr = args.lr if args.lr is not None else 0.1
        device = pick_device(args, comm, hvd)
        model = model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
        if not args.elastic:  # elastic: its first sync broadcasts (a replacement joins there)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        if len(X) < size:  # every rank knows both: all refuse alike
            raise SystemExit(f"train.py: {len(X)} training samples cannot give {size} ranks a "
                             "shard each: run fewer ranks")
        shard = data.shard(X, y, rank, size)
        compute = emu.compute_trace(size, args.compute_ms / 1e3) if args.compute_ms else None
        steps = epoch_steps(len(X), size, args.batch_size)
        report = Reporter(args, args.epochs * steps, rank == 0)
        if args.elastic:
            steps, loss, acc, size = train_elastic(args, model, opt, (X, y), (Xt, yt), report,
                                                   compute, device, hvd)
        else:
            steps, loss, acc = train_loop(args, model, opt, shard, (Xt, yt), rank, steps,
                                          report, compute, device)
        report.final(ranks=size, workers=size, steps=steps, loss=loss, test_accuracy=acc,
                     wall_s=time.monotonic() - t0, device=str(device))
        hvd.shutdown()
        return 0

    from mlfabric.torch.ps_optimizer import PSOptimizer, ps_init, serve_model
    workers_asked = comm.size - 1 - args.servers - args.replicas  # (ps_init checks the rest)
    if len(X) < workers_asked:  # every rank knows both: all refuse alike, before any role waits
        raise SystemExit(f"train.py: {len(X)} training samples cannot give {workers_asked} "
                         "workers a shard each: run fewer ranks")
    from mlfabric.errors import MlfabricError
    try:  # refused on every rank (too few ranks for the roles asked, ...): one line each
        role = ps_init(PS_MODES[args.mode], servers=args.servers, replicas=args.replicas,
                       emulation=emu, slack=args.slack, seed=args.seed,
                       batch_interval=args.batch_interval)
    except (MlfabricError, ValueError) as e:
        raise SystemExit(f"train.py: {e}")
    from mlfabric.runtime.roles import Roles
    roles = Roles(comm.size, args.servers, args.replicas)
    workers = roles.worker_ranks
    if role != "worker":
        summary = serve_model(model)
        if role == "server" and args.servers == 1:
            with torch.no_grad():
                acc = models.accuracy(model, Xt, yt)
            print("server: final model test accuracy %.4f (pushed %d, applied %d, dropped %s)"
                  % (acc, summary.pushed, summary.applied, dict(summary.dropped)), flush=True)
            comm.send(float(acc), dest=roles.worker_ranks[0], tag=_FINAL_TAG)  # for RESULT
        return 0
    w = roles.worker_index(comm.rank)
    sync = args.mode == "ps-sync"
    # asynchronous updates land one by one, several steps stale: a smaller step per update
    lr = args.lr if args.lr is not None else (0.1 if sync else 0.06 / len(workers))
    opt = PSOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum),
                      model.parameters(), tau_max=args.tau_max, div_max=args.div_max)
    shard = data.shard(X, y, w, len(workers))
    compute = emu.compute_trace(len(workers), args.compute_ms / 1e3) if args.compute_ms else None
    steps = epoch_steps(len(X), len(workers), args.batch_size)
    report = Reporter(args, args.epochs * steps, w == 0)
    steps, loss, acc = train_loop(args, model, opt, shard, (Xt, yt), w, steps, report, compute)
    summary = opt.finish()
    # test_accuracy: this worker's model at its last epoch (its last pull); in the asynchronous
    # modes updates still in flight then, and the other workers' later steps, land after it.
    # final_test_accuracy: the server's model once every worker is done (one server; with
    # several, the model is sharded over them and this is left out)
    final = _final_accuracy(comm, roles.server_ranks[0]) \
        if w == 0 and args.servers == 1 else None
    report.final(ranks=comm.size, workers=len(workers), steps=steps, loss=loss,
                 test_accuracy=acc, final_test_accuracy=final, wall_s=time.monotonic() - t0,
                 pushed=summary.pushed, applied=summary.applied, dropped=dict(summary.dropped),
                 balanced=summary.balanced, max_delay=summary.max_delay)
    return 0


_FINAL_TAG = 0x7A11  # the server's final accuracy to the reporting worker (COMM_WORLD)


def _final_accuracy(comm, server):
    """The server's final model accuracy, sent once every worker is done; None if it does not
    come within MLFABRIC_TIMEOUT (the summary is printed anyway)."""
    from mlfabric._core.config import timeout_s
    deadline = time.monotonic() + timeout_s()
    while time.monotonic() < deadline:
        if comm.Iprobe(source=server, tag=_FINAL_TAG):
            return comm.recv(source=server, tag=_FINAL_TAG)
        time.sleep(0.01)
    return None


if __name__ == "__main__":
    sys.exit(main())
