"""The intra-host transport: one MPI-3 shared window per host holding the engine's segment
(csrc/shm_engine.h), plus mlfabric-allocated shared buffers that the engine reads zero-copy.

Owns: opening and freeing the windows, the registry of shared buffers (which allocation and offset a
user array lives at, and where each peer's copy is mapped), and turning the engine's status codes
into exceptions. Used only when every rank of the communicator is on this host."""
import itertools

from mpi4py import MPI

from .. import _C, _config
from ..errors import MlfabricError, PeerTimeoutError
from . import header


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
        self.win = MPI.Win.Allocate_shared(nbytes if self.rank == 0 else 0, 1, comm=comm)
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
    def allocate(self, nbytes):
        """Collective: a shared segment of nbytes for every rank; returns the SharedAlloc."""
        win = MPI.Win.Allocate_shared(max(int(nbytes), 1), 64, comm=self.comm)
        peers = [win.Shared_query(j)[0].address for j in range(self.size)]
        alloc = SharedAlloc(next(self._ids), win, peers[self.rank], int(nbytes), peers)
        self.allocs.append(alloc)
        return alloc

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
