"""Multi-rank cases for mlfabric.torch (Horovod's PyTorch API): every tensor op against a float64
reference computed locally (every rank can regenerate every rank's input), async and in-place
forms, uneven allgather, alltoall with splits, autograd, join with uneven data, the object
helpers, mismatch errors on every rank, and DistributedOptimizer against single-process training
on the concatenated batch."""
import copy
import os
import re

import numpy as np
import pytest
import torch

import mlfabric.torch as hvd

from .common import RTOL, bf16_round, same_everywhere, values

FLOATS = ("float32", "float64", "float16", "bfloat16")
NATIVE = FLOATS + ("int32", "int64")
WIDENED = ("uint8", "int8", "int16", "bool")
OPS = {hvd.Sum: "sum", hvd.Average: "avg", hvd.Min: "min", hvd.Max: "max", hvd.Product: "prod"}


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores


def tdtype(name):
    return getattr(torch, name)


def inputs(rank, count, dtype, op, salt=0):
    """float64 values of rank's input, exact in dtype (and small enough for prod)."""
    if dtype in NATIVE:
        return values(rank, count, dtype, op, salt)
    rng = np.random.default_rng(rank * 7919 + count * 31 + salt)
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(np.float64)
    lo, hi = {"uint8": (0, 256), "int8": (-128, 128), "int16": (-30000, 30000)}[dtype]
    if op == "prod":
        lo, hi = max(lo, -3), min(hi, 4)
    return rng.integers(lo, hi, count).astype(np.float64)


def as_tensor(v, dtype, shape=None):
    t = torch.from_numpy(np.asarray(v, np.float64)).to(tdtype(dtype))
    return t.reshape(shape) if shape is not None else t


def reference(op, stack):
    """float64 reduction over axis 0 (the ranks), as op `op` (core name) does it."""
    n = stack.shape[0]
    return {"sum": stack.sum(0), "avg": stack.sum(0) / n, "min": stack.min(0),
            "max": stack.max(0), "prod": np.prod(stack, 0)}[op]


def check(got, want, dtype, what, mag=None):
    """got (tensor) equals want (float64) as far as dtype can hold it."""
    want = np.asarray(want, np.float64)
    assert tuple(got.shape) == want.shape, f"{what}: shape {tuple(got.shape)} != {want.shape}"
    assert got.dtype == tdtype(dtype), f"{what}: dtype {got.dtype}"
    g = got.to(torch.float64).numpy()
    if dtype in FLOATS:
        if dtype == "bfloat16":
            want_r = bf16_round(want)
        else:
            want_r = want.astype(dtype).astype(np.float64)
        tol = RTOL[dtype] * ((np.abs(want) if mag is None else mag) + 1.0)
        bad = np.flatnonzero(np.abs(g - want_r) > tol)
    else:
        # Integer results wrap like the dtype; bool: any nonzero is True.
        exact = torch.from_numpy(want.astype(np.int64)).to(tdtype(dtype)).to(torch.float64)
        bad = np.flatnonzero(g != exact.numpy())
        want_r = exact.numpy()
    assert bad.size == 0, (f"{what}: {bad.size} of {g.size} wrong; first at {bad[0]}: got "
                           f"{g.flat[bad[0]]}, want {want_r.flat[bad[0]]}")


# --- before init ----------------------------------------------------------------------------------

def case_calls_before_init_raise():
    assert not hvd.is_initialized()
    for call in (hvd.rank, hvd.size, hvd.cross_rank, lambda: hvd.allreduce(torch.ones(3)),
                 lambda: hvd.reducescatter(torch.ones(3)),
                 lambda: hvd.grouped_allgather([torch.ones(3)]),
                 lambda: hvd.grouped_reducescatter([torch.ones(3)]),
                 lambda: hvd.start_timeline("/tmp/never.json"),
                 lambda: hvd.broadcast_parameters({}, 0), lambda: hvd.join(),
                 lambda: hvd.synchronize(0)):
        with pytest.raises(hvd.NotInitializedError):
            call()
    hvd.init()
    assert hvd.is_initialized()
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()
    # the tests run on one host: one rank of each local rank, every host alike
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)


# --- allreduce ------------------------------------------------------------------------------------

def case_allreduce_ops_dtypes_forms():
    n, r = hvd.size(), hvd.rank()
    for op, core in OPS.items():
        for dtype in NATIVE + WIDENED:
            if core == "avg" and dtype not in FLOATS:
                continue
            if core == "prod" and dtype == "bfloat16":
                continue  # bfloat16 products of many ranks round at every step
            for shape in ((), (1,), (7,), (3, 5), (1021,)):
                count = int(np.prod(shape, dtype=np.int64))
                stack = np.stack([inputs(q, count, dtype, core) for q in range(n)])
                want = reference(core, stack).reshape(shape)
                mag = np.abs(stack).sum(0).reshape(shape) / (n if core == "avg" else 1) \
                    if core in ("sum", "avg") else None
                what = f"allreduce {core} {dtype} {shape}"
                x = as_tensor(stack[r], dtype, shape)
                keep = x.clone()
                check(hvd.allreduce(x, op=op), want, dtype, what, mag)
                assert torch.equal(x, keep), f"{what}: input modified"
                h = hvd.allreduce_async(x, op=op)
                check(hvd.synchronize(h), want, dtype, what + " async", mag)
                y = x.clone()
                assert hvd.allreduce_(y, op=op) is y
                check(y, want, dtype, what + " in place", mag)
                y = x.clone()
                h = hvd.allreduce_async_(y, op=op)
                assert hvd.synchronize(h) is y
                check(y, want, dtype, what + " async in place", mag)
                same_everywhere(y, what)


def case_allreduce_defaults_scaling_noncontiguous():
    n, r = hvd.size(), hvd.rank()
    stack = np.stack([values(q, 60, "float64", "sum") for q in range(n)])
    x = torch.from_numpy(stack[r].copy())
    check(hvd.allreduce(x), stack.mean(0), "float64", "default op is Average")
    check(hvd.allreduce(x, average=False), stack.sum(0), "float64", "average=False is Sum")
    check(hvd.allreduce(x, average=True), stack.mean(0), "float64", "average=True")
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    check(got, stack.sum(0) * 0.5, "float64", "pre/post scale")
    got = hvd.allreduce(x, op=hvd.Average, postscale_factor=3.0)
    check(got, stack.mean(0) * 3.0, "float64", "average with postscale")
    # A transposed (non-contiguous) tensor, in place.
    base = x.reshape(6, 10).clone()
    view = base.t()
    hvd.allreduce_(view, op=hvd.Sum)
    check(base, stack.sum(0).reshape(6, 10), "float64", "non-contiguous in place")
    # String ops are accepted too; bad ones are refused on every rank alike.
    check(hvd.allreduce(x, op="sum"), stack.sum(0), "float64", "op='sum'")
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(x, op=hvd.Sum, average=True)
    # Average on integers (Horovod's): the sum times 1 / size in float64, truncated
    ints = np.stack([values(q, 60, "int32", "sum") for q in range(n)])
    check(hvd.allreduce(torch.from_numpy(ints[r]).int()), ints.sum(0) * (1.0 / n), "int32",
          "integer Average")
    with pytest.raises(TypeError, match="need a numeric tensor, got torch.bool"):
        hvd.allreduce(torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="unsupported dtype"):
        hvd.allreduce(torch.ones(3, dtype=torch.complex64))
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [n] * 3


# --- tensor fusion of queued async allreduces ------------------------------------------------------

def _rounds():
    from mlfabric.torch import dispatch
    return dispatch.state().rounds


def _slow_head():
    """An async allreduce of 16 MB (above the fusion threshold: it fuses nothing): while it runs,
    the calls issued after it queue up behind it on every rank. Its handle."""
    return hvd.allreduce_async_(torch.ones(4 << 20), op=hvd.Sum)


def case_async_allreduces_fuse_and_each_gets_its_result():
    n, r = hvd.size(), hvd.rank()
    # 100 like calls behind a slow one: fused (fewer control rounds than calls), each exact.
    stack = np.stack([values(q, 100 * 7, "float64", "sum") for q in range(n)])
    xs = [torch.from_numpy(stack[r, 7 * i:7 * i + 7].copy()) for i in range(100)]
    before = _rounds()
    head = _slow_head()
    handles = [hvd.allreduce_async_(x, op=hvd.Sum) for x in xs]
    assert hvd.synchronize(head).eq(n).all()
    for i, (x, h) in enumerate(zip(xs, handles)):
        assert hvd.synchronize(h) is x
        check(x, stack[:, 7 * i:7 * i + 7].sum(0), "float64", f"fused call {i}")
    rounds = _rounds() - before
    assert rounds < 101, f"{rounds} control rounds for 101 calls: nothing was fused"
    # A mix: runs of like calls between others (dtype, op, scaling), in place and not, shapes
    # 0-d to 2-d, non-contiguous, a widened dtype (int8) and names: every result exact, every
    # input of an out-of-place call untouched.
    specs = []
    for i in range(60):
        dtype = ("float32", "float64", "int8", "bfloat16")[i // 15]
        op = (hvd.Sum, hvd.Max, hvd.Average)[i % 3] if dtype in FLOATS else (hvd.Sum, hvd.Min)[i % 2]
        shape = ((), (5,), (3, 4), (4, 3))[i % 4]
        specs.append((dtype, op, shape, i % 5 == 0, 2.0 if i % 7 == 0 else 1.0,
                      f"t{i}" if i % 2 else None))
    calls = []
    head = _slow_head()
    for i, (dtype, op, shape, inplace, pre, name) in enumerate(specs):
        core = OPS[op]
        count = int(np.prod(shape, dtype=np.int64))
        st = np.stack([inputs(q, count, dtype, core, salt=i) for q in range(n)])
        x = as_tensor(st[r], dtype, shape)
        if shape == (4, 3):
            x = x.t().contiguous().t()  # non-contiguous, the same values
        keep = x.clone()
        if dtype in FLOATS and pre != 1.0:
            h = (hvd.allreduce_async_ if inplace else hvd.allreduce_async)(
                x, op=op, name=name, prescale_factor=pre, postscale_factor=0.5)
            want = reference(core, st * pre).reshape(shape) * 0.5
        else:
            h = (hvd.allreduce_async_ if inplace else hvd.allreduce_async)(x, op=op, name=name)
            want = reference(core, st).reshape(shape)
        # the reduction's rounding is relative to the magnitudes summed (as in the cases above)
        mag = np.abs(st * pre).sum(0).reshape(shape) if core in ("sum", "avg") else None
        calls.append((x, keep, h, want, mag, dtype, inplace, f"mixed call {i} {dtype} {core}"))
    hvd.synchronize(head)
    for x, keep, h, want, mag, dtype, inplace, what in calls:
        got = hvd.synchronize(h)
        if inplace:
            assert got is x, what
        else:
            assert torch.equal(x, keep), f"{what}: input modified"
        check(got, want, dtype, what, mag)
        same_everywhere(got.to(torch.float64), what)


def case_fused_async_allreduces_keep_the_order_of_their_effects():
    n = hvd.size()
    # Calls on the same memory see each other's results, as issued one after another, however
    # many were queued: a second in-place call sums the first's result, an out-of-place one
    # after an in-place one reads its result, and one on an overlapping view as well.
    t, u, base = torch.ones(8), torch.ones(8), torch.ones(12)
    head = _slow_head()
    h1, h2 = hvd.allreduce_async_(t, op=hvd.Sum), hvd.allreduce_async_(t, op=hvd.Sum)
    h3, h4 = hvd.allreduce_async_(u, op=hvd.Sum), hvd.allreduce_async(u, op=hvd.Sum)
    h5, h6 = hvd.allreduce_async_(base[:8], op=hvd.Sum), hvd.allreduce_async_(base[4:], op=hvd.Sum)
    hvd.synchronize(head)
    for h in (h1, h2, h3, h5, h6):
        hvd.synchronize(h)
    assert t.tolist() == [n * n] * 8
    assert hvd.synchronize(h4).tolist() == [n * n] * 8 and u.tolist() == [n] * 8
    assert base.tolist() == [n] * 4 + [n * n] * 4 + [n] * 4
    # The same memory through two storages (two tensors made from one numpy array): an
    # out-of-place call reading part of what an in-place call ahead of it writes sees its result.
    a = np.ones(8, np.float32)
    head = _slow_head()
    h1 = hvd.allreduce_async_(torch.from_numpy(a), op=hvd.Sum, prescale_factor=2.0)
    h2 = hvd.allreduce_async(torch.from_numpy(a[4:]), op=hvd.Sum, prescale_factor=2.0)
    hvd.synchronize(head)
    hvd.synchronize(h1)
    assert a.tolist() == [2 * n] * 8
    assert hvd.synchronize(h2).tolist() == [4 * n * n] * 4
    # An in-place result bumps the tensor's version, fused or not, as torch's in-place ops do
    # (autograd then refuses a backward through a tensor it saved).
    for fused in (False, True):
        xs = [torch.ones(4) for _ in range(4)]
        versions = [x._version for x in xs]
        head = _slow_head() if fused else None
        hs = [hvd.allreduce_async_(x, op=hvd.Sum) for x in xs]
        if head is not None:
            hvd.synchronize(head)
        for h in hs:
            hvd.synchronize(h)
        assert all(x._version > v for x, v in zip(xs, versions)), fused
    w = torch.ones(3, requires_grad=True)
    y = w * 1.0
    loss = (y * y).sum()  # saves y
    hvd.allreduce_(y.detach(), op=hvd.Sum)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    y = w * 1.0  # broadcast_ too (on every rank: the root's tensor is "written" as well)
    loss = (y * y).sum()
    hvd.broadcast_(y.detach(), 0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # Out-of-place results of fused calls are tensors of their own, not views of one buffer.
    head = _slow_head()
    hs = [hvd.allreduce_async(torch.ones(5), op=hvd.Sum) for _ in range(20)]
    hvd.synchronize(head)
    for h in hs:
        out = hvd.synchronize(h)
        assert out.tolist() == [n] * 5
        assert out.untyped_storage().nbytes() == 5 * 4


def case_fused_async_allreduces_that_disagree_fail_in_their_own_round():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    # The last rank's 11th call has another shape: the ten before it are fused and exact, it
    # fails on every rank (before any data moves), and the ten after it are fused and exact.
    head = _slow_head()
    before = [hvd.allreduce_async(torch.full((3,), float(r + i)), op=hvd.Sum) for i in range(10)]
    odd = hvd.allreduce_async(torch.ones(4 if r == n - 1 else 5), op=hvd.Sum)
    after = [hvd.allreduce_async(torch.full((3,), float(r * i)), op=hvd.Sum) for i in range(10)]
    hvd.synchronize(head)
    base = n * (n - 1) / 2
    for i, h in enumerate(before):
        assert hvd.synchronize(h).tolist() == [base + n * i] * 3, i
    with pytest.raises(hvd.MismatchError, match="shape"):
        hvd.synchronize(odd)
    for i, h in enumerate(after):
        assert hvd.synchronize(h).tolist() == [base * i] * 3, i
    # Names the same way: a name differing on one rank in a run of named calls.
    head = _slow_head()
    hs = [hvd.allreduce_async(torch.ones(2), op=hvd.Sum,
                              name=f"x{i}" if i != 5 or r != n - 1 else "y") for i in range(10)]
    hvd.synchronize(head)
    for i, h in enumerate(hs):
        if i == 5:
            with pytest.raises(hvd.MismatchError, match="names differ"):
                hvd.synchronize(h)
        else:
            assert hvd.synchronize(h).tolist() == [n, n], i


def case_a_fused_run_that_fails_names_each_call_in_its_error():
    # A failure after the control round of a fused run (injected: the run's one allreduce
    # raises, as a dead peer would make it) reaches every call of the run, each error naming
    # its own call. The first rank it happens to tells the others, which may hear of it before
    # their own allreduce fails; every later call fails (the communicator is unusable after it)
    # until mlfabric is initialised again.
    from mlfabric.torch import dispatch, fusion
    real = fusion.allreduce_flat

    def failing(flat, plan):
        if 3 < flat.numel() < 100:  # a fused run of the calls below (each has 3 elements)
            raise hvd.PeerTimeoutError("allreduce: no answer within 1 s (injected)")
        return real(flat, plan)
    fusion.allreduce_flat = failing
    dispatch.state().fusion_pause = 0  # (an earlier case's refused offers may have paused fusion)
    try:
        head = _slow_head()
        hs = [hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name=f"g{i}") for i in range(4)]
        hvd.synchronize(head)
        with pytest.raises(hvd.PeerTimeoutError, match="injected|gave up") as first:
            hvd.synchronize(hs[0])  # the head of the first run raises the error itself
        fused = 0
        for i, h in enumerate(hs[1:], 1):
            with pytest.raises(hvd.PeerTimeoutError) as info:
                hvd.synchronize(h)
            msg = str(info.value)
            assert msg.startswith(f"allreduce 'g{i}'"), msg
            if "fused with" in msg:
                fused += 1
                assert re.match(rf"allreduce 'g{i}', fused with allreduce 'g\d': allreduce: "
                                r"no answer within 1 s \(injected\)$", msg), msg
            else:
                assert "unusable" in msg or "gave up" in msg, msg
        assert fused or "injected" not in str(first.value), "nothing was fused behind g0"
        with pytest.raises(hvd.PeerTimeoutError, match="unusable|gave up"):
            hvd.allreduce(torch.ones(2), op=hvd.Sum)
    finally:
        fusion.allreduce_flat = real
        hvd.shutdown()
        hvd.init()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


def case_async_allreduces_beside_a_joined_rank():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    # The last rank joins at once; the others' queued async calls (which fuse nothing while a
    # rank is joined: it takes part in one call at a time) sum its zeros.
    if r == n - 1:
        assert hvd.join() == n - 2  # the highest of the ranks joining last
    else:
        hs = [hvd.allreduce_async(torch.full((4,), float(r + i)), op=hvd.Sum) for i in range(30)]
        for i, h in enumerate(hs):
            assert hvd.synchronize(h).tolist() == [sum(q + i for q in range(n - 1))] * 4, i
        hvd.join()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]


def _adasum_reference(vectors):
    """float64 numpy: the pairwise tree at distance 1, 2, 4, ... (adasum.py's definition)."""
    level = [np.asarray(v, np.float64).reshape(-1) for v in vectors]
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level), 2):
            if i + 1 == len(level):
                nxt.append(level[i])
                continue
            a, b = level[i], level[i + 1]
            dot, na, nb = a @ b, a @ a, b @ b
            ca, cb = (1 - dot / (2 * na) if na else 1), (1 - dot / (2 * nb) if nb else 1)
            nxt.append(ca * a + cb * b)
        level = nxt
    return level[0]


def case_allreduce_adasum():
    """op=Adasum against a float64 reference of the tree (odd counts too), its defining
    properties (the same vector everywhere: that vector; orthogonal ones: their sum), every
    form, float32 / float16, scale factors; not differentiable; refused where it is undefined,
    on every rank."""
    n, r = hvd.size(), hvd.rank()
    stack = np.stack([values(q, 12, "float64", "sum", salt=3) for q in range(n)])
    x = torch.from_numpy(stack[r].copy()).reshape(3, 4)
    want = _adasum_reference(stack).reshape(3, 4)
    check(hvd.allreduce(x, op=hvd.Adasum), want, "float64", "adasum")
    check(hvd.synchronize(hvd.allreduce_async(x, op="adasum")), want, "float64", "adasum async")
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Adasum)
    check(y, want, "float64", "adasum in place")
    same = torch.arange(1.0, 7.0, dtype=torch.float64)
    check(hvd.allreduce(same, op=hvd.Adasum), same.numpy(), "float64", "parallel: averaged")
    basis = torch.zeros(max(n, 2), dtype=torch.float64)
    basis[r] = r + 1.0
    check(hvd.allreduce(basis, op=hvd.Adasum), np.pad(np.arange(1.0, n + 1), (0, max(n, 2) - n)),
          "float64", "orthogonal: summed")
    check(hvd.allreduce(torch.zeros(3), op=hvd.Adasum), np.zeros(3), "float32", "zeros")
    xf = x.float()
    got = hvd.allreduce(xf, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5)
    assert got.dtype == torch.float32
    # adasum is scale-equivariant: (2x) combined, times 0.5, is x combined
    assert np.allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5), "scale factors"
    half = hvd.allreduce(x.half(), op=hvd.Adasum)
    assert half.dtype == torch.float16
    assert np.allclose(half.double().numpy(), want, rtol=5e-3, atol=5e-3), "float16"
    w = x.clone().requires_grad_(True)
    with pytest.raises(hvd.MlfabricError, match="gradient of allreduce with op adasum"):
        hvd.allreduce(w, op=hvd.Adasum).sum().backward()
    with pytest.raises(TypeError, match="needs a floating tensor"):
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    for fn in (lambda: hvd.grouped_allreduce([x], op=hvd.Adasum),
               lambda: hvd.reducescatter(x, op=hvd.Adasum)):
        with pytest.raises(hvd.MlfabricError, match="Adasum is for allreduce"):
            fn()
    if n > 1:  # a shape that differs on one rank: every rank fails
        with pytest.raises(hvd.MismatchError):
            hvd.allreduce(torch.ones(4 if r == n - 1 else 3), op=hvd.Adasum)
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [n] * 3


def case_distributed_optimizer_adasum():
    """op=Adasum: each rank steps its own optimizer (SGD with momentum, Adam: their state stays
    local) on its own batch, then every parameter moves by the Adasum of the ranks' changes,
    against a float64 simulation of every rank's optimizer and the tree; fp16 compression of
    the changes within its rounding."""
    n, r = hvd.size(), hvd.rank()
    for make, compression, tol in (
            (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), hvd.Compression.none, 1e-12),
            (lambda ps: torch.optim.Adam(ps, lr=0.01), hvd.Compression.none, 1e-12),
            (lambda ps: torch.optim.SGD(ps, lr=0.1), hvd.Compression.fp16, 2e-3)):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                    torch.nn.Linear(4, 2)).double()
        start = [p.detach().clone() for p in model.parameters()]
        opt = hvd.DistributedOptimizer(make(model.parameters()), op=hvd.Adasum,
                                       named_parameters=model.named_parameters(),
                                       compression=compression)
        # the reference: every rank's model copy and optimizer, stepped from the same weights
        copies = []
        for _ in range(n):
            m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                    torch.nn.Linear(4, 2)).double()
            m.load_state_dict(model.state_dict())
            copies.append((m, make(m.parameters())))
        for step in range(3):
            data = [(torch.from_numpy(np.random.default_rng(step * 10 + q).normal(0, 1, (5, 3))),
                     torch.from_numpy(np.random.default_rng(step * 10 + q + 5).normal(0, 1,
                                                                                    (5, 2))))
                    for q in range(n)]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(data[r][0]), data[r][1]).backward()
            opt.step()
            before = [p.detach().clone() for p in copies[0][0].parameters()]
            deltas = []
            for (m, o), (x, y) in zip(copies, data):
                o.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
                deltas.append([(p - b).detach().numpy() for p, b in zip(m.parameters(), before)])
            for i, b in enumerate(before):
                combined = torch.from_numpy(_adasum_reference([d[i] for d in deltas]).reshape(
                    b.shape))
                for m, _ in copies:
                    list(m.parameters())[i].data.copy_(b + combined)
        for p, q in zip(model.parameters(), copies[0][0].parameters()):
            assert torch.allclose(p, q, rtol=tol, atol=tol), (p - q).abs().max()
        if n > 1:  # the ranks' changes differ: their Adasum is not their plain sum or mean
            assert any((p - s).abs().max() > 1e-3 for p, s in zip(model.parameters(), start))
        same_everywhere(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
                        "adasum weights")


def case_grouped_allreduce():
    n, r = hvd.size(), hvd.rank()
    shapes = [((3, 4), "float32"), ((5,), "float64"), ((2, 2), "float32"), ((7,), "int32"),
              ((), "float64")]
    stacks = [np.stack([inputs(q, int(np.prod(s, dtype=np.int64)), d, "sum", salt=i)
                        for q in range(n)]) for i, (s, d) in enumerate(shapes)]
    xs = [as_tensor(st[r], d, s) for st, (s, d) in zip(stacks, shapes)]
    wants = [reference("sum", st).reshape(s) for st, (s, _) in zip(stacks, shapes)]
    for got, want, (s, d) in zip(hvd.grouped_allreduce(xs, op=hvd.Sum), wants, shapes):
        check(got, want, d, f"grouped {d} {s}")
    h = hvd.grouped_allreduce_async(xs, op=hvd.Sum)
    for got, want, (s, d) in zip(hvd.synchronize(h), wants, shapes):
        check(got, want, d, f"grouped async {d} {s}")
    ys = [x.clone() for x in xs]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(ys, op=hvd.Sum), ys))
    for got, want, (s, d) in zip(ys, wants, shapes):
        check(got, want, d, f"grouped in place {d} {s}")
    floats = [x for x, (_, d) in zip(xs, shapes) if d != "int32"]
    for got, st, x in zip(hvd.grouped_allreduce(floats), [s for s, (_, d) in zip(stacks, shapes)
                                                          if d != "int32"], floats):
        check(got, st.mean(0).reshape(x.shape), str(x.dtype).replace("torch.", ""),
              "grouped average")


def case_grouped_lists_read_natively_or_through_python_agree():
    """A rank whose native reader of tensor metadata is off (another torch, or
    MLFABRIC_TORCH_META=0) reads its lists through torch's Python API: the same signature, so
    its grouped calls agree with the others' (exact sums), and lists that differ still fail on
    every rank, whichever way each rank read its own."""
    from mlfabric.torch import tensor_meta
    n, r = hvd.size(), hvd.rank()
    saved = tensor_meta._SCAN
    if r % 2 == 0:
        tensor_meta._SCAN = False
    try:
        def make(q):
            return [torch.full((3, 2), float(q + 1)), torch.full((4,), q + 1, dtype=torch.int32),
                    torch.arange(10, dtype=torch.float64).view(2, 5).t() * (q + 1), torch.ones(())]
        want = [sum(make(q)[i] for q in range(n)) for i in range(4)]
        for got, w in zip(hvd.grouped_allreduce(make(r), op=hvd.Sum), want):
            assert got.shape == w.shape and torch.equal(got, w), (got, w)
        if n > 1:  # the same total size, another split on rank 0
            xs = make(r)
            if r == 0:
                xs[0] = xs[0].view(2, 3)
            with pytest.raises(hvd.MismatchError):
                hvd.grouped_allreduce_(xs, op=hvd.Sum)
    finally:
        tensor_meta._SCAN = saved


def case_grouped_allreduce_staging_and_outputs():
    """grouped_allreduce stages through reusable buffers: the same list reduced again (its views
    cached), another list, dtypes widened on the wire, a 0-d, an empty and a non-contiguous
    tensor, scaling, a call larger than the staging buffer; results independent of each other
    and of later calls, and results of the differentiable form modifiable in place."""
    from mlfabric.torch import fusion
    n, r = hvd.size(), hvd.rank()
    shapes = [((2, 3), "float32"), ((), "float32"), ((0, 4), "float32"), ((4,), "int8"),
              ((3,), "bool"), ((5,), "bfloat16"), ((3, 2), "float32")]

    def make(salt):
        stacks = [np.stack([inputs(q, int(np.prod(s, dtype=np.int64)), d, "sum", salt=salt + i)
                            for q in range(n)]) for i, (s, d) in enumerate(shapes)]
        xs = [as_tensor(st[r], d, s) for st, (s, d) in zip(stacks, shapes)]
        xs[-1] = xs[-1].t().contiguous().t()  # same values, not contiguous
        wants = [(reference("sum", st).reshape(s), np.abs(st).sum(0).reshape(s))
                 for st, (s, _) in zip(stacks, shapes)]
        return xs, wants

    for salt in (0, 10, 0):  # the first list again: its staging views come from the cache
        xs, wants = make(salt)
        outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
        ys = [x.clone() for x in xs]
        assert all(a is b for a, b in zip(hvd.grouped_allreduce_(ys, op=hvd.Sum), ys))
        for got, got_, (want, mag), (s, d) in zip(outs, ys, wants, shapes):
            check(got, want, d, f"grouped {d} {s} salt {salt}", mag)
            check(got_, want, d, f"grouped in place {d} {s} salt {salt}", mag)
        kept = [o.clone() for o in outs]
        hvd.grouped_allreduce(make(20)[0], op=hvd.Sum)  # a later call leaves these alone
        outs[0].fill_(7)  # and so does a change to another result
        assert all(torch.equal(a, b) for a, b in zip(outs[1:], kept[1:]))
    # Scaling, in both forms, also for a list larger than the staging buffer (which then gets
    # a buffer of its own): prescale 0.5 and postscale 3 give 1.5 times the sum.
    floats = [x for x in make(30)[0] if x.dtype == torch.float32]
    sums = hvd.grouped_allreduce(floats, op=hvd.Sum)
    staging_max = fusion.STAGING_MAX
    try:
        for limit in (staging_max, 16):
            fusion.STAGING_MAX = limit
            for inplace in (False, True):
                xs = [x.clone() for x in floats]
                fn = hvd.grouped_allreduce_ if inplace else hvd.grouped_allreduce
                got = fn(xs, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
                for g, s in zip(got, sums):
                    torch.testing.assert_close(
                        g.double(), 1.5 * s.double(), rtol=1e-6, atol=1e-5,
                        msg=f"scaled grouped, in place {inplace}, staging limit {limit}")
    finally:
        fusion.STAGING_MAX = staging_max
    # The differentiable form's results may be modified in place (autograd allows it).
    a, b = (torch.ones(2, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ga, gb = hvd.grouped_allreduce([a * 1.0, b * 2.0], op=hvd.Sum)
    ga /= 2
    (ga + gb).sum().backward()
    check(a.grad, np.full(2, n / 2), "float64", "grouped grad after an in-place change")
    check(b.grad, np.full(2, 2.0 * n), "float64", "grouped grad b")


def _zero_copy_calls():
    from mlfabric.comm import context
    shm = context.get().shm
    return None if shm is None else shm.zero_copy_calls


def case_grouped_allreduce_direct_copies_and_shared_staging():
    """Lists of contiguous tensors of one dtype are copied in and out by the C++ gather /
    scatter (no torch op per tensor), through a staging buffer in shared memory: a large list's
    allreduce is zero-copy. Results equal float64 references; the in-place form bumps the
    tensors' versions as a torch in-place op would (autograd then refuses a tensor it saved);
    while a rank is joined the others still reduce (through private staging, no collective
    allocation the joined rank would miss)."""
    n, r = hvd.size(), hvd.rank()
    sizes = [0, 1, 7, 1000, 4096, 30_000, 3, 100_000, 11]  # > 100k elements in all
    stacks = [np.stack([inputs(q, k, "float64", "sum", salt=i) for q in range(n)])
              for i, k in enumerate(sizes)]
    for dtype in ("float64", "float32"):
        xs = [as_tensor(st[r], dtype).clone() for st in stacks]  # not sharing st's memory
        xs[1] = xs[1].reshape(())  # a 0-d tensor among them
        before = _zero_copy_calls()
        outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
        versions = [x._version for x in xs]
        assert hvd.grouped_allreduce_(xs, op=hvd.Sum) is not None
        after = _zero_copy_calls()
        for i, (got, got_, st) in enumerate(zip(outs, xs, stacks)):
            want = reference("sum", st).reshape(got.shape)
            mag = np.abs(st).sum(0).reshape(got.shape)
            check(got, want, dtype, f"grouped direct {dtype} [{i}]", mag)
            check(got_, want, dtype, f"grouped direct in place {dtype} [{i}]", mag)
        assert all(x._version > v for x, v in zip(xs, versions)), "versions not bumped"
        if n > 1 and before is not None:
            assert after == before + 2, f"{dtype}: {after - before} zero-copy calls, expected 2"
    # autograd sees the in-place write
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    h = w * 1.0
    loss = (h * h).sum()  # saves h for backward
    hvd.grouped_allreduce_([h, torch.ones(2, dtype=torch.float64)], op=hvd.Sum)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # A joined rank: the others' grouped allreduces still run (and find the sum of the active
    # ranks' tensors); then everyone is back to shared staging.
    if n > 1:
        big = [torch.full((60_000,), float(r + 1)), torch.full((50_000,), 2.0 * (r + 1))]
        # the others join together after rank n - 1: the highest of them is reported
        if r == n - 1:
            assert hvd.join() == n - 2
        else:
            got = hvd.grouped_allreduce(big, op=hvd.Sum)
            active = sum(q + 1 for q in range(n - 1))
            assert torch.equal(got[0], torch.full((60_000,), float(active))), got[0][:4]
            assert torch.equal(got[1], torch.full((50_000,), 2.0 * active)), got[1][:4]
            assert hvd.join() == n - 2
        got = hvd.grouped_allreduce(big, op=hvd.Sum)
        assert torch.equal(got[0], torch.full((60_000,), float(n * (n + 1) // 2)))


def case_distributed_optimizer_buckets_shared_and_kept_over_shutdown():
    """With every rank on this host, the gradient buckets live in shared memory (their
    allreduces are zero-copy); hvd.shutdown() moves them (and the .grad views) to private
    memory, so the gradients stay readable and equal; the optimizer's step still works after
    init() again."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(3)
    model = torch.nn.Linear(400, 300).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    before = _zero_copy_calls()
    opt.zero_grad(set_to_none=False)  # gradients are then the buckets' views
    x = torch.full((2, 400), float(r + 1), dtype=torch.float64)
    model(x).sum().backward()
    opt.synchronize()
    if n > 1 and before is not None:
        assert _zero_copy_calls() > before, "bucket allreduces were not zero-copy"
    # d(sum)/dW = column sums of x: 2 (r + 1) everywhere; averaged over ranks: n + 1
    want = np.full((300, 400), float(n + 1))
    check(model.weight.grad, want, "float64", "shared bucket gradient")
    grad = model.weight.grad
    hvd.shutdown()
    check(grad, want, "float64", "gradient view after shutdown")
    check(model.weight.grad, want, "float64", ".grad after shutdown")
    hvd.init()
    _still_works()


def case_distributed_optimizers_built_and_dropped_leave_no_close_hooks():
    """Each optimizer with shared buckets registers a hook to unshare them at shutdown; the
    hooks of optimizers that are gone are dropped when the next one is built."""
    import gc

    from mlfabric.comm import context
    from mlfabric.torch.optimizer import _unshare
    if not hvd.is_initialized():   # (run alone)
        hvd.init()
    for _ in range(5):
        model = torch.nn.Linear(30, 20)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        del opt, model
        gc.collect()
    hooks = [f for f in context.get().on_close if getattr(f, "func", None) is _unshare]
    assert len(hooks) <= 1, len(hooks)   # (1: the last one's, not yet pruned; 0: private)


# --- allgather, broadcast, alltoall ---------------------------------------------------------------

def case_allgather_uneven_first_dims():
    n, r = hvd.size(), hvd.rank()
    for dtype in ("float32", "float64", "bfloat16", "int64", "uint8", "bool"):
        rows = [(q * 2) % 3 for q in range(n)]  # rank 0 sends no rows
        blocks = [inputs(q, rows[q] * 6, dtype, "sum").reshape(rows[q], 2, 3) for q in range(n)]
        want = np.concatenate(blocks)
        mine = as_tensor(blocks[r], dtype)
        check(hvd.allgather(mine), want, dtype, f"allgather {dtype}")
        check(hvd.synchronize(hvd.allgather_async(mine)), want, dtype, f"allgather async {dtype}")
    # Equal first dims (the unpadded path), a 0-d tensor, and all-empty.
    got = hvd.allgather(torch.full((2, 3), float(r)))
    check(got, np.repeat(np.arange(n, dtype=np.float64), 6).reshape(2 * n, 3), "float32", "equal")
    check(hvd.allgather(torch.tensor(r)), np.arange(n), "int64", "0-d")
    assert hvd.allgather(torch.zeros((0, 4))).shape == (0, 4)


def case_broadcast_every_root():
    n, r = hvd.size(), hvd.rank()
    for root in range(n):
        for dtype in ("float32", "bfloat16", "int16", "bool", "int64"):
            data = [inputs(q, 12, dtype, "sum", salt=root) for q in range(n)]
            x = as_tensor(data[r], dtype, (3, 4))
            keep = x.clone()
            check(hvd.broadcast(x, root), data[root].reshape(3, 4), dtype, f"bcast {root}")
            assert torch.equal(x, keep)
            check(hvd.synchronize(hvd.broadcast_async(x, root)), data[root].reshape(3, 4),
                  dtype, "bcast async")
            y = x.clone()
            assert hvd.broadcast_(y, root) is y
            check(y, data[root].reshape(3, 4), dtype, "bcast in place")
            y = x.clone()
            assert hvd.synchronize(hvd.broadcast_async_(y, root)) is y
            check(y, data[root].reshape(3, 4), dtype, "bcast async in place")
        base = torch.full((4, 3), float(r))
        hvd.broadcast_(base.t(), root)  # non-contiguous, in place
        assert (base == root).all()


def case_alltoall_with_splits():
    n, r = hvd.size(), hvd.rank()
    for dtype in ("float32", "float64", "int32", "uint8"):
        splits = [[(q + 2 * j) % 3 for j in range(n)] for q in range(n)]
        data = [inputs(q, sum(splits[q]) * 2, dtype, "sum").reshape(-1, 2) for q in range(n)]

        def block(q, j):
            start = sum(splits[q][:j])
            return data[q][start:start + splits[q][j]]

        want = np.concatenate([block(q, r) for q in range(n)])
        x = as_tensor(data[r], dtype)
        out, received = hvd.alltoall(x, splits=splits[r])
        check(out, want, dtype, f"alltoall {dtype}")
        assert received.tolist() == [splits[q][r] for q in range(n)]
        out, received = hvd.synchronize(hvd.alltoall_async(x, splits=torch.tensor(splits[r])))
        check(out, want, dtype, f"alltoall async {dtype}")
    # Without splits: shape[0] / size rows each; the result alone comes back.
    x = torch.arange(2 * n * 3, dtype=torch.float64).reshape(2 * n, 3) + 100 * r
    got = hvd.alltoall(x)
    want = np.concatenate([(np.arange(2 * n * 3).reshape(2 * n, 3) + 100 * q)[2 * r:2 * r + 2]
                           for q in range(n)])
    check(got, want, "float64", "alltoall equal splits")
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            hvd.alltoall(torch.ones(n + 1, 2))
    with pytest.raises(ValueError, match="add up to"):
        hvd.alltoall(torch.ones(n, 2), [2] * n)


# --- autograd -------------------------------------------------------------------------------------

def case_autograd_like_horovod():
    n, r = hvd.size(), hvd.rank()
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    # allreduce: the gradient is the allreduce of the gradients (same op).
    (hvd.allreduce(w * (r + 1), op=hvd.Sum) * (r + 1)).sum().backward()
    tri = n * (n + 1) / 2
    check(w.grad, np.full(3, tri * (r + 1)), "float64", "allreduce Sum grad")
    w.grad = None
    (hvd.allreduce(w * (r + 1)) * (r + 1)).sum().backward()  # Average
    check(w.grad, np.full(3, tri / n * (r + 1)), "float64", "allreduce Average grad")
    # Recorded only where autograd needs it (a tensor requiring grad, grad mode on); the same
    # results either way.
    with torch.no_grad():
        outs = [hvd.allreduce(w, op=hvd.Sum), hvd.allgather(w), hvd.broadcast(w, 0),
                *hvd.grouped_allreduce([w, w], op=hvd.Sum), hvd.alltoall(w.repeat(n))]
    assert all(o.grad_fn is None and not o.requires_grad for o in outs), outs
    check(outs[0], np.arange(1, 4) * float(n), "float64", "allreduce under no_grad")
    check(outs[1], np.tile(np.arange(1, 4), n), "float64", "allgather under no_grad")
    assert hvd.allreduce(w).grad_fn is not None and hvd.allgather(w).grad_fn is not None
    # allgather: this rank's rows of the averaged gradient.
    w.grad = None
    rows = r % 2 + 1
    x = w[:rows] * 1.0
    g = hvd.allgather(x)
    scale = torch.arange(1, g.shape[0] + 1, dtype=torch.float64) * (r + 1)
    (g * scale).sum().backward()
    offset = sum(q % 2 + 1 for q in range(r))
    want = np.zeros(3)
    want[:rows] = np.arange(offset + 1, offset + rows + 1) * tri / n
    check(w.grad, want, "float64", "allgather grad")
    # broadcast: the averaged gradient on the root, zeros elsewhere.
    w.grad = None
    (hvd.broadcast(w, 0) * (r + 1)).sum().backward()
    check(w.grad, np.full(3, tri / n if r == 0 else 0.0), "float64", "broadcast grad")
    # alltoall: the gradient goes back where the rows came from.
    v = torch.arange(n, dtype=torch.float64, requires_grad=True)
    out, _ = hvd.alltoall(v * 1.0, splits=[1] * n)
    (out * (r + 1)).sum().backward()
    check(v.grad, np.arange(1, n + 1, dtype=np.float64), "float64", "alltoall grad")
    # grouped_allreduce, and a clear error for ops without a gradient.
    a, b = (torch.ones(2, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ga, gb = hvd.grouped_allreduce([a, b * 2], op=hvd.Sum)
    (ga * (r + 1) + gb).sum().backward()
    check(a.grad, np.full(2, tri), "float64", "grouped grad a")
    check(b.grad, np.full(2, 2.0 * n), "float64", "grouped grad b")
    m = hvd.allreduce(w * 1.0, op=hvd.Max)
    with pytest.raises(hvd.MlfabricError, match="not defined"):
        m.sum().backward()
    out = hvd.allreduce(w * 1.0)
    out /= 2  # a result may be modified in place


# --- reducescatter -------------------------------------------------------------------------------

def _rows_of(rows, n, r):
    """(first row, rows) of rank r's block of a reducescatter: the first rows % n ranks get one
    more (Horovod's split)."""
    counts = [rows // n + (q < rows % n) for q in range(n)]
    return sum(counts[:r]), counts[r]


def case_reducescatter_ops_dtypes_forms():
    """Every op and dtype against float64, rows that do not divide by size() and fewer rows
    than ranks, the async form, the scale factors."""
    n, r = hvd.size(), hvd.rank()
    for op, core in OPS.items():
        for dtype in NATIVE + ("int8", "bool"):
            if (core == "avg" and dtype not in FLOATS) or (core == "prod" and dtype == "bfloat16"):
                continue
            for rows, tail in ((2 * n + 1, (3,)), (max(n - 1, 1), ()), (n, (2, 2))):
                count = rows * int(np.prod(tail, dtype=np.int64))
                stack = np.stack([inputs(q, count, dtype, core, salt=rows) for q in range(n)])
                x = as_tensor(stack[r], dtype, (rows, *tail))
                lo, k = _rows_of(rows, n, r)
                want = reference(core, stack).reshape(rows, *tail)[lo:lo + k]
                mag = np.abs(stack).sum(0).reshape(rows, *tail)[lo:lo + k]
                what = f"reducescatter {core} {dtype} {(rows, *tail)}"
                check(hvd.reducescatter(x, op=op), want, dtype, what, mag)
                check(hvd.synchronize(hvd.reducescatter_async(x, op=op)), want, dtype,
                      what + " async", mag)
                assert torch.equal(x, as_tensor(stack[r], dtype, (rows, *tail))), \
                    what + ": input changed"
    x = torch.from_numpy(values(r, 12, "float64", "sum")).reshape(6, 2)
    stack = np.stack([values(q, 12, "float64", "sum") for q in range(n)]).reshape(n, 6, 2)
    lo, k = _rows_of(6, n, r)
    check(hvd.reducescatter(x, prescale_factor=0.5, postscale_factor=3.0),
          1.5 * stack.sum(0)[lo:lo + k] / n, "float64", "reducescatter average x 1.5")
    check(hvd.reducescatter(x, op=hvd.Sum, postscale_factor=2.0), 2 * stack.sum(0)[lo:lo + k],
          "float64", "reducescatter sum x 2")
    check(hvd.reducescatter(torch.zeros(0, 3)), np.zeros((0, 3)), "float32", "empty")
    # Horovod's argument order: name, compression, op
    check(hvd.reducescatter(x, "rs", hvd.Compression.none, hvd.Sum), stack.sum(0)[lo:lo + k],
          "float64", "reducescatter, positional arguments")


def case_reducescatter_autograd_and_compression():
    """The gradient of a reducescatter is the allgather of the outputs' gradients times the
    factors, and times size() for Sum (Horovod's); with grad="local", size() times less (the
    derivative of the ranks' summed loss); fp16 compression within its tolerance."""
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    stack = np.stack([values(q, rows * 2, "float64", "sum") for q in range(n)]).reshape(n, rows, 2)
    weights = [np.arange(1, _rows_of(rows, n, q)[1] * 2 + 1, dtype=np.float64) * (q + 1)
               for q in range(n)]  # d loss / d output on rank q
    grad_out = np.concatenate([w.reshape(-1, 2) for w in weights])  # every rank's, in order
    for op, scale, grad in ((hvd.Sum, 2.0 * n, "horovod"), (hvd.Average, 2.0, "horovod"),
                            (hvd.Sum, 2.0, "local"), (hvd.Average, 2.0 / n, "local")):
        x = torch.from_numpy(stack[r].copy()).requires_grad_(True)
        kw = {} if grad == "horovod" else {"grad": grad}  # Horovod's is the default
        y = hvd.reducescatter(x, op=op, prescale_factor=2.0, **kw)
        (y * torch.from_numpy(weights[r].reshape(-1, 2))).sum().backward()
        check(x.grad, scale * grad_out, "float64", f"reducescatter grad {op} {grad}")
    with pytest.raises(ValueError, match="grad must be one of 'horovod', 'local'"):
        hvd.reducescatter(torch.ones(n), grad="global")
    with pytest.raises(hvd.MlfabricError, match="gradient of reducescatter with op max"):
        x = torch.ones(n, requires_grad=True)
        hvd.reducescatter(x, op=hvd.Max).sum().backward()
    x = torch.from_numpy(stack[r]).float()
    lo, k = _rows_of(rows, n, r)
    got = hvd.reducescatter(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert got.dtype == torch.float32
    want = stack.sum(0)[lo:lo + k]
    assert np.allclose(got.double().numpy(), want, rtol=2e-3, atol=2e-3 * n), "fp16 compression"


def case_reducescatter_bad_input_fails_on_every_rank():
    """A 0-d tensor or Average on bools on one rank: its own error there, a MismatchError
    naming it on the others; shapes or ops that differ between ranks: a MismatchError on every
    rank naming both; then the next call works."""
    n, r = hvd.size(), hvd.rank()
    bad = n - 1
    if r == bad:
        with pytest.raises(ValueError, match="at least one dimension"):
            hvd.reducescatter(torch.tensor(1.0))
        with pytest.raises(TypeError, match="need a numeric tensor"):
            hvd.reducescatter(torch.ones(3, dtype=torch.bool))
    elif n > 1:
        for _ in range(2):
            with pytest.raises(hvd.MismatchError, match=rf"rank\(s\) \[{bad}\] rejected"):
                hvd.reducescatter(torch.ones(3))
    if n > 1:
        with pytest.raises(hvd.MismatchError, match=r"ranks disagree on shape: \(3, 2\) on "
                           rf"rank\(s\) \[.*\]; \(4, 2\) on rank\(s\) \[{bad}\]"):
            hvd.reducescatter(torch.ones(4 if r == bad else 3, 2))
        with pytest.raises(hvd.MismatchError, match="ranks disagree on op"):
            hvd.reducescatter(torch.ones(3), op=hvd.Max if r == bad else hvd.Sum)
        with pytest.raises(hvd.MismatchError, match=r"ranks disagree on call: reducescatter on "
                           rf"rank\(s\) \[.*\]; allreduce on rank\(s\) \[{bad}\]"):
            (hvd.allreduce if r == bad else hvd.reducescatter)(torch.ones(3))
    lo, k = _rows_of(3, n, r)
    assert hvd.reducescatter(torch.ones(3), op=hvd.Sum).tolist() == [float(n)] * k


# --- grouped allgather / reducescatter -----------------------------------------------------------

_GROUP_DTYPES = ("float32", "float64", "int32", "int8", "bfloat16", "float32")


def _gather_list(r, salt=0):
    """Rank r's list for a grouped allgather, as float64 arrays and dtypes: rows differing by
    rank and by tensor (none at all on some), row shapes () to (2, 3), a 0-d tensor."""
    tails = [(3,), (), (2, 3), (1,), (4,), ()]
    arrays = []
    for i, (dtype, tail) in enumerate(zip(_GROUP_DTYPES, tails)):
        rows = (r + i) % 3 if i != 5 else None
        count = (1 if rows is None else rows) * int(np.prod(tail, dtype=np.int64))
        v = inputs(r, count, dtype, "sum", salt=salt + i)
        arrays.append(v.reshape(() if rows is None else (rows, *tail)))
    return arrays


def case_grouped_allgather_matches_allgather():
    """Each tensor of the list gathered as allgather gathers it (float64 reference and the
    single call, exactly), mixed dtypes in one list, the async form, autograd."""
    n, r = hvd.size(), hvd.rank()
    lists = [_gather_list(q) for q in range(n)]
    xs = [as_tensor(v, d, v.shape) for v, d in zip(lists[r], _GROUP_DTYPES)]
    for form, got in (("sync", hvd.grouped_allgather(xs, name="g")),
                      ("async", hvd.synchronize(hvd.grouped_allgather_async(xs)))):
        assert isinstance(got, list) and len(got) == len(xs), form
        for i, (g, dtype) in enumerate(zip(got, _GROUP_DTYPES)):
            want = np.concatenate([np.reshape(lists[q][i], (-1, *lists[q][i].shape[1:]))
                                   for q in range(n)])
            check(g, want, dtype, f"grouped_allgather {form} tensors[{i}]")
            assert torch.equal(g, hvd.allgather(xs[i])), f"{form} tensors[{i}] != allgather"
    # outputs are tensors of their own (not views): they may be modified in place, under
    # autograd too, as Horovod's
    w = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    for outs in ([hvd.allgather(w * 1)], hvd.grouped_allgather([w * 1, w * 1]),
                 [hvd.reducescatter(torch.ones(n, 3, dtype=torch.float64,
                                               requires_grad=True) * 1, op=hvd.Sum)],
                 hvd.grouped_reducescatter([w[0].expand(n, 3) * 1, w[0] * 1], op=hvd.Sum)):
        for o in outs:
            o.mul_(2)
        sum(o.sum() for o in outs).backward()
    # a list holding an integer tensor: the floating ones still get their gradients
    a, b = hvd.grouped_allgather([w * 1, torch.arange(2)])
    w.grad = None
    a.sum().backward()
    assert torch.equal(w.grad, torch.ones(2, 3, dtype=torch.float64)), w.grad
    assert b.tolist() == [0, 1] * n
    # autograd: each input's gradient is its rows of the averaged output gradient, as allgather
    ws = [torch.arange(1.0, 5.0, dtype=torch.float64).reshape(2, 2) + r,
          torch.full((r % 2 + 1, 2), float(r + 1), dtype=torch.float64)]
    for w in ws:
        w.requires_grad_(True)
    outs = hvd.grouped_allgather(ws)
    sum((o * (k + 1) * torch.arange(o.numel(), dtype=torch.float64).reshape(o.shape)).sum()
        for k, o in enumerate(outs)).backward()
    for k, w in enumerate(ws):
        twin = w.detach().clone().requires_grad_(True)
        o = hvd.allgather(twin)
        ((k + 1) * o * torch.arange(o.numel(), dtype=torch.float64).reshape(o.shape)).sum() \
            .backward()
        assert torch.allclose(w.grad, twin.grad, rtol=0, atol=1e-12), f"grad of tensors[{k}]"


def case_grouped_reducescatter_matches_reducescatter():
    """Each tensor of the list reduced and split as reducescatter does (float64 reference and
    the single call), every op, mixed dtypes, rows that do not divide by size(), the async
    form, scale factors, compression, autograd."""
    n, r = hvd.size(), hvd.rank()
    shapes = [(2 * n + 1, 3), (max(n - 1, 1),), (n, 2, 2), (1, 5), (3 * n + 2,)]
    dtypes = ("float32", "float64", "int32", "float64", "bfloat16")
    for op, core in OPS.items():
        kinds = [(s, d) for s, d in zip(shapes, dtypes)
                 if not (core == "avg" and d not in FLOATS) and not (core == "prod" and
                                                                     d == "bfloat16")]
        stacks = [np.stack([inputs(q, int(np.prod(s)), d, core, salt=7 * i) for q in range(n)])
                  for i, (s, d) in enumerate(kinds)]
        xs = [as_tensor(st_[r], d, s) for st_, (s, d) in zip(stacks, kinds)]
        got = hvd.grouped_reducescatter(xs, op=op)
        got_async = hvd.synchronize(hvd.grouped_reducescatter_async(xs, op=op))
        for i, (s, d) in enumerate(kinds):
            lo, k = _rows_of(s[0], n, r)
            want = reference(core, stacks[i]).reshape(s)[lo:lo + k]
            mag = np.abs(stacks[i]).sum(0).reshape(s)[lo:lo + k]
            what = f"grouped_reducescatter {core} tensors[{i}] {d} {s}"
            check(got[i], want, d, what, mag)
            check(got_async[i], want, d, what + " async", mag)
            assert torch.equal(got[i], hvd.reducescatter(xs[i], op=op)), what + " != single"
    # the other packing path (a widened dtype, a non-contiguous tensor), against single calls
    odd = [torch.arange(3 * n + 1, dtype=torch.int8) * (r + 1),
           torch.arange(4.0 * (n + 1)).reshape(4, n + 1).t() + r]  # (n + 1, 4), transposed
    for a, b in zip(hvd.grouped_reducescatter(odd, op=hvd.Sum),
                    [hvd.reducescatter(t, op=hvd.Sum) for t in odd]):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    # scale factors and compression, against the single call
    x = [torch.from_numpy(values(r, 12, "float64", "sum")).reshape(6, 2),
         torch.from_numpy(values(r, 5, "float64", "sum", salt=1))]
    for a, b in zip(hvd.grouped_reducescatter(x, prescale_factor=0.5, postscale_factor=2.5),
                    [hvd.reducescatter(t, prescale_factor=0.5, postscale_factor=2.5) for t in x]):
        assert torch.allclose(a, b, rtol=1e-15, atol=0), "scale factors"
    xf = [t.float() for t in x]
    for a, b in zip(hvd.grouped_reducescatter(xf, op=hvd.Sum, compression=hvd.Compression.fp16),
                    [hvd.reducescatter(t, op=hvd.Sum, compression=hvd.Compression.fp16)
                     for t in xf]):
        assert a.dtype == torch.float32 and torch.equal(a, b), "fp16 compression"
    # autograd: as reducescatter's
    ws = [t.clone().requires_grad_(True) for t in x]
    twins = [t.clone().requires_grad_(True) for t in x]
    for o in (hvd.grouped_reducescatter(ws, op=hvd.Sum, prescale_factor=2.0),
              [hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0) for t in twins]):
        sum(((k + 1) * v * (r + 1)).sum() for k, v in enumerate(o)).backward()
    for w, t in zip(ws, twins):
        assert torch.allclose(w.grad, t.grad, rtol=0, atol=1e-12), "reducescatter grads"


def case_grouped_gather_scatter_bad_lists_fail_on_every_rank():
    """Lists that differ between ranks (length, dtype, shape) are a MismatchError on every rank
    saying so; a bad list on one rank is its own error there and a MismatchError naming it on
    the others; then the next call works."""
    n, r = hvd.size(), hvd.rank()
    bad = n - 1
    with pytest.raises(ValueError, match="at least one tensor"):
        hvd.grouped_allgather([])  # the same on every rank: nothing to match
    if n > 1:
        lists = {"length": ([torch.ones(2)] * (3 if r == bad else 2)),
                 "dtype": [torch.ones(2, dtype=torch.float64 if r == bad else torch.float32)],
                 "row shape": [torch.ones(2, 3 if r == bad else 2)]}
        for why, xs in lists.items():
            for fn in (hvd.grouped_allgather, hvd.grouped_reducescatter):
                with pytest.raises(hvd.MismatchError, match=r"the ranks' lists differ.*"
                                   rf"\[{bad}\]"):
                    fn(xs)
        # reducescatter: first dimensions must agree too (allgather's may differ)
        with pytest.raises(hvd.MismatchError, match="lists differ"):
            hvd.grouped_reducescatter([torch.ones(3 if r == bad else 2, 2)])
        # a list against a single-tensor call that travels alike ((n, 6) either way): both fail
        with pytest.raises(hvd.MismatchError):
            if r == bad:
                hvd.reducescatter(torch.ones(n, 6))
            else:
                hvd.grouped_reducescatter([torch.ones(2 * n, 3)])
    if n > 2:
        # lists that differ but travel alike ((n, 2)), a joined rank watching: it must not take
        # part in a call the others refuse (it would be one call ahead of them)
        # (join() returns the last to join: of the others, joining together, the highest)
        if r == bad:
            assert hvd.join() == n - 2
        else:
            with pytest.raises(hvd.MismatchError, match="lists differ"):
                hvd.grouped_reducescatter([torch.ones(2 * n, 1) if r == 0 else
                                           torch.ones(n, 2)])
            assert hvd.join() == n - 2
        assert hvd.grouped_allgather([torch.ones(3 if r == bad else 2, 2)])[0].shape[0] == \
            2 * n + 1
    if r == bad:
        with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor"):
            hvd.grouped_allgather([torch.ones(2), "x"])
        with pytest.raises(ValueError, match=r"tensors\[0\] has no dimension"):
            hvd.grouped_reducescatter([torch.tensor(1.0)])
        with pytest.raises(TypeError, match="must be a list"):
            hvd.grouped_reducescatter(torch.ones(2))
    elif n > 1:
        for fn in (hvd.grouped_allgather, hvd.grouped_reducescatter, hvd.grouped_reducescatter):
            with pytest.raises(hvd.MismatchError, match=rf"rank\(s\) \[{bad}\] rejected"):
                fn([torch.ones(2)])
    _still_works()


# --- timeline -------------------------------------------------------------------------------------

def case_timeline_records_each_call():
    """start_timeline .. stop_timeline: each rank's file is complete JSON holding every call it
    made in between (its queue wait, the call, each control round inside it), none after;
    the files merge into one trace with a row per rank."""
    import json
    import tempfile

    from mlfabric.torch import timeline

    n, r = hvd.size(), hvd.rank()
    folder = hvd.broadcast_object(tempfile.mkdtemp(prefix="mlfabric-tl-") if r == 0 else None)
    mine = hvd.start_timeline(os.path.join(folder, "trace.json"))
    assert mine == os.path.join(folder, "trace.json" if n == 1 else f"trace.{r}.json"), mine
    hvd.allreduce(torch.ones(4), name="tl.a")
    hvd.synchronize(hvd.allgather_async(torch.ones(r + 1), name="tl.b"))
    hvd.grouped_allreduce([torch.ones(2), torch.ones(3, dtype=torch.float64)], name="tl.g")
    hvd.barrier()
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(4), name="tl.after")  # not recorded
    with open(mine) as f:
        events = json.load(f)  # complete JSON once stopped
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["pid"] == r for e in events), "every event on this rank's row"
    calls = {e["name"]: e for e in spans if e["name"] not in ("QUEUE", "NEGOTIATE")}
    assert set(calls) == {"allreduce 'tl.a'", "allgather 'tl.b'", "grouped_allreduce 'tl.g'",
                          "barrier"}, sorted(calls)
    queued = [e["args"]["call"] for e in spans if e["name"] == "QUEUE"]
    assert sorted(queued) == sorted(calls), queued
    for what, call in calls.items():
        rounds = [e for e in spans if e["name"] == "NEGOTIATE" and e["args"]["call"] == what]
        # a control round per call; the grouped allreduce of two dtypes: one per dtype
        assert len(rounds) == (2 if what.startswith("grouped") else 1), (what, rounds)
        for e in rounds:
            assert call["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= call["ts"] + \
                call["dur"] + 1, f"{what}: a control round outside its call"
    hvd.barrier()
    if r == 0:
        files = [timeline.rank_path(os.path.join(folder, "trace.json"), q, n) for q in range(n)]
        out = os.path.join(folder, "all.json")
        timeline.merge(out, files)
        with open(out) as f:
            assert {e["pid"] for e in json.load(f)} == set(range(n))
        # a file cut short (a crash) still loads
        with open(files[0]) as f:
            text = f.read()
        cut = os.path.join(folder, "cut.json")
        with open(cut, "w") as f:
            f.write(text[:text.rindex("},") + 2])
        assert 0 < len(timeline.load(cut)) < len(events)
        with open(cut, "w") as f:  # an event cut in two
            f.write(text[:text.rindex("},") - 5])
        assert 0 < len(timeline.load(cut)) < len(events)
        open(cut, "w").close()  # killed before anything reached the file
        assert timeline.load(cut) == []
    hvd.barrier()


# --- join -----------------------------------------------------------------------------------------

def case_join_uneven_batches():
    n, r = hvd.size(), hvd.rank()
    last = n - 1  # rank r has r + 1 batches: the last rank joins last
    for s in range(r + 1):
        active = list(range(s, n))
        xs = {q: values(q, 9, "float64", "sum", salt=s) for q in range(n)}
        got = hvd.allreduce(torch.from_numpy(xs[r]), name="avg")
        # Joined ranks contribute zeros; Average divides by size(), as in Horovod.
        check(got, sum(xs[q] for q in active) / n, "float64", f"join avg step {s}")
        got = hvd.allreduce(torch.from_numpy(xs[r]), op=hvd.Max)
        check(got, np.max([xs[q] for q in active], 0), "float64", f"join max step {s}")
        got = hvd.allreduce(torch.from_numpy(xs[r]), op=hvd.Min)
        check(got, np.min([xs[q] for q in active], 0), "float64", f"join min step {s}")
        got = hvd.allgather(torch.full((q_rows := r % 2 + 1, 2), float(r)))
        want = np.concatenate([np.full((q % 2 + 1, 2), float(q)) for q in active])
        check(got, want, "float32", f"join allgather step {s}")
        check(hvd.broadcast(torch.tensor([float(r)] * 3), last), np.full(3, last), "float32",
              f"join broadcast step {s}")
        out, rec = hvd.alltoall(torch.arange(n, dtype=torch.int64) + 10 * r, splits=[1] * n)
        assert out.tolist() == [r + 10 * q for q in active], out
        # reducescatter: joined ranks contribute the identity and their rows are dropped
        zs = {q: values(q, 2 * (2 * n + 1), "float64", "sum", salt=50 + s).reshape(-1, 2)
              for q in range(n)}
        lo, k = _rows_of(2 * n + 1, n, r)
        check(hvd.reducescatter(torch.from_numpy(zs[r]), op=hvd.Max),
              np.max([zs[q] for q in active], 0)[lo:lo + k], "float64",
              f"join reducescatter max step {s}")
        # grouped: standard calls on the wire, so a joined rank takes part unaware
        ga, gb = hvd.grouped_allgather([torch.full((r % 2 + 1, 2), float(r)),
                                        torch.full((r,), r, dtype=torch.int8)])
        check(ga, want, "float32", f"join grouped_allgather step {s}")
        check(gb, np.concatenate([np.full(q, q) for q in active]), "int8",
              f"join grouped_allgather int8 step {s}")
        (gz,) = hvd.grouped_reducescatter([torch.from_numpy(zs[r])], op=hvd.Max)
        check(gz, np.max([zs[q] for q in active], 0)[lo:lo + k], "float64",
              f"join grouped_reducescatter max step {s}")
        assert q_rows
    # all_calls: the joined ranks take part in allgathers, alltoalls and broadcasts too
    assert hvd.join(all_calls=True) == last
    # Everyone joins at once: the highest rank is reported; then all works as before.
    assert hvd.join() == n - 1
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]


def case_join_root_joined_is_an_error_everywhere():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    if r == 0:
        assert hvd.join(all_calls=True) == n - 1
    else:
        with pytest.raises(hvd.MlfabricError, match="root rank 0 has joined"):
            hvd.broadcast(torch.ones(2), 0)
        hvd.allreduce(torch.ones(2))
        assert hvd.join() == n - 1


def case_broadcast_parameters_and_optimizer_state_beside_a_joined_rank():
    """Rank 0 has joined: the others broadcast parameters and optimizer state from the highest
    rank (a root numbered past the count of active ranks), and get the root's values; a joined
    root is an error on every active rank."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    if r == 0:
        assert hvd.join(all_calls=True) == n - 1
        return
    torch.manual_seed(61 + r)  # another model on each rank
    model = torch.nn.Linear(3, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * r, momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=n - 1)
    hvd.broadcast_optimizer_state(opt, root_rank=n - 1)
    torch.manual_seed(61 + n - 1)
    want = torch.nn.Linear(3, 2).double()
    for got, ref in zip(model.parameters(), want.parameters()):
        assert torch.equal(got.detach(), ref.detach())
    assert opt.param_groups[0]["lr"] == 0.1 * (n - 1)
    with pytest.raises(hvd.MlfabricError, match="root rank 0 has joined"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert hvd.join() == n - 1


# --- objects, parameters, optimizer state ---------------------------------------------------------

def case_broadcast_and_allgather_objects():
    n, r = hvd.size(), hvd.rank()
    obj = {"rank": r, "payload": list(range(r * 100)), "f": lambda v: v + r}
    got = hvd.broadcast_object(obj, root_rank=n - 1)
    assert got["rank"] == n - 1 and len(got["payload"]) == (n - 1) * 100 and got["f"](1) == n
    assert hvd.broadcast_object(None if r else "x", 0) == "x"
    every = hvd.allgather_object(("r", r, "y" * r))
    assert every == [("r", q, "y" * q) for q in range(n)]


class Net(torch.nn.Module):
    def __init__(self, seed, width=7, extra=False):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(5, width)
        self.fc2 = torch.nn.Linear(width, 3)
        self.unused = torch.nn.Parameter(torch.randn(4))  # never gets a gradient
        self.bn = torch.nn.BatchNorm1d(3)  # buffers, with an int64 counter
        if extra:
            self.fc3 = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.bn(self.fc2(torch.tanh(self.fc1(x))))


def _state_digest(sd):
    return [(k, v.to(torch.float64).sum().item(), tuple(v.shape)) for k, v in sd.items()]


def case_broadcast_parameters_and_optimizer_state():
    n, r = hvd.size(), hvd.rank()
    model = Net(seed=100 + r).double()
    root_sd = Net(seed=100).double().state_dict()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, root_sd[k]), k
    # named_parameters() (a generator of pairs) and another root, a numpy integer.
    model = Net(seed=200 + r).double()
    hvd.broadcast_parameters(model.named_parameters(), root_rank=np.int64(n - 1))
    root = dict(Net(seed=200 + n - 1).double().named_parameters())
    for k, v in model.named_parameters():
        assert torch.equal(v, root[k]), k
    # Optimizer state: the root has taken a step (Adam moments) and another lr.
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 0:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    digests = hvd.allgather_object(_state_digest({f"{i}.{k}": v for i, s in
                                                  opt.state_dict()["state"].items()
                                                  for k, v in s.items()}))
    assert all(d == digests[0] for d in digests) and digests[0]
    # An optimizer with empty state everywhere gets it first, as Horovod's (a step with zero
    # gradients): the same state on every rank, the parameters kept.
    before = [p.detach().clone() for p in model.parameters()]
    fresh = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    hvd.broadcast_optimizer_state(fresh, root_rank=n - 1)
    state = fresh.state_dict()["state"]
    assert len(state) == len(before), state.keys()
    digests = hvd.allgather_object(_state_digest({f"{i}.{k}": v for i, s in state.items()
                                                  for k, v in s.items()
                                                  if isinstance(v, torch.Tensor)}))
    assert all(d == digests[0] for d in digests) and digests[0]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


class _OddStateOptimizer(torch.optim.SGD):
    """SGD whose state holds what a custom optimizer may: tensors of several dtypes and shapes
    (0-dim, empty), nested in lists, tuples and dicts, beside a sparse tensor, a tensor that
    requires grad and plain Python values (no str: torch's load_state_dict turns one into the
    text of a generator)."""

    def fill(self, seed):
        g = torch.Generator().manual_seed(seed)
        for i, p in enumerate(self.param_groups[0]["params"]):
            self.state[p] = {
                "moments": [torch.randn(p.shape, generator=g, dtype=torch.float64),
                            torch.randn(3, generator=g).to(torch.bfloat16)],
                "pair": (torch.tensor(seed + i, dtype=torch.int64), torch.empty(0, 5)),
                "nested": {"mask": torch.rand(4, generator=g) > 0.5, "count": seed + i,
                           "scale": 0.5 * (seed + i), "none": None},
                "sparse": torch.sparse_coo_tensor([[0, 2]], torch.randn(2, generator=g), (4,),
                                                  check_invariants=True),
                "tracked": torch.randn(2, generator=g).requires_grad_(),
                "step": torch.tensor(float(seed)),
                "transposed": torch.randn(3, 2, generator=g, dtype=torch.float64).t(),
                "strided": torch.randn(6, generator=g, dtype=torch.float64)[::2],  # pickled
            }
            self.state[p]["alias"] = self.state[p]["moments"][0]  # one tensor, twice


def _flat_state(opt):
    """[(path, value)] of an optimizer's state, tensors as (dtype, shape, float64 values)."""
    out = []

    def walk(path, v):
        if isinstance(v, torch.Tensor):
            dense = v.to_dense() if v.layout != torch.strided else v
            out.append((path, str(v.dtype), tuple(v.shape), v.layout, v.requires_grad,
                        v.stride() if v.layout == torch.strided else None,
                        dense.detach().to(torch.float64).flatten().tolist()))
        elif isinstance(v, dict):
            for k in v:
                walk(f"{path}.{k}", v[k])
        elif isinstance(v, (list, tuple)):
            out.append((path, type(v).__name__, len(v)))
            for k, x in enumerate(v):
                walk(f"{path}[{k}]", x)
        else:
            out.append((path, v))
    walk("state", opt.state_dict()["state"])
    return out


def case_broadcast_optimizer_state_sends_tensors_as_tensors():
    """broadcast_optimizer_state's tensors travel as tensors (fused per dtype), the rest
    pickled: every rank ends with exactly the root's state, whatever it holds, each tensor with
    storage of its own, and the pickled part carries no tensor the collectives can move."""
    n, r = hvd.size(), hvd.rank()
    root = n // 2
    model = Net(seed=5).double()
    opt = _OddStateOptimizer(model.parameters(), lr=0.1 * (r + 1), momentum=0.5)
    opt.fill(seed=10 * r)
    sent = broadcast_optimizer_state_pickling(opt, root)
    if r == root:
        pickled = [t for path, t in _walk_values(sent[0]) if isinstance(t, torch.Tensor)]
        # only what the collectives cannot move: the sparse, grad-tracking and gapped tensors
        assert sorted(t.layout != torch.strided or t.requires_grad or t.stride() == (2,)
                      for t in pickled) == [True] * (3 * len(opt.state)), pickled
    assert opt.param_groups[0]["lr"] == 0.1 * (root + 1)
    reference = _OddStateOptimizer(model.parameters(), lr=0.1 * (root + 1), momentum=0.5)
    reference.fill(seed=10 * root)  # what the root held, rebuilt here
    if r != root:  # torch's load_state_dict casts floating state to the parameter's dtype
        reference.load_state_dict(copy.deepcopy(reference.state_dict()))
    assert _flat_state(opt) == _flat_state(reference)
    assert str(opt.state_dict()["param_groups"]) == str(reference.state_dict()["param_groups"])
    storages = [t.untyped_storage().data_ptr() for s in opt.state.values()
                for t in (s["moments"][0], s["step"])]
    assert len(set(storages)) == len(storages)  # no state tensor is a view of another's memory
    assert all(s["alias"] is s["moments"][0] for s in opt.state.values())  # still one tensor
    from mlfabric.torch.functions import _sendable  # (a nested tensor has no single shape)
    assert not _sendable(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    model(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    opt.step()  # the loaded state works with this rank's parameters


def case_broadcast_optimizer_state_keeps_strides():
    """A channels_last parameter's Adam moments are channels_last too; every rank's loaded
    state keeps the root's strides, which fused Adam needs (it pairs state and parameter
    elements by memory position): one identical step after the broadcast leaves every rank with
    the same weights."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(7 + r)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(conv.parameters(), lr=0.1, fused=True)
    if r == n - 1:  # only the root has state
        for p in conv.parameters():
            p.grad = torch.randn(p.shape).to(memory_format=torch.channels_last) \
                if p.dim() == 4 else torch.randn(p.shape)
        opt.step()
    hvd.broadcast_parameters(conv.state_dict(), root_rank=n - 1)
    hvd.broadcast_optimizer_state(opt, root_rank=n - 1)
    for p in conv.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].stride() == p.stride(), (key, opt.state[p][key].stride())
    g = torch.Generator().manual_seed(99)
    for p in conv.parameters():
        p.grad = torch.randn(p.shape, generator=g).contiguous(
            memory_format=torch.channels_last if p.dim() == 4 else torch.contiguous_format)
    opt.step()
    same_everywhere(torch.cat([p.detach().reshape(-1) for p in conv.parameters()]),
                    "weights after one step from the broadcast state")


def case_object_failures_on_one_rank_fail_everywhere():
    """An object the root cannot pickle, one that one rank of an allgather cannot, and an
    optimizer whose state the root cannot read: that rank raises its own error, every other
    rank an MlfabricError saying which rank failed, none waits; the ranks stay in step."""
    import threading
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    with pytest.raises(TypeError if r == root else hvd.MlfabricError) as info:
        hvd.broadcast_object(threading.Lock() if r == root else None, root_rank=root)
    if r != root:
        assert f"root rank {root} could not pickle" in str(info.value), info.value
    with pytest.raises(TypeError if r == 0 else hvd.MlfabricError) as info:
        hvd.allgather_object(threading.Lock() if r == 0 else r)
    if r != 0:
        assert "rank(s) [0]" in str(info.value), info.value

    class Broken(torch.optim.SGD):
        def state_dict(self):
            if hvd.rank() == root:
                raise RuntimeError("state on a device that is gone")
            return super().state_dict()
    opt = Broken(Net(seed=1).parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as info:
        hvd.broadcast_optimizer_state(opt, root_rank=root)
    want = "state on a device that is gone" if r == root else f"root rank {root} could not read"
    assert want in str(info.value), info.value
    _still_works()


def broadcast_optimizer_state_pickling(opt, root):
    """hvd.broadcast_optimizer_state(opt, root), returning the objects it sent pickled (through
    broadcast_object)."""
    from mlfabric.torch import functions
    sent, real = [], functions.broadcast_object

    def spy(obj, root_rank=0, name=None):
        sent.append(obj)
        return real(obj, root_rank, name)
    functions.broadcast_object = spy
    try:
        hvd.broadcast_optimizer_state(opt, root_rank=root)
    finally:
        functions.broadcast_object = real
    return sent


def _walk_values(obj, path="", out=None):
    out = [] if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk_values(v, f"{path}.{k}", out)
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Tensor):
        for k, v in enumerate(obj):
            _walk_values(v, f"{path}[{k}]", out)
    else:
        out.append((path, obj))
    return out


# --- mismatches -----------------------------------------------------------------------------------

def _expect_mismatch(fn, *needles):
    with pytest.raises(hvd.MismatchError) as info:
        fn()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"


def _still_works():
    n = hvd.size()
    assert hvd.allreduce(torch.ones(5), op=hvd.Sum).tolist() == [n] * 5


def case_mismatches_fail_on_every_rank():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    odd = n - 1
    _expect_mismatch(lambda: hvd.allreduce(torch.ones(3 + (r == odd))), "shape",
                     f"(4,) on rank(s) [{odd}]")
    _expect_mismatch(lambda: hvd.allreduce(torch.ones(3, dtype=torch.float64 if r == odd
                                                      else torch.float32)), "dtype", "float64")
    _expect_mismatch(lambda: hvd.allreduce(torch.ones(3), op=hvd.Max if r == odd else hvd.Sum),
                     "op", "max")
    _expect_mismatch(lambda: hvd.allgather(torch.ones(2, 3 + (r == odd))), "shape of a row")
    _expect_mismatch(lambda: hvd.broadcast(torch.ones(3), r), "root")
    _expect_mismatch(lambda: hvd.allreduce(torch.ones(3), name=f"t{r == odd}"),
                     "tensor names differ", f"| [{odd}]")
    if r == odd:
        _expect_mismatch(lambda: hvd.allgather(torch.ones(3)), "call", "allgather", "allreduce")
    else:
        _expect_mismatch(lambda: hvd.allreduce(torch.ones(3)), "call", "allgather", "allreduce")
    _still_works()
    # A rank with bad arguments: its own error there, a MismatchError naming it elsewhere.
    if r == odd:
        with pytest.raises(ValueError, match="splits"):
            hvd.alltoall(torch.ones(n, 2), splits=[n + 1] + [0] * (n - 1))
        with pytest.raises(ValueError, match="root_rank"):
            hvd.broadcast_(torch.ones(2), n + 3)
        with pytest.raises(TypeError, match="torch.Tensor"):
            hvd.allreduce([1.0, 2.0])
        with pytest.raises(TypeError, match="compression"):
            hvd.allreduce(torch.ones(2), compression="zip")
    else:
        for _ in range(4):
            _expect_mismatch(lambda: hvd.alltoall(torch.ones(n, 2)), f"rank(s) [{odd}] rejected")
    _still_works()
    # Different models: broadcast_parameters names the parameter, on every rank.
    model = Net(seed=1, width=7 + (r == odd)).double()
    _expect_mismatch(lambda: hvd.broadcast_parameters(model.state_dict(), 0),
                     "broadcast_parameters", f"rank {odd}", "'fc1.bias'", "[8]", "[7]")
    model = Net(seed=1, extra=(r == odd))
    _expect_mismatch(lambda: hvd.broadcast_parameters(model.named_parameters(), 0),
                     "'fc3.", "is not on the root")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _expect_mismatch(lambda: hvd.broadcast_optimizer_state(opt, 0), "parameter group 0")
    with pytest.raises(ValueError, match="root_rank must be the same"):
        hvd.broadcast_parameters(model.state_dict(), r)
    # Lists that differ: the first fused group already fails, on every rank.
    xs = [torch.ones(2), torch.ones(3, dtype=torch.float64)] + [torch.ones(1)] * (r == odd)
    _expect_mismatch(lambda: hvd.grouped_allreduce(xs), "grouped_allreduce", "shape")
    _still_works()
    # DistributedOptimizer over different models: the first gradient bucket fails everywhere.
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 5)).sum().backward()
    _expect_mismatch(opt.step, "allreduce 'gradients[0]: ")
    _still_works()
    # The same shapes under names in another order on one rank (a dict of layers built in
    # another order): their gradients would be summed with another layer's; fails everywhere.
    layers = {k: torch.nn.Linear(4, 4) for k in "pqs"}
    order = "qps" if r == odd else "pqs"
    twin = torch.nn.ModuleDict({k: layers[k] for k in order})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1),
                                   named_parameters=twin.named_parameters())
    twin["p"](torch.ones(1, 4)).sum().backward()
    _expect_mismatch(opt.step, "allreduce 'gradients[0]: ")
    _still_works()


# --- DistributedOptimizer -------------------------------------------------------------------------

B = 4  # samples per rank per micro-batch


def _data(n, steps, micro):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(steps, micro, n * B, 5, dtype=torch.float64, generator=g)
    y = torch.randn(steps, micro, n * B, 3, dtype=torch.float64, generator=g)
    return x, y


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _train_distributed(make_opt, op, passes, steps, clip=None, **kw):
    n, r = hvd.size(), hvd.rank()
    model = Net(seed=5).double()
    model.bn = torch.nn.Identity()
    if callable(kw.get("groups")):  # groups of this model's parameters
        kw["groups"] = kw["groups"](model)
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   op=op, backward_passes_per_step=passes, **kw)
    x, y = _data(n, steps, passes)
    mine = slice(r * B, (r + 1) * B)
    for s in range(steps):
        opt.zero_grad()
        for m in range(passes):
            _loss(model, x[s, m, mine], y[s, m, mine]).backward()
        if clip is None:
            opt.step()
        else:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
    return model


def _train_reference(make_opt, op, passes, steps, clip=None):
    """One process, the concatenated batch: the loss whose gradient the ranks compute."""
    n = hvd.size()
    model = Net(seed=5).double()
    model.bn = torch.nn.Identity()
    opt = make_opt(model)
    x, y = _data(n, steps, passes)
    for s in range(steps):
        opt.zero_grad()
        total = 0
        for m in range(passes):
            for q in range(n):  # each rank's mean loss; Average divides their sum by n
                part = slice(q * B, (q + 1) * B)
                total = total + _loss(model, x[s, m, part], y[s, m, part])
        (total / n if op == hvd.Average else total).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def case_distributed_optimizer_matches_single_process():
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.05)  # noqa: E731
    configs = [
        dict(make_opt=sgd, op=hvd.Average, passes=1),
        dict(make_opt=sgd, op=hvd.Average, passes=2),
        dict(make_opt=sgd, op=hvd.Sum, passes=1),
        dict(make_opt=sgd, op=hvd.Sum, passes=2),
        dict(make_opt=adam, op=hvd.Average, passes=1, gradient_predivide_factor=2.0),
        dict(make_opt=sgd, op=hvd.Average, passes=1, clip=0.05),
        dict(make_opt=sgd, op=hvd.Average, passes=1, threshold="64"),  # a bucket per tensor
        dict(make_opt=sgd, op=hvd.Average, passes=1, threshold="0"),
    ]
    for cfg in configs:
        threshold = cfg.pop("threshold", None)
        if threshold is not None:
            os.environ["MLFABRIC_FUSION_THRESHOLD"] = threshold
        try:
            got = _train_distributed(steps=3, **cfg)
        finally:
            os.environ.pop("MLFABRIC_FUSION_THRESHOLD", None)
        cfg.pop("gradient_predivide_factor", None)
        want = _train_reference(steps=3, **cfg)
        diff = _max_diff(got, want)
        assert diff < 1e-10, f"{cfg} threshold={threshold}: weights differ by {diff}"
        same_everywhere(torch.cat([p.detach().reshape(-1) for p in got.parameters()]), str(cfg))


def case_distributed_optimizer_groups_and_sparse_as_dense():
    """Horovod's groups / num_groups (explicit buckets) give the same weights as single-process
    training, with the buckets asked for; sparse_as_dense=True reduces an embedding's sparse
    gradient (without it: an error on every rank); bad groups fail on every rank."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    want = _train_reference(sgd, hvd.Average, 1, steps=3)
    # parameters in reverse: fc2.bias, fc2.weight, fc1.bias, fc1.weight (unused: no grad hook
    # needed, it still is a parameter of the optimizer)
    model = Net(seed=5).double()
    model.bn = torch.nn.Identity()  # 5 parameters, as _train_distributed's

    def bucket_sizes(**kw):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)
        return [len(b.params) for b in opt._mlf_buckets], opt

    for kw, sizes in ((dict(num_groups=2), [3, 2]), (dict(groups=3), [2, 2, 1]),
                      (dict(groups=1), [5]), (dict(groups=0), [5])):  # 0: the threshold's
        assert bucket_sizes(**kw)[0] == sizes, (kw, bucket_sizes(**kw)[0])
        got = _train_distributed(sgd, hvd.Average, 1, steps=3, **kw)
        diff = _max_diff(got, want)
        assert diff < 1e-10, f"{kw}: weights differ by {diff}"
    for groups in ([[model.fc1.weight, model.fc2.weight]],
                   [[model.fc1.bias], [model.fc2.bias, model.unused]]):
        sizes, opt = bucket_sizes(groups=groups)
        assert sorted(sizes, reverse=True) == [2, 1, 1, 1], (groups, sizes)
        members = [{id(p) for p in b.params} for b in opt._mlf_buckets]
        assert all({id(p) for p in g} in members for g in groups), "a group is one bucket"
    got = _train_distributed(sgd, hvd.Average, 1, steps=3,
                             groups=lambda m: [[m.fc1.bias], [m.fc2.bias, m.fc1.weight]])
    assert _max_diff(got, want) < 1e-10, "explicit groups: weights differ"
    for kw, needle in ((dict(groups=-1), "must be >= 0"), (dict(groups=[[torch.ones(2)]]),
                                                            "not one of the optimizer"),
                       (dict(groups=[[model.fc1.bias], [model.fc1.bias]]),
                        "more than one group"), (dict(num_groups=2, groups=2), "not both")):
        with pytest.raises(ValueError, match=needle):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    # groups that differ between ranks (as many buckets, other members): a MismatchError on
    # every rank (with as many buckets everywhere, the ranks stay in step after it)
    if hvd.size() > 1:
        pair = [model.fc1.weight, model.fc1.bias] if hvd.rank() == 0 else \
            [model.fc2.weight, model.fc2.bias]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       groups=[pair])
        with pytest.raises(hvd.MismatchError):
            _loss(model, *[t[0, 0, :B] for t in _data(1, 1, 1)]).backward()
            opt.step()
        _still_works()
    # sparse gradients: an embedding, against one process on the concatenated batch
    n, r = hvd.size(), hvd.rank()

    def embedder():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Embedding(11, 4, sparse=True),
                                   torch.nn.Linear(4, 1)).double()

    ids = torch.randint(0, 11, (3, n, 5), generator=torch.Generator().manual_seed(1))
    ref = embedder()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for s in range(3):
        ref_opt.zero_grad()
        (sum(ref(ids[s, q]).sum() for q in range(n)) / n).backward()
        ref_opt.step()
    mine = embedder()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.5),
                                   sparse_as_dense=True)
    for s in range(3):
        opt.zero_grad()
        mine(ids[s, r]).sum().backward()
        opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), ref.parameters()))
    assert diff < 1e-12, f"sparse_as_dense: weights differ by {diff}"
    _still_works()


def _sparse(q, size=(9, 3), dtype=torch.float64):
    """Rank q's sparse input: 0, 2 or 4 entries (rank 0 none), duplicates possible."""
    g = torch.Generator().manual_seed(q)
    k = q % 3 * 2
    idx = torch.randint(0, size[0], (1, k), generator=g)
    return torch.sparse_coo_tensor(idx, torch.randn(k, *size[1:], generator=g,
                                                    dtype=torch.float64).to(dtype), size,
                                   check_invariants=True)


def case_sparse_allreduce():
    """sparse_allreduce_async: the sum / average of every rank's sparse tensor (ranks with
    different numbers of entries, none included), coalesced, against the float64 sum of the
    dense forms; ranks whose sizes, dense dimensions or arguments differ fail on every rank."""
    n, r = hvd.size(), hvd.rank()
    dense = torch.stack([_sparse(q).to_dense() for q in range(n)])
    for op, want in ((hvd.Sum, dense.sum(0)), (hvd.Average, dense.sum(0) / n)):
        got = hvd.synchronize(hvd.sparse_allreduce_async(_sparse(r), name="emb", op=op))
        assert got.layout == torch.sparse_coo and got.is_coalesced() and got.shape == (9, 3)
        diff = (got.to_dense() - want).abs().max().item()
        assert diff < 1e-12, f"{op}: differs by {diff}"
    ints = hvd.synchronize(hvd.sparse_allreduce_async(_sparse(r, dtype=torch.int64), op=hvd.Sum))
    assert torch.equal(ints.to_dense(), torch.stack(
        [_sparse(q, dtype=torch.int64).to_dense() for q in range(n)]).sum(0)), "int64 sum"
    if n == 1:
        return
    odd = n - 1
    _expect_mismatch(lambda: hvd.synchronize(hvd.sparse_allreduce_async(
        _sparse(r, (9 + (r == odd), 3)), op=hvd.Sum)), "sparse dimensions' sizes",
        f"[10] on rank(s) [{odd}]")
    _still_works()
    _expect_mismatch(lambda: hvd.synchronize(hvd.sparse_allreduce_async(
        _sparse(r, (9, 3 + (r == odd))), op=hvd.Sum)), "shape of a row")
    _still_works()
    if r == odd:
        with pytest.raises(TypeError, match="sparse COO"):
            hvd.sparse_allreduce_async(torch.ones(9, 3))
    else:
        _expect_mismatch(lambda: hvd.synchronize(hvd.sparse_allreduce_async(_sparse(r))),
                         f"rank(s) [{odd}] rejected")
    _still_works()


class _SparseNet(torch.nn.Module):
    """A dense layer, an embedding with sparse gradients, a dense head: in reverse order the
    embedding's gradient lies between dense ones in one bucket."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.pre = torch.nn.Linear(2, 2)
        self.emb = torch.nn.Embedding(11, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)
        self.double()

    def loss(self, ids, x, use_emb):
        rows = self.emb(ids) if use_emb else x.new_ones(1, 4)
        return self.pre(x).sum() + self.head(rows).sum()


def case_distributed_optimizer_sparse_gradients():
    """Without sparse_as_dense, an embedding's sparse gradient is reduced as a sparse tensor
    (its .grad after the step is sparse) and the dense ones around it in the same bucket as
    usual: the weights of one process on the concatenated batch, op Average and Sum (and with
    fp16 compression of the dense ones, within its tolerance); a rank that skips the embedding
    in a step (no gradient there) still takes part."""
    n, r = hvd.size(), hvd.rank()
    ids = torch.randint(0, 11, (3, n, 5), generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, n, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    uses = lambda s, q: not (s == 1 and q == n - 1 and n > 1)  # noqa: E731
    for op, compression, tol in ((hvd.Average, hvd.Compression.none, 1e-12),
                                 (hvd.Sum, hvd.Compression.none, 1e-12),
                                 (hvd.Average, hvd.Compression.fp16, 1e-3)):
        ref = _SparseNet()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        mine = _SparseNet()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.1),
                                       named_parameters=mine.named_parameters(), op=op,
                                       compression=compression)
        assert len(opt._mlf_buckets) == 1
        for s in range(3):
            ref_opt.zero_grad()
            total = sum(ref.loss(ids[s, q], x[s, q], uses(s, q)) for q in range(n))
            (total / n if op == hvd.Average else total).backward()
            ref_opt.step()
            opt.zero_grad()
            mine.loss(ids[s, r], x[s, r], uses(s, r)).backward()
            opt.step()
            assert mine.emb.weight.grad.layout == torch.sparse_coo, "reduced as sparse"
            diff = (mine.emb.weight.grad.to_dense() - ref.emb.weight.grad.to_dense()).abs().max()
            assert diff < tol, f"{op}, step {s}: the embedding's gradient differs by {diff}"
        diff = max((a - b).abs().max().item() for a, b in zip(mine.parameters(),
                                                               ref.parameters()))
        assert diff < tol, f"{op}, {compression.__name__}: weights differ by {diff}"
        if compression is hvd.Compression.fp16:
            assert diff > 0, "the dense gradients went through float16"
        same_everywhere(torch.cat([p.detach().reshape(-1) for p in mine.parameters()]), op)
    _still_works()


def case_distributed_optimizer_hooks_in_any_order():
    """Ranks whose gradients become ready in different orders still issue the buckets in the
    same order (one bucket per tensor here, so any reordering would pair wrong tensors)."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(11)
    model = torch.nn.ModuleList([torch.nn.Linear(4, 4).double() for _ in range(4)])
    ref = torch.nn.ModuleList([torch.nn.Linear(4, 4).double() for _ in range(4)])
    ref.load_state_dict(model.state_dict())
    opt = _bucket_per_tensor(model.parameters())
    x = torch.randn(n, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    order = list(range(4)) if r % 2 else [2, 0, 3, 1]
    loss = 0
    for i in order:  # the branches' gradients are accumulated in a rank-dependent order
        loss = loss + (model[i](x[r]) ** 2).sum() * (i + 1)
    loss.backward()
    opt.step()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    total = sum((ref[i](x[q]) ** 2).sum() * (i + 1) for q in range(n) for i in range(4))
    (total / n).backward()
    ropt.step()
    assert _max_diff(model, ref) < 1e-10


def case_distributed_optimizer_after_the_first_step():
    """From the first reduction on, of the last bucket's parameters (this whole small model)
    only one keeps a Python hook (the sentinel, for the guards); the others only mark that a
    gradient came. op=Sum, so that a second reduction would show: gradients clipped in place
    between synchronize() and step() are not reduced again; a gradient made afresh after
    synchronize() (p.grad = None, then backward) is, and the sentinel, which that pass did not
    reach, moves to the parameter it did; a step without gradients for the first layer reduces
    zeros there; the guards still hold."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                torch.nn.Linear(7, 3)).double()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   op=hvd.Sum)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(n, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    h = torch.randn(n, 6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    def hooked():  # parameters with a Python hook (a mark is a functools.partial of setattr)
        return [p for p in model.parameters()
                if any(getattr(f, "func", None) is not setattr
                       for f in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())]

    for step in range(4):
        opt.zero_grad()
        ropt.zero_grad(set_to_none=False)  # (ours: zeros where no gradient came, Horovod's rule)
        if step < 3:
            (model(x[r]) ** 2).sum().backward()
            sum((ref(x[q]) ** 2).sum() for q in range(n)).backward()
        else:  # only the last layer: no gradient for the first
            (model[2](h[r]) ** 2).sum().backward()
            sum((ref[2](h[q]) ** 2).sum() for q in range(n)).backward()
        opt.synchronize()
        if step == 1:  # clipped in place, the same on every rank: step() must not reduce again
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        if step == 2:  # a fresh gradient after synchronize(): step() reduces everything again
            model[2].bias.grad = None
            (model[2].bias * (r + 1)).sum().backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p.grad.mul_(n)  # (op=Sum: the sums summed again)
                ref[2].bias.grad.fill_(n * (n + 1) / 2)
        opt.step()
        ropt.step()
        assert _max_diff(model, ref) < 1e-10, f"step {step}: {_max_diff(model, ref)}"
        assert len(hooked()) == 1, f"step {step}: {len(hooked())} parameters hooked"
        # the sentinel: a first-layer parameter (their gradients come last), until step 2's
        # second backward pass reaches only the last layer's bias
        want = list(model[0].parameters()) if step < 2 else [model[2].bias]
        assert any(hooked()[0] is p for p in want), f"step {step}: the sentinel moved wrongly"
    opt.zero_grad()
    model(x[r]).sum().backward()
    with pytest.raises(hvd.MlfabricError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(hvd.MlfabricError, match="backward_passes_per_step"):
        model(x[r]).sum().backward()
    opt.step()
    _still_works()


def case_distributed_optimizer_guards():
    model = Net(seed=3).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    x = torch.randn(6, 5, dtype=torch.float64)
    model(x).sum().backward()
    with pytest.raises(hvd.MlfabricError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(hvd.MlfabricError, match="backward_passes_per_step"):
        model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()  # nothing new since step(): reduces the (absent) gradients as zeros
    opt.synchronize()  # and a second call does nothing
    opt.step()
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("a", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="not in it"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match="do not apply"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="adasum",
                                 num_groups=2)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 backward_passes_per_step=0)
    with pytest.raises(TypeError):
        hvd.DistributedOptimizer(model)
    _still_works()


def case_join_with_distributed_optimizer():
    """Rank r trains r + 1 steps, then joins; the joined ranks add zeros to the average, so at
    step s the gradient is sum over ranks q >= s of their gradients, divided by size()."""
    n, r = hvd.size(), hvd.rank()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    model = Net(seed=9).double()
    model.bn = torch.nn.Identity()
    opt = hvd.DistributedOptimizer(make(model), named_parameters=model.named_parameters())
    x, y = _data(n, n, 1)
    for s in range(r + 1):
        opt.zero_grad()
        part = slice(r * B, (r + 1) * B)
        _loss(model, x[s, 0, part], y[s, 0, part]).backward()
        opt.step()
    last = hvd.join()
    assert last == n - 1
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    ref = Net(seed=9).double()
    ref.bn = torch.nn.Identity()
    ropt = make(ref)
    for s in range(n):
        ropt.zero_grad()
        total = sum(_loss(ref, x[s, 0, slice(q * B, (q + 1) * B)],
                          y[s, 0, slice(q * B, (q + 1) * B)]) for q in range(s, n))
        (total / n).backward()
        _step_with_zeros(ropt, ref.parameters())
    assert _max_diff(model, ref) < 1e-10


def _zero(opt, model, how):
    """Zero the gradients the way a training loop may: through the optimizer (to None or to
    zeros) or through the model, which the optimizer does not see."""
    if how == "model":
        model.zero_grad()
    else:
        opt.zero_grad(set_to_none=how == "none")


def case_distributed_optimizer_gradients_are_bucket_views():
    """The gradients are views of the optimizer's bucket buffers (one storage per bucket), the
    same tensors step after step, reduced there in place; training matches one process on the
    whole batch whatever zeroes them between steps (zero_grad(set_to_none=True / False), which
    keep the views and zero them, model.zero_grad(), which drops them), with 1 or 2 backward passes per step, default or small buckets (the
    first bucket is capped separately), and a clipping step under skip_synchronize()."""
    from mlfabric.torch import ops
    from mlfabric.torch.optimizer import FIRST_BUCKET
    n, r = hvd.size(), hvd.rank()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    zeroings = ("none", "zeros", "model", "none", "model", "zeros")
    # DDP's bucketing: the first bucket of each dtype capped apart from the others.
    ts = [torch.zeros(k, dtype=dt) for k, dt in ((2, torch.float64), (3, torch.float64),
                                                  (1, torch.float32), (4, torch.float64),
                                                  (5, torch.float64), (8, torch.float32))]
    assert ops.fuse(ts, 72, 40) == [[0, 1], [2, 5], [3, 4]]
    assert ops.fuse(ts, 0, 0) == [[i] for i in range(6)]
    for passes in (1, 2):
        for threshold in (None, "200"):
            models = []
            for _ in range(2):
                m = Net(seed=5).double()
                m.bn = torch.nn.Identity()
                m.unused.requires_grad_(False)  # every bucket then fills during backward
                models.append(m)
            model, ref = models
            if threshold is not None:
                os.environ["MLFABRIC_FUSION_THRESHOLD"] = threshold
            try:
                opt = hvd.DistributedOptimizer(make(model), backward_passes_per_step=passes,
                                               named_parameters=model.named_parameters())
            finally:
                os.environ.pop("MLFABRIC_FUSION_THRESHOLD", None)
            ropt = make(ref)
            x, y = _data(n, len(zeroings), passes)
            mine = slice(r * B, (r + 1) * B)
            first = None
            for s, how in enumerate(zeroings):
                _zero(opt, model, how)
                _zero(ropt, ref, how)
                if s and how != "model":  # the optimizer keeps the views, zeroed, even to None
                    assert all(p.grad is v and not v.any() for b in opt._mlf_buckets
                               for p, v in zip(b.params, b.views)), f"step {s}: views not kept"
                for m in range(passes):
                    _loss(model, x[s, m, mine], y[s, m, mine]).backward()
                total = sum(_loss(ref, x[s, m, q * B:(q + 1) * B], y[s, m, q * B:(q + 1) * B])
                            for m in range(passes) for q in range(n))
                (total / n).backward()
                clip = s == len(zeroings) - 1
                if clip:
                    opt.synchronize()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                    with opt.skip_synchronize():
                        opt.step()
                else:
                    opt.step()
                ropt.step()
                grads = [p.grad for p in model.parameters() if p.requires_grad]
                if first is None:
                    first = grads
                what = f"passes {passes}, threshold {threshold}, step {s} ({how})"
                assert all(a is b for a, b in zip(grads, first)), f"{what}: new .grad tensors"
                assert _max_diff(model, ref) < 1e-10, f"{what}: {_max_diff(model, ref)}"
            cap = ops.fusion_threshold() if threshold is None else int(threshold)
            params = [p for p in model.parameters() if p.requires_grad][::-1]
            buckets = ops.fuse(params, cap, min(FIRST_BUCKET, cap))
            assert len(buckets) == (1 if threshold is None else 3)  # 192 B (first), 56, 280
            # each bucket is one flat buffer whose slices, back to back, are the .grad tensors
            assert [b.params for b in opt._mlf_buckets] == [[params[i] for i in m]
                                                             for m in buckets]
            for b in opt._mlf_buckets:
                at = b.flat.data_ptr()
                for p, view in zip(b.params, b.views):
                    assert p.grad is view and p.grad.data_ptr() == at
                    at += p.grad.nbytes
            same_everywhere(torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                            f"passes {passes}, threshold {threshold}")


def case_distributed_optimizer_one_bucket_for_a_small_model():
    """A model whose gradients fit in one bucket (the default 4 MiB) gets one bucket, with no
    1 MiB first bucket apart (optimizer._first_cap); one just over it gets DDP's first bucket,
    then buckets of the threshold. Both reduce to the float64 mean over ranks."""
    n, r = hvd.size(), hvd.rank()
    for count, want in ((4, [4]), (5, [1, 4])):  # parameters of 1 MiB - 64 KiB, float32
        params = [torch.nn.Parameter(torch.zeros((1 << 18) - (1 << 14))) for _ in range(count)]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1.0))
        assert [len(b.params) for b in opt._mlf_buckets] == want, (count, want)
        opt.zero_grad()
        sum(p.sum() * (r + 1 + i) for i, p in enumerate(params)).backward()
        opt.step()
        for i, p in enumerate(params):  # the mean of r + 1 + i over ranks, subtracted once
            expected = -(np.mean([q + 1 + i for q in range(n)]))
            assert torch.all(p.detach().double() == expected), (count, i, p[:3])


def case_distributed_optimizer_parameters_unused_on_some_ranks():
    """A branch that some ranks skip in some steps: those ranks contribute zeros for its
    gradient (Horovod's rule), never what their bucket held from an earlier step, whether the
    gradients were zeroed to None or to zeros; a gradient a rank set by hand before backward
    is accumulated into and reduced like any other, and one replaced after backward receives
    the result."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(21)
    model = torch.nn.ModuleList([torch.nn.Linear(3, 3).double() for _ in range(2)])
    ref = torch.nn.ModuleList([torch.nn.Linear(3, 3).double() for _ in range(2)])
    ref.load_state_dict(model.state_dict())
    opt = _bucket_per_tensor(model.parameters())
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(5, n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    preset = torch.full((3,), 0.25, dtype=torch.float64)  # rank 0's hand-set bias gradient

    def loss(m, s, q):
        uses = s == 0 or (q + s) % 2 == 0  # branch 1 on rank q at step s
        out = (m[0](x[s, q]) ** 2).sum()
        return out + (m[1](x[s, q]) ** 2).sum() * 3 if uses else out

    for s in range(5):
        opt.zero_grad(set_to_none=s % 2 == 0)
        ropt.zero_grad()
        if s == 3 and r == 0:
            model[0].bias.grad = preset.clone()
        loss(model, s, r).backward()
        if s == 4:  # replaced while being reduced: the new tensor still gets the result
            model[0].weight.grad = model[0].weight.grad.clone()
        opt.step()
        (sum(loss(ref, s, q) for q in range(n)) / n).backward()
        if s == 3:
            ref[0].bias.grad += preset / n
        _step_with_zeros(ropt, ref.parameters())
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"


def _bucket_per_tensor(params, **kwargs):
    """DistributedOptimizer over SGD (lr 0.1) with a gradient bucket per tensor (kwargs: more of
    its arguments)."""
    os.environ["MLFABRIC_FUSION_THRESHOLD"] = "0"
    try:
        return hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), **kwargs)
    finally:
        os.environ.pop("MLFABRIC_FUSION_THRESHOLD")


def _branchy(n, seed, **kwargs):
    """Three layers, the last used on some ranks only, its optimizer (kwargs: more of
    DistributedOptimizer's) with a bucket per tensor (six buckets: the branch's two come first,
    the first layer's weight last); a copy as the float64 reference."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleList([torch.nn.Linear(3, 3).double() for _ in range(3)])
    ref = copy.deepcopy(model)
    opt = _bucket_per_tensor(model.parameters(), **kwargs)
    return model, ref, opt


def _step_with_zeros(opt, params):
    """Step the reference optimizer, parameters that no rank's loss used counting zeros (Horovod
    reduces zeros for them)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()


def _branchy_loss(m, x, uses):
    out = (m[1](m[0](x)) ** 2).sum()
    return out + (m[2](x) ** 2).sum() * 3 if uses else out


def case_distributed_optimizer_calls_between_backward_and_step_on_rank_dependent_graphs():
    """A branch that some ranks take and others skip (so the hooks start its buckets in
    backward on some ranks only), then other collectives before step(): a metric's allreduce,
    a broadcast, a blocking allgather. Every rank issues the same buckets before them, so the
    calls meet their peers' and the weights match single-process training on every rank's
    loss, the skipping ranks contributing zeros (Horovod's rule), over several steps."""
    n, r = hvd.size(), hvd.rank()
    model, ref, opt = _branchy(n, 23)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def uses(s, q):
        return (q + s) % 2 == 0 or n == 1

    for s in range(4):
        opt.zero_grad()
        ropt.zero_grad()
        loss = _branchy_loss(model, x[s, r], uses(s, r))
        loss.backward()
        mean = hvd.allreduce(loss.detach(), name="metric")  # a call between backward and step
        want = sum(_branchy_loss(ref, x[s, q], uses(s, q)).item() for q in range(n)) / n
        assert abs(mean.item() - want) < 1e-10 * max(1.0, abs(want)), (s, mean.item(), want)
        if s >= 2:
            flag = hvd.broadcast(torch.tensor([float(s)]), root_rank=n - 1, name="flag")
            assert flag.item() == s
            rows = hvd.allgather(torch.full((1, 2), float(r)))
            assert rows[:, 0].tolist() == [float(q) for q in range(n)]
        opt.step()
        (sum(_branchy_loss(ref, x[s, q], uses(s, q)) for q in range(n)) / n).backward()
        _step_with_zeros(ropt, ref.parameters())
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"


def case_distributed_optimizer_second_optimizer_after_a_rank_dependent_graph():
    """Two optimizers (a GAN's generator and discriminator, say), each its own backward: the
    first's with a branch every rank skips in some steps (its buckets wait on every rank),
    the second's with a branch some ranks skip, then both steps. The first's waiting buckets
    start after all of the second's but its last, on every rank alike (whichever of the
    second's its hooks started), so both match single-process training."""
    n, r = hvd.size(), hvd.rank()
    gen, gref, gopt = _branchy(n, 37)
    model, ref, opt = _branchy(n, 41)
    ropt = torch.optim.SGD(list(ref.parameters()) + list(gref.parameters()), lr=0.1)
    x = torch.randn(3, n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    for s in range(3):
        opt.zero_grad()
        gopt.zero_grad()
        ropt.zero_grad()
        _branchy_loss(gen, x[s, r], s % 2 == 0).backward()
        _branchy_loss(model, x[s, r], (r + s) % 2 == 0 or n == 1).backward()
        opt.step()
        gopt.step()
        total = sum(_branchy_loss(gref, x[s, q], s % 2 == 0) +
                    _branchy_loss(ref, x[s, q], (q + s) % 2 == 0 or n == 1) for q in range(n))
        (total / n).backward()
        _step_with_zeros(ropt, [*ref.parameters(), *gref.parameters()])
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"
        assert _max_diff(gen, gref) < 1e-10, f"step {s}: {_max_diff(gen, gref)}"


def case_distributed_optimizer_rank_dependent_backward_then_another_optimizers():
    """Two optimizers, each its own backward: the first's with a branch some ranks skip (its
    hooks start its buckets on some ranks only), then the second's, the same on every rank
    (its hooks start its buckets during that backward), then both steps. The second's first
    bucket starts the first's waiting ones on every rank, so neither pairs its buckets with
    the other's (same shapes here: that would go unnoticed) and both match single-process
    training."""
    n, r = hvd.size(), hvd.rank()
    model, ref, opt = _branchy(n, 67)
    other, oref, oopt = _branchy(n, 71)
    ropt = torch.optim.SGD([*ref.parameters(), *oref.parameters()], lr=0.1)
    x = torch.randn(3, n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    for s in range(3):
        opt.zero_grad()
        oopt.zero_grad()
        ropt.zero_grad()
        _branchy_loss(model, x[s, r], (r + s) % 2 == 0 or n == 1).backward()
        _branchy_loss(other, x[s, r], True).backward()
        opt.step()
        oopt.step()
        total = sum(_branchy_loss(ref, x[s, q], (q + s) % 2 == 0 or n == 1) +
                    _branchy_loss(oref, x[s, q], True) for q in range(n))
        (total / n).backward()
        _step_with_zeros(ropt, [*ref.parameters(), *oref.parameters()])
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"
        assert _max_diff(other, oref) < 1e-10, f"step {s}: {_max_diff(other, oref)}"


def case_distributed_optimizer_gradients_only_in_its_last_bucket_on_some_ranks():
    """Explicit groups (the first layer's two tensors the last bucket), after a first step:
    one rank's loss reaches only one tensor of the last bucket, the others' all but the second
    layer's bias (so their hooks start nothing either, or some buckets), then a metric's
    allreduce and step(): the same buckets are issued everywhere and the weights match
    single-process training."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(73)
    a, b = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double()
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1),
                                   groups=[[a.weight, a.bias]])
    ropt = torch.optim.SGD([*ra.parameters(), *rb.parameters()], lr=0.1)
    x = torch.randn(n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(13))

    def loss(la, lb, s, q):
        if s == 0:
            return (lb(la(x[q])) ** 2).sum()
        if q == n - 1 and n > 1:
            return (la.bias ** 2).sum()  # the last bucket's second tensor only
        return ((la(x[q]) @ lb.weight.T) ** 2).sum()  # no gradient for b.bias

    for s in range(3):
        opt.zero_grad()
        ropt.zero_grad()
        mine = loss(a, b, s, r)
        mine.backward()
        hvd.allreduce(mine.detach(), name="metric")
        opt.step()
        (sum(loss(ra, rb, s, q) for q in range(n)) / n).backward()
        _step_with_zeros(ropt, [*ra.parameters(), *rb.parameters()])
        got = torch.cat([p.detach().reshape(-1) for p in [*a.parameters(), *b.parameters()]])
        want = torch.cat([p.detach().reshape(-1) for p in [*ra.parameters(), *rb.parameters()]])
        assert (got - want).abs().max().item() < 1e-10, f"step {s}"


def case_distributed_optimizer_one_backward_two_optimizers_rank_dependent():
    """One backward through a model with a branch some ranks skip (its optimizer has buckets
    per tensor) and a critic whose optimizer is one bucket, the critic stepped first: the
    model's waiting buckets start before the critic's bucket on every rank, so both match
    single-process training."""
    n, r = hvd.size(), hvd.rank()
    model, ref, opt = _branchy(n, 43)
    torch.manual_seed(47)
    critic = torch.nn.Linear(3, 1).double()
    cref = copy.deepcopy(critic)
    copt = hvd.DistributedOptimizer(torch.optim.SGD(critic.parameters(), lr=0.1))
    assert len(copt._mlf_buckets) == 1
    ropt = torch.optim.SGD([*ref.parameters(), *cref.parameters()], lr=0.1)
    x = torch.randn(3, n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def loss(m, c, s, q):
        return _branchy_loss(m, x[s, q], (q + s) % 2 == 0 or n == 1) + c(x[s, q]).sum() ** 2

    for s in range(3):
        opt.zero_grad()
        copt.zero_grad()
        ropt.zero_grad()
        loss(model, critic, s, r).backward()
        copt.step()
        opt.step()
        (sum(loss(ref, cref, s, q) for q in range(n)) / n).backward()
        _step_with_zeros(ropt, ref.parameters())
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"
        assert _max_diff(critic, cref) < 1e-10, f"step {s}: {_max_diff(critic, cref)}"


def case_distributed_optimizer_metric_calls_between_accumulated_passes():
    """backward_passes_per_step=2 with a metric's allreduce after each backward pass (as a
    gradient-accumulation loop logs its loss): the first pass's call does not start the
    buckets (the accumulation is not done), so the weights match single-process training on
    both passes of every rank, with the branch taken on some ranks only."""
    n, r = hvd.size(), hvd.rank()
    model, ref, opt = _branchy(n, 29, backward_passes_per_step=2)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(3, 2, n, 2, 3, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(8))
    for s in range(3):
        opt.zero_grad()
        ropt.zero_grad()
        for k in range(2):
            loss = _branchy_loss(model, x[s, k, r], r % 2 == k % 2)
            loss.backward()
            hvd.allreduce(loss.detach(), name=f"metric.{k}")
        opt.step()
        total = sum(_branchy_loss(ref, x[s, k, q], q % 2 == k % 2)
                    for q in range(n) for k in range(2))
        (total / n).backward()
        _step_with_zeros(ropt, ref.parameters())
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"


def case_distributed_optimizer_reentrant_checkpoints_beside_sync_batch_norm():
    """Reentrant checkpoints (each segment's backward a graph task nested in the outer one): a
    first layer, a segment ending in SyncBatchNorm, a segment with nothing after it (so the
    outer pass brings this optimizer no gradient of its own between the two nested ones), a
    bucket per tensor. SyncBatchNorm's backward call comes inside the optimizer's backward
    pass, the second segment is not a pass of its own, so no bucket starts early; with two
    passes a step and a metric's allreduce after each, the first pass's does not start them
    either. The weights match single-process training with BatchNorm on the concatenated batch
    (float64, 1e-10)."""
    from torch.utils.checkpoint import checkpoint
    n, r = hvd.size(), hvd.rank()
    for passes in (1, 2):
        torch.manual_seed(83)
        ls = [torch.nn.Linear(4, 4).double() for _ in range(4)]
        model = torch.nn.ModuleList([*ls[:2], hvd.SyncBatchNorm(4).double(), *ls[2:]])
        ref = copy.deepcopy(torch.nn.ModuleList([*ls[:2], torch.nn.BatchNorm1d(4).double(),
                                                 *ls[2:]]))
        opt = _bucket_per_tensor(model.parameters(), backward_passes_per_step=passes)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = torch.randn(3, passes, n, 5, 4, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(15))

        def forward(m, inp, ck):
            h = ck(lambda t: torch.relu(m[2](m[1](t))), m[0](inp))
            return ck(lambda t: m[4](torch.relu(m[3](t))), h)

        for s in range(3):
            opt.zero_grad()
            for k in range(passes):
                loss = forward(model, x[s, k, r],
                               lambda f, t: checkpoint(f, t, use_reentrant=True)).pow(2).mean()
                loss.backward()
                hvd.allreduce(loss.detach(), name="metric")
            opt.step()
            ropt.zero_grad()
            sum(forward(ref, x[s, k].reshape(-1, 4), lambda f, t: f(t)).pow(2).mean()
                for k in range(passes)).backward()
            ropt.step()
            assert _max_diff(model, ref) < 1e-10, f"passes {passes}, step {s}"


def case_distributed_optimizer_accumulated_passes_reaching_different_layers():
    """backward_passes_per_step=2 where one rank's passes each reach one layer (no parameter
    gets both its passes there) and the others' reach both, then a metric's allreduce before
    step(): counting passes, not parameters through theirs, every rank starts the same buckets
    before the metric; the weights match single-process training (float64, 1e-10)."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(89)
    a, b = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double()
    model = torch.nn.ModuleList([a, b])
    ref = copy.deepcopy(model)
    opt = _bucket_per_tensor(model.parameters(), backward_passes_per_step=2)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(2, n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(16))

    def losses(m, s, q):
        if q == n - 1 and n > 1:  # one layer a pass
            return [(m[1](x[s, q]) ** 2).sum(), (m[0](x[s, q]) ** 2).sum()]
        return [(m[1](m[0](x[s, q])) ** 2).sum() for _ in range(2)]

    for s in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        for loss in losses(model, s, r):
            loss.backward()
        hvd.allreduce(torch.ones(1), name="metric")
        opt.step()
        (sum(sum(losses(ref, s, q)) for q in range(n)) / n).backward()
        ropt.step()
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"


def case_distributed_optimizer_gradient_after_a_call_that_started_its_bucket():
    """Two backward passes for one step (backward_passes_per_step=1) with a collective call
    between them: the call starts the buckets the first pass left unstarted, so a gradient the
    second pass brings to one of them could not be reduced: a clear error on every rank (the
    same graph everywhere here), and the optimizer is usable again after synchronize()."""
    n, r = hvd.size(), hvd.rank()
    model, ref, opt = _branchy(n, 31)
    x = torch.randn(n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    opt.zero_grad()
    (model[1](model[0](x[r])) ** 2).sum().backward()  # the branch's buckets wait
    hvd.allreduce(torch.ones(1), name="between")
    with pytest.raises(hvd.MlfabricError, match="came after its bucket's reduction had started"):
        (model[2](x[r]) ** 2).sum().backward()
    opt.synchronize()  # the started buckets finish; the optimizer starts afresh
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.zero_grad()
    ropt.zero_grad()
    _branchy_loss(model, x[r], True).backward()
    hvd.allreduce(torch.ones(1), name="after")
    opt.step()
    (sum(_branchy_loss(ref, x[q], True) for q in range(n)) / n).backward()
    ropt.step()
    assert _max_diff(model, ref) < 1e-10


def _two_layers(seed, out):
    """(model 3 -> 4 -> out in float64, its copy, a DistributedOptimizer over SGD for the
    model, SGD for the copy)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, out)).double()
    ref = copy.deepcopy(model)
    return (model, ref, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
            torch.optim.SGD(ref.parameters(), lr=0.1))


def case_distributed_optimizer_set_backward_passes_per_step():
    """Horovod's set_backward_passes_per_step: from 1 to 2 passes between steps, the weights
    match single-process training on every pass of every rank; called after a backward pass it
    is refused; ranks that set different counts fail at the next reduction with a
    MismatchError on every rank, and train on once they agree again."""
    n, r = hvd.size(), hvd.rank()
    model, ref, opt, ropt = _two_layers(53, 2)
    x = torch.randn(3, 2, n, 2, 3, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(10))
    for s, passes in enumerate((1, 2, 2)):
        if s == 1:
            with pytest.raises(ValueError, match="integer >= 1"):
                opt.set_backward_passes_per_step(0)
            opt.set_backward_passes_per_step(2)
        opt.zero_grad()
        ropt.zero_grad()
        for k in range(passes):
            (model(x[s, k, r]) ** 2).sum().backward()
            if k == 0 and passes == 2:
                with pytest.raises(hvd.MlfabricError, match="after backward passes"):
                    opt.set_backward_passes_per_step(1)
        opt.step()
        (sum((ref(x[s, k, q]) ** 2).sum() for q in range(n) for k in range(passes)) /
         n).backward()
        ropt.step()
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"
    if n == 1:
        return
    opt.set_backward_passes_per_step(1 if r == 0 else 2)
    opt.zero_grad()
    (model(x[0, 0, r]) ** 2).sum().backward()
    with pytest.raises(hvd.MismatchError, match="backward_passes_per_step"):
        opt.step()
    opt.set_backward_passes_per_step(1)
    opt.zero_grad()
    (model(x[0, 0, r]) ** 2).sum().backward()
    opt.step()
    same_everywhere(torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                    "after the counts agree again")


def case_distributed_optimizer_refuses_parameters_it_does_not_reduce():
    """A layer frozen when the optimizer was built and unfrozen since (fine-tuning), or a
    parameter group added later: their gradients are not in the buckets, so step() refuses
    them (on every rank, naming them) rather than letting each rank step on its own gradient;
    a frozen layer that stays frozen steps as usual."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(59)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    model[0].requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    (model(x[r]) ** 2).sum().backward()
    opt.step()  # frozen: nothing to reduce, nothing refused
    assert torch.equal(model[0].weight, before)
    model[0].requires_grad_(True)
    opt.zero_grad()
    (model(x[r]) ** 2).sum().backward()
    with pytest.raises(hvd.MlfabricError, match=r"2 parameter\(s\) \(0.weight, 0.bias\)"):
        opt.step()
    assert torch.equal(model[0].weight, before)  # not stepped on a local gradient
    extra = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    model[0].requires_grad_(False)
    model[0].zero_grad(set_to_none=True)
    opt.add_param_group({"params": [extra]})
    opt.zero_grad()
    ((model(x[r]) ** 2).sum() + (extra * r).sum()).backward()
    with pytest.raises(hvd.MlfabricError, match=r"shape \(2,\).*add_param_group"):
        opt.step()


def case_distributed_optimizer_with_grad_scaler():
    """Horovod's mixed-precision recipe: scaler.scale(loss).backward(); synchronize();
    scaler.unscale_(opt); clip; with skip_synchronize(): scaler.step(opt); scaler.update(). A
    step where one rank's gradient overflows (an inf input there) is skipped on every rank
    alike (the reduced gradients are the same everywhere) and the scale backs off everywhere;
    the other steps match single-process training (float64, 1e-10)."""
    n, r = hvd.size(), hvd.rank()
    model, ref, opt, ropt = _two_layers(79, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x = torch.randn(4, n, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    x[2, n - 1, 0, 0] = float("inf")  # step 2 overflows on the last rank only
    for s in range(4):
        opt.zero_grad()
        scaler.scale((model(x[s, r]) ** 2).sum()).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0 ** 10 * (0.5 if s >= 2 else 1.0), (s, scaler.get_scale())
        if s != 2:  # the reference skips the overflowing step too
            ropt.zero_grad()
            (sum((ref(x[s, q]) ** 2).sum() for q in range(n)) / n).backward()
            ropt.step()
        assert _max_diff(model, ref) < 1e-10, f"step {s}: {_max_diff(model, ref)}"


def case_distributed_optimizer_fp16_over_steps():
    """Compression.fp16 through the buckets' float16 buffers, several steps, two backward
    passes, small buckets, gradients zeroed to None and to zeros: each step's reduced gradient
    is within the documented bound of the float64 average over ranks."""
    n, r = hvd.size(), hvd.rank()
    model = Net(seed=6).double()
    model.bn = torch.nn.Identity()
    os.environ["MLFABRIC_FUSION_THRESHOLD"] = "100"
    try:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       compression=hvd.Compression.fp16,
                                       backward_passes_per_step=2)
    finally:
        os.environ.pop("MLFABRIC_FUSION_THRESHOLD")
    x, y = _data(n, 3, 2)
    for s in range(3):
        opt.zero_grad(set_to_none=s != 1)
        local = []
        for q in range(n):  # every rank's local gradient at the current weights, in float64
            ref = Net(seed=6).double()
            ref.bn = torch.nn.Identity()
            ref.load_state_dict(model.state_dict())
            for m in range(2):
                _loss(ref, x[s, m, q * B:(q + 1) * B], y[s, m, q * B:(q + 1) * B]).backward()
            local.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                          for p in ref.parameters()])
        for m in range(2):
            _loss(model, x[s, m, r * B:(r + 1) * B], y[s, m, r * B:(r + 1) * B]).backward()
        opt.synchronize()
        for i, p in enumerate(model.parameters()):
            grads = torch.stack([g[i] for g in local])
            tol = (n + 2) * 2.0 ** -11 * grads.abs().sum(0) / n + 2.0 ** -24
            err = (p.grad - grads.mean(0)).abs()
            assert (err <= tol).all(), f"step {s}, parameter {i}: {err.max()} > bound"
        same_everywhere(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), f"{s}")
        with opt.skip_synchronize():
            opt.step()


# --- fp16 compression -----------------------------------------------------------------------------

def case_fp16_compression_within_documented_tolerance():
    n, r = hvd.size(), hvd.rank()
    stack = np.stack([values(q, 4099, "float32", "sum") for q in range(n)])
    x = torch.from_numpy(stack[r].astype(np.float32))
    bound = (n + 2) * 2.0 ** -11 * np.abs(stack).sum(0) + 2.0 ** -24
    for op, want, div in ((hvd.Sum, stack.sum(0), 1), (hvd.Average, stack.mean(0), n)):
        got = hvd.allreduce(x, op=op, compression=hvd.Compression.fp16)
        assert got.dtype == torch.float32
        err = np.abs(got.double().numpy() - want)
        assert (err <= bound / div).all(), f"fp16 {op}: worst {err.max()} vs {bound.max() / div}"
        assert err.max() > 0  # really went through float16
    # DistributedOptimizer with fp16 gradients: the reduced gradient is within the same bound.
    model = Net(seed=4)
    model.bn = torch.nn.Identity()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   compression=hvd.Compression.fp16)
    xb, yb = (t.float() for t in _data(n, 1, 1))
    local = []
    for q in range(n):  # every rank's local gradient, recomputed here in float64
        ref = Net(seed=4).double()
        ref.bn = torch.nn.Identity()
        _loss(ref, xb[0, 0, q * B:(q + 1) * B].double(),
              yb[0, 0, q * B:(q + 1) * B].double()).backward()
        local.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                      for p in ref.parameters()])
    _loss(model, xb[0, 0, r * B:(r + 1) * B], yb[0, 0, r * B:(r + 1) * B]).backward()
    opt.synchronize()
    for i, p in enumerate(model.parameters()):
        grads = torch.stack([g[i] for g in local])
        tol = (n + 2) * 2.0 ** -11 * grads.abs().sum(0) / n + 2e-6 * grads.abs().max() + 1e-7
        assert ((p.grad.double() - grads.mean(0)).abs() <= tol).all(), f"parameter {i}"
    with opt.skip_synchronize():
        opt.step()


def case_shutdown_and_init_again():
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(hvd.NotInitializedError):
        hvd.allreduce(torch.ones(2))
    hvd.init()
    _still_works()


def case_compression_objects():
    from mlfabric.torch.compression import Compression
    x = torch.linspace(-3, 3, 11, dtype=torch.float64)
    c, ctx = Compression.fp16.compress(x)
    assert c.dtype == torch.float16 and ctx == torch.float64
    back = Compression.fp16.decompress(c, ctx)
    assert back.dtype == torch.float64 and (back - x).abs().max() <= 2.0 ** -11 * 3
    i = torch.arange(5)
    assert Compression.fp16.compress(i)[0] is i
    assert Compression.none.compress(x)[0] is x and Compression.none.decompress(x, None) is x


def case_core_alltoall_numpy():
    """mlfabric.alltoall itself (the collective mlfabric.torch's alltoall runs on), on numpy."""
    import mlfabric as mf
    n, r = mf.size(), mf.rank()
    splits = [(r + j) % 2 + 1 for j in range(n)]
    x = np.arange(sum(splits) * 3, dtype=np.float32).reshape(-1, 3) + 1000 * r
    out, received = mf.alltoall(x, splits)
    want = []
    for q in range(n):
        sq = [(q + j) % 2 + 1 for j in range(n)]
        xq = np.arange(sum(sq) * 3, dtype=np.float32).reshape(-1, 3) + 1000 * q
        want.append(xq[sum(sq[:r]):sum(sq[:r + 1])])
    assert received.tolist() == [(q + r) % 2 + 1 for q in range(n)]
    np.testing.assert_array_equal(out, np.concatenate(want))
    out, received = mf.alltoall_async(np.full((n, 2), r, np.int64)).wait()
    np.testing.assert_array_equal(out, np.repeat(np.arange(n), 2).reshape(n, 2))
    if n > 1:
        with pytest.raises(mf.MismatchError, match="one row"):
            mf.alltoall(np.ones((n, 2 + (r == n - 1))))
    with pytest.raises(ValueError, match="at least one dimension"):
        mf.alltoall(np.array(1.0))


def case_sparse_tensors_refused_on_every_rank():
    """A sparse tensor in a grouped list (found by the one-pass scan: data_ptr() raises for
    it) is named on its rank; the others fail at the same call; the next call works."""
    n, r = hvd.size(), hvd.rank()
    ts = [torch.ones(3), torch.ones(2, 2), torch.ones(4)]
    if r == 0:
        ts[1] = ts[1].to_sparse()
        with pytest.raises(TypeError, match=r"tensors\[1\] has layout torch.sparse_coo; only dense"):
            hvd.grouped_allreduce(ts, op=hvd.Sum)
    elif n > 1:
        with pytest.raises(hvd.MismatchError, match=r"rank\(s\) \[0\] rejected their arguments"):
            hvd.grouped_allreduce(ts, op=hvd.Sum)
    outs = hvd.grouped_allreduce([torch.ones(3), torch.ones(2, 2)], op=hvd.Sum)
    assert [o.tolist() for o in outs] == [[n] * 3, [[n, n], [n, n]]]


def _partial_model(rank, seed=5):
    """A shared trunk and a head local to `rank`, whose width differs between ranks."""
    g = torch.Generator().manual_seed(seed)
    trunk = torch.nn.Linear(4, 6).double()
    head = torch.nn.Linear(6, 2 + rank % 2).double()
    with torch.no_grad():
        for p in trunk.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        g2 = torch.Generator().manual_seed(seed + 100 + rank)
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g2, dtype=torch.float64))
    return torch.nn.Sequential(trunk, torch.nn.Tanh(), head)


def _partial_batch(rank, step, passes):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + passes)
    return torch.randn(3 + rank, 4, generator=g, dtype=torch.float64)


def case_partial_distributed_optimizer_keeps_local_layers_local():
    """PartialDistributedOptimizer(local_layers=[head]): the trunk's gradients are averaged,
    each rank's head (of a different width on odd ranks) steps on its own gradient; against
    a float64 simulation of every rank in one process, to 1e-10, over SGD with momentum and
    two backward passes a step. A bad local_layers on one rank fails everywhere."""
    n, r = hvd.size(), hvd.rank()
    loss = lambda m, x: (m(x) ** 2).sum()  # noqa: E731
    model = _partial_model(r)
    opt = hvd.PartialDistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), backward_passes_per_step=2,
        local_layers=[model[2]])
    refs = [_partial_model(k) for k in range(n)]
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in refs]
    for step in range(3):
        opt.zero_grad()
        for k in range(2):
            loss(model, _partial_batch(r, step, k)).backward()
        opt.step()
        for rank, (m, o) in enumerate(zip(refs, ref_opts)):
            o.zero_grad()
            for k in range(2):
                loss(m, _partial_batch(rank, step, k)).backward()
        for i, _ in enumerate(refs[0][0].parameters()):  # the trunk: averaged over the ranks
            mean = sum(list(m[0].parameters())[i].grad for m in refs) / n
            for m in refs:
                list(m[0].parameters())[i].grad = mean.clone()
        for o in ref_opts:
            o.step()
    diff = _max_diff(model, refs[r])
    assert diff < 1e-10, f"weights differ from the float64 simulation by {diff}"
    trunk = torch.cat([p.detach().reshape(-1) for p in model[0].parameters()])
    same_everywhere(trunk, "the trunk")
    bad = {"local_layers": [model[2].weight] if r == 0 else [model[2]]}
    if r == 0:
        with pytest.raises(TypeError, match="local_layers must be a list of torch.nn.Module"):
            hvd.PartialDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **bad)
    elif n > 1:
        with pytest.raises(hvd.MismatchError, match=r"rank\(s\) \[0\] refused their"):
            hvd.PartialDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **bad)
    _still_works()


def case_distributed_optimizer_bad_arguments_on_one_rank_fail_everywhere():
    """Arguments refused on one rank only (an unsupported op; a parameter of an unsupported
    dtype) are that rank's error and a MismatchError naming it on the others, at construction;
    then everything works."""
    n, r = hvd.size(), hvd.rank()
    model = Net(seed=3).double()
    for bad in ("op", "dtype"):
        kw, params = {}, list(model.parameters())
        if r == 0 and bad == "op":
            kw["op"] = hvd.Max
        if r == 0 and bad == "dtype":
            params = params + [torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))]
        if r == 0:
            with pytest.raises((ValueError, TypeError),
                               match="op Average, Sum or Adasum|complex64"):
                hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), **kw)
        elif n > 1:
            with pytest.raises(hvd.MismatchError, match=r"rank\(s\) \[0\] refused their"):
                hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), **kw)
    _still_works()
