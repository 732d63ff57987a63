"""A parameter-server job's end is bounded by liveness, not by its length (run by
tests/mpi/test_errors.py with MLFABRIC_TIMEOUT=3): a job several timeouts long completes, and a rank
whose daemon stops turning makes every rank fail with its name within a few timeouts. The stuck
case runs last: its daemon thread stays stuck until the process ends.

MLFABRIC_TIMEOUT also bounds a process's exit once its job failed (mlfabric._core.exit_guard:
interpreter teardown, then MPI_Finalize's fence over every rank). That exit is no part of what
is tested here, and on a loaded 2-core machine five ranks' teardown and fence take several
seconds: bounded by the 3 s meant for liveness, the failed ranks gave up on MPI_Finalize and
mpirun reported an abnormal end. At exit the bound is the harness's usual one again."""
import atexit
import os
import time

import pytest
from mpi4py import MPI

import mlfabric.ps as ps
from mlfabric._core import config as _config
from mlfabric.errors import MlfabricError
from mlfabric.ps import api
from mlfabric.ps.driver import run_job
from mlfabric.runtime.roles import Roles

from .common import take_part

WORLD = MPI.COMM_WORLD
EXIT_BOUND_S = "20"   # tests/mpi_util.py's default MLFABRIC_TIMEOUT


def _exit_bound():
    os.environ["MLFABRIC_TIMEOUT"] = EXIT_BOUND_S


# registered after mlfabric's exit guard (imported above), so it runs before the guard reads the
# bound (atexit runs the last registered first)
atexit.register(_exit_bound)


def case_a_job_longer_than_the_timeout_ends_normally():
    limit = _config.timeout_s()
    t0 = time.monotonic()
    res = run_job("mlfabric-A", size=1000, iterations=4, compute_s=limit * 0.8)
    took = time.monotonic() - t0
    # (the point: serve() and finish() return, where a bound on the job's length would have
    # made the servers and the scheduler raise PeerTimeoutError once it lasted MLFABRIC_TIMEOUT)
    assert res.summary.balanced, res.summary
    assert took > 2.5 * limit, took   # precondition: the job did outlast the timeout


def case_z_a_stuck_daemon_fails_the_job_on_every_rank():
    roles = Roles(WORLD.size, 1)
    victim = roles.worker_ranks[-1]
    limit = _config.timeout_s()
    role = ps.init("mlfabric-A")
    t0 = time.monotonic()
    def work():
        if WORLD.rank == victim:   # its daemon stops turning (a deadlock, say)
            api._state["rt"].daemon._turn = lambda: time.sleep(3600)
    with pytest.raises(MlfabricError) as info:
        take_part(role, work)
    took, text = time.monotonic() - t0, str(info.value)
    assert took < 4 * limit, (took, text)
    if WORLD.rank == victim:
        assert "daemon has stopped turning" in text, text
    else:
        assert "no word from rank %d (worker)" % victim in text, text
