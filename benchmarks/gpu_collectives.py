"""GPU collectives: mlfabric (its NCCL path, blocking calls) beside torch.distributed's NCCL
backend (each call followed by a stream synchronize, so both are timed to completion), in one
MPI job, alternating round by round. Per size: the median over rounds of each round's mean time
per call (the slowest rank's), algbw and busbw as nccl-tests define them, and a check of every
result against a float64 reference.

    mpirun -n N python benchmarks/gpu_collectives.py [--colls allreduce,allgather,broadcast
        --min-bytes 1024 --max-bytes 256M --iters 20 --rounds 5 --out results.json]

With fewer GPUs than ranks on the host, every rank claims a host of its own for NCCL
(NCCL_HOSTID; mlfabric's MLFABRIC_NCCL_SHARE_GPU=1 does the same), so several ranks share one
GPU through NCCL's socket transport: then the numbers measure the two libraries' overheads over
the same transport, not what a GPU interconnect would carry.
"""
import os
import socket
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlfabric.bench import harness  # noqa: E402
from mlfabric.bench.script import byte_size, positive_int  # noqa: E402


BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0}


def options(p):
    p.add_argument("--colls", default="allreduce,allgather,broadcast")
    p.add_argument("--min-bytes", type=byte_size, default="1K")
    p.add_argument("--max-bytes", type=byte_size, default="256M")
    p.add_argument("--factor", type=positive_int, default=4, help="size factor (>= 2)")
    harness.add_iters(p, 20, "timed calls per round")
    harness.add_rounds(p, 5)
    harness.add_out(p)


def check(p, args):
    if args.factor < 2 or args.min_bytes > args.max_bytes:
        p.error("need --factor >= 2 and --min-bytes <= --max-bytes")


def run(world, args):
    rank, size = world.rank, world.size

    import torch
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    shared = torch.cuda.device_count() < local.size
    if shared:  # before either library creates its first NCCL communicator
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-bench-rank{rank}"
        os.environ["MLFABRIC_NCCL_SHARE_GPU"] = "1"
    dev = torch.device("cuda", local.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)

    import torch.distributed as dist
    import mlfabric as mf
    from mlfabric.comm import nccl
    mf.init()
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, device_id=dev)

    def mlfabric_call(coll, x, out):
        if coll == "allreduce":
            mf.allreduce(x, out=out)
        elif coll == "allgather":
            mf.allgather(x, out=out)
        else:
            mf.broadcast(x, root=0)

    def torch_call(coll, x, out):
        if coll == "allreduce":
            out.copy_(x)
            dist.all_reduce(out)
        elif coll == "allgather":
            dist.all_gather_into_tensor(out, x)
        else:
            dist.broadcast(x, src=0)
        torch.cuda.synchronize(dev)

    impls = {"mlfabric": mlfabric_call, "torch-nccl": torch_call}
    sizes, b = [], args.min_bytes
    while b <= args.max_bytes:
        sizes.append(b)
        b *= args.factor
    rows = []
    for coll in args.colls.split(","):
        for nbytes in sizes:
            count = nbytes // 4
            x = torch.arange(count, dtype=torch.float32, device=dev) % 1000 + rank
            out_n = count * size if coll == "allgather" else count
            outs = {name: torch.empty(out_n, dtype=torch.float32, device=dev) for name in impls}
            # the check: one call each, against float64
            base = np.arange(count, dtype=np.float64) % 1000
            want = {"allreduce": size * base + size * (size - 1) / 2,
                    "allgather": np.concatenate([base + q for q in range(size)]),
                    "broadcast": base}[coll]
            wrong = {}
            for name, call in impls.items():
                xi = x.clone()
                call(coll, xi, outs[name])
                got = (xi if coll == "broadcast" else outs[name]).double().cpu().numpy()
                wrong[name] = int(np.count_nonzero(np.abs(got - want) > 1e-6 * np.abs(want) + 1e-6))
            times = {name: [] for name in impls}
            for rnd in range(args.rounds):
                order = list(impls) if rnd % 2 == 0 else list(impls)[::-1]
                for name in order:
                    impls[name](coll, x, outs[name])  # warm-up
                    world.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        impls[name](coll, x, outs[name])
                    dt = (time.perf_counter() - t0) / args.iters
                    times[name].append(world.allreduce(dt, op=MPI.MAX))
            row = {"coll": coll, "bytes": nbytes, "ranks": size, "wrong": wrong}
            for name in impls:
                t = statistics.median(times[name])
                algbw = nbytes / t / 1e9
                row[name] = {"us": t * 1e6, "algbw_GBs": algbw,
                             "busbw_GBs": algbw * BUS_FACTOR[coll](size), "rounds_s": times[name]}
            row["torch_over_mlfabric"] = row["torch-nccl"]["us"] / row["mlfabric"]["us"]
            rows.append(row)
            if rank == 0:
                print(f"{coll:9s} {nbytes:>11d} B  mlfabric {row['mlfabric']['us']:10.1f} us "
                      f"busbw {row['mlfabric']['busbw_GBs']:7.2f} GB/s | torch-nccl "
                      f"{row['torch-nccl']['us']:10.1f} us busbw "
                      f"{row['torch-nccl']['busbw_GBs']:7.2f} GB/s | torch/mlfabric "
                      f"{row['torch_over_mlfabric']:5.2f} | wrong {wrong}", flush=True)
    doc = None
    if rank == 0:
        doc = {"command": "mpirun -n %d python %s" % (size, " ".join(sys.argv)),
               "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())),
               "mlfabric_nccl": nccl.version(), "ranks_share_one_gpu": shared,
               "rows": rows}
    dist.destroy_process_group()
    mf.finalize()
    return doc


ENTRY = harness.Entry("gpu_collectives", __doc__, options, run, check)

if __name__ == "__main__":
    harness.main(ENTRY)
