"""A/B profile of the shared-memory engine's two paths for arbitrary (private) buffers against
MPI, in one job: the staged pipeline, the single-copy path (process_vm_readv) and mpi4py's
in-place Allreduce, interleaved 7 times per size, medians reported. This is the measurement behind
the engine's choice of path (BENCHMARKS.md).

    mpirun -n 2 python benchmarks/shm_paths.py [sizes in MiB, default 1 4 16 64]
        [--iters 10 --rounds 7] [--out FILE.json]

Rank 0 prints the table and, with --out, writes the JSON ("results": per size the three
medians in us and every round's times).
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

import mlfabric as mf
from mlfabric.bench import harness
from mlfabric.bench.script import positive_int
from mlfabric.comm import context


def per_call_us(comm, fn, iters=10):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def options(p):
    p.add_argument("sizes", nargs="*", type=positive_int, default=[1, 4, 16, 64],
                   help="sizes in MiB (default 1 4 16 64)")
    harness.add_iters(p, 10, "calls per path per round")
    harness.add_rounds(p, 7, "rounds (the three paths interleaved)")
    harness.add_out(p)


def run(comm, args):
    mf.init()
    engine = context.get().shm.engine
    engine.probe_publish()  # mlfabric probes the single-copy path only for two ranks
    comm.Barrier()
    if comm.allreduce(int(engine.probe_peers()), op=MPI.MIN) == 0:
        raise SystemExit("process_vm_readv is not allowed here: no single-copy path to measure")
    sizes, results = args.sizes, []
    if comm.rank == 0:
        print(f"# {comm.size} ranks; median us per allreduce (float32 sum, in place)")
        print(f"{'MiB':>5} {'staged':>9} {'single-copy':>12} {'mpi':>9} {'mpi/staged':>11} "
              f"{'mpi/single':>11}")
    for mib in sizes:
        x = np.ones((mib << 20) // 4, np.float32)
        runs = {"staged": [], "single": [], "mpi": []}
        for _ in range(args.rounds):
            engine.enable_cma(False, 0, 1 << 40)
            runs["staged"].append(per_call_us(comm, lambda: mf.allreduce(x, out=x), args.iters))
            engine.enable_cma(True, 0, 1 << 40)
            runs["single"].append(per_call_us(comm, lambda: mf.allreduce(x, out=x), args.iters))
            runs["mpi"].append(per_call_us(comm, lambda: comm.Allreduce(MPI.IN_PLACE, x),
                                           args.iters))
        med = {k: statistics.median(v) for k, v in runs.items()}
        results.append({"mib": mib, "median_us": med, "per_round_us": runs})
        if comm.rank == 0:
            print(f"{mib:>5} {med['staged']:>9.0f} {med['single']:>12.0f} {med['mpi']:>9.0f} "
                  f"{med['mpi'] / med['staged']:>11.2f} {med['mpi'] / med['single']:>11.2f}")
    mf.finalize()
    return {"meta": {"ranks": comm.size, "iters": args.iters, "rounds": args.rounds},
            "results": results} if comm.rank == 0 else None


ENTRY = harness.Entry("shm_paths", __doc__, options, run)

if __name__ == "__main__":
    harness.main(ENTRY)
