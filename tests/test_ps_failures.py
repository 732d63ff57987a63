"""Failures under ULFM (mpirun --with-ft ulfm): a rank is killed with SIGKILL mid-job and the
survivors finish (or, when nothing can save the job, all get a clear error). The jobs are in
tests/mpi_cases/ps_failures.py; each surviving rank prints 'RESULT ok' or 'RESULT FAIL ...'."""
import pytest

from .mpi_util import run_mpi

ULFM = ("--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true")


@pytest.mark.mpi
@pytest.mark.parametrize("scenario, n", [("server-replica", 6), ("server-replica", 5),
                                         ("server-alone", 5), ("worker-async", 5),
                                         ("worker-async", 6), ("worker-sync", 6),
                                         ("relay-sync", 5), ("relay-sync", 6)])
def test_a_killed_rank(scenario, n, tmp_path):
    proc = run_mpi(n, ["-m", "tests.mpi_cases.ps_failures", scenario, str(tmp_path)],
                   timeout=120, env={"MLFABRIC_TIMEOUT": "10"}, mpirun_args=ULFM)
    out = proc.stdout
    assert "RESULT FAIL" not in out, out
    assert proc.returncode == 0, out  # the survivors' exit too (a dead peer can hold it up)
    assert out.count("RESULT ok") == n - 1, out  # every survivor, and only survivors
