"""A/B profile of the shared-memory engine's two paths for arbitrary (private) buffers against
MPI, in one job: the staged pipeline, the single-copy path (process_vm_readv) and mpi4py's
in-place Allreduce, interleaved 7 times per size, medians reported. This is the measurement behind
the engine's choice of path (BENCHMARKS.md).

    mpirun -n 2 python benchmarks/shm_paths.py [sizes in MiB, default 1 4 16 64]
"""
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mlfabric as mf
from mlfabric.comm import context


def per_call_us(comm, fn, iters=10):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main():
    mf.init()
    comm = MPI.COMM_WORLD
    engine = context.get().shm.engine
    engine.probe_publish()  # mlfabric probes the single-copy path only for two ranks
    comm.Barrier()
    if comm.allreduce(int(engine.probe_peers()), op=MPI.MIN) == 0:
        raise SystemExit("process_vm_readv is not allowed here: no single-copy path to measure")
    sizes = [int(a) for a in sys.argv[1:]] or [1, 4, 16, 64]
    if comm.rank == 0:
        print(f"# {comm.size} ranks; median us per allreduce (float32 sum, in place)")
        print(f"{'MiB':>5} {'staged':>9} {'single-copy':>12} {'mpi':>9} {'mpi/staged':>11} "
              f"{'mpi/single':>11}")
    for mib in sizes:
        x = np.ones((mib << 20) // 4, np.float32)
        runs = {"staged": [], "single": [], "mpi": []}
        for _ in range(7):
            engine.enable_cma(False, 0, 1 << 40)
            runs["staged"].append(per_call_us(comm, lambda: mf.allreduce(x, out=x)))
            engine.enable_cma(True, 0, 1 << 40)
            runs["single"].append(per_call_us(comm, lambda: mf.allreduce(x, out=x)))
            runs["mpi"].append(per_call_us(comm, lambda: comm.Allreduce(MPI.IN_PLACE, x)))
        med = {k: statistics.median(v) for k, v in runs.items()}
        if comm.rank == 0:
            print(f"{mib:>5} {med['staged']:>9.0f} {med['single']:>12.0f} {med['mpi']:>9.0f} "
                  f"{med['mpi'] / med['staged']:>11.2f} {med['mpi'] / med['single']:>11.2f}")
    mf.finalize()


if __name__ == "__main__":
    main()
