"""The NCCL transport for GPU arrays. Owns: finding and loading libnccl (ctypes, at first use, so
mlfabric needs no NCCL at build time), one communicator per mlfabric context (its unique id sent
over MPI), launching NCCL collectives on mlfabric's own CUDA stream, and the bounded wait for them.

Argument checks and the header exchange that turns a mismatch into an error on every rank stay
in collectives.py: by the time a call reaches this module every rank has agreed to make it, so
NCCL never sees mismatched calls. NCCL collectives cannot be cancelled; a wait that outlives
MLFABRIC_TIMEOUT aborts the communicator (ncclCommAbort, which frees a kernel stuck on a dead
peer) and raises PeerTimeoutError; every later GPU call on this rank is then refused before
its header exchange, so its peers get a MismatchError naming it. Init (connections included:
NCCL_RUNTIME_CONNECT=0 unless set), destroy and abort are bounded too.

Several ranks on one GPU: NCCL refuses them ("Duplicate GPU detected"). MLFABRIC_NCCL_SHARE_GPU=1
gives each rank a host id of its own (NCCL_HOSTID), so NCCL treats them as separate hosts and
moves data through its socket transport: slow, but it lets a one-GPU machine test several ranks.
"""
import contextlib
import ctypes
import glob
import os
import socket
import threading
import time

from .._core import config as _config
from ..errors import MlfabricError, PeerTimeoutError

# ncclDataType_t of mlfabric's wire dtypes (_dtypes.DTYPE_NAMES order: float32, float64, float16,
# bfloat16, int32, int64).
_NCCL_DTYPE = (7, 8, 6, 9, 2, 4)
# ncclRedOp_t of mlfabric's kernel ops (_dtypes.OPS order: sum, prod, min, max); avg is ncclAvg.
_NCCL_OP = (0, 1, 3, 2)
_NCCL_AVG = 4
_IN_PROGRESS = 7          # ncclInProgress: what a healthy communicator's async error reads
_MIN_VERSION = 21000      # ncclAvg came with NCCL 2.10

_lib = None
_lib_error = None
_launch_only = threading.local()   # .pending: the list deferred() yields, on this thread


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _candidates():
    """Where libnccl may be, in order: MLFABRIC_NCCL_LIB; the loader's search (which also finds
    the copy torch has already loaded, by its soname); the nvidia-nccl wheel that CUDA builds of
    torch install."""
    explicit = _config.nccl_lib()
    if explicit:
        return [explicit]
    found = ["libnccl.so.2"]
    try:
        import nvidia.nccl
        for root in nvidia.nccl.__path__:
            found += sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    except ImportError:
        pass
    return found


def _declare(lib):
    p, i, size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    sigs = {
        "ncclGetVersion": [ctypes.POINTER(i)],
        "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
        "ncclCommInitRank": [ctypes.POINTER(p), i, _UniqueId, i],
        "ncclCommDestroy": [p], "ncclCommAbort": [p],
        "ncclCommGetAsyncError": [p, ctypes.POINTER(i)],
        "ncclAllReduce": [p, p, size_t, i, i, p, p],
        "ncclReduce": [p, p, size_t, i, i, i, p, p],
        "ncclBroadcast": [p, p, size_t, i, i, p, p],
        "ncclAllGather": [p, p, size_t, i, p, p],
        "ncclReduceScatter": [p, p, size_t, i, i, p, p],
        "ncclSend": [p, size_t, i, i, p, p], "ncclRecv": [p, size_t, i, i, p, p],
        "ncclGroupStart": [], "ncclGroupEnd": [],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i], ctypes.c_char_p
    if hasattr(lib, "ncclGetLastError"):   # NCCL >= 2.13: the detail of the last error
        lib.ncclGetLastError.argtypes, lib.ncclGetLastError.restype = [p], ctypes.c_char_p


def library():
    """The loaded libnccl, or MlfabricError saying why there is none."""
    global _lib, _lib_error
    if _lib is None and _lib_error is None:
        tried = []
        for path in _candidates():
            try:
                lib = ctypes.CDLL(path)
                _declare(lib)
            except (OSError, AttributeError) as exc:
                tried.append(f"{path}: {exc}")
                continue
            v = ctypes.c_int()
            lib.ncclGetVersion(ctypes.byref(v))
            if v.value < _MIN_VERSION:
                tried.append(f"{path}: NCCL {v.value} is older than 2.10")
                continue
            _lib = lib
            break
        else:
            _lib_error = ("GPU arrays need NCCL, and no usable libnccl was found (set "
                          "MLFABRIC_NCCL_LIB to its path); tried: " + "; ".join(tried))
    if _lib is None:
        raise MlfabricError(_lib_error)
    return _lib


def available():
    """True when libnccl can be loaded."""
    try:
        library()
        return True
    except MlfabricError:
        return False


def version():
    """NCCL's version as an int (2.28.9 -> 22809)."""
    v = ctypes.c_int()
    library().ncclGetVersion(ctypes.byref(v))
    return v.value


def _check(rc, what, comm=None):
    if rc != 0:
        lib = library()
        last = getattr(lib, "ncclGetLastError", None)
        detail = (last(comm) or b"").decode(errors="replace") if last is not None else ""
        msg = f"{what}: NCCL error {rc} ({lib.ncclGetErrorString(rc).decode()})"
        if "Duplicate GPU" in detail:
            msg += (f": {detail}. NCCL needs one GPU per rank: pick the device with "
                    "torch.cuda.set_device(mlfabric.local_rank()) before the first GPU call; to "
                    "test several ranks on one GPU set MLFABRIC_NCCL_SHARE_GPU=1 (slow)")
        elif detail:
            msg += f": {detail}"
        raise MlfabricError(msg)


def _bounded(fn, seconds):
    """Run fn() on a daemon thread (ctypes lets go of the GIL in the call) and wait at most
    `seconds`: True when it returned. NCCL calls that need their peers (init, destroy; abort too,
    where peers are gone) can block without end; a thread left behind cannot hold up the exit."""
    t = threading.Thread(target=fn, name="mlfabric-nccl", daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


@contextlib.contextmanager
def deferred():
    """Inside, on this thread, a collective returns once launched, not once done: the current
    stream is made to wait for it (what the caller queues there after follows it), and
    (communicator, devices, event, what) of each goes to the list this yields, for the caller's
    bounded wait (Communicator.wait) later. So one call's NCCL work can queue behind the last
    one's instead of starting after the host saw it finish (as DDP's bucket allreduces queue)."""
    outer = getattr(_launch_only, "pending", None)
    pending = _launch_only.pending = []
    try:
        yield pending
    finally:
        _launch_only.pending = outer


class Communicator:
    """One NCCL communicator over an mlfabric context's ranks, bound to one GPU, with a stream
    of its own per array library. Made by init(), collectively (every rank at the same call,
    which collectives.py's header exchange guarantees)."""

    def __init__(self, rank, size, device):
        self.rank, self.size, self.device = rank, size, device
        self.handle = ctypes.c_void_p()
        self.streams = {}   # array library's name -> mlfabric's stream on this GPU
        self.failed = "not initialised"  # why the communicator cannot be used (None: it can)
        # Held from the usability check through a launch, and taken (bounded) by abort(): with
        # deferred() the wait, and so the abort, runs on the caller's thread while the queue's
        # thread may be launching the next call on this communicator. (Reentrant: a launch that
        # fails aborts while holding it.)
        self._launching = threading.RLock()

    def init(self, ctx, devices):
        """Every rank: rank 0 makes NCCL's unique id and broadcasts it (over MPI, bounded, with
        a status word, so a failure there is an error on every rank), then ncclCommInitRank,
        bounded by MLFABRIC_TIMEOUT (a peer that died before it would hold it forever)."""
        import numpy as np
        from . import p2p
        lib = library()
        if _config.nccl_share_gpu():
            # Before NCCL computes its host hash (at the first communicator of the process).
            os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-mlfabric-rank{ctx.rank}"
        # Connect every channel inside the (bounded) init, not lazily in the first collective
        # that needs one: that connect runs in the launching host thread and waits for the
        # peers without end (seen: a launch whose peers never came hung, 3 ranks on an H100).
        # A user's own setting wins.
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
        uid = _UniqueId()
        raw = np.zeros(129, np.uint8)   # the id, then a status: 1 made, 2 failed
        rc = 0
        if ctx.rank == 0:
            rc = lib.ncclGetUniqueId(ctypes.byref(uid))
            raw[:128] = np.frombuffer(bytes(uid.internal), np.uint8)
            raw[128] = 1 if rc == 0 else 2
        p2p.wait([ctx.comm.Ibcast(raw, root=0)], [0], "NCCL init (unique id broadcast)")
        if raw[128] != 1:
            self.failed = "NCCL's unique id could not be made on rank 0"
            _check(rc, "NCCL init (unique id)")
            raise MlfabricError("NCCL init: rank 0 could not make NCCL's unique id (see its error)")
        ctypes.memmove(ctypes.addressof(uid), raw.ctypes.data, 128)
        result = []

        def init_rank():
            try:
                with devices.on(self.device):
                    result.append(lib.ncclCommInitRank(ctypes.byref(self.handle), ctx.size, uid,
                                                       ctx.rank))
            except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
                result.append(exc)
        timeout = _config.timeout_s()
        if not _bounded(init_rank, timeout):
            self.failed = "NCCL init timed out"
            raise PeerTimeoutError(f"NCCL init did not finish within {timeout:g} s "
                                   "(MLFABRIC_TIMEOUT): a peer died or never reached it")
        if result[0] != 0:
            self.failed = "NCCL init failed"
            if isinstance(result[0], BaseException):
                raise MlfabricError(f"NCCL init failed: {result[0]}") from result[0]
            _check(result[0], "NCCL init")
        self.failed = None

    # --- launching ---------------------------------------------------------------------------

    def _usable(self, what):
        if self.failed is not None:
            raise MlfabricError(f"{what}: the NCCL communicator is unusable: {self.failed}")

    def run(self, what, devices, ready, launch):
        """Make mlfabric's stream wait for `ready` (an event on the caller's stream, recorded when
        the call was made), launch(lib, comm, stream_handle, stream) NCCL calls on it, and wait
        (bounded) until they are done; inside deferred(), only launch them (see there)."""
        lib = library()
        with self._launching, devices.on(self.device):
            self._usable(what)
            stream = self.streams.get(devices.name)
            if stream is None:
                stream = self.streams[devices.name] = devices.new_stream(self.device)
            if ready is not None:
                stream.wait_event(ready)
            try:
                launch(lib, self.handle, devices.stream_handle(stream), stream)
            except BaseException:
                # the peers launched theirs: they would wait for this rank until their timeout
                self.abort(f"{what} could not be launched on rank {self.rank}")
                raise
            done = devices.record(stream)
            pending = getattr(_launch_only, "pending", None)
            if pending is not None:
                devices.follow(done)
                pending.append((self, devices, done, what))
                return
        self.wait(devices, done, what)

    def wait(self, devices, event, what):
        """Return once event has happened; MlfabricError if NCCL reports an error or the
        communicator was aborted meanwhile (by another call's wait: the event may then have
        completed on a killed kernel), PeerTimeoutError after MLFABRIC_TIMEOUT seconds (the
        communicator is aborted then)."""
        lib = library()
        timeout = _config.timeout_s()
        start = time.monotonic()
        err = ctypes.c_int()
        polls = 0
        while True:
            if self.failed is not None:
                raise MlfabricError(f"{what}: the NCCL communicator is unusable: {self.failed}")
            if devices.done(event):
                break
            polls += 1
            if polls % 64 == 0:  # a host call into NCCL: not on every poll
                lib.ncclCommGetAsyncError(self.handle, ctypes.byref(err))
                if err.value not in (0, _IN_PROGRESS):
                    try:
                        _check(err.value, what, self.handle)   # (its detail, before the abort)
                    finally:
                        self.abort(f"{what} failed in NCCL")
                if time.monotonic() - start > timeout:
                    self.abort(f"{what} timed out")
                    raise PeerTimeoutError(
                        f"{what}: the NCCL collective did not finish within {timeout:g} s "
                        "(MLFABRIC_TIMEOUT); a peer died, hangs, or is in another call. The NCCL "
                        "communicator was aborted")
            # Spin while a small collective is likely to finish within microseconds; then yield
            # the core (ranks may share cores with the GPU's feeding threads).
            time.sleep(0 if polls < 2000 else 50e-6)

    def abort(self, why):
        """Mark the communicator failed and abort it (frees a kernel stuck on a dead peer); the
        abort is bounded too: with peers gone it has been seen to block. Marked first, so no
        launch starts after; a launch under way gets a second to finish (one blocked on a dead
        peer is what the abort frees)."""
        if self.failed is None:
            self.failed = why
            lib = library()
            locked = self._launching.acquire(timeout=1.0)
            try:
                _bounded(lambda: lib.ncclCommAbort(self.handle), min(_config.timeout_s(), 10.0))
            finally:
                if locked:
                    self._launching.release()

    def close(self):
        """At finalize: destroy a healthy communicator (its peers do the same), bounded."""
        if self.failed is None:
            self.failed = "closed"
            lib = library()
            if not _bounded(lambda: lib.ncclCommDestroy(self.handle),
                            min(_config.timeout_s(), 30.0)):
                _bounded(lambda: lib.ncclCommAbort(self.handle), 10.0)

    # --- the collectives (pointers are device addresses; counts in elements) ---------------

    def op(self, opc, avg):
        # One rank: avg is sum. (NCCL 2.28.9's ncclAvg on one rank left the last of 100003
        # float32 elements unwritten in an out-of-place call, on an H100; ncclSum did not.)
        if avg and self.size == 1:
            return _NCCL_OP[0]
        return _NCCL_AVG if avg else _NCCL_OP[opc]

    def allreduce(self, what, devices, ready, src, dst, count, code, opc, avg, then=None):
        """then(stream): more work for mlfabric's stream after the allreduce, waited for with it
        (an uneven reduce_scatter's copy of this rank's rows)."""
        def launch(lib, comm, s, stream):
            _check(lib.ncclAllReduce(src, dst, count, _NCCL_DTYPE[code], self.op(opc, avg),
                                     comm, s), what, comm)
            if then is not None:
                then(stream)
        self.run(what, devices, ready, launch)

    def reduce(self, what, devices, ready, src, dst, count, code, opc, avg, root):
        def launch(lib, comm, s, _):
            _check(lib.ncclReduce(src, dst, count, _NCCL_DTYPE[code], self.op(opc, avg), root,
                                   comm, s), what, comm)
        self.run(what, devices, ready, launch)

    def broadcast(self, what, devices, ready, buf, count, code, root):
        def launch(lib, comm, s, _):
            _check(lib.ncclBroadcast(buf, buf, count, _NCCL_DTYPE[code], root, comm, s), what,
                    comm)
        self.run(what, devices, ready, launch)

    def allgather(self, what, devices, ready, src, dst, count, code):
        def launch(lib, comm, s, _):
            _check(lib.ncclAllGather(src, dst, count, _NCCL_DTYPE[code], comm, s), what, comm)
        self.run(what, devices, ready, launch)

    def reduce_scatter(self, what, devices, ready, src, dst, count, code, opc, avg):
        def launch(lib, comm, s, _):
            _check(lib.ncclReduceScatter(src, dst, count, _NCCL_DTYPE[code], self.op(opc, avg),
                                          comm, s), what, comm)
        self.run(what, devices, ready, launch)

    def alltoallv(self, what, devices, ready, src, dst, send_bytes, recv_bytes):
        """Byte counts per peer; blocks back to back in rank order on both sides."""
        def launch(lib, comm, s, _):
            _check(lib.ncclGroupStart(), what)
            so = ro = 0
            try:
                for peer in range(self.size):
                    if send_bytes[peer]:
                        _check(lib.ncclSend(src + so, send_bytes[peer], 1, peer, comm, s), what,
                                comm)
                    if recv_bytes[peer]:
                        _check(lib.ncclRecv(dst + ro, recv_bytes[peer], 1, peer, comm, s), what,
                                comm)
                    so += send_bytes[peer]
                    ro += recv_bytes[peer]
            finally:
                _check(lib.ncclGroupEnd(), what, comm)
        self.run(what, devices, ready, launch)
