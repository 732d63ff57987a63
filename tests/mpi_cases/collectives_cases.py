"""Multi-rank cases for the public collectives: every op x dtype x algorithm against a float64
reference, odd sizes, in place and out of place, torch tensors, non-contiguous views, shared
buffers (zero-copy), bitwise-identical results on every rank."""
import numpy as np
import pytest

import mlfabric as mf

from .common import (DTYPES, OPS, assert_close, magnitude, reference, same_everywhere, setup, to_dtype,  # noqa: F401
                     torch, values)

SIZES = (0, 1, 7, 1021, 65537)
# Larger than the engine's staging area (slots x ranks x block), so the pipeline wraps around.
BIG = 2_000_003


def _allreduce_check(dtype, op, count, algorithm, salt=0):
    n, r = mf.size(), mf.rank()
    if op == "avg" and dtype.startswith("int"):
        return
    x = to_dtype(values(r, count, dtype, op, salt), dtype)
    got = mf.allreduce(x, op=op, algorithm=algorithm)
    inputs = [values(q, count, dtype, op, salt) for q in range(n)]
    what = f"allreduce {op} {dtype} n={count} {algorithm}"
    assert_close(got, reference(op, inputs, n), dtype, what, magnitude(op, inputs, n))
    same_everywhere(got, what)


def case_allreduce_shm_all_ops_dtypes():
    for dtype in DTYPES:
        for op in OPS:
            for count in SIZES:
                _allreduce_check(dtype, op, count, "shm")


def case_allreduce_mpi_algorithms():
    for algorithm in ("ring", "rhd", "tree"):
        for dtype in DTYPES:
            for op in OPS:
                for count in (0, 1, 7, 1021):
                    _allreduce_check(dtype, op, count, algorithm)
        _allreduce_check("float32", "sum", 65537, algorithm)


def case_allreduce_larger_than_segment():
    for algorithm in ("auto", "shm", "ring"):
        _allreduce_check("float32", "sum", BIG, algorithm)
    _allreduce_check("float64", "max", BIG // 2, "shm")
    _allreduce_check("bfloat16", "avg", BIG // 3, "shm")


def case_allreduce_in_place_and_out():
    n, r = mf.size(), mf.rank()
    for count in (5, 300_007):
        want = reference("sum", [values(q, count, "float64", "sum") for q in range(n)], n)
        x = values(r, count, "float64", "sum")
        assert mf.allreduce(x, out=x) is x
        assert_close(x, want, "float64", "in place")
        x = values(r, count, "float64", "sum")
        out = np.full(count, np.nan)
        assert mf.allreduce(x, out=out) is out
        assert_close(out, want, "float64", "out=")
        assert_close(x, values(r, count, "float64", "sum"), "float64", "input untouched")


def case_allreduce_torch_and_noncontiguous():
    n, r = mf.size(), mf.rank()
    base = values(r, 6 * 50, "float32", "sum").reshape(6, 50).astype(np.float32)
    want = reference("sum", [values(q, 300, "float32", "sum").reshape(6, 50) for q in range(n)], n)
    view = base.T  # non-contiguous: copied in, copied back
    mf.allreduce(view, out=view)
    assert_close(base, want, "float32", "non-contiguous in place")
    if torch is None:
        return
    t = torch.from_numpy(values(r, 300, "float32", "sum").reshape(6, 50).astype(np.float32))
    got = mf.allreduce(t)
    assert isinstance(got, torch.Tensor) and got.shape == (6, 50)
    assert_close(got, want, "float32", "torch")
    tt = t.clone().t()  # non-contiguous torch
    mf.allreduce(tt, out=tt)
    assert_close(tt.t(), want, "float32", "torch non-contiguous")
    g = torch.ones(10, requires_grad=True)
    assert_close(mf.allreduce(g.detach()), np.full(10, n), "float32", "requires_grad source")
    # a tensor in, a tensor out, on the direct path too
    got = mf.allgather(torch.full((2, 3), float(r)))
    assert isinstance(got, torch.Tensor) and got.shape == (2 * n, 3), got
    assert (got[::2, 0] == torch.arange(n, dtype=torch.float32)).all(), got


def _zero_copy_calls():
    from mlfabric.comm import context
    return context.get().shm.zero_copy_calls


def case_shared_buffers_zero_copy():
    n, r = mf.size(), mf.rank()
    for count in (1, 1021, 300_007):
        s = mf.shared_empty(count, np.float64)
        assert mf.is_shared(s)
        s[:] = values(r, count, "float64", "sum")
        want = reference("sum", [values(q, count, "float64", "sum") for q in range(n)], n)
        before = _zero_copy_calls()
        mf.allreduce(s, out=s)
        # Calls longer than one pipeline step read peers' buffers in place.
        assert _zero_copy_calls() == before + (count > 100_000), (before, _zero_copy_calls())
        assert_close(s, want, "float64", f"shared in place n={count}")
        same_everywhere(s, "shared")
        s[:] = values(r, count, "float64", "sum")
        out = mf.shared_empty(count, np.float64)
        mf.allreduce(s, op="avg", out=out)
        assert_close(out, want / n, "float64", "shared out of place")
        # Broadcast and allgather read peers' shared buffers directly too.
        s[:] = r
        mf.broadcast(s, root=n - 1)
        assert (s == n - 1).all()
        s[:] = r
        g = mf.allgather(s)
        assert (g.reshape(n, count) == np.arange(n)[:, None]).all()
    # A view at the same offset everywhere is still zero-copy; a private array is not shared.
    s = mf.shared_zeros((4, 200_000), np.float32)
    s[1:3] = r + 1
    before = _zero_copy_calls()
    mf.allreduce(s[1:3], out=s[1:3])
    assert _zero_copy_calls() == before + 1
    assert (s[1:3] == n * (n + 1) / 2).all() and (s[0] == 0).all() and (s[3] == 0).all()
    assert not mf.is_shared(np.zeros(3))
    if torch is not None:
        ts = mf.shared_empty((3, 4), torch.bfloat16)
        ts.fill_(1.0)
        mf.allreduce(ts, out=ts)
        assert (ts.float() == n).all()
        # a shared tensor longer than a step is read in place, as a shared numpy array is
        big = mf.shared_empty((300_007,), torch.float32)
        big.fill_(r + 1.0)
        before = _zero_copy_calls()
        mf.allreduce(big, out=big)
        assert _zero_copy_calls() == before + 1, (before, _zero_copy_calls())
        assert (big == n * (n + 1) / 2).all()


def case_broadcast_every_root():
    n, r = mf.size(), mf.rank()
    for dtype in DTYPES:
        for count in (0, 1, 1021, BIG if dtype == "float32" else 3):
            for root in range(n):
                x = to_dtype(values(r, count, dtype, "sum"), dtype)
                assert mf.broadcast(x, root=root) is x
                assert_close(x, values(root, count, dtype, "sum"), dtype, f"broadcast {dtype}")


def case_allgather():
    n, r = mf.size(), mf.rank()
    for dtype in DTYPES:
        for shape in ((), (0,), (7,), (3, 5), (BIG,) if dtype == "int32" else (2,)):
            count = int(np.prod(shape))
            x = to_dtype(values(r, count, dtype, "sum").reshape(shape), dtype)
            got = mf.allgather(x)
            want = np.concatenate([values(q, count, dtype, "sum").reshape(shape or (1,))
                                   for q in range(n)])
            assert_close(got, want, dtype, f"allgather {dtype} {shape}")


def case_direct_and_general_paths_agree():
    # Small numpy calls take a direct path (a prepared engine call); out= (allgather) or an
    # explicit algorithm (allreduce) sends rank 0 down the general path instead. The two paths
    # must describe the same call alike, or every rank would fail with a mismatch.
    n, r = mf.size(), mf.rank()
    x = np.arange(6, dtype=np.int64).reshape(2, 3) + 10 * r
    out = np.empty((2 * n, 3), np.int64) if r == 0 else None
    got = mf.allgather(x, out=out)
    assert got.shape == (2 * n, 3) and (out is None or got is out)
    want = np.concatenate([np.arange(6, dtype=np.int64).reshape(2, 3) + 10 * q for q in range(n)])
    assert (got == want).all(), got
    y = np.full(5, r + 0.5)
    got = mf.allreduce(y, op="avg", algorithm="shm" if r == 0 else "auto")
    assert np.allclose(got, sum(q + 0.5 for q in range(n)) / n), got


def case_direct_path_plans_stay_bounded():
    # The engine keeps every prepared call: allgathers of ever new shapes (sparse gradients'
    # varying rows) must stop preparing new ones at the cache's bound, and stay right after it.
    from mlfabric.comm import context
    ctx = context.get()
    if ctx.shm is None:
        return
    made, plan = [], ctx.shm.plan

    def counting(*a):
        made.append(a)
        return plan(*a)
    ctx.shm.plan = counting
    try:
        n, r = mf.size(), mf.rank()
        for rows in range(1, 1100):
            got = mf.allgather(np.full((rows, 1), r, np.int32))
            assert got.shape == (n * rows, 1) and (got[::rows, 0] == np.arange(n)).all(), rows
    finally:
        del ctx.shm.plan  # the instance attribute: the method again
    assert len(ctx.plain_plans) <= 1024 and len(made) <= 1024, (len(ctx.plain_plans), len(made))


def case_reduce_scatter():
    n, r = mf.size(), mf.rank()
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and dtype.startswith("int"):
                continue
            for rows in (0, 1, n, 2 * n + 1, 1000):
                count = rows * 3
                x = to_dtype(values(r, count, dtype, op).reshape(rows, 3), dtype)
                got = mf.reduce_scatter(x, op=op)
                inputs = [values(q, count, dtype, op).reshape(rows, 3) for q in range(n)]
                want = np.array_split(reference(op, inputs, n), n)[r]
                mag = magnitude(op, inputs, n)
                mag = None if mag is None else np.array_split(mag, n)[r]
                assert_close(got, want, dtype, f"reduce_scatter {op} {dtype} rows={rows}", mag)


def case_reduce_to_root():
    n, r = mf.size(), mf.rank()
    for root in range(n):
        for count in (0, 3, 300_007):
            x = values(r, count, "float64", "max")
            got = mf.reduce(x, root=root, op="max")
            if r == root:
                assert_close(got, reference("max", [values(q, count, "float64", "max")
                                                    for q in range(n)], n), "float64", "reduce")
            else:
                assert got is None


def case_async_handles_in_order():
    n, r = mf.size(), mf.rank()
    xs = [np.full(1000 * (i + 1), r + i, np.float64) for i in range(5)]
    handles = [mf.allreduce_async(x) for x in xs]
    hb = mf.broadcast_async(np.full(10, r, np.int64), root=0)
    # Waiting out of order is fine: the calls ran in the order they were issued.
    assert (hb.wait() == 0).all()
    for i in reversed(range(5)):
        got = handles[i].wait()
        assert handles[i].done()
        assert (got == sum(q + i for q in range(n))).all()
    # A blocking call after async ones runs after them: it sees the first call's result.
    x = np.full(300_000, r + 1.0)
    h = mf.allreduce_async(x, out=x)
    got = mf.allreduce(x)  # must read x after the async call wrote the sum into it
    h.wait()
    assert (got == n * n * (n + 1) / 2).all(), got[:3]
    h = mf.allgather_async(np.array([r]))
    assert list(h.wait()) == list(range(n))
    hr = mf.reduce_scatter_async(np.ones((n, 2)))
    assert (hr.wait() == n).all()


def case_barrier_and_send_recv():
    n, r = mf.size(), mf.rank()
    mf.barrier()
    if n < 2:
        return
    # A ring of messages, different sizes and dtypes, with tags.
    right, left = (r + 1) % n, (r - 1) % n
    if r % 2 == 0:
        mf.send(np.arange(10, dtype=np.int64) + r, right, tag=3)
        got = mf.recv(np.empty(10, np.int64), left, tag=3)
    else:
        got = mf.recv(np.empty(10, np.int64), left, tag=3)
        mf.send(np.arange(10, dtype=np.int64) + r, right, tag=3)
    assert (got == np.arange(10) + left).all()


def case_send_recv_large_tags():
    """Tags beyond the first 8192 (torch code uses large ones) reach their own receive: messages
    on tags that differ only above 8192 never cross; a tag MPI cannot carry, or a negative one,
    is a ValueError naming the range, at once."""
    from mpi4py import MPI
    n, r = mf.size(), mf.rank()
    top = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - 0x8000 + 1
    for bad in (-1, top, 1.5, True):
        with pytest.raises(ValueError, match=r"tag must be an int in \[0, "):
            mf.isend(np.zeros(2), (r + 1) % n, tag=bad)
    if n < 2:
        return
    right, left = (r + 1) % n, (r - 1) % n
    tags = [8191, 8192, 100_000, top - 1]
    recvs = {t: mf.irecv(np.empty(3, np.int64), left, tag=t) for t in reversed(tags)}
    sends = [mf.isend(np.array([t, r, 7], np.int64), right, tag=t) for t in tags]
    for t, req in recvs.items():
        assert req.wait().tolist() == [t, left, 7], (t, req.wait())
    for req in sends:
        req.wait()


def case_isend_irecv_posted_when_made():
    """isend / irecv return Requests posted when made: every rank may post its receive before
    its send (a ring, small and large); test() polls; blocking send pairs with irecv."""
    n, r = mf.size(), mf.rank()
    if n < 2:
        return
    right, left = (r + 1) % n, (r - 1) % n
    for count in (10, 1 << 18):
        got = np.empty(count, np.float64)
        rreq = mf.irecv(got, left, tag=5)
        sreq = mf.isend(np.arange(count, dtype=np.float64) + r, right, tag=5)
        assert rreq.wait() is got and sreq.wait() is None
        assert rreq.test() and sreq.test()
        assert (got == np.arange(count) + left).all()
    if r == 0:
        mf.send(np.full(4, 3, np.int32), 1)
    elif r == 1:
        req = mf.irecv(np.empty(4, np.int32), 0)
        while not req.test():
            pass
        assert (req.wait() == 3).all()


def case_broadcast_then_barrier_rounds():
    # Broadcasts of a few pipeline steps (fewer than the slots) let the root run ahead: the next
    # call's header must not land on a header a slow peer still reads.
    n, r = mf.size(), mf.rank()
    x = np.empty(150_000, np.float32)
    for i in range(300):
        x[:] = r + i
        mf.broadcast(x, root=i % n)
        assert x[0] == i % n + i and x[-1] == i % n + i
        mf.barrier()


def case_single_copy_path_when_enabled():
    from mlfabric._core import config as _config
    from mlfabric.comm import context
    engine = context.get().shm.engine
    if not engine.cma_enabled:
        return  # one rank, or the kernel refuses process_vm_readv here
    lo, hi = _config.cma_range(mf.size())
    before = engine.cma_calls
    _allreduce_check("float32", "sum", 2_000_003, "shm", salt=1)
    assert engine.cma_calls == before + (lo < 2_000_003 * 4 <= hi)


# --- one rank's bad input: its own error there, at once a MismatchError naming it elsewhere ----

def _fails_alone(bad, fn, error, match):
    """fn() on every rank: `error` matching `match` on rank bad (its own, not a peer's), a
    MismatchError naming bad on the others."""
    if mf.rank() == bad:
        with pytest.raises(error, match=match) as info:
            fn()
        assert not isinstance(info.value, mf.MismatchError), info.value
    else:
        with pytest.raises(mf.MismatchError, match=rf"rank\(s\) \[{bad}\] rejected"):
            fn()


def _neg_ones(shape):
    """A float32 tensor of ones with its negative bit set (the .imag of a conjugate)."""
    return torch.full(shape, -1j).conj().imag


def case_one_rank_tensor_numpy_cannot_view():
    # Tensors numpy cannot view raise torch's own errors (RuntimeError, not only TypeError or
    # ValueError), on the direct path too: the rank passing one must still join the call.
    if torch is None:
        return
    n, r = mf.size(), mf.rank()
    bad = n - 1
    good = [torch.ones(4, 3, requires_grad=True), torch.ones(3, 4).t(), _neg_ones((4, 3))]
    x = good[r % 3]  # views numpy can take, or the general path copies
    rows = torch.ones(n, 3)

    def batched(fn, shape):  # vmap's batched tensors have no storage numpy could view
        return (lambda: torch.func.vmap(fn)(torch.ones(2, *shape))) if r == bad else \
            (lambda: fn(torch.ones(shape)))
    storage = "storage"  # torch: "Cannot access data pointer of Tensor that doesn't have storage"
    _fails_alone(bad, batched(mf.allreduce, (4, 3)), RuntimeError, storage)
    _fails_alone(bad, batched(mf.allgather, (4, 3)), RuntimeError, storage)
    _fails_alone(bad, batched(mf.broadcast, (4, 3)), RuntimeError, storage)
    _fails_alone(bad, batched(mf.reduce_scatter, (n, 3)), RuntimeError, storage)
    _fails_alone(bad, batched(lambda t: mf.alltoall(t)[0], (n, 3)), RuntimeError, storage)
    csr = torch.ones(4, 3).to_sparse_csr()  # is_contiguous() raises for it
    _fails_alone(bad, lambda: mf.allreduce(csr if r == bad else x), TypeError, "dense")
    coo = torch.ones(4, 3).to_sparse()
    _fails_alone(bad, lambda: mf.allgather(coo if r == bad else x), TypeError, "dense")
    _fails_alone(bad, lambda: mf.alltoall(coo if r == bad else rows), TypeError, "dense")
    # the others' inputs, and the calls after, are fine
    got = mf.allreduce(x)
    assert isinstance(got, torch.Tensor) and (got == torch.full((4, 3), float(n))).all(), got
    # A contiguous tensor with its negative bit set, in and out: copied, and copied back.
    y = torch.full((1,), -1j * (r + 1)).conj().imag
    assert y.is_neg() and y.is_contiguous() and y.item() == r + 1
    assert mf.allreduce(y).item() == n * (n + 1) // 2
    assert mf.broadcast(y, root=n - 1) is y and y.item() == n and y.is_neg()
    assert mf.allreduce(y, out=y) is y and y.item() == n * n
    got = mf.allgather(torch.full((2,), -1j * r).conj().imag)
    assert got.tolist() == [float(q) for q in range(n) for _ in range(2)], got


def case_one_rank_output_whose_elements_share_memory():
    # An output where elements share memory would keep one result per location: refused before
    # the call (before, a numpy one got a wrong result silently, and a torch one raised after
    # the data moved, its peers going on with theirs).
    n, r = mf.size(), mf.rank()
    bad = 0
    x = np.arange(6.0) + r
    want = np.arange(6.0) * n + n * (n - 1) // 2
    # a 0 stride (broadcast), and rows that interleave: [0 1 2], [1 2 3]
    for shared in (np.lib.stride_tricks.as_strided(np.zeros(1), (6,), (0,)),
                   np.lib.stride_tricks.as_strided(np.zeros(4), (2, 3), (8, 8))):
        assert shared.flags.writeable
        own = np.full(12, np.nan)[::2]  # not contiguous, but every element its own
        out = shared if r == bad else own
        _fails_alone(bad, lambda: mf.allreduce(x, out=out), ValueError, "share memory")
        assert (shared == 0).all()
    # strides that interleave without overlapping (offsets 0 2 4 and 3 5 7) are fine
    apart = np.lib.stride_tricks.as_strided(np.zeros(8), (3, 2), (16, 24))
    assert mf.allreduce(x, out=apart) is apart and (apart.ravel() == want).all(), apart
    if torch is not None:
        t = torch.arange(6.0) + r
        expanded = torch.zeros(1).expand(6)

        def out_of(shape):
            return expanded if r == bad else torch.zeros(shape)
        _fails_alone(bad, lambda: mf.allreduce(t, out=out_of(6)), ValueError, "share memory")
        _fails_alone(bad, lambda: mf.allgather(t, out=out_of(6 * n)), ValueError, "share memory")
        _fails_alone(bad, lambda: mf.broadcast(out_of(6)), ValueError, "share memory")
        _fails_alone(bad, lambda: mf.reduce(t, root=bad, out=out_of(6) if r == bad else None),
                     ValueError, "share memory")
        rows = torch.ones(2 * n, 3)
        _fails_alone(bad, lambda: mf.reduce_scatter(
            rows, out=torch.zeros(1, 1).expand(2, 3) if r == bad else torch.zeros(2, 3)),
            ValueError, "share memory")
        assert (expanded == 0).all()
        got = mf.allreduce(t, out=torch.zeros(3, 2).t())
        assert (got.reshape(-1) == torch.from_numpy(want).float()).all(), got
    got = mf.allreduce(x)
    assert (got == want).all(), got


def _grad_layouts(shape):
    """Tensors of zeros that require grad, of shape `shape` (2-D): a contiguous leaf, a
    transposed leaf, a leaf over every other column, a transposed view of a leaf."""
    rows, cols = shape
    return [torch.zeros(shape, requires_grad=True),
            torch.zeros(cols, rows).t().requires_grad_(),
            torch.zeros(rows, 2 * cols)[:, ::2].requires_grad_(),
            torch.zeros(cols, rows, requires_grad=True).t()]


def case_leaf_that_requires_grad_receives_in_any_layout():
    # A contiguous one is written through numpy, outside autograd; a non-contiguous one was
    # copied back with torch's copy_, which autograd refuses for a leaf that requires grad (or
    # a view of one): the rank raised after the data moved, its peers going on.
    if torch is None:
        return
    n, r = mf.size(), mf.rank()
    x = torch.arange(12.0).reshape(4, 3) + 100 * r
    total = torch.arange(12.0).reshape(4, 3) * n + 100 * n * (n - 1) // 2
    for i in range(4):
        pick = (i + r) % 4  # ranks mix the layouts within one call

        def target(shape):
            g = _grad_layouts(shape)[pick]
            assert g.requires_grad and g.is_leaf == (pick != 3)
            return g

        g = target((4, 3))
        assert mf.allreduce(x, out=g) is g and (g == total).all(), (pick, g)
        g = target((4, 3))
        with torch.no_grad():
            g.copy_(x)
        assert mf.allreduce(g, out=g) is g and (g == total).all(), (pick, g)
        g = target((4, 3))
        with torch.no_grad():
            g.copy_(x)
        root = i % n
        assert mf.broadcast(g, root=root) is g and (g == x - 100 * (r - root)).all(), (pick, g)
        g = target((4 * n, 3))
        want = torch.cat([x - 100 * (r - q) for q in range(n)])
        assert mf.allgather(x, out=g) is g and (g == want).all(), (pick, g)
        g = target((4, 3))
        got = mf.reduce(x, root=root, out=g if r == root else None)
        assert (got is None) if r != root else (got is g and (g == total).all()), (pick, got)
        big = torch.cat([x] * n)
        g = target((4, 3))
        assert mf.reduce_scatter(big, out=g) is g and (g == total).all(), (pick, g)
        assert g.requires_grad and (g.grad_fn is None) == (pick != 3)  # autograd untouched


def case_alltoall_with_a_rank_that_moves_no_rows():
    """The last rank neither sends nor receives a row: the others' exchange still completes
    (MPI_Ialltoallv is collective; the rank used to skip it and leave them waiting)."""
    n, r = mf.size(), mf.rank()
    if n < 3:
        return
    idle = n - 1
    splits = np.array([0 if (r == idle or q == idle) else 2 for q in range(n)], np.int64)
    x = np.full((int(splits.sum()), 3), float(r))
    out, received = mf.alltoall(x, splits)
    want = [0 if (r == idle or q == idle) else 2 for q in range(n)]
    assert list(received) == want, received
    assert out.tolist() == [[float(q)] * 3 for q in range(n) for _ in range(want[q])]
