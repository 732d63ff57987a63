"""The intra-host transport: one MPI-3 shared window per host holding the engine's segment
(csrc/shm_engine.h), plus mlfabric-allocated shared buffers that the engine reads zero-copy.

Owns: opening and freeing the windows, the registry of shared buffers (which allocation and offset a
user array lives at, and where each peer's copy is mapped), and turning the engine's status codes
into exceptions. Used only when every rank of the communicator is on this host.

Space: Open MPI backs each shared window with a file in /dev/shm (osc_sm_backing_directory), and
only the first rank of the window creates it; when that filesystem is too small (Docker gives a
container 64 MiB), that rank fails with MPI_ERR_INTERN while its peers wait in the allocation for
good. So before every window the ranks agree, in one allgather, on whether the free space there
covers it; when it does not, every rank raises ShmSpaceError (for the engine's segment,
open_transport() returns None instead, so that mlfabric runs on the MPI path). Each rank then
maps its part of a new shared buffer in at once (MADV_POPULATE_WRITE), so that later checks see
the space taken and running out shows as an error here, on every rank, rather than as SIGBUS at
first touch."""
import ctypes
import itertools
import mmap
import os
import warnings

from mpi4py import MPI

from .. import _C
from .._core import config as _config, exit_guard
from ..errors import MlfabricError, PeerTimeoutError
from . import header

MiB, GiB = 1 << 20, 1 << 30
# Kept free for Open MPI's own shared-memory files (its transport's segments grow with traffic),
# per rank of the host: what a shared allocation may not take.
MPI_RESERVE = 1 * MiB
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


class ShmSpaceError(MlfabricError):
    """The filesystem backing shared memory (/dev/shm) has too little free space for a shared
    allocation. Raised on every rank of the allocation; nothing was allocated, and the
    communicator stays usable."""


class ShmAllocError(MlfabricError):
    """MPI failed to allocate a shared window on this rank after the ranks agreed there was
    room: its peers may be left inside MPI's allocation, so the communicator is unusable."""


def backing_dir():
    """Where Open MPI puts its shared windows' files: osc_sm_backing_directory, /dev/shm by
    default on Linux."""
    return os.environ.get("OMPI_MCA_osc_sm_backing_directory") or "/dev/shm"


def free_bytes(path):
    """Bytes an unprivileged process may still allocate in the filesystem at path, or -1 when it
    cannot be read (not checked then)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def _size(n):
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def space_advice(path, more=0):
    """How to get more room (`more` bytes on top of what is used there now), for the errors."""
    try:
        st = os.statvfs(path)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:
        used = 0
    gib = max(1, -(-(used + more) * 5 // 4 // GiB))  # a quarter to spare, whole GiB
    return (f"enlarge {path} (docker run --shm-size={gib}g; Kubernetes: a memory-backed emptyDir "
            f"at /dev/shm; as root: mount -o remount,size={gib}g {path}) or set MLFABRIC_SHM=0 "
            "(no shared memory: slower on one host)")


_libc = None


def _populate(address, nbytes):
    """Back [address, address+nbytes) of a shared mapping with memory now: True when done or not
    possible on this kernel (then the space is taken at first touch), False when the filesystem
    ran out (no SIGBUS: madvise reports it)."""
    global _libc
    if nbytes <= 0:
        return True
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return True
    page = mmap.PAGESIZE
    start = address - address % page
    length = -(-(address + nbytes - start) // page) * page
    if _libc.madvise(start, length, _MADV_POPULATE_WRITE) == 0:
        return True
    return ctypes.get_errno() not in (14, 12)  # EFAULT (would SIGBUS), ENOMEM; EINVAL: old kernel


def _check_space(comm, nbytes, reserve, what):
    """Collective over comm: raise ShmSpaceError on every rank unless the backing filesystem of
    every rank has room for a window of nbytes per rank (this rank's; they may differ) with
    `reserve` bytes to spare."""
    path = backing_dir()
    every = comm.allgather((int(nbytes), free_bytes(path)))
    total = sum(n for n, _ in every)
    # Open MPI's window: the ranks' parts back to back, a page and its per-rank state besides.
    need = total + mmap.PAGESIZE + 256 * (len(every) + 1) + reserve
    known = [f for _, f in every if f >= 0]
    if not known or min(known) >= need:
        return
    free = min(known)
    parts = (f"{len(every)} ranks x {_size(every[0][0])}" if len({n for n, _ in every}) == 1
             else f"{len(every)} ranks, {_size(total)} in all")
    raise ShmSpaceError(
        f"{what}: {path} has {_size(free)} free, this needs {_size(need)} ({parts}, plus "
        f"{_size(need - total)} kept free for Open MPI and mlfabric's engine); "
        f"{space_advice(path, need)}")


def _allocate_shared(comm, nbytes, disp_unit, what):
    """MPI.Win.Allocate_shared, after the ranks agreed there is room: a failure on one rank is
    ShmAllocError there (its peers may stay inside MPI's allocation for good; this process's
    exit is then bounded, as after a timeout, so that the job ends)."""
    try:
        return MPI.Win.Allocate_shared(nbytes, disp_unit, comm=comm)
    except MPI.Exception as exc:
        exit_guard.out_of_step()
        raise ShmAllocError(
            f"{what}: MPI could not allocate {_size(nbytes)} of shared memory in {backing_dir()} "
            f"({exc.Get_error_string()}); its peers may be left waiting in the allocation, so "
            f"this job cannot go on. If {backing_dir()} is full: {space_advice(backing_dir())}"
        ) from None


def open_transport(comm):
    """The ShmTransport on comm (collective), or None on every rank when the backing filesystem
    cannot hold the engine's segment: mlfabric then runs on the MPI path, with a warning (from
    the host's first rank) saying why."""
    try:
        return ShmTransport(comm)
    except ShmSpaceError as exc:
        if comm.rank == 0:
            warnings.warn(f"mlfabric runs without shared memory (slower on one host): {exc}",
                          RuntimeWarning, stacklevel=2)
        return None


class SharedAlloc:
    """One collective allocation: my segment at `base` (nbytes), peers' segments at `peers`."""

    def __init__(self, alloc_id, win, base, nbytes, peers):
        self.id, self.win, self.base, self.nbytes, self.peers = alloc_id, win, base, nbytes, peers


class ShmTransport:
    def __init__(self, comm):
        self.comm = comm            # all ranks on this host, rank order = the user's communicator
        self.rank, self.size = comm.rank, comm.size
        block, slots = _config.shm_block_bytes(), _config.shm_slots()
        self.block = block
        nbytes = _C.ShmEngine.required_bytes(self.size, block, slots)
        what = "init (the shared-memory engine's segment)"
        _check_space(comm, nbytes if self.rank == 0 else 0, MPI_RESERVE * self.size, what)
        self.win = _allocate_shared(comm, nbytes if self.rank == 0 else 0, 1, what)
        # The engine's pages are taken as it first touches them (each rank its own): later
        # allocations leave room for them.
        self.reserve = nbytes + MPI_RESERVE * self.size
        mem, _ = self.win.Shared_query(0)
        self.engine = _C.ShmEngine(mem.address, nbytes, self.rank, self.size, block, slots,
                                   _config.timeout_s())
        if self.rank == 0:
            self.engine.reset_segment()
        comm.Barrier()
        # Single-copy reads of peers' buffers (process_vm_readv), when the kernel allows them
        # here for every rank (containers often forbid them); the same answer on every rank.
        cma_min, cma_max = _config.cma_range(self.size)
        if cma_max > 0 and self.size > 1:
            self.engine.probe_publish()
            comm.Barrier()
            ok = comm.allreduce(1 if self.engine.probe_peers() else 0, op=MPI.MIN) == 1
            self.engine.enable_cma(ok, cma_min, cma_max)
            comm.Barrier()
        self.allocs = []
        self._ids = itertools.count()
        self.zero_copy_calls = 0   # calls that read peers' shared buffers in place (for tests)

    # --- shared buffers -------------------------------------------------------------------
    def allocate(self, nbytes, what="shared_empty"):
        """Collective: a shared segment of nbytes for every rank; returns the SharedAlloc.
        ShmSpaceError on every rank (nothing allocated) when the backing filesystem lacks room
        for it; ShmAllocError where MPI failed anyway (see _allocate_shared)."""
        size = max(int(nbytes), 1)
        _check_space(self.comm, size, self.reserve, what)
        win = _allocate_shared(self.comm, size, 64, what)
        peers = [win.Shared_query(j)[0].address for j in range(self.size)]
        # Take the pages now: between the check and here another process may have taken the
        # space, and untouched pages would not show in the next allocation's check.
        if self.comm.allreduce(int(_populate(peers[self.rank], size)), op=MPI.MIN) == 0:
            win.Free()
            raise ShmSpaceError(f"{what}: {backing_dir()} ran out of space while mapping "
                                f"{_size(size)} per rank in; "
                                f"{space_advice(backing_dir(), size * self.size)}")
        alloc = SharedAlloc(next(self._ids), win, peers[self.rank], int(nbytes), peers)
        self.allocs.append(alloc)
        return alloc

    def check_space(self, nbytes, what):
        """Collective: ShmSpaceError on every rank unless allocate(nbytes) has room now (for an
        owner of several allocations that would rather not start them than fall short midway)."""
        _check_space(self.comm, max(int(nbytes), 1), self.reserve, what)

    def lookup(self, ptr, nbytes):
        """(alloc, offset) when [ptr, ptr+nbytes) lies in one of my shared segments, else None."""
        for a in self.allocs:
            if a.base <= ptr and ptr + nbytes <= a.base + a.nbytes:
                return a, ptr - a.base
        return None

    def zero_copy_info(self, buf):
        """Header words (id, offset) and peers' addresses of buf, or ((-1, -1), [])."""
        if not self.allocs or buf is None or buf.copied or buf.count == 0:
            return (-1, -1), ()
        hit = self.lookup(buf.ptr, buf.nbytes)
        if hit is None:
            return (-1, -1), ()
        alloc, off = hit
        return (alloc.id, off), [p + off for p in alloc.peers]

    # --- collectives ----------------------------------------------------------------------
    def run(self, what, kind, hdr, code=0, op=0, scale=1.0, root=0, inp=None, out=None,
            count=0, chunks=(), peer_in=(), peer_out=()):
        """Run one call on the engine; raise MismatchError / PeerTimeoutError like every rank."""
        status, zero_copy, message = self.engine.run(
            header.KIND_CODES[kind], code, op, scale, root, None if inp is None else inp.arr,
            None if out is None else out.arr, count, chunks, hdr, peer_in, peer_out)
        if status:
            self._raise(what, status, message)
        self.zero_copy_calls += bool(zero_copy)
        return zero_copy

    def plan(self, kind, code, op, scale, hdr):
        """Index of a prepared call for run_plan()."""
        return self.engine.add_plan(header.KIND_CODES[kind], code, op, scale, hdr)

    def run_plan(self, what, index, x, out):
        """Run a prepared call on C-contiguous numpy arrays; False (nothing done) when one is
        not contiguous."""
        status = self.engine.run_plan(index, x, out)
        if status == 0:
            return True
        if status < 0:
            return False
        self._raise(what, status, self.engine.last_message)

    def _raise(self, what, status, message):
        if status == 1:
            header.check(header.from_flat(self.engine.headers(), self.size), what)
            raise MlfabricError(f"{what}: header mismatch")  # pragma: no cover - check() raises
        if status == 2:
            raise PeerTimeoutError(f"{what}: {message}")
        raise MlfabricError(f"{what}: {message}; the shared-memory engine is unusable now")

    def check_headers(self, what, hdr):
        """Header round only: every rank's header compared, no data moved (for the MPI paths)."""
        self.run(what, "barrier", hdr)

    def close(self):
        for a in self.allocs:
            a.win.Free()
        self.allocs = []
        self.win.Free()
