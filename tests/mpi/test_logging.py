"""MLFABRIC_LOG_LEVEL under real mpirun: at info each rank names, on stderr, the backend and path
an allreduce takes once per size class; at the default level it says nothing; a misspelled
MLFABRIC_* variable is warned about at init."""
import re

import pytest

from tests.mpi_util import run_mpi

# Two sizes, each called three times (the direct path, a plan per shape) plus one more shape in
# the first size class, then a shared buffer (zero-copy) and an MPI algorithm by name.
JOB = """
import numpy as np, mlfabric as mf
mf.init()
for n in (1000, 1000, 1000, 1001, 1 << 20, 1 << 20, 1 << 20):
    assert mf.allreduce(np.ones(n, np.float32))[0] == mf.size()
for _ in range(2):
    assert mf.allreduce(np.ones(1000, np.float32), algorithm="ring")[0] == mf.size()
    x = mf.shared_zeros((1 << 20,), np.float32)
    x[:] = 1
    mf.allreduce(x, out=x)
    assert x[0] == mf.size()
print("DONE", mf.rank(), flush=True)
mf.finalize()
"""


@pytest.mark.mpi
def test_info_names_the_path_once_per_size_class():
    proc = run_mpi(2, ["-c", JOB], timeout=180, env={"MLFABRIC_LOG_LEVEL": "info"})
    out = proc.stdout
    assert proc.returncode == 0 and out.count("DONE") == 2, out
    for rank in (0, 1):
        lines = [line for line in out.splitlines()
                 if line.startswith(f"[mlfabric rank {rank}] INFO comm: ")]
        # CMA: allowed where the kernel lets ranks read each other (not in every container)
        big = re.escape("allreduce 4.0 MiB float32 on 2 ranks -> shm (") + \
            "(single-copy CMA|staged)" + re.escape(")")
        assert len(lines) == 4, out
        assert lines[0].endswith("allreduce 3.9 KiB float32 on 2 ranks -> shm (staged)"), out
        assert re.search(big, lines[1]), out
        assert lines[2].endswith("allreduce 3.9 KiB float32 on 2 ranks -> ring"), out
        assert lines[3].endswith(
            "allreduce 4.0 MiB float32 on 2 ranks -> shm (zero-copy shared buffer)"), out


@pytest.mark.mpi
def test_the_default_level_is_quiet_and_misspellings_are_named():
    proc = run_mpi(2, ["-c", JOB], timeout=180, env={"MLFABRIC_SHM_BLOKC": "65536"})
    out = proc.stdout
    assert proc.returncode == 0 and out.count("DONE") == 2, out
    assert "INFO comm" not in out, out
    for rank in (0, 1):
        assert f"[mlfabric rank {rank}] WARNING mlfabric: MLFABRIC_SHM_BLOKC is not an mlfabric " \
               "setting (ignored); did you mean MLFABRIC_SHM_BLOCK?" in out, out
