"""mlfabric.bench: the microbenchmarks, modelled on nccl-tests and the OSU micro-benchmarks.

`mpirun -n N python -m mlfabric.bench allreduce|broadcast|allgather|reduce_scatter|pingpong ...`
runs the MPI driver (driver.py: sweep, timing, checking; impls.py: mlfabric / mpi / gloo calls;
report.py: table, JSON, plot); `python -m mlfabric.bench kernels ...` runs the single-process kernel
benchmark (kernels.py). The MPI scripts under benchmarks/ are entries of one driver
(harness.py: shared options, one main, the common JSON envelope). The driver's modules import
mpi4py, torch and mlfabric's API only where they use them. See benchmarks/README.md.
"""
