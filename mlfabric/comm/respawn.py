"""Replacing ranks that died, so an elastic job goes on at its full size: after a failure the
survivors (hvd.elastic.run) spawn as many new processes as died, running this same program
(MPI_Comm_spawn), and merge with them into one communicator; a spawned process's
mlfabric.init() on the default communicator finds its parent and joins that merge instead of
initialising on its own MPI.COMM_WORLD. The replacement then runs the program from its start
and gets the survivors' state from its first elastic sync.

MLFABRIC_ELASTIC_REPLACE = the most processes a job spawns over its life (default 0: none,
the survivors go on alone). Bounded so that a replacement that itself keeps dying cannot make
the survivors spawn forever; the count so far travels to each new process with its welcome.

Owns the handshake: a replacement is started with MLFABRIC_REPLACEMENT=1 in its environment (a
process spawned by some other program initialises as usual); the survivors agree (ULFM's
MPI_Comm_agree) that the spawn worked everywhere, then their root sends each new process a
welcome (a token and the count of processes spawned so far) over the intercommunicator before
the merge; a replacement that gets no welcome within MLFABRIC_TIMEOUT fails its init (rather
than train alone). And the `joining` flag, true in a replacement until its first elastic sync
(DistributedOptimizer then builds its buckets without the collective round its peers will not
make)."""
import os
import sys
import time

from mpi4py import MPI

from .._core import exit_guard
from .._core.config import elastic_replace, timeout_s
from ..errors import MlfabricError

_TAG = 7781
_TOKEN = "mlfabric-replacement"
_UNSET = object()

joining = False   # a replacement that has not had its first elastic sync yet
spawned = 0       # processes this job has spawned so far (as this process knows it)
_joined = _UNSET  # join()'s result, once (a process has one parent for its life)


def command():
    """The arguments after the interpreter that started this program (python -m module ...,
    or python script ...), for its replacements; None when it cannot be started again (python
    -c, an interactive interpreter)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name[:-len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return ["-m", name, *sys.argv[1:]]
    if not sys.argv or sys.argv[0] in ("", "-c") or not os.path.exists(sys.argv[0]):
        return None
    return list(sys.argv)


def _unreachable():
    """Why processes of a spawned job could not reach this one, or None: Open MPI's shared-memory
    transport does not connect separate jobs, so a BTL list without tcp leaves the merge waiting
    forever (seen here with OMPI_MCA_btl=self,sm)."""
    btl = os.environ.get("OMPI_MCA_btl", "").strip()
    if not btl or btl.startswith("^") or "Open MPI" not in MPI.Get_library_version():
        return None
    if "tcp" not in [b.strip() for b in btl.split(",")]:
        return (f"OMPI_MCA_btl={btl} has no transport between separate jobs (add tcp, or leave "
                "it unset)")
    return None


def spawn(survivors, lost):
    """Spawn up to `lost` replacements (within the job's limit) and merge them after the
    survivors. Collective over survivors. Returns the merged communicator, or None when nothing
    was spawned (replacing off, the limit reached, or no command to start them with); raises
    MlfabricError, on every survivor, when MPI could not spawn them somewhere (no free slots,
    say)."""
    global spawned
    count = min(lost, elastic_replace() - spawned)
    args = command()
    if count <= 0 or args is None:
        return None
    why = _unreachable()
    if why is not None:
        raise MlfabricError(f"cannot spawn replacements: {why}")
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    info.Set("env", "MLFABRIC_REPLACEMENT=1")
    inter, error = None, None
    try:
        inter = survivors.Spawn(sys.executable, args, maxprocs=count, root=0, info=info)
    except MPI.Exception as exc:
        error = exc
    finally:
        info.Free()
    spawned += count  # tried: counts against the limit either way
    if not survivors.Agree(int(error is None)):  # the same answer on every survivor
        if inter is not None:
            inter.Free()  # those started get no welcome: they fail their init, bounded
        raise MlfabricError(f"could not spawn {count} replacement(s)"
                            + (f": {error}" if error is not None else " on some rank(s)"))
    if survivors.rank == 0:
        for i in range(count):
            inter.send((_TOKEN, spawned), dest=i, tag=_TAG)
    return inter.Merge(high=False)


def join():
    """In a process spawned as a replacement: the communicator merged with the survivors (its
    ranks after theirs); None in any other process. Waits at most MLFABRIC_TIMEOUT for the
    survivors' welcome (MlfabricError without it)."""
    global _joined, joining, spawned
    if _joined is not _UNSET:
        return _joined
    _joined = None
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL or os.environ.get("MLFABRIC_REPLACEMENT") != "1":
        return None
    req = parent.irecv(source=0, tag=_TAG)
    deadline = time.monotonic() + timeout_s()
    while True:
        done, welcome = req.test()
        if done:
            break
        if time.monotonic() > deadline:
            req.Cancel()
            raise MlfabricError(f"this process was spawned to replace a dead rank, but the "
                                f"survivors did not welcome it within {timeout_s():g} s "
                                "(MLFABRIC_TIMEOUT): their spawn failed elsewhere; exiting "
                                "rather than training alone")
        time.sleep(0.001)
    if not (isinstance(welcome, tuple) and len(welcome) == 2 and welcome[0] == _TOKEN):
        raise MlfabricError(f"a replacement process got {welcome!r} from its parent, not "
                            "mlfabric's welcome")
    spawned, joining = int(welcome[1]), True
    exit_guard.peer_failed()  # the job lost a rank: its MPI_Finalize may wait on the dead
    _joined = parent.Merge(high=True)
    return _joined
