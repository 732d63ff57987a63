"""The GPU path of the public collectives (collectives.py sends GPU arrays here; this module
never imports it: what both share is in call.py): the same arguments, checks and results as the
host path, moved by NCCL (comm/nccl.py).

Every call still exchanges headers over MPI first, with the algorithm word set to 'nccl': ranks
that disagree on shape, dtype, op or root, or where one passes a GPU array and another a host
array, all raise MismatchError before NCCL sees anything (NCCL itself would hang or corrupt).
Arrays are wrapped, and the caller's stream marked with a 'ready' event, on the caller's thread,
since a non-blocking call runs on mlfabric's queue thread, whose current stream is another.
A call returns once NCCL is done (inside nccl.deferred(), as mlfabric.torch calls it, once
launched: the caller then waits). Results on the GPU are written in place: a non-contiguous
output is refused, not copied back."""
from .._core import device as _device, dtypes as _dtypes
from . import call, context, header, nccl
from ..errors import MlfabricError


def _now(fn):
    """Run fn() on the caller's thread; return a function that gives its result, or raises its
    error when called inside prepare() (so a rank with bad arguments still joins the header
    exchange, as rejected, and its peers fail at once)."""
    try:
        value = fn()
    except Exception as exc:  # any failed check (torch raises RuntimeErrors) is a rejection
        error = exc  # (the name `exc` is unbound when the except block ends)

        def fail():
            raise error
        return fail
    return lambda: value


def _check_gpu(ctx, xb, what):
    """Errors that must surface before the header exchange (so the peers hear of them at once):
    no NCCL, a communicator that has failed, or another GPU than the communicator's."""
    nccl.library()
    comm = ctx.nccl
    if comm is not None and comm.failed is not None:
        raise MlfabricError(f"{what}: this rank's NCCL communicator is unusable: {comm.failed}")
    if comm is not None and comm.device != xb.device:
        raise MlfabricError(f"{what}: this rank's NCCL communicator is on GPU {comm.device}, the "
                            f"array is on GPU {xb.device}; mlfabric uses one GPU per rank")


def _communicator(ctx, xb):
    """This context's NCCL communicator, created at the first GPU call: right after that call's
    header exchange, on every rank, whatever the rank then sends (creating it is collective)."""
    if ctx.nccl is None:
        comm = ctx.nccl = nccl.Communicator(ctx.rank, ctx.size, xb.device)
        comm.init(ctx, xb.devices)   # a failure leaves it marked failed: later calls refuse
    return ctx.nccl


def _output(xb, out, what, count, shape):
    if out is None:
        return _device.empty_like(xb, shape)
    return out, _device.check_out(xb, out, what, count)


def allreduce_now(x, out):
    """The caller's-thread part of an allreduce of GPU array x (see _now): a function that gives
    (xb, result, out view, ready event) for allreduce_plan, or raises the error found."""
    def now():
        xb = _device.wrap(x)
        res, ob = _output(xb, out, "allreduce", xb.count, xb.shape)
        return xb, res, ob, _device.ready_event(xb)
    return _now(now)


def allreduce_plan(ctx, early, opc, avg):
    """(header, body) of an allreduce over NCCL (collectives.py checked the op and chose NCCL);
    early: what the function allreduce_now returned gave."""
    what = "allreduce"
    xb, res, ob, ready = early
    _check_gpu(ctx, xb, what)

    def body(hdr):
        call.exchange_headers(ctx, what, hdr)
        comm = _communicator(ctx, xb)
        if xb.count:
            comm.allreduce(what, xb.devices, ready, xb.ptr, ob.ptr, xb.count, xb.code, opc, avg)
        return res
    return header.make(what, xb.code, opc, avg, 0, xb.shape, "nccl"), body


def reduce(x, root, op, out):
    what = "reduce"

    def now():
        ctx = context.get()
        xb = _device.wrap(x)
        r = call.check_root(root, ctx.size)
        res, ob = _output(xb, out, what, xb.count, xb.shape) if ctx.rank == r else (None, xb)
        return xb, r, res, ob, _device.ready_event(xb)
    early = _now(now)

    def prepare(ctx):
        xb, r, res, ob, ready = early()
        opc, avg = _dtypes.op_code(op, xb.code)
        _check_gpu(ctx, xb, what)

        def body(hdr):
            call.exchange_headers(ctx, what, hdr)
            comm = _communicator(ctx, xb)
            if xb.count:
                comm.reduce(what, xb.devices, ready, xb.ptr, ob.ptr, xb.count, xb.code, opc, avg,
                            r)
            return res
        return header.make(what, xb.code, opc, avg, r, xb.shape, "nccl"), body

    return call.run(what, prepare)


def broadcast(x, root, async_, element=0):
    what = "broadcast"

    def now():
        xb = _device.wrap(x, output=True)
        return xb, _device.ready_event(xb)
    early = _now(now)

    def prepare(ctx):
        xb, ready = early()
        r = call.check_root(root, ctx.size)
        _check_gpu(ctx, xb, what)

        def body(hdr):
            call.exchange_headers(ctx, what, hdr)
            comm = _communicator(ctx, xb)
            if xb.count:
                comm.broadcast(what, xb.devices, ready, xb.ptr, xb.count, xb.code, r)
            return x
        return header.make(what, xb.code, 0, False, r, xb.shape, "nccl", element=element), body

    return call.run(what, prepare, async_)


def allgather(x, out, async_, element=0):
    what = "allgather"

    def now():
        n = context.get().size
        xb = _device.wrap(x)
        shape = (n * xb.shape[0], *xb.shape[1:]) if xb.shape else (n,)
        res, ob = _output(xb, out, what, n * xb.count, shape)
        return xb, res, ob, _device.ready_event(xb)
    early = _now(now)

    def prepare(ctx):
        xb, res, ob, ready = early()
        _check_gpu(ctx, xb, what)

        def body(hdr):
            call.exchange_headers(ctx, what, hdr)
            comm = _communicator(ctx, xb)
            if xb.count:
                comm.allgather(what, xb.devices, ready, xb.ptr, ob.ptr, xb.count, xb.code)
            return res
        return header.make(what, xb.code, 0, False, 0, xb.shape, "nccl", element=element), body

    return call.run(what, prepare, async_)


def reduce_scatter(x, op, out, async_):
    what = "reduce_scatter"

    def now():
        ctx = context.get()
        xb = _device.wrap(x)
        if not xb.shape:
            raise ValueError("reduce_scatter needs an array with at least one dimension")
        rows = call.split_rows(xb.shape[0], ctx.size)
        row_len = xb.count // xb.shape[0] if xb.shape[0] else 0
        counts = [r * row_len for r in rows]
        res, ob = _output(xb, out, what, counts[ctx.rank], (rows[ctx.rank], *xb.shape[1:]))
        # uneven blocks (NCCL's reduce-scatter takes equal ones): the whole sum lands here
        full = _device.empty_like(xb)[1] if len(set(counts)) > 1 else None
        return xb, res, ob, counts, full, _device.ready_event(xb)
    early = _now(now)

    def prepare(ctx):
        xb, res, ob, counts, full, ready = early()
        opc, avg = _dtypes.op_code(op, xb.code)
        _check_gpu(ctx, xb, what)

        def body(hdr):
            call.exchange_headers(ctx, what, hdr)
            comm = _communicator(ctx, xb)
            if not xb.count:
                return res
            if full is None:
                comm.reduce_scatter(what, xb.devices, ready, xb.ptr, ob.ptr, counts[0], xb.code,
                                    opc, avg)
                return res
            # Only when shape[0] is not a multiple of the ranks: reduce everything, keep this
            # rank's rows.
            lo = sum(counts[:ctx.rank])
            mine = xb.devices.flat(full.arr)[lo:lo + counts[ctx.rank]]
            comm.allreduce(what, xb.devices, ready, xb.ptr, full.ptr, xb.count, xb.code, opc, avg,
                           then=lambda stream: xb.devices.copy_on(stream,
                                                                  xb.devices.flat(ob.arr), mine))
            return res
        return header.make(what, xb.code, opc, avg, 0, xb.shape, "nccl"), body

    return call.run(what, prepare, async_)


def alltoall(x, splits, async_):
    """As collectives.alltoall: the split counts go over MPI, the rows over NCCL. The output's
    size is known only after the split exchange, so it is allocated then (on the queue thread, for
    a non-blocking call) from the caller's stream's pool, and the NCCL work waits for an event
    recorded after that allocation."""
    what = "alltoall"

    def now():
        n = context.get().size
        xb = _device.wrap(x)
        if not xb.shape:
            raise ValueError("alltoall needs an array with at least one dimension")
        return xb, call.alltoall_splits(splits, xb.shape[0], n), \
            xb.devices.current_stream(xb.arr)
    early = _now(now)

    def prepare(ctx):
        xb, send_rows, caller = early()
        _check_gpu(ctx, xb, what)

        def body(hdr):
            call.exchange_headers(ctx, what, hdr)
            comm = _communicator(ctx, xb)
            rest = tuple(xb.shape[1:])
            recv_rows, row_bytes = call.exchange_splits(ctx, what, send_rows, rest, xb.code)
            devices = xb.devices
            with devices.using(caller):
                res, ob = _device.empty_like(xb, (int(recv_rows.sum()), *rest))
                ready = devices.record(caller)
            if row_bytes and (send_rows.any() or recv_rows.any()):
                comm.alltoallv(what, devices, ready, xb.ptr, ob.ptr,
                               [int(r) * row_bytes for r in send_rows],
                               [int(r) * row_bytes for r in recv_rows])
            return res, recv_rows
        # The shape carried is one row's (the first dimension may differ between ranks).
        return header.make(what, xb.code, 0, False, 0, tuple(xb.shape[1:]), "nccl"), body

    return call.run(what, prepare, async_)
