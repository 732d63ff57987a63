"""Failures under ULFM (mpirun --with-ft ulfm): a rank is killed with SIGKILL mid-job and the
survivors finish (or, when nothing can save the job, all get a clear error). The jobs are in
tests/mpi_cases/ps_failure_job.py; each surviving rank prints 'RESULT ok' or 'RESULT FAIL ...'."""
import pytest

from tests.mpi_util import run_mpi

ULFM = ("--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true")


@pytest.mark.mpi
@pytest.mark.parametrize("scenario, n", [("server-replica", 6), ("server-replica", 5),
                                         ("server-alone", 5), ("worker-async", 5),
                                         ("worker-async", 6), ("worker-sync", 6),
                                         ("relay-sync", 5), ("relay-sync", 6)])
def test_a_killed_rank(scenario, n, tmp_path):
    proc = run_mpi(n, ["-m", "tests.mpi_cases.ps_failure_job", scenario, str(tmp_path)],
                   timeout=120, env={"MLFABRIC_TIMEOUT": "10"}, mpirun_args=ULFM)
    out = proc.stdout
    assert "RESULT FAIL" not in out, out
    assert proc.returncode == 0, out  # the survivors' exit too (a dead peer can hold it up)
    assert out.count("RESULT ok") == n - 1, out  # every survivor, and only survivors


@pytest.mark.mpi
def test_a_killed_server_fails_over_on_every_run(tmp_path):
    """The failover, run twelve times at 5 and 6 ranks, the server dying at a different point of
    the job each time (from its first updates to two thirds of them): every run ends with the
    scheduler's summary, accounts balanced, on every survivor. A stall once in tens of runs is
    what this looks for: a stuck rank's stacks come with the failure (run_mpi), and a job that
    can no longer end is an error within MLFABRIC_TIMEOUT rather than a wait."""
    iters = 12   # ps_failures.ITERS
    for i in range(12):
        n = 5 + i % 2
        at = max(1, round((i + 1) / 18 * iters * (n - 3)))
        out = tmp_path / str(i)
        out.mkdir()
        proc = run_mpi(n, ["-m", "tests.mpi_cases.ps_failure_job", "server-replica", str(out),
                           str(at)],
                       timeout=90, env={"MLFABRIC_TIMEOUT": "10"}, mpirun_args=ULFM)
        text = "run %d (%d ranks, the server dies after %d updates):\n%s" % (i, n, at,
                                                                               proc.stdout)
        assert "RESULT FAIL" not in proc.stdout, text
        assert proc.returncode == 0, text
        assert proc.stdout.count("RESULT ok") == n - 1, text
