"""The implementations the driver compares, by family. On CPU buffers (--device cpu): mlfabric
(mlfabric, mlfabric-oop, mlfabric-shared), hvd (mlfabric.torch's Horovod API on CPU tensors), mpi
(mpi, mpi-oop: mpi4py buffer calls) and gloo (torch.distributed on CPU). On GPU buffers
(--device cuda, CUDA torch tensors): mlfabric (mlfabric, mlfabric-oop: mlfabric's NCCL path) and
torch-nccl (torch.distributed's NCCL backend, each call followed by a stream synchronize).
Owns buffer allocation in each implementation's native kind (numpy array, torch tensor, mlfabric
shared buffer, CUDA tensor), claiming this rank's GPU (cuda_setup), the one call each collective
makes and the backend mlfabric resolves for it; never times or checks anything (driver.py does).
mlfabric and torch are imported lazily, inside their family.
"""
import inspect
import os
import socket
import sys
from datetime import timedelta

import numpy as np

COLLS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "pingpong", "alltoall",
         "reduce", "sendrecv")
REDUCING = ("allreduce", "reduce_scatter", "reduce")
PINGPONG_TAG = 17
SENDRECV_TAG = 18


class Unsupported(Exception):
    """This implementation cannot run this case; the driver skips it with a printed note."""


def limit_threads():
    """One compute thread per rank, as torchrun does, unless OMP_NUM_THREADS says otherwise: with
    a rank per core, torch's OpenMP workers (used by the bench's own fills and checks, and by
    gloo) would only oversubscribe the cores the ranks being measured need."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")  # a later import reads the variable
    if torch is not None:
        torch.set_num_threads(1)


def import_torch():
    """torch, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


# --- buffers: a 1-D numpy array, or a torch tensor (always for bfloat16, which numpy lacks) ------

def torch_dtype(torch, name):
    return getattr(torch, name)


def alloc(count, dtype, kind="numpy", device=None):
    """An uninitialised 1-D buffer of count elements: numpy unless kind == 'torch', bfloat16 or
    a device (a torch.device: a tensor there)."""
    if kind == "torch" or dtype == "bfloat16" or device is not None:
        torch = import_torch()
        if torch is None:
            raise Unsupported(f"{dtype} torch buffers need torch, which is not installed")
        return torch.empty(count, dtype=torch_dtype(torch, dtype), device=device)
    return np.empty(count, dtype=dtype)


def is_numpy(buf):
    return isinstance(buf, np.ndarray)


def length(buf):
    return int(buf.shape[0]) if len(buf.shape) else 1


def write(buf, lo, values):
    """buf[lo:lo+len(values)] = values (int64 / float64 numpy values, cast to buf's dtype)."""
    hi = lo + len(values)
    if is_numpy(buf):
        buf[lo:hi] = values
    else:
        torch = import_torch()
        buf[lo:hi].copy_(torch.from_numpy(np.ascontiguousarray(values)))


def fill_const(buf, value):
    if is_numpy(buf):
        buf.fill(value)
    else:
        buf.fill_(value)


def read(buf, lo, hi):
    """buf[lo:hi] as a float64 numpy array (exact for the small integers the driver writes); a
    GPU tensor's elements are copied to the host (which waits for the work queued on them)."""
    if is_numpy(buf):
        return np.asarray(buf[lo:hi], dtype=np.float64)
    torch = import_torch()
    return buf[lo:hi].to(torch.float64).cpu().numpy()


def _extent(buf):
    """(address, bytes) of a numpy array's or torch tensor's elements."""
    if is_numpy(buf):
        return buf.__array_interface__["data"][0], buf.nbytes
    return buf.data_ptr(), buf.numel() * buf.element_size()


def same_memory(a, b):
    """Whether two buffers overlap: the call then runs in place (None is never in place)."""
    if a is None or b is None:
        return False
    (pa, na), (pb, nb) = _extent(a), _extent(b)
    return pa < pb + nb and pb < pa + na


def mpi_view(buf):
    """A numpy view of buf's memory that mpi4py can send (bfloat16 travels as raw 16-bit words)."""
    if is_numpy(buf):
        return buf
    torch = import_torch()
    if buf.dtype == torch.bfloat16:
        return buf.view(torch.int16).numpy()
    return buf.numpy()


class Case:
    """One prepared benchmark case.

    run() issues the call once. The driver writes the input pattern into `inbuf` and clears `outbuf`
    (None: the call allocates its output) before running; output() is what it then checks. Either
    may be None on a rank that takes no part (pingpong's idle ranks)."""

    def __init__(self, run, inbuf, outbuf=None, output=None, backend=None):
        self.run = run
        self.inbuf = inbuf
        self.outbuf = outbuf
        self._output = output
        self.backend = backend  # what mlfabric resolved the algorithm to, where it chooses

    def output(self):
        return self._output() if self._output is not None else self.outbuf


def idle_case():
    return Case(lambda: None, None, None)


def chunk_of(buf, rank, chunk):
    return buf[rank * chunk:(rank + 1) * chunk]


# --- families ------------------------------------------------------------------------------------

class Family:
    """A group of variants sharing one runtime (set up once per run, shut down at the end).

    available() is local and cheap (imports); setup() may be collective. supports() returns a
    reason string when a variant cannot run a (coll, dtype, op), else None; prepare() builds a Case.
    """
    name = ""
    variants = ()

    def available(self):
        return None

    def setup(self, comm, opts):
        self.comm, self.opts = comm, opts
        self.rank, self.n = comm.rank, comm.size

    def shutdown(self):
        pass

    def supports(self, variant, coll, dtype, op):
        return None

    def missing(self, coll):
        """Why this family cannot run coll at all (no call for it), or None."""
        if not hasattr(self, "_" + coll):
            return f"{self.name} has no {coll} here"
        return None

    def prepare(self, variant, coll, p):
        return getattr(self, "_" + coll)(variant, p)

    def version(self):
        return None

    def algorithm(self, variant, coll):
        """The algorithm a record reports for this variant as asked (None where there is no
        choice); the backend it resolves to for a buffer is the prepared Case's `backend`."""
        return None


class MpiFamily(Family):
    """mpi4py buffer calls on numpy arrays: `mpi` in place where MPI has it, `mpi-oop` not."""
    name = "mpi"
    variants = ("mpi", "mpi-oop")

    def supports(self, variant, coll, dtype, op):
        if variant == "mpi-oop" and coll in ("broadcast", "pingpong", "sendrecv"):
            return f"{coll} has no out-of-place form (it is the same call as 'mpi')"
        if dtype == "bfloat16" and coll in REDUCING:
            return "MPI has no bfloat16 reductions"
        return None

    def _op(self, p):
        from mpi4py import MPI
        return {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN,
                "max": MPI.MAX}[p.op]

    def _post(self, p):
        """avg = sum, then divide by the number of ranks (MPI has no avg op)."""
        if p.op != "avg":
            return lambda buf: None
        n = self.n
        return lambda buf: np.divide(buf, n, out=buf)

    def _allreduce(self, variant, p):
        from mpi4py import MPI
        comm, op, post = self.comm, self._op(p), self._post(p)
        x = alloc(p.count, p.dtype)
        if variant == "mpi":
            def run():
                comm.Allreduce(MPI.IN_PLACE, x, op)
                post(x)
            return Case(run, x, x)
        y = alloc(p.count, p.dtype)

        def run_oop():
            comm.Allreduce(x, y, op)
            post(y)
        return Case(run_oop, x, y)

    def _broadcast(self, variant, p):
        comm, root = self.comm, p.root
        x = alloc(p.count, p.dtype)
        mx = mpi_view(x)
        return Case(lambda: comm.Bcast(mx, root=root), x, x)

    def _allgather(self, variant, p):
        from mpi4py import MPI
        comm = self.comm
        out = alloc(p.recv_count, p.dtype)
        mout = mpi_view(out)
        if variant == "mpi":
            return Case(lambda: comm.Allgather(MPI.IN_PLACE, mout),
                        chunk_of(out, self.rank, p.send_count), out)
        x = alloc(p.send_count, p.dtype)
        mx = mpi_view(x)
        return Case(lambda: comm.Allgather(mx, mout), x, out)

    def _reduce_scatter(self, variant, p):
        from mpi4py import MPI
        comm, op, post = self.comm, self._op(p), self._post(p)
        x = alloc(p.send_count, p.dtype)
        if variant == "mpi":
            head = x[:p.recv_count]

            def run():
                comm.Reduce_scatter_block(MPI.IN_PLACE, x, op)
                post(head)
            return Case(run, x, head)
        y = alloc(p.recv_count, p.dtype)

        def run_oop():
            comm.Reduce_scatter_block(x, y, op)
            post(y)
        return Case(run_oop, x, y)

    def _pingpong(self, variant, p):
        comm, tag = self.comm, PINGPONG_TAG
        if self.rank == 0:
            s, r = alloc(p.count, p.dtype), alloc(p.count, p.dtype)
            ms, mr = mpi_view(s), mpi_view(r)

            def run0():
                comm.Send(ms, 1, tag)
                comm.Recv(mr, 1, tag)
            return Case(run0, s, r)
        if self.rank == 1:
            b = alloc(p.count, p.dtype)
            mb = mpi_view(b)

            def run1():
                comm.Recv(mb, 0, tag)
                comm.Send(mb, 0, tag)
            return Case(run1, b, b)
        return idle_case()

    def _alltoall(self, variant, p):
        from mpi4py import MPI
        comm = self.comm
        x = alloc(p.send_count, p.dtype)
        mx = mpi_view(x)
        if variant == "mpi":
            return Case(lambda: comm.Alltoall(MPI.IN_PLACE, mx), x, x)
        y = alloc(p.recv_count, p.dtype)
        my = mpi_view(y)
        return Case(lambda: comm.Alltoall(mx, my), x, y)

    def _reduce(self, variant, p):
        from mpi4py import MPI
        comm, op, root = self.comm, self._op(p), p.root
        post = self._post(p) if self.rank == root else (lambda buf: None)
        x = alloc(p.send_count, p.dtype)
        if variant == "mpi":
            send = MPI.IN_PLACE if self.rank == root else x

            def run():
                comm.Reduce(send, x, op, root=root)
                post(x)
            return Case(run, x, x)
        y = alloc(p.recv_count, p.dtype)

        def run_oop():
            comm.Reduce(x, y, op, root=root)
            post(y)
        return Case(run_oop, x, y)

    def _sendrecv(self, variant, p):
        comm, tag = self.comm, SENDRECV_TAG
        nxt, prev = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        s, r = alloc(p.count, p.dtype), alloc(p.count, p.dtype)
        ms, mr = mpi_view(s), mpi_view(r)
        return Case(lambda: comm.Sendrecv(ms, nxt, tag, mr, prev, tag), s, r)

    def version(self):
        from mpi4py import MPI
        return MPI.Get_library_version().strip().splitlines()[0]


def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", 0))
        return s.getsockname()[1]
    finally:
        s.close()


class GlooFamily(Family):
    """torch.distributed with the gloo backend on CPU tensors."""
    name = "gloo"
    variants = ("gloo",)

    def available(self):
        torch = import_torch()
        if torch is None:
            return "gloo skipped: torch is not installed"
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            return "gloo skipped: this torch build has no gloo backend"
        return None

    backend = "gloo"
    device = None   # where the tensors live: None for the CPU

    def setup(self, comm, opts):
        super().setup(comm, opts)
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        hosts = comm.allgather(socket.gethostname())
        addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        port = comm.bcast(free_port() if self.rank == 0 else None, root=0)
        os.environ["MASTER_ADDR"] = os.environ.get("MLFABRIC_BENCH_MASTER_ADDR", addr)
        os.environ["MASTER_PORT"] = str(port)
        kw = {}
        if self.device is not None and has_kwarg(dist.init_process_group, "device_id"):
            kw["device_id"] = self.device   # NCCL binds its communicator to the GPU at once
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.n,
                                timeout=timedelta(seconds=300), **kw)
        # Newer torch renames the tensor-in/tensor-out collectives; use whichever exists.
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reduce_scatter = (getattr(dist, "reduce_scatter_single", None)
                               or dist.reduce_scatter_tensor)

    def shutdown(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def _op(self, p):
        R = self.dist.ReduceOp
        if p.op == "avg":
            return getattr(R, "AVG", None) or R.SUM
        return {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}[p.op]

    def _post(self, p):
        if p.op == "avg" and not hasattr(self.dist.ReduceOp, "AVG"):
            n = self.n
            return lambda t: t.div_(n)
        return lambda t: None

    def _tensor(self, count, dtype):
        return alloc(count, dtype, kind="torch", device=self.device)

    def _allreduce(self, variant, p):
        dist, op, post = self.dist, self._op(p), self._post(p)
        x = self._tensor(p.count, p.dtype)

        def run():
            dist.all_reduce(x, op=op)
            post(x)
        return Case(run, x, x)

    def _broadcast(self, variant, p):
        dist, root = self.dist, p.root
        x = self._tensor(p.count, p.dtype)
        return Case(lambda: dist.broadcast(x, src=root), x, x)

    def _allgather(self, variant, p):
        x, out = self._tensor(p.send_count, p.dtype), self._tensor(p.recv_count, p.dtype)
        gather = self.all_gather
        return Case(lambda: gather(out, x), x, out)

    def _reduce_scatter(self, variant, p):
        op, post, scatter = self._op(p), self._post(p), self.reduce_scatter
        x, y = self._tensor(p.send_count, p.dtype), self._tensor(p.recv_count, p.dtype)

        def run():
            scatter(y, x, op=op)
            post(y)
        return Case(run, x, y)

    def _pingpong(self, variant, p):
        dist = self.dist
        if self.rank == 0:
            s, r = self._tensor(p.count, p.dtype), self._tensor(p.count, p.dtype)

            def run0():
                dist.send(s, 1)
                dist.recv(r, 1)
            return Case(run0, s, r)
        if self.rank == 1:
            b = self._tensor(p.count, p.dtype)

            def run1():
                dist.recv(b, 0)
                dist.send(b, 0)
            return Case(run1, b, b)
        return idle_case()

    def version(self):
        return "torch " + self.torch.__version__


def has_kwarg(fn, name):
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class MlfabricFamily(Family):
    """mlfabric's public API: `mlfabric` in place on an ordinary buffer, `mlfabric-oop` into a
    preallocated out (allreduce), `mlfabric-shared` in place on a buffer from shared_empty()."""
    name = "mlfabric"
    variants = ("mlfabric", "mlfabric-oop", "mlfabric-shared")

    def available(self):
        try:
            import mlfabric
            for fn in ("init", "allreduce", "broadcast", "allgather", "reduce_scatter", "send",
                       "recv", "shared_empty", "finalize"):
                if not hasattr(mlfabric, fn):
                    return f"mlfabric.{fn} is missing"
        except Exception as e:  # a broken build must not take the other impls down
            return f"mlfabric cannot be imported: {type(e).__name__}: {e}"
        return None

    def setup(self, comm, opts):
        super().setup(comm, opts)
        import mlfabric
        self.mlf = mlfabric
        self._pool, self._slot = {}, 0
        mlfabric.init(comm=comm)
        self.owns_init = True

    def shutdown(self):
        self._pool.clear()  # finalize() frees the shared memory: drop the views first
        if getattr(self, "owns_init", False):
            self.mlf.finalize()

    def supports(self, variant, coll, dtype, op):
        if variant == "mlfabric-oop" and coll != "allreduce":
            return ("only allreduce has an out-of-place variant (the other calls are in place "
                    "or return their output)")
        return None

    def algorithm(self, variant, coll):
        return self.opts.algorithm if coll == "allreduce" else None

    def prepare(self, variant, coll, p):
        self._slot = 0  # shared buffers are handed out by slot, in the same order on every rank
        return super().prepare(variant, coll, p)

    def _buf(self, variant, count, dtype):
        """A 1-D buffer; for mlfabric-shared a view of a pooled shared_empty() buffer.

        shared_empty() is collective and its memory lives until finalize(), so every rank asks
        for the same slots in the same order and a slot is reallocated only when it is too small
        (an ascending sweep keeps < 2x the largest size per slot)."""
        if variant != "mlfabric-shared":
            return alloc(count, dtype)
        slot, self._slot = self._slot, self._slot + 1
        pooled = self._pool.get(slot)
        if pooled is None or pooled[0] != dtype or length(pooled[1]) < count:
            want = dtype
            if dtype == "bfloat16":
                want = import_torch().bfloat16
            try:
                pooled = (dtype, self.mlf.shared_empty((max(count, 1),), want))
            except TypeError as e:
                raise Unsupported(f"shared_empty cannot hold {dtype}: {e}") from e
            self._pool[slot] = pooled
        return pooled[1][:count]

    def _allreduce(self, variant, p):
        from mlfabric.comm.collectives import chosen_backend
        mlf, op, alg = self.mlf, p.op, self.opts.algorithm
        x = self._buf(variant, p.count, p.dtype)
        y = self._buf(variant, p.count, p.dtype) if variant == "mlfabric-oop" else x
        return Case(lambda: mlf.allreduce(x, op=op, out=y, algorithm=alg), x, y,
                    backend=chosen_backend(x, alg))

    def _broadcast(self, variant, p):
        mlf, root = self.mlf, p.root
        x = self._buf(variant, p.count, p.dtype)
        return Case(lambda: mlf.broadcast(x, root=root), x, x)

    def _returning(self, fn, variant, inp, out_count, dtype, **kw):
        """A Case for a call that returns its output, passing a preallocated out= when it can."""
        if has_kwarg(fn, "out"):
            out = self._buf(variant, out_count, dtype)
            return Case(lambda: fn(inp, out=out, **kw), inp, out)
        box = [None]

        def run():
            box[0] = fn(inp, **kw)
        return Case(run, inp, None, output=lambda: box[0])

    def _allgather(self, variant, p):
        x = self._buf(variant, p.send_count, p.dtype)
        return self._returning(self.mlf.allgather, variant, x, p.recv_count, p.dtype)

    def _reduce_scatter(self, variant, p):
        x = self._buf(variant, p.send_count, p.dtype)
        return self._returning(self.mlf.reduce_scatter, variant, x, p.recv_count, p.dtype,
                               op=p.op)

    def _pingpong(self, variant, p):
        mlf = self.mlf
        # Every rank allocates both buffers: shared_empty() is collective.
        s, r = self._buf(variant, p.count, p.dtype), self._buf(variant, p.count, p.dtype)
        if self.rank == 0:
            def run0():
                mlf.send(s, 1, tag=PINGPONG_TAG)
                mlf.recv(r, 1, tag=PINGPONG_TAG)
            return Case(run0, s, r)
        if self.rank == 1:
            def run1():
                mlf.recv(s, 0, tag=PINGPONG_TAG)
                mlf.send(s, 0, tag=PINGPONG_TAG)
            return Case(run1, s, s)
        return idle_case()

    def _alltoall(self, variant, p):
        fn = self.mlf.alltoall
        x = self._buf(variant, p.send_count, p.dtype)
        box = [None]

        def run():
            box[0] = fn(x)[0]   # (out, recv_splits)
        return Case(run, x, None, output=lambda: box[0])

    def _reduce(self, variant, p):
        x = self._buf(variant, p.send_count, p.dtype)
        return self._returning(self.mlf.reduce, variant, x, p.recv_count, p.dtype,
                               root=p.root, op=p.op)

    def _sendrecv(self, variant, p):
        """Even ranks send first and odd ranks receive first, so blocking calls never wait on
        each other round the ring."""
        mlf, tag = self.mlf, SENDRECV_TAG
        nxt, prev = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        s, r = self._buf(variant, p.count, p.dtype), self._buf(variant, p.count, p.dtype)
        if self.rank % 2 == 0:
            def run():
                mlf.send(s, nxt, tag=tag)
                mlf.recv(r, prev, tag=tag)
        else:
            def run():
                mlf.recv(r, prev, tag=tag)
                mlf.send(s, nxt, tag=tag)
        return Case(run, s, r)

    def version(self):
        return "mlfabric " + str(getattr(self.mlf, "__version__", "?"))


class HvdFamily(Family):
    """mlfabric.torch, called as a Horovod script calls horovod.torch, on CPU tensors: what a
    user of the drop-in API pays per call (its control round included), beside gloo's
    torch.distributed calls on the same tensors."""
    name = "hvd"
    variants = ("hvd",)
    OPS = {"sum": "Sum", "avg": "Average", "min": "Min", "max": "Max", "prod": "Product"}

    def available(self):
        if import_torch() is None:
            return "hvd skipped: torch is not installed"
        try:
            import mlfabric.torch  # noqa: F401
        except Exception as e:  # a broken build must not take the other impls down
            return f"mlfabric.torch cannot be imported: {type(e).__name__}: {e}"
        return None

    def setup(self, comm, opts):
        super().setup(comm, opts)
        import mlfabric.torch as hvd
        self.hvd = hvd
        self.owns_init = not hvd.is_initialized()  # the mlfabric family may have done it
        hvd.init(comm)

    def shutdown(self):
        if getattr(self, "owns_init", False):
            self.hvd.shutdown()

    def supports(self, variant, coll, dtype, op):
        if coll == "pingpong":
            return "Horovod's API has no point-to-point calls"
        if coll == "reduce_scatter" and op not in ("sum", "avg"):
            return "hvd.reducescatter reduces with Sum or Average only"
        return None

    def _op(self, p):
        return getattr(self.hvd, self.OPS[p.op])

    def _allreduce(self, variant, p):
        hvd, op = self.hvd, self._op(p)
        x = alloc(p.count, p.dtype, kind="torch")
        return Case(lambda: hvd.allreduce_(x, op=op), x, x)

    def _broadcast(self, variant, p):
        hvd, root = self.hvd, p.root
        x = alloc(p.count, p.dtype, kind="torch")
        return Case(lambda: hvd.broadcast_(x, root), x, x)

    def _returning(self, fn, inp, **kw):
        box = [None]

        def run():
            box[0] = fn(inp, **kw)
        return Case(run, inp, None, output=lambda: box[0])

    def _allgather(self, variant, p):
        return self._returning(self.hvd.allgather, alloc(p.send_count, p.dtype, kind="torch"))

    def _reduce_scatter(self, variant, p):
        return self._returning(self.hvd.reducescatter, alloc(p.send_count, p.dtype, kind="torch"),
                               op=self._op(p))

    def version(self):
        return "mlfabric.torch " + str(getattr(sys.modules.get("mlfabric"), "__version__", "?"))


# --- GPU buffers (--device cuda): CUDA torch tensors, one GPU per rank ------------------------

def cuda_problem():
    """Why this process cannot run the GPU benchmark, or None (local: no communication)."""
    torch = import_torch()
    if torch is None:
        return "torch is not installed (GPU buffers are CUDA torch tensors)"
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:  # a broken driver install: say what torch says
        return f"torch.cuda failed: {type(e).__name__}: {e}"
    if count == 0:
        return (f"torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False; "
                f"its CUDA build: {torch.version.cuda or 'none'})")
    return None


def cuda_setup(comm):
    """Claim this rank's GPU (local rank modulo the host's GPUs) and make it torch's current
    device; returns (torch.device, shared). Collective over comm.

    With fewer GPUs than ranks on the host, every rank claims a host of its own for NCCL
    (NCCL_HOSTID; mlfabric's MLFABRIC_NCCL_SHARE_GPU=1 does the same), so several ranks share
    one GPU through NCCL's socket transport: the numbers then measure the two libraries'
    overheads over the same transport, not what a GPU interconnect carries. Runs before either
    library creates an NCCL communicator, which reads these variables."""
    from mpi4py import MPI
    import torch
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        count = torch.cuda.device_count()
        shared = comm.allreduce(int(count < local.size), op=MPI.MAX) == 1
        if shared:
            os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-bench-rank{comm.rank}"
            os.environ["MLFABRIC_NCCL_SHARE_GPU"] = "1"
        device = torch.device("cuda", local.rank % count)
    finally:
        local.Free()
    torch.cuda.set_device(device)
    return device, shared


class MlfabricGpuFamily(MlfabricFamily):
    """mlfabric's public API on CUDA tensors (its NCCL path; every call returns once NCCL is
    done): `mlfabric` in place, `mlfabric-oop` into a preallocated out (allreduce). Shared
    buffers are host memory, and point-to-point calls move host arrays only."""
    variants = ("mlfabric", "mlfabric-oop")
    HOST_ONLY = ("pingpong", "sendrecv")

    def available(self):
        reason = super().available()
        if reason is not None:
            return reason
        from mlfabric.comm import nccl
        try:
            nccl.library()
        except Exception as e:
            return f"mlfabric's GPU path cannot load NCCL: {e}"
        return None

    def missing(self, coll):
        if coll in self.HOST_ONLY:
            return f"mlfabric's {coll} moves host arrays only (no GPU path)"
        return super().missing(coll)

    def _buf(self, variant, count, dtype):
        return alloc(count, dtype, device=self.opts.cuda_device)

    def version(self):
        from mlfabric.comm import nccl
        return f"{super().version()} (NCCL {nccl.version()})"


class TorchNcclFamily(GlooFamily):
    """torch.distributed with the NCCL backend on CUDA tensors; each call is followed by a
    synchronize of the GPU, so it is timed to completion as mlfabric's blocking calls are."""
    name = "torch-nccl"
    variants = ("torch-nccl",)
    backend = "nccl"

    def available(self):
        torch = import_torch()
        if torch is None:
            return "torch-nccl skipped: torch is not installed"
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_nccl_available():
            return "torch-nccl skipped: this torch build has no NCCL backend"
        return None

    def setup(self, comm, opts):
        self.device = opts.cuda_device
        super().setup(comm, opts)

    def prepare(self, variant, coll, p):
        case = super().prepare(variant, coll, p)
        call, sync, device = case.run, self.torch.cuda.synchronize, self.device

        def run():
            call()
            sync(device)
        case.run = run
        return case

    def _alltoall(self, variant, p):
        dist = self.dist
        x, y = self._tensor(p.send_count, p.dtype), self._tensor(p.recv_count, p.dtype)
        return Case(lambda: dist.all_to_all_single(y, x), x, y)

    def _reduce(self, variant, p):
        dist, op, root = self.dist, self._op(p), p.root
        post = self._post(p) if self.rank == root else (lambda t: None)
        x = self._tensor(p.send_count, p.dtype)

        def run():
            dist.reduce(x, root, op=op)
            post(x)
        return Case(run, x, x)

    def version(self):
        return "torch %s (NCCL %s)" % (self.torch.__version__,
                                       ".".join(map(str, self.torch.cuda.nccl.version())))


# the families of each buffer device (--device)
DEVICE_FAMILIES = {
    "cpu": {"mlfabric": MlfabricFamily, "hvd": HvdFamily, "mpi": MpiFamily, "gloo": GlooFamily},
    "cuda": {"mlfabric": MlfabricGpuFamily, "torch-nccl": TorchNcclFamily},
}
DEFAULT_IMPLS = {"cpu": "mlfabric,mpi,gloo", "cuda": "mlfabric,torch-nccl"}
FAMILIES = DEVICE_FAMILIES["cpu"]
VARIANT_FAMILY = {v: f for f, cls in FAMILIES.items() for v in cls.variants}


def families(device="cpu"):
    return DEVICE_FAMILIES[device]


def variant_family(device="cpu"):
    """variant name -> family name, for the families of `device`."""
    return {v: f for f, cls in families(device).items() for v in cls.variants}


def known_names(device="cpu"):
    return ", ".join(f"{f} ({', '.join(cls.variants)})" for f, cls in families(device).items())


def resolve(spec, device="cpu"):
    """'mlfabric,mpi-oop' -> [('mlfabric', 'mlfabric'), ..., ('mpi', 'mpi-oop')]: family names
    expand to all their variants, variant names stand for themselves; order kept, duplicates
    dropped. ValueError naming the known names (of the families of `device`) for anything
    else."""
    fams, by_variant = families(device), variant_family(device)
    out = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        if name in fams:
            pairs = [(name, v) for v in fams[name].variants]
        elif name in by_variant:
            pairs = [(by_variant[name], name)]
        else:
            other = [d for d in DEVICE_FAMILIES if d != device
                     and (name in DEVICE_FAMILIES[d] or name in variant_family(d))]
            where = f" (it runs with --device {other[0]})" if other else ""
            raise ValueError(f"unknown implementation {name!r} for --device {device}{where}; "
                             f"known: {known_names(device)}")
        out += [pr for pr in pairs if pr not in out]
    if not out:
        raise ValueError(f"--impl names no implementation; known: {known_names(device)}")
    return out
