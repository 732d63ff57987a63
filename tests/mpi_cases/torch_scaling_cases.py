"""Multi-rank cases for the scaling of mlfabric.torch's reductions, as Horovod's: op Average,
prescale_factor and postscale_factor on integer tensors (scaled in float64, truncated toward zero
back to the dtype; Average a Sum times 1 / size) and on floating ones (in their own precision,
float16 through float32), in allreduce and its in-place, async and fused forms,
grouped_allreduce, reducescatter, grouped_reducescatter and with a joined rank; every rank gets
the same bits. Integer results are compared exactly, floating ones within the dtype's rounding,
with float64 references every rank computes from every rank's input (seeded by rank). Also: a
dtype that differs between ranks fails on every rank; bool takes no scaling; reducescatter's
gradient conventions (Horovod's default and grad="local"); op Adasum in a reducescatter is a
RuntimeError (MlfabricError) on every rank; Horovod's positional order of reducescatter."""
import numpy as np
import pytest
import torch

import mlfabric.torch as hvd

from .common import RTOL, same_everywhere

DTYPES = ("int32", "int64", "float16", "float32", "float64")
# (op, prescale_factor, postscale_factor): Average alone, each factor alone, both with Average,
# a negative factor (truncation toward zero on both sides)
SCALINGS = ((hvd.Average, 1.0, 1.0), (hvd.Sum, 0.37, 1.0), (hvd.Sum, 1.0, 0.61),
            (hvd.Average, 0.37, 2.5), (hvd.Sum, -1.7, 0.3))


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()


def _input(q, shape, dtype, salt=0):
    """Rank q's input as float64 values exact in dtype (every rank can regenerate it)."""
    rng = np.random.default_rng(q * 7919 + salt * 104729 + DTYPES.index(dtype) * 31)
    hi = 1000 if dtype.startswith("int") else 100
    return rng.integers(-hi, hi + 1, shape).astype(np.float64)


def _tensor(v, dtype):
    """A tensor of its own (never sharing v's memory) of dtype holding v."""
    return torch.tensor(np.asarray(v, np.float64)).to(getattr(torch, dtype))


def _scaled(v, factor, dtype):
    """v (float64 values exact in dtype) times factor, as Horovod scales a dtype's buffer on the
    CPU: integers in float64, truncated toward zero; float32 by float32(factor); float16 in
    float32, rounded to float16; float64 in float64."""
    if factor == 1.0:
        return v
    if dtype.startswith("int"):
        return np.trunc(v * factor)
    if dtype == "float64":
        return v * factor
    prod = v.astype(np.float32) * np.float32(factor)
    return (prod.astype(np.float16) if dtype == "float16" else prod).astype(np.float64)


def _reference(stack, op, pre, post, dtype, n):
    """The reduction of the ranks' inputs (stack: one row per rank) with Horovod's scaling, in
    float64: each input prescaled as the dtype scales, summed, then times post (/ n for
    Average) as the dtype scales. Exact for integers; for floats the sum's rounding is the
    tolerance's business."""
    total = np.sum([_scaled(v, pre, dtype) for v in stack], axis=0)
    after = post / n if op == hvd.Average else post
    if dtype.startswith("int"):
        return np.trunc(total * after)
    return total * after


def _check(got, want, dtype, mags, what, everywhere=True):
    """got (a tensor) is want: exactly for integers; within the dtype's rounding of each step
    (the prescaled inputs, the sum, the scaling after) for floats; the same bits on every rank
    (everywhere: a result every rank holds)."""
    assert got.dtype == getattr(torch, dtype), f"{what}: dtype {got.dtype}"
    assert tuple(got.shape) == want.shape, f"{what}: shape {tuple(got.shape)} != {want.shape}"
    g = got.to(torch.float64).numpy()
    if dtype.startswith("int"):
        bad = np.flatnonzero(g != want)
    else:
        bad = np.flatnonzero(np.abs(g - want) > 4 * RTOL[dtype] * (mags + 1.0))
    assert bad.size == 0, (f"{what}: {bad.size} of {g.size} wrong; first at {bad[0]}: got "
                           f"{g.flat[bad[0]]}, want {want.flat[bad[0]]}")
    if everywhere:
        same_everywhere(got, what)


def _mags(stack, op, pre, post, n):
    """The magnitudes the float result's rounding is relative to."""
    return np.abs(stack * pre).sum(0) * abs(post) / (n if op == hvd.Average else 1)


def _rows_of(rows, n, r):
    """(first row, rows) of rank r's block of a reducescatter (Horovod's split)."""
    counts = [rows // n + (q < rows % n) for q in range(n)]
    return sum(counts[:r]), counts[r]


def _slow_head():
    """An async allreduce of 16 MB (above the fusion threshold): the calls issued after it queue
    up behind it on every rank, to be fused."""
    return hvd.allreduce_async_(torch.ones(4 << 20), op=hvd.Sum)


def case_allreduce_scaling_in_every_form():
    """allreduce, allreduce_, allreduce_async, allreduce_async_ and grouped_allreduce (a list of
    every dtype) of each scaling, against the references."""
    n, r = hvd.size(), hvd.rank()
    shape = (3, 7)
    for k, (op, pre, post) in enumerate(SCALINGS):
        stacks = {d: np.stack([_input(q, shape, d, salt=k) for q in range(n)]) for d in DTYPES}
        kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
        for d in DTYPES:
            want = _reference(stacks[d], op, pre, post, d, n)
            mags = _mags(stacks[d], op, pre, post, n)
            what = f"allreduce {d} op={op} pre={pre} post={post}"
            x = _tensor(stacks[d][r], d)
            keep = x.clone()
            _check(hvd.allreduce(x, **kw), want, d, mags, what)
            assert torch.equal(x, keep), f"{what}: input changed"
            _check(hvd.synchronize(hvd.allreduce_async(x, **kw)), want, d, mags, what + " async")
            y = x.clone()
            assert hvd.allreduce_(y, **kw) is y
            _check(y, want, d, mags, what + " in place")
            y = x.t()  # in place, non-contiguous
            hvd.synchronize(hvd.allreduce_async_(y, **kw))
            _check(y.t(), want, d, mags, what + " async in place, non-contiguous")
        xs = [_tensor(stacks[d][r], d) for d in DTYPES]
        for i, got in enumerate(hvd.grouped_allreduce(xs, **kw)):
            d = DTYPES[i]
            _check(got, _reference(stacks[d], op, pre, post, d, n), d,
                   _mags(stacks[d], op, pre, post, n), f"grouped_allreduce {d} op={op} "
                   f"pre={pre} post={post}")


def case_fused_async_allreduces_scale_like_single_calls():
    """Async allreduces queued behind a slow one (fused where every rank can) give each call its
    own scaled result: integer and float16 ones of every scaling, in place and not."""
    n, r = hvd.size(), hvd.rank()
    calls = []
    head = _slow_head()
    for k, (op, pre, post) in enumerate(SCALINGS):
        for d in ("int32", "int64", "float16"):
            stack = np.stack([_input(q, (11,), d, salt=50 + k) for q in range(n)])
            for inplace in (False, True):
                x = _tensor(stack[r], d)
                h = (hvd.allreduce_async_ if inplace else hvd.allreduce_async)(
                    x, op=op, prescale_factor=pre, postscale_factor=post)
                calls.append((h, _reference(stack, op, pre, post, d, n),
                              _mags(stack, op, pre, post, n), d,
                              f"fused {d} op={op} pre={pre} post={post} in place={inplace}"))
    hvd.synchronize(head)
    for h, want, mags, d, what in calls:
        _check(hvd.synchronize(h), want, d, mags, what)


def case_reducescatter_scaling():
    """reducescatter and grouped_reducescatter (rows that do not divide by size(), a list of
    every dtype) of each scaling: this rank's rows of the references."""
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    lo, k_rows = _rows_of(rows, n, r)
    for k, (op, pre, post) in enumerate(SCALINGS):
        stacks = {d: np.stack([_input(q, (rows, 3), d, salt=100 + k) for q in range(n)])
                  for d in DTYPES}
        kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
        wants = {d: _reference(stacks[d], op, pre, post, d, n)[lo:lo + k_rows] for d in DTYPES}
        mags = {d: _mags(stacks[d], op, pre, post, n)[lo:lo + k_rows] for d in DTYPES}
        for d in DTYPES:
            what = f"reducescatter {d} op={op} pre={pre} post={post}"
            x = _tensor(stacks[d][r], d)
            got = hvd.reducescatter(x, **kw)
            _check(got, wants[d], d, mags[d], what, everywhere=False)
            same_everywhere(hvd.allgather(got), what + ", gathered")  # each rank's rows alike
            _check(hvd.synchronize(hvd.reducescatter_async(x, **kw)), wants[d], d, mags[d],
                   what + " async", everywhere=False)
        got = hvd.grouped_reducescatter([_tensor(stacks[d][r], d) for d in DTYPES], **kw)
        for d, g in zip(DTYPES, got):
            _check(g, wants[d], d, mags[d], f"grouped_reducescatter {d} op={op} pre={pre} "
                   f"post={post}", everywhere=False)


def case_integer_average_truncates_toward_zero():
    """Sums that do not divide by size(), of both signs: the quotient truncated toward zero
    (C's cast, as Horovod's), not floored or rounded."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    # rank 0 holds the sums wanted, the others zeros: sum s over n ranks is trunc(s / n)
    sums = np.array([-7, -5, -4, -1, 1, 4, 5, 7, 2 * n + 1, -(2 * n + 1)], np.float64)
    x = _tensor(sums if r == 0 else np.zeros_like(sums), "int64")
    got = hvd.allreduce(x).numpy()
    assert (got == np.trunc(sums * (1.0 / n))).all(), got
    assert (got[sums < 0] <= 0).all() and (np.abs(got) <= np.abs(sums) / n).all(), got


def case_narrow_integers_wrap_before_the_scaling_after():
    """int8 travels widened to int64, but its sum wraps as int8's would before the scaling after
    it (Horovod scales the int8 sum): 100 from each rank, averaged."""
    n = hvd.size()
    got = hvd.allreduce(torch.full((4,), 100, dtype=torch.int8))
    wrapped = (100 * n + 128) % 256 - 128
    want = (np.trunc(wrapped * (1.0 / n)) + 128) % 256 - 128
    assert got.dtype == torch.int8 and (got.numpy() == want).all(), (got, want)
    got = hvd.allreduce(torch.full((4,), -3, dtype=torch.int16), op=hvd.Sum,
                        prescale_factor=2.5, postscale_factor=0.5)
    assert (got.numpy() == np.trunc(np.trunc(-3 * 2.5) * n * 0.5)).all(), got


def case_joined_rank_in_an_integer_average():
    """The last rank joins; the others' integer Average (async, fused where they can) and
    reducescatter divide by size(), the joined rank's zeros included (Horovod's)."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    active = n - 1
    stack = np.stack([_input(q, (6,), "int32", salt=200) for q in range(active)])
    want = np.trunc(stack.sum(0) * (1.0 / n))
    rows = 2 * n
    rs_stack = np.stack([_input(q, (rows, 2), "int64", salt=201) for q in range(active)])
    rs_want = np.trunc(rs_stack.sum(0) * (2.5 / n))
    if r < active:  # (no same_everywhere here: the joined rank takes no part in it)
        handles = [hvd.allreduce_async(_tensor(stack[r], "int32")) for _ in range(3)]
        for h in handles:
            got = hvd.synchronize(h)
            assert got.dtype == torch.int32 and (got.numpy() == want).all(), (got, want)
        lo, k_rows = _rows_of(rows, n, r)
        got = hvd.reducescatter(_tensor(rs_stack[r], "int64"), postscale_factor=2.5)
        assert (got.numpy() == rs_want[lo:lo + k_rows]).all(), (got, rs_want)
    last = hvd.join()
    same_everywhere(np.array([last]), "join's return")


def case_dtype_that_differs_fails_on_every_rank():
    """int32 on some ranks, float32 on the others (the default op Average, which both take): a
    MismatchError (a RuntimeError) naming the dtypes on every rank; then the next call works."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    t = torch.ones(4, 2, dtype=torch.int32 if r % 2 == 0 else torch.float32)
    for call in (hvd.allreduce, hvd.reducescatter):
        with pytest.raises(hvd.MismatchError, match="ranks disagree on dtype"):
            call(t)
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [n] * 3


def case_bool_takes_no_scaling():
    """bool: Sum (any) works; Average or a factor is a TypeError on every rank (Horovod cannot
    scale it either)."""
    n = hvd.size()
    assert hvd.allreduce(torch.tensor([True, False]), op=hvd.Sum).tolist() == [True, False]
    for kw in ({}, {"op": hvd.Sum, "prescale_factor": 2.0}, {"op": hvd.Sum,
                                                               "postscale_factor": 0.5}):
        with pytest.raises(TypeError, match="need a numeric tensor, got torch.bool"):
            hvd.allreduce(torch.ones(3, dtype=torch.bool), **kw)
        with pytest.raises(TypeError, match="need a numeric tensor"):
            hvd.reducescatter(torch.ones(n, dtype=torch.bool), **kw)
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [n] * 3


def case_reducescatter_gradient_conventions():
    """The input's gradient is the allgather of the outputs' gradients times the factors, and
    times size() for Sum (Horovod's, the default); grad="local" is size() times less. The same
    for grouped_reducescatter and inside a process set; a bad grad is a ValueError on every
    rank."""
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    # d loss / d output on rank q: (q + 1) * (1, 2, 3, ...) over its rows
    weights = [np.arange(1, 2 * _rows_of(rows, n, q)[1] + 1, dtype=np.float64).reshape(-1, 2)
               * (q + 1) for q in range(n)]
    gathered = np.concatenate(weights)
    for op in (hvd.Sum, hvd.Average):
        for grad in ("horovod", "local"):
            local = 1.5 * 0.5 / (n if op == hvd.Average else 1)
            want = gathered * (local * n if grad == "horovod" else local)
            kw = dict(op=op, prescale_factor=1.5, postscale_factor=0.5)
            if grad != "horovod":
                kw["grad"] = grad
            x = torch.ones(rows, 2, dtype=torch.float64, requires_grad=True)
            (hvd.reducescatter(x, **kw) * torch.from_numpy(weights[r])).sum().backward()
            assert np.allclose(x.grad.numpy(), want, rtol=1e-14, atol=0), (op, grad, x.grad)
            xs = [torch.ones(rows, 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
            outs = hvd.grouped_reducescatter(xs, **kw)
            sum(((i + 1) * o * torch.from_numpy(weights[r])).sum()
                for i, o in enumerate(outs)).backward()
            for i, xi in enumerate(xs):
                assert np.allclose(xi.grad.numpy(), want * (i + 1), rtol=1e-14, atol=0), \
                    ("grouped", op, grad, i, xi.grad)
    # inside a process set of the even ranks: its size is the factor
    evens = hvd.add_process_set(list(range(0, n, 2)))
    try:
        if r % 2 == 0:
            m = evens.size()
            x = torch.ones(m, 3, dtype=torch.float64, requires_grad=True)
            hvd.reducescatter(x, op=hvd.Sum, process_set=evens).sum().backward()
            assert (x.grad.numpy() == m).all(), x.grad
    finally:
        hvd.remove_process_set(evens)
    for bad in ("global", None, 1):
        with pytest.raises(ValueError, match="grad must be one of 'horovod', 'local'"):
            hvd.reducescatter(torch.ones(n), grad=bad)
        with pytest.raises(ValueError, match="grad must be one of 'horovod', 'local'"):
            hvd.grouped_reducescatter([torch.ones(n)], grad=bad)
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [n] * 3


def case_reducescatter_adasum_is_a_runtime_error():
    """op Adasum in a reducescatter: Horovod's kind of error (a RuntimeError: MlfabricError) on
    every rank, in every form; then the next call works."""
    n = hvd.size()
    for call in (lambda: hvd.reducescatter(torch.ones(n, 2), op=hvd.Adasum),
                 lambda: hvd.synchronize(hvd.reducescatter_async(torch.ones(n), op=hvd.Adasum)),
                 lambda: hvd.grouped_reducescatter([torch.ones(n)], op=hvd.Adasum)):
        with pytest.raises(hvd.MlfabricError, match="op Adasum is for allreduce"):
            call()
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [n] * 3


def case_reducescatter_positional_order_is_horovods():
    """(tensor, name, compression, op, process_set, prescale_factor, postscale_factor), and the
    async forms' (tensor, name, op, process_set, prescale_factor, postscale_factor)."""
    n, r = hvd.size(), hvd.rank()
    x = torch.full((n, 2), float(r + 1), dtype=torch.float64)
    tri = n * (n + 1) / 2
    got = hvd.reducescatter(x, "rs.pos", hvd.Compression.none, hvd.Sum, None, 2.0, 0.25)
    assert (got.numpy() == tri * 0.5).all(), got
    got = hvd.synchronize(hvd.reducescatter_async(x, "rs.pos.a", hvd.Sum, None, 2.0, 0.25))
    assert (got.numpy() == tri * 0.5).all(), got
    got = hvd.grouped_reducescatter([x], "rs.pos.g", hvd.Compression.none, hvd.Sum, None, 2.0,
                                    0.25)
    assert (got[0].numpy() == tri * 0.5).all(), got
    got = hvd.synchronize(hvd.grouped_reducescatter_async([x], "rs.pos.ga", hvd.Sum, None, 2.0,
                                                          0.25))
    assert (got[0].numpy() == tri * 0.5).all(), got
