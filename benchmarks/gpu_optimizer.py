"""DistributedOptimizer on GPUs: a training step of an MLP on CUDA, mlfabric.torch's
DistributedOptimizer (gradient hooks start bucket allreduces over NCCL during backward) beside
torch's DistributedDataParallel on torch.distributed's NCCL backend, in one MPI job, variants
alternating round by round:

    alone     rank 0 alone, no communication, the others asleep: the single-process step
    hvd       DistributedOptimizer
    ddp-nccl  DistributedDataParallel, NCCL backend

Each step is timed to completion (a device synchronize at its end) and split: forward, backward
(host time to queue it), sync (DistributedOptimizer.synchronize(); for DDP nothing: it waits
inside backward) and update (the optimizer step and the device synchronize, so queued GPU work
lands here). Both reduced variants take the same steps from the same weights on the same data:
their weights must agree at the end (float32, checked).

    mpirun -n N python benchmarks/gpu_optimizer.py [--inputs 2048 --hidden 2048 --layers 6
        --batch 4096 --steps 5 --rounds 5 --out results.json]

With fewer GPUs than ranks on the host the ranks share one GPU (NCCL_HOSTID per rank, and
MLFABRIC_NCCL_SHARE_GPU=1; NCCL's socket transport between them): then their kernels also take
turns on that GPU, and the numbers compare the two libraries under the same constraint.
"""
import json
import os
import socket
import statistics
import sys
import time

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlfabric.bench import harness  # noqa: E402

VARIANTS = ("alone", "hvd", "ddp-nccl")


def options(p):
    p.add_argument("--inputs", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=4096, help="per-rank batch")
    p.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    harness.add_rounds(p, 5, "rounds (alternating variant order)", type=int)
    p.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate (the tests raise "
                   "it, so that an unreduced gradient would move the weights measurably)")
    harness.add_out(p)


def check(p, args):
    for name in ("inputs", "hidden", "layers", "batch", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")


def run(world, args):
    rank, size = world.rank, world.size
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.torch_optimizer import PHASES, mlp, train_steps

    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    if torch.cuda.device_count() < local.size:  # before either library makes a communicator
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-bench-rank{rank}"
        os.environ["MLFABRIC_NCCL_SHARE_GPU"] = "1"
    dev = torch.device("cuda", local.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    import mlfabric.torch as hvd
    hvd.init()
    addr = world.bcast(socket.gethostbyname(socket.gethostname()) if rank == 0 else None)
    port = world.bcast(29500 + os.getpid() % 1000 if rank == 0 else None)
    dist.init_process_group("nccl", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=size, device_id=dev)
    comm = world.Dup()

    gen = torch.Generator(device=dev).manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, args.inputs, device=dev, generator=gen),
                torch.randn(args.batch, 1, device=dev, generator=gen))
               for _ in range(args.steps)]
    runs = {}
    for name in VARIANTS:
        model = mlp(args).to(dev)
        if name == "ddp-nccl":
            model = DDP(model, device_ids=[dev.index])
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        reduce = None
        if name == "hvd":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            reduce = opt.synchronize
        runs[name] = (model, opt, reduce)
    for name, (model, opt, reduce) in runs.items():  # warm-up: buckets, communicators
        comm.Barrier()
        if name != "alone" or rank == 0:
            train_steps(model, opt, batches[:2], dict.fromkeys(PHASES, 0.0), reduce,
                        torch.cuda.synchronize)
    times = {n: [] for n in VARIANTS}
    splits = {n: dict.fromkeys(PHASES, 0.0) for n in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            model, opt, reduce = runs[name]
            comm.Barrier()
            t0 = time.perf_counter()
            if name != "alone" or rank == 0:
                train_steps(model, opt, batches, splits[name], reduce, torch.cuda.synchronize)
            times[name].append((time.perf_counter() - t0) / args.steps)
            comm.Barrier()
    weights = {n: torch.cat([p.detach().reshape(-1) for p in runs[n][0].parameters()])
               for n in ("hvd", "ddp-nccl")}
    diff = (weights["hvd"] - weights["ddp-nccl"]).abs().max().item()
    scale = weights["ddp-nccl"].abs().max().item()
    all_times, all_splits = comm.gather(times, root=0), comm.gather(splits, root=0)
    all_diff = comm.gather(diff, root=0)
    status, out = 0, None
    if rank == 0:
        n_steps = args.rounds * args.steps
        out = {"meta": {"command": harness.command_line(), "ranks": size,
                        "gpu": torch.cuda.get_device_name(dev),
                        "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                        "parameters": sum(p.numel() for p in runs["alone"][0].parameters())},
               "variants": {}}
        for name in VARIANTS:
            ranks = all_times[:1] if name == "alone" else all_times
            per_round = [max(ts) for ts in zip(*(t[name] for t in ranks))]
            ranks_split = all_splits[:1] if name == "alone" else all_splits
            out["variants"][name] = {
                "median_ms": statistics.median(per_round) * 1e3,
                "per_round_ms": [t * 1e3 for t in per_round],
                "split_ms": {k: statistics.mean(s[name][k] for s in ranks_split) / n_steps * 1e3
                             for k in PHASES}}
        v = {n: out["variants"][n]["median_ms"] for n in VARIANTS}
        out["ratios"] = {"hvd / alone": v["hvd"] / v["alone"],
                         "ddp-nccl / hvd": v["ddp-nccl"] / v["hvd"]}
        out["max_abs_weight_diff"] = max(all_diff)
        # float32 sums in different orders over (steps + warm-up) x rounds updates; not (<=)
        # so that a NaN counts as wrong
        out["wrong"] = int(not max(all_diff) <= 1e-4 * max(scale, 1.0))
        status = out["wrong"]
        print(f"{out['meta']['parameters']} parameters, batch {args.batch} per rank, {size} "
              f"ranks on {out['meta']['gpus']} GPU(s) ({out['meta']['gpu']})")
        print(f"{'variant':10} {'step ms':>9} " + " ".join(f"{k:>9}" for k in PHASES))
        for name in VARIANTS:
            r = out["variants"][name]
            print(f"{name:10} {r['median_ms']:9.2f} "
                  + " ".join(f"{r['split_ms'][k]:9.2f}" for k in PHASES))
        print("ratios:", json.dumps({k: round(x, 3) for k, x in out["ratios"].items()}),
              f"max |w_hvd - w_ddp| {out['max_abs_weight_diff']:.2e}")
    status = comm.bcast(status, root=0)
    comm.Free()
    dist.destroy_process_group()
    hvd.shutdown()
    return out, status


ENTRY = harness.Entry("gpu_optimizer", __doc__, options, run, check)

if __name__ == "__main__":
    harness.main(ENTRY)
