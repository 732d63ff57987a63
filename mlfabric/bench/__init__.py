"""mlfabric.bench: the microbenchmarks, modelled on nccl-tests and the OSU micro-benchmarks.

`mpirun -n N python -m mlfabric.bench COLL ...` (allreduce, broadcast, allgather, reduce_scatter,
alltoall, reduce, sendrecv, pingpong) runs the MPI driver (driver.py: sweep, timing, checking;
impls.py: the mlfabric / hvd / mpi / gloo calls on CPU buffers, and with --device cuda mlfabric's
NCCL path / torch-nccl on GPU buffers; report.py: table, JSON, plot); `python -m mlfabric.bench
kernels|sched|sched-oracle ...` run the single-process benchmarks (kernels.py, sched.py,
sched_oracle.py). The MPI scripts under benchmarks/ are entries of one harness (harness.py:
shared options, one main, the common JSON envelope); benchmarks/gpu_collectives.py is the
driver's GPU mode run in rounds. The driver's modules import mpi4py, torch and mlfabric's API
only where they use them. See benchmarks/README.md.
"""
