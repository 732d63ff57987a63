"""One collective call's frame, shared by the host path (collectives.py), the GPU path
(gpu_collectives.py) and shared buffers (shared.py): the guard every call runs inside (run: the
call's place in mlfabric's queue, the header exchange that turns bad arguments on one rank into an
error on every rank, giving up on the context when a call ends out of step), the MPI exchanges
both data paths make before moving data (headers, alltoall's split counts), and the argument
checks they share (root, reduce_scatter's rows, alltoall's splits)."""
import functools

import numpy as np

from .._core import buffers as _buffers, dtypes as _dtypes
from . import context, header, p2p
from ..errors import MismatchError


def exchange_headers(ctx, what, hdr):
    """Header-only exchange for paths that do not carry headers themselves (MPI algorithms)."""
    if ctx.shm is not None:
        ctx.shm.check_headers(what, hdr)
        return
    mine = np.asarray(hdr, np.int64)
    every = np.empty(ctx.size * header.WORDS, np.int64)
    req = ctx.comm.Iallgather(mine, every)
    p2p.wait([req], p2p.others(ctx.comm), f"{what} (header exchange)")
    header.check(header.from_flat(every, ctx.size), what)


def run(what, prepare, async_=False):
    """Check arguments (prepare() -> (header, body) or raise), exchange headers, run body().

    A rank whose arguments are bad still joins the header exchange with a 'rejected' header, so
    its peers fail at once with a MismatchError naming it, and then raises its own error."""
    ctx = context.get()
    call = functools.partial(_call, ctx, what, prepare)
    if async_:
        return ctx.executor.submit(what, call)
    return ctx.executor.run(what, call)


def _call(ctx, what, prepare):
    """One call on ctx, on the thread that runs it (see run). Whatever ends it out of step with
    the peers (a timeout, any error after the header exchange but a mismatch every rank raises
    alike) makes this rank give up on ctx and tell its peers (context.Context.fail), so that no
    rank pairs a later call with messages of this one."""
    ctx.enter(what)
    # waits over MPI poll for a peer giving up; the engine's own waits see its failed marks
    watched = ctx.shm is None
    previous = p2p.watch(ctx.peer_failure) if watched else None
    try:
        try:
            hdr, body = prepare(ctx)
        except Exception as exc:  # any failed check: torch's RuntimeErrors, OverflowErrors too
            _reject(ctx, what)
            raise exc
        try:
            result = body(hdr)
        except MismatchError:
            raise  # the header check: every rank raises it, in step
        except BaseException as exc:
            ctx.fail(what, exc)
            raise
    finally:
        if watched:
            p2p.watch(previous)
        ctx.leave()
    ctx.confirm(what)
    return result


def _reject(ctx, what):
    """Join the header exchange as 'rejected', so the peers fail at once naming this rank."""
    try:
        exchange_headers(ctx, what, header.rejected(what))
    except MismatchError:
        pass  # the peers' view of this call; this rank's own error is the one to raise
    except Exception as exc:  # the exchange itself failed (a timeout): out of step now
        ctx.fail(what, exc)


def exchange_splits(ctx, what, send_rows, rest, code):
    """(rows this rank receives from each rank, bytes of one row of shape `rest`): alltoall's
    split counts go round over MPI first, for the host and the GPU path alike."""
    recv_rows = np.empty(ctx.size, np.int64)
    p2p.wait([ctx.comm.Ialltoall(send_rows, recv_rows)], p2p.others(ctx.comm),
             f"{what} (split exchange)")
    return recv_rows, int(np.prod(rest, dtype=np.int64)) * _dtypes.ITEMSIZE[code]


# --- argument checks ----------------------------------------------------------------------------

def check_root(root, n):
    """root as an int, or ValueError unless it is a rank in [0, n)."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ValueError(f"root must be a rank in [0, {n}), got {root!r}")
    return int(root)


def split_rows(rows, n):
    """Rows of each rank's chunk: like numpy.array_split, the first rows % n ranks get one more."""
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def alltoall_splits(splits, rows, n):
    """Rows each rank gets, as an int64 array of n; ValueError when they do not fit x."""
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall without splits sends shape[0] / size rows to each rank: "
                             f"shape[0]={rows} is not divisible by size={n}; pass splits")
        return np.full(n, rows // n, np.int64)
    if _buffers.is_torch(splits):
        splits = splits.detach().cpu().numpy()
    arr = np.asarray(splits)
    if arr.ndim != 1 or arr.size != n or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"alltoall: splits must be {n} integers (one per rank), got {splits!r}")
    arr = arr.astype(np.int64)
    if (arr < 0).any() or int(arr.sum()) != rows:
        raise ValueError(f"alltoall: splits {arr.tolist()} must be non-negative and add up to "
                         f"shape[0]={rows}")
    return arr
