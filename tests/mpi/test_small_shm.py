"""A small /dev/shm (Docker's default is 64 MiB) under real mpirun: shared allocations that do not
fit are an error on every rank naming /dev/shm and how to enlarge it (or a fallback to private
memory where the owner can do without), never a hang (tests/mpi_cases/small_shm_cases.py). The
jobs run in a private mount namespace with a 64 MiB tmpfs over /dev/shm; skipped where this
machine does not allow that."""
import pytest

from tests.mpi_util import run_cases, run_mpi, small_shm_prefix


def _prefix():
    prefix, why = small_shm_prefix("64m")
    if prefix is None:
        pytest.skip(f"cannot give a job a small /dev/shm here ({why})")
    return prefix


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_small_shm(n):
    run_cases("small_shm_cases", n, timeout=240, env={"MLFABRIC_TIMEOUT": "10"},
              prefix=_prefix())


@pytest.mark.mpi
def test_mpi_failing_after_the_check_ends_the_job_bounded():
    # Open MPI's allocation fails on rank 0 (the space check made to pass): its peer is left
    # inside MPI for good, so the job cannot end cleanly, but it must end, and rank 0's
    # finalize() must return
    proc = run_mpi(2, ["-m", "tests.mpi_cases.small_shm_cases", "mpi-fails"], timeout=120,
                   env={"MLFABRIC_TIMEOUT": "3"}, prefix=_prefix())
    out = proc.stdout
    assert "rank 0: ShmAllocError: shared_empty: MPI could not allocate" in out, out
    assert "/dev/shm" in out and "--shm-size" in out, out
    assert "rank 0: finalized" in out, out
    assert proc.returncode != 0, out  # the job was ended, not finished


@pytest.mark.mpi
def test_bench_shared_buffer_too_large_is_reported():
    # `bench allreduce -b 64G` on 64 MiB: the shared variant's case is an error on every rank
    # naming /dev/shm, and the run goes on to its end
    proc = run_mpi(2, ["-m", "mlfabric.bench", "allreduce", "-b", "64G", "-e", "64G",
                       "--impl", "mlfabric-shared", "--iters", "1", "--warmup", "0"],
                   timeout=180, env={"MLFABRIC_TIMEOUT": "10"}, prefix=_prefix())
    assert "/dev/shm" in proc.stdout and "--shm-size" in proc.stdout, proc.stdout
