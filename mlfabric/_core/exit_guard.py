"""A bounded exit once a peer has died, or once this process's collectives got out of step with its
peers' (a PeerTimeoutError, an uncaught exception: see context.Context.close).

Open MPI's MPI_Finalize ends with a fence over every process the job started, the dead
included; under ULFM that fence sometimes never completes (about 1 run in 7 of a 3-rank job on
this 2-core machine with one rank SIGKILLed and the others shrunk: a plain mpi4py program, no
mlfabric; open-mpi/ompi#11404). mlfabric calls peer_failed() when it learns a peer died (an
elastic reset, the parameter-server runtime's failure handling), and at exit also asks MPI
whether any process of the job is known to have failed (a rank told of a failure by a peer
meets none itself); either way, at interpreter exit, once mlfabric's own exit handlers are
done, a native watchdog (_C.arm_exit_watchdog) gives MPI_Finalize MLFABRIC_TIMEOUT seconds, then
says so on stderr and ends the process: with status 1 if an exception went uncaught, else 0 (a
status given to sys.exit is not seen: Python does not show it to exit handlers). A job where
nobody died exits as it always did."""
import atexit
import sys

from .. import _C
from .config import timeout_s

_armed = False       # a peer died (or ranks got out of step): bound the exit
_uncaught = False    # an exception reached sys.excepthook


def peer_failed():
    """Record that a peer of this process died, so its exit is bounded (idempotent)."""
    global _armed
    _armed = True


def out_of_step():
    """Record that this process's collectives and its peers' no longer match (a timeout, an
    uncaught exception here or on a peer): MPI_Finalize waits for every process of the job, some
    of which may never get there, so the exit is bounded as after a peer's death (idempotent)."""
    peer_failed()


def uncaught():
    """Whether an exception went uncaught in the main program (asked at exit). sys.last_value
    too: Python sets it before calling the hook, and a hook set after ours never calls ours.
    Not seen: SystemExit (Python does not show its status to exit handlers)."""
    return _uncaught or getattr(sys, "last_value", None) is not None


def _excepthook_wrapper(previous):
    def excepthook(*exc):
        global _uncaught
        _uncaught = True
        previous(*exc)
    return excepthook


sys.excepthook = _excepthook_wrapper(sys.excepthook)


def _world_has_failed():
    """Whether MPI knows a process of the job has died (ULFM's failure detector tells every
    rank, including those whose own calls never met the dead one: ranks told of a failure by a
    peer, or not at all). Never starts MPI."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        return False
    try:
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return False
        return MPI.COMM_WORLD.Get_failed().Get_size() > 0
    except Exception:  # noqa: BLE001 - an MPI without ULFM: nothing known to have failed
        return False


def _at_exit():
    if not (_armed or _world_has_failed()):
        return
    seconds = timeout_s()
    status = 1 if uncaught() else 0
    _C.arm_exit_watchdog(seconds, status, (
        f"mlfabric: exit not done {seconds:g} s (MLFABRIC_TIMEOUT) after a peer failure or a "
        "timeout: Open MPI's MPI_Finalize waits for every process of the job, which a dead or "
        f"out-of-step one may never reach; exiting without it, status {status}\n"))


# Registered when mlfabric is imported, before its own exit handlers (context.finalize, the
# torch layer's: bounded by their own waits), so it runs after them (atexit runs last-registered
# first) and the timer covers MPI_Finalize (mpi4py's, a C-level exit function run after all).
atexit.register(_at_exit)
