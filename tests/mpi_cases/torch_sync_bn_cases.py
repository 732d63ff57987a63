"""Multi-rank cases for mlfabric.torch's SyncBatchNorm (Horovod's hvd.SyncBatchNorm), each
against a float64 reference computed in one process: every rank regenerates every rank's batch,
so the reference is torch.nn.BatchNorm1d/2d on the concatenated batch. Forward output, input
gradient, the local weight/bias gradients (and their sum over ranks), running statistics after
several steps; uneven, empty and single-row batches; eval mode without communication; errors
on every rank for mismatched layers; a rank inside join(); DistributedOptimizer training against
single-process training."""
import os
import time
import zlib
from unittest import mock

import numpy as np
import pytest
import torch

import mlfabric.torch as hvd
from mlfabric.torch import ops
from mlfabric.torch.sync_batch_norm import SyncBatchNorm

from .common import same_everywhere

C = 3
TAILS = ((), (4,), (3, 2))  # (N, C), (N, C, L), (N, C, H, W)
# per-channel offset and scale of the inputs: a mean several standard deviations from 0
LOC = np.array([3.0, -2.0, 0.5])
SCALE = np.array([1.0, 0.5, 2.0])
RTOL = {"float64": 2e-13, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}
# At one rank the layer is torch's own batch norm, whose float32 CPU kernel is less exact
# (mean and variance in float32): measured 1.5e-6 relative on these inputs.
TORCH_RTOL = {"float32": 1e-5}


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _rounded(a, dtype):
    """a as dtype holds it, in float64 (what both the ranks and the reference compute on)."""
    return torch.from_numpy(np.asarray(a, np.float64)).to(getattr(torch, dtype)).double().numpy()


def _batch(q, rows, tail, dtype, key, offset=0.0):
    """Rank q's input (rows, C, *tail) and the weights of its loss sum(y * g)."""
    shape = (rows, C, *tail)
    bshape = (1, C) + (1,) * len(tail)
    x = _rng("x", q, key).normal(0, 1, shape) * SCALE.reshape(bshape) + LOC.reshape(bshape)
    x += offset
    g = _rng("g", q, key).normal(0, 1, shape)
    return _rounded(x, dtype), _rounded(g, dtype)


def close(got, want, dtype, what):
    got = got.detach().to(torch.float64).numpy() if isinstance(got, torch.Tensor) else got
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if not want.size:
        return
    rtol = TORCH_RTOL.get(dtype, RTOL[dtype]) if hvd.size() == 1 else RTOL[dtype]
    tol = rtol * (np.abs(want).max() + 1.0)
    err = np.abs(got - want).max()
    assert err <= tol, f"{what}: off by {err} (tolerance {tol})"


def _reference_bn(tail, **kw):
    cls = {2: torch.nn.BatchNorm2d, 3: torch.nn.BatchNorm3d}.get(len(tail), torch.nn.BatchNorm1d)
    return cls(C, **kw).double()


def _dims(tail):
    return [0] + [2 + i for i in range(len(tail))]


def _train_and_check(dtype, tail, rows_of, momentum=0.1, affine=True, track=True, steps=3,
                     salt=0, joined=False, offset=0.0):
    """steps training steps of SyncBatchNorm, rank r on rows_of(r) rows, each checked against
    torch's BatchNorm in float64 on the concatenated batch. Returns (module, reference).
    joined: some rank is inside hvd.join() (so no MPI call outside mlfabric)."""
    n, r = hvd.size(), hvd.rank()
    tdt = getattr(torch, dtype)
    what = f"{dtype} {(None, C, *tail)} momentum={momentum} affine={affine} track={track}"
    kw = dict(momentum=momentum, affine=affine, track_running_stats=track)
    m = SyncBatchNorm(C, **kw).to(tdt)
    ref = _reference_bn(tail, **kw)
    if affine:
        w = _rounded(_rng("w", salt).uniform(0.5, 2.0, C), dtype)
        b = _rounded(_rng("b", salt).normal(0, 1, C), dtype)
        with torch.no_grad():
            for p, v in ((m.weight, w), (m.bias, b), (ref.weight, w), (ref.bias, b)):
                p.copy_(torch.from_numpy(v))
    lo = sum(rows_of(q) for q in range(r))
    mine = slice(lo, lo + rows_of(r))
    dims = _dims(tail)
    for s in range(steps):
        at = f"{what} step {s}"
        batches = [_batch(q, rows_of(q), tail, dtype, (salt, s), offset) for q in range(n)]
        X = torch.from_numpy(np.concatenate([bx for bx, _ in batches])).requires_grad_(True)
        G = torch.from_numpy(np.concatenate([bg for _, bg in batches]))
        Y = ref(X)
        (Y * G).sum().backward()
        x = torch.from_numpy(batches[r][0]).to(tdt).requires_grad_(True)
        y = m(x)
        (y * torch.from_numpy(batches[r][1]).to(tdt)).sum().backward()
        assert y.dtype == tdt and x.grad.dtype == tdt, at
        close(y, Y[mine], dtype, f"{at}: output")
        close(x.grad, X.grad[mine], dtype, f"{at}: input gradient")
        if affine:
            # Horovod's contract: each rank's weight/bias gradient is its own rows' part of the
            # gradient of the sum of the ranks' losses; summed over ranks, torch's gradient.
            Xd = X.detach()
            if Xd.numel():
                mean = Xd.mean(dims, keepdim=True)
                var = Xd.var(dims, unbiased=False, keepdim=True)
                xhat = (Xd - mean) / torch.sqrt(var + m.eps)
            else:
                xhat = Xd
            close(m.weight.grad, (G * xhat)[mine].sum(dims), dtype, f"{at}: local weight grad")
            close(m.bias.grad, G[mine].sum(dims), dtype, f"{at}: local bias grad")
            close(hvd.allreduce(m.weight.grad, op=hvd.Sum), ref.weight.grad, dtype,
                  f"{at}: weight grad summed over ranks")
            close(hvd.allreduce(m.bias.grad, op=hvd.Sum), ref.bias.grad, dtype,
                  f"{at}: bias grad summed over ranks")
            for p in (m.weight, m.bias, ref.weight, ref.bias):
                p.grad = None
        if track:
            close(m.running_mean, ref.running_mean, dtype, f"{at}: running_mean")
            close(m.running_var, ref.running_var, dtype, f"{at}: running_var")
            assert m.num_batches_tracked.item() == ref.num_batches_tracked.item() == s + 1, at
            if not joined:
                same_everywhere(torch.cat([m.running_mean, m.running_var]),
                                f"{at}: running stats")
        else:
            assert m.running_mean is None and m.num_batches_tracked is None, at
    return m, ref


def _uneven(q):
    return 3 + 2 * q


def _still_works():
    n = hvd.size()
    assert hvd.allreduce(torch.ones(5), op=hvd.Sum).tolist() == [n] * 5
    _train_and_check("float64", (), _uneven, steps=1, salt=99)


# --- before init ----------------------------------------------------------------------------------

def case_eval_before_init_and_training_needs_init():
    try:
        assert not hvd.is_initialized()
        # exported as hvd.SyncBatchNorm (Horovod's name) once mlfabric.torch imports it
        assert getattr(hvd, "SyncBatchNorm", SyncBatchNorm) is SyncBatchNorm
        m = SyncBatchNorm(C)
        assert isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        # the same state as torch's batch norm: a state_dict loads either way
        assert list(m.state_dict()) == list(torch.nn.BatchNorm2d(C).state_dict())
        m.eval()
        x = torch.randn(4, C, 2)
        assert torch.equal(m(x), torch.nn.BatchNorm1d(C).eval()(x))
        m.train()
        with pytest.raises(hvd.NotInitializedError, match=r"call mlfabric.torch.init\(\) first"):
            m(x)
        assert m.num_batches_tracked.item() == 0
    finally:
        hvd.init()  # the other cases run whatever happened here


# --- training: against torch on the concatenated batch --------------------------------------------

def case_training_matches_batch_norm_on_concatenated_batch():
    """Uneven batches (rank r: 3 + 2r rows), the input layouts of BatchNorm1d/2d (and 3d),
    float32 and float64, momentum 0.1 and None (cumulative), affine or not, tracking or not."""
    configs = [dict(), dict(momentum=None), dict(affine=False), dict(track=False),
               dict(momentum=None, affine=False)]
    for dtype in ("float64", "float32"):
        for i, tail in enumerate(TAILS):
            for j, cfg in enumerate(configs):
                _train_and_check(dtype, tail, _uneven, salt=10 * i + j, **cfg)
        _train_and_check(dtype, (2, 2, 2), _uneven, salt=50)  # (N, C, D, H, W)


def case_float32_far_from_zero():
    """float32 data whose mean is 500 to 4000 standard deviations from 0 keep float32 accuracy:
    the sums of squares are taken around each rank's own mean, the centring is exact. (Not at
    one rank: that is torch's own batch norm, off by 3e-5 relative here.)"""
    if hvd.size() == 1:
        return
    for tail in ((), (3, 2)):
        _train_and_check("float32", tail, _uneven, offset=1000.0, salt=30)


def case_half_precision_inputs():
    """float16 / bfloat16: computed in float32 (sums in float64), output and gradient in the
    input's dtype, the float32 parameters of mixed precision training."""
    n, r = hvd.size(), hvd.rank()
    for dtype in ("float16", "bfloat16"):
        tdt = getattr(torch, dtype)
        m = SyncBatchNorm(C)
        ref = _reference_bn((4,))
        batches = [_batch(q, _uneven(q), (4,), dtype, "half") for q in range(n)]
        X = torch.from_numpy(np.concatenate([bx for bx, _ in batches])).requires_grad_(True)
        G = torch.from_numpy(np.concatenate([bg for _, bg in batches]))
        Y = ref(X)
        (Y * G).sum().backward()
        lo = sum(_uneven(q) for q in range(r))
        mine = slice(lo, lo + _uneven(r))
        x = torch.from_numpy(batches[r][0]).to(tdt).requires_grad_(True)
        y = m(x)
        (y * torch.from_numpy(batches[r][1]).to(tdt)).sum().backward()
        assert y.dtype == tdt and x.grad.dtype == tdt and m.weight.grad.dtype == torch.float32
        close(y, Y[mine], dtype, f"{dtype} output")
        close(x.grad, X.grad[mine], dtype, f"{dtype} input gradient")
        close(hvd.allreduce(m.weight.grad, op=hvd.Sum), ref.weight.grad, dtype, "weight grad")
        close(m.running_var, ref.running_var, "float32", f"{dtype} running_var")


def case_input_without_grad_and_no_grad_mode():
    """The backward allreduce happens even where the input needs no gradient (the weight does),
    so ranks that differ there still pair their calls; under torch.no_grad() there is no
    backward at all."""
    n, r = hvd.size(), hvd.rank()
    m = SyncBatchNorm(C).double()
    ref = _reference_bn(())
    batches = [_batch(q, _uneven(q), (), "float64", "nograd") for q in range(n)]
    X = torch.from_numpy(np.concatenate([bx for bx, _ in batches]))
    G = torch.from_numpy(np.concatenate([bg for _, bg in batches]))
    (ref(X) * G).sum().backward()
    x = torch.from_numpy(batches[r][0])
    if r % 2:
        x.requires_grad_(True)
    (m(x) * torch.from_numpy(batches[r][1])).sum().backward()
    close(hvd.allreduce(m.weight.grad, op=hvd.Sum), ref.weight.grad, "float64", "weight grad")
    with torch.no_grad():
        y = m(x)
    assert y.grad_fn is None and m.num_batches_tracked.item() == 2


# --- eval mode ------------------------------------------------------------------------------------

def case_eval_uses_running_stats_without_communication():
    """After training, eval mode is torch's eval batch norm with the (global) running statistics,
    and communicates nothing: rank r calls it r + 1 times, with any batch size, while the
    allreduce is made to fail if called."""
    r = hvd.rank()
    for tail in TAILS:
        for track in (True, False):
            m, ref = _train_and_check("float64", tail, _uneven, track=track, steps=2, salt=40)
            m.eval()
            ref.eval()
            boom = mock.Mock(side_effect=AssertionError("eval mode communicated"))
            with mock.patch.object(ops, "allreduce_", boom), \
                    mock.patch.object(ops, "allreduce", boom):
                for k in range(r + 1):
                    x, _ = _batch(r, 2 + k, tail, "float64", ("eval", k))
                    x = torch.from_numpy(x)
                    close(m(x), ref(x), "float64", f"eval {tail} track={track} call {k}")
            assert not boom.called
    _still_works()


# --- errors on every rank -------------------------------------------------------------------------

def _expect(exc_type, fn, *needles):
    with pytest.raises(exc_type) as info:
        fn()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"


def case_mismatched_layers_fail_on_every_rank():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    odd = n - 1
    # Different num_features: the statistics' allreduce fails on every rank, naming the layer.
    c = C + (r == odd)
    m = SyncBatchNorm(c)
    _expect(hvd.MismatchError, lambda: m(torch.randn(4, c)), f"SyncBatchNorm({c})",
            "SyncBatchNorm statistics", "shape", f"(3, {C + 1}) on rank(s) [{odd}]",
            "same num_features")
    # nothing moved: the module's state is as it was
    assert m.num_batches_tracked.item() == 0 and not m.running_mean.any()
    _still_works()
    # A rank whose input does not fit its own layer, or is 1-D, or is not floating: its own
    # error there, a MismatchError naming it elsewhere (at once, not after a timeout).
    m = SyncBatchNorm(C)
    for bad, err, needle in ((torch.randn(4, C + 1), ValueError, "has 4 channels"),
                             (torch.randn(4), ValueError, "expected at least 2D input"),
                             (torch.ones(4, C, dtype=torch.int64), TypeError, "not floating")):
        if r == odd:
            _expect(err, lambda: m(bad), needle)
        else:
            _expect(hvd.MismatchError, lambda: m(torch.randn(4, C)), "SyncBatchNorm",
                    f"rank(s) [{odd}] rejected")
    assert m.num_batches_tracked.item() == 0
    _still_works()
    # eps <= 0 on one rank (torch's kernels refuse it; ours would give NaN): its ValueError
    # there, a MismatchError naming it elsewhere.
    m = SyncBatchNorm(C, eps=0.0 if r == odd else 1e-5)
    if r == odd:
        _expect(ValueError, lambda: m(torch.randn(4, C)), "eps must be positive")
    else:
        _expect(hvd.MismatchError, lambda: m(torch.randn(4, C)), f"rank(s) [{odd}] rejected")
    _still_works()
    # Layers built otherwise on one rank (each setting alone): a MismatchError on every rank,
    # before any statistics move.
    for setting in ({"eps": 1e-3}, {"momentum": 0.5}, {"momentum": None}, {"affine": False},
                    {"track_running_stats": False}):
        m = SyncBatchNorm(C, **(setting if r == odd else {}))
        _expect(hvd.MismatchError, lambda: m(torch.randn(4, C)), "SyncBatchNorm statistics",
                "same num_features, eps, momentum")
    _still_works()
    # A rank that issues something else while the others run backward: a clear error on all.
    m = SyncBatchNorm(C).double()
    x = torch.randn(4, C, dtype=torch.float64, requires_grad=True)
    y = m(x)
    if r == odd:
        _expect(hvd.MismatchError, lambda: hvd.allreduce(torch.ones(2, C, dtype=torch.float64),
                                                          name="something else"),
                "names differ")
    else:
        _expect(hvd.MismatchError, lambda: y.sum().backward(), "SyncBatchNorm gradient "
                "statistics", "names differ")
    _still_works()


def case_ranks_in_different_modes_fail_on_every_rank():
    """model.train() on some ranks only (a user error): a rank in eval mode communicates nothing
    and goes on, so the training ranks' statistics allreduce meets its next collective. Whatever
    that is, at once a MismatchError on every rank: on the training ranks from the layer, asking
    whether it is in training mode everywhere; on the eval ranks from their call. Never a silent
    pairing (an unnamed float64 (3, C) allreduce has the statistics' very shape and dtype).
    Afterwards the ranks are in step. One rank: both modes are plain batch norm."""
    n, r = hvd.size(), hvd.rank()
    x = torch.from_numpy(_batch(r, _uneven(r), (), "float64", "modes")[0])
    if n == 1:
        m, ref = SyncBatchNorm(C).double(), _reference_bn(())
        close(m(x), ref(x), "float64", "one rank, training mode")
        m.eval()
        ref.eval()
        close(m(x), ref(x), "float64", "one rank, eval mode")
        _still_works()
        return
    evals = [q for q in range(n) if q % 2]  # odd and even sizes: [1], [1], [1, 3]
    nexts = (  # the eval ranks' next collective, what every rank's error says
        (lambda: hvd.allreduce(torch.full((3, C), 100.0, dtype=torch.float64), op=hvd.Sum),
         "different calls of the same shape"),
        (lambda: hvd.allreduce(torch.ones(2), name="metric"), "names differ"),
        (hvd.barrier, "disagree on call: allreduce on rank(s)"),
    )
    for call, needle in nexts:
        m = SyncBatchNorm(C).double()
        if r in evals:
            m.eval()
            close(m(x), _reference_bn(()).eval()(x), "float64", "eval rank's output")
            _expect(hvd.MismatchError, call, needle)
        else:
            _expect(hvd.MismatchError, lambda: m(x), "SyncBatchNorm(3) in training mode",
                    needle, "Is SyncBatchNorm in training mode on every rank?")
            # the failed call left the module as it was
            assert m.num_batches_tracked.item() == 0 and not m.running_mean.any()
        _still_works()  # in step again: an allreduce's sum, a training step


# --- empty and tiny batches -----------------------------------------------------------------------

def case_a_rank_with_no_rows_takes_part():
    n = hvd.size()
    odd = n - 1
    rows = lambda q: 0 if q == odd else _uneven(q)  # noqa: E731
    for tail in ((), (3, 2)):
        _train_and_check("float64", tail, rows, salt=60)
        _train_and_check("float32", tail, rows, momentum=None, salt=61)


def case_every_rank_empty():
    """As torch on an empty batch: an empty output, zero weight gradients, the running
    statistics unchanged, the counter still advanced."""
    m, _ = _train_and_check("float64", (3, 2), lambda q: 0, steps=2, salt=70)
    assert not m.running_mean.any() and torch.equal(m.running_var, torch.ones(C,
                                                                              dtype=torch.float64))


def case_one_value_per_channel_in_all_is_an_error_everywhere():
    """torch's ValueError for a batch of one value per channel, on every rank alike (the global
    count decides: one row on rank 0, none elsewhere)."""
    r = hvd.rank()
    m = SyncBatchNorm(C)
    x = torch.randn(1 if r == 0 else 0, C)
    _expect(ValueError, lambda: m(x), "Expected more than 1 value per channel when training")
    if hvd.size() > 1:  # (one rank: torch's own batch norm, which counts the batch first)
        assert m.num_batches_tracked.item() == 0 and not m.running_mean.any()
    _still_works()


# --- join -----------------------------------------------------------------------------------------

def case_joined_rank_contributes_nothing():
    """A rank inside hvd.join() takes part in the others' SyncBatchNorm allreduces with zeros:
    count 0, so the statistics are those of the ranks still training."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    odd = n - 1
    if r == odd:
        assert hvd.join() == n - 2
        return
    rows = lambda q: 0 if q == odd else _uneven(q)  # noqa: E731
    _train_and_check("float64", (4,), rows, steps=2, salt=80, joined=True)
    hvd.join()


# --- DistributedOptimizer -------------------------------------------------------------------------

B = 4  # rows per rank: equal, so the average of the ranks' mean losses is the global mean loss


class _Net(torch.nn.Module):
    def __init__(self, bn, conv):
        super().__init__()
        self.conv = conv
        if conv:
            self.body = torch.nn.Conv2d(2, 3, 3, padding=1)
            self.bn = bn(3)
            self.mid = torch.nn.Linear(3 * 3 * 3, 4)
            self.bn2 = (torch.nn.BatchNorm1d if bn is torch.nn.BatchNorm2d else bn)(4)
            self.head = torch.nn.Linear(4, 2)
        else:
            self.body = torch.nn.Linear(5, 4)
            self.bn = bn(4)
            self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.bn(self.body(x)))
        if self.conv:
            h = torch.tanh(self.bn2(self.mid(h.flatten(1))))
        return self.head(h)


def _opt_data(n, steps, conv):
    g = torch.Generator().manual_seed(11 + conv)
    shape = (2, 3, 3) if conv else (5,)
    x = torch.randn(steps, n * B, *shape, dtype=torch.float64, generator=g) + 1.5
    y = torch.randn(steps, n * B, 2 if conv else 3, dtype=torch.float64, generator=g)
    return x, y


def case_distributed_optimizer_matches_single_process():
    n, r = hvd.size(), hvd.rank()
    steps = 3
    for conv in (False, True):
        torch.manual_seed(5)
        model = _Net(SyncBatchNorm, conv).double()
        torch.manual_seed(5)
        ref = _Net(torch.nn.BatchNorm2d if conv else torch.nn.BatchNorm1d, conv).double()
        ref.load_state_dict(model.state_dict())  # same keys as torch's batch norm
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        x, y = _opt_data(n, steps, conv)
        mine = slice(r * B, (r + 1) * B)
        for s in range(steps):
            opt.zero_grad()
            ((model(x[s, mine]) - y[s, mine]) ** 2).mean().backward()
            opt.step()
            ref_opt.zero_grad()
            ((ref(x[s]) - y[s]) ** 2).mean().backward()
            ref_opt.step()
        got, want = model.state_dict(), ref.state_dict()
        for k in want:
            diff = (got[k].double() - want[k].double()).abs().max().item()
            assert diff < 1e-10, f"conv={conv} {k}: differs by {diff}"
        same_everywhere(torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                        f"conv={conv} weights")



# --- last: a timeout leaves mlfabric unusable ----------------------------------------------------

def case_timeout_eval_rank_without_further_collective():
    """A rank in eval mode that issues no further collective (here: it waits in the runner's MPI
    call, outside mlfabric): the training ranks raise PeerTimeoutError from the layer within
    MLFABRIC_TIMEOUT (3 s), asking whether it is in training mode on every rank. Run alone, by
    test_torch_sync_bn_mode_mismatch_times_out (SYNC_BN_TIMEOUT_CASE=1); else a no-op."""
    if os.environ.get("SYNC_BN_TIMEOUT_CASE") != "1":
        return
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    m = SyncBatchNorm(C).double()
    x = torch.from_numpy(_batch(r, _uneven(r), (), "float64", "timeout")[0])
    if r % 2:
        m.eval()
        m(x)
        return
    t0 = time.monotonic()
    _expect(hvd.PeerTimeoutError, lambda: m(x), "SyncBatchNorm(3) in training mode",
            "Is SyncBatchNorm in training mode on every rank?")
    waited = time.monotonic() - t0
    assert 2.5 < waited < 10, waited
    assert m.num_batches_tracked.item() == 0
