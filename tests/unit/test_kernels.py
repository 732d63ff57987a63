"""Tests of the CPU kernels (mlfabric.kernels over mlfabric._C): every op x dtype x instruction set
this CPU has, against float64 numpy references. Single process."""
import os
import subprocess
import sys

import numpy as np
import pytest

from mlfabric import _C
from mlfabric import kernels as K
from mlfabric.errors import MlfabricError

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

ISAS = K.supported_isas()
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
CODE = {name: i for i, name in enumerate(DTYPES)}
FLOATS = DTYPES[:4]
OPS = ("sum", "prod", "min", "max")
KS = (1, 2, 3, 5, 9, 17)  # 9 and 17 take the grouped path (more than 8 sources)
# Empty, single, primes, around the 32-element chunk and 1024-element tile.
SIZES = (0, 1, 7, 31, 32, 33, 1021, 1024, 4099, 65537)


@pytest.fixture(autouse=True)
def restore_isa():
    before = K.isa()
    yield
    K.set_isa(before)


def each_isa():
    for name in ISAS:
        K.set_isa(name)
        yield name


# ------------------------------------------------------------------------------------ helpers

def storage(dtype):
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_rne(x):
    """Reference float -> bfloat16 bits: the nearer of the two neighbouring bfloat16 values, ties
    to the even one, found by comparing distances in float64 (independent of the kernel's bit
    trick). NaN -> some NaN, callers compare NaNs by isnan."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    lo_bits = u & np.uint32(0xFFFF0000)
    hi_bits = lo_bits + np.uint32(0x10000)  # next bfloat16 away from zero
    lo = lo_bits.view(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        hi = hi_bits.view(np.float32).astype(np.float64)
        hi = np.where(np.isinf(hi) & ~np.isinf(f), np.sign(f).astype(np.float64) * 2.0 ** 128, hi)
        x64 = f.astype(np.float64)
        dlo, dhi = np.abs(x64 - lo), np.abs(hi - x64)
        odd = ((lo_bits >> 16) & 1) == 1
        pick_hi = (dhi < dlo) | ((dhi == dlo) & odd)
    out = np.where(pick_hi, hi_bits >> 16, lo_bits >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), out)


def from_f64(x, dtype):
    """Round float64 values to the storage of dtype (bfloat16 via float32, exact for the values the
    exact tests use)."""
    if dtype == "bfloat16":
        return bf16_rne(np.asarray(x, dtype=np.float32))
    with np.errstate(over="ignore"):  # overflow to infinity is part of what is tested
        return np.asarray(x).astype(dtype)


def to_f64(a, dtype):
    if dtype == "bfloat16":
        return bf16_to_f32(a).astype(np.float64)
    return a.astype(np.float64)


def exact_inputs(rng, dtype, op, k, n):
    """Inputs whose reduction is exact in every dtype (small integers, powers of two for prod)."""
    if dtype.startswith("int"):
        info = np.iinfo(dtype)
        return [rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True) for _ in range(k)]
    if op == "prod":
        vals = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], size=(k, n))
    else:
        vals = rng.integers(-8, 9, size=(k, n)).astype(np.float64)
    return [from_f64(v, dtype) for v in vals]


def reference(inputs, dtype, op, scale=1.0):
    if dtype.startswith("int"):  # numpy integer arrays wrap like the kernels
        fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        acc = inputs[0].copy()
        for x in inputs[1:]:
            acc = fn(acc, x)
        return acc
    fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    acc = to_f64(inputs[0], dtype)
    for x in inputs[1:]:
        acc = fn(acc, to_f64(x, dtype))
    return from_f64(acc * scale, dtype)


def run_reduce(inputs, dtype, op, out=None, scale=1.0):
    """Reduce raw storage arrays (bfloat16 as uint16) through the binding."""
    n = inputs[0].size
    out = np.empty(n, storage(dtype)) if out is None else out
    _C.reduce(out.ctypes.data, [x.ctypes.data for x in inputs], n, CODE[dtype], OPS.index(op),
              scale)
    return out


def assert_same_bits(got, want, dtype, ctx=""):
    """Equal bits, except that any NaN matches any NaN (payloads are compared across ISAs)."""
    size = np.dtype(storage(dtype)).itemsize
    got, want = got.view(np.uint8).reshape(-1, size), want.view(np.uint8).reshape(-1, size)
    msg = f"{dtype} {ctx}"
    if dtype in FLOATS:
        gf = to_f64(got.view(storage(dtype)).ravel(), dtype)
        wf = to_f64(want.view(storage(dtype)).ravel(), dtype)
        nan = np.isnan(wf)
        np.testing.assert_array_equal(np.isnan(gf), nan, err_msg=msg)
        np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=msg)
    else:
        np.testing.assert_array_equal(got, want, err_msg=msg)


# ------------------------------------------------------------------------------------ reduce

def test_isa_names():
    assert K.isa() in K.ISAS
    assert "scalar" in ISAS
    for name in each_isa():
        assert K.isa() == name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reduce_exact(dtype, op):
    rng = np.random.default_rng(CODE[dtype] * 10 + OPS.index(op))
    for k in KS:
        for n in SIZES:
            inputs = exact_inputs(rng, dtype, op, k, n)
            want = reference(inputs, dtype, op)
            for isa in each_isa():
                got = run_reduce(inputs, dtype, op)
                assert_same_bits(got, want, dtype, f"{op} {isa} k={k} n={n}")


@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce_scale_exact(dtype):
    rng = np.random.default_rng(1)
    for k in (1, 2, 5, 9):
        for n in (1, 33, 4099):
            inputs = exact_inputs(rng, dtype, "sum", k, n)
            for op in OPS:
                want = reference(inputs, dtype, op, scale=0.5)  # exact: a power of two
                for _ in each_isa():
                    assert_same_bits(run_reduce(inputs, dtype, op, scale=0.5), want, dtype)


TOL = {"float32": 2.0 ** -23, "float64": 2.0 ** -52, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce_random_within_rounding(dtype):
    """Real-valued data: float16/bfloat16 within one unit in the last place of the float64
    reference (float32 accumulation, one rounding), float32/float64 within k roundings."""
    rng = np.random.default_rng(2)
    for k in (2, 3, 5, 9):
        for n in (1, 1021, 65537):
            inputs = [from_f64(rng.standard_normal(n), dtype) for _ in range(k)]
            ref = sum(to_f64(x, dtype) for x in inputs)
            mag = sum(np.abs(to_f64(x, dtype)) for x in inputs)
            for scale in (1.0, 1.0 / k, 0.1):
                refs, mags = ref * scale, mag * scale
                # k roundings of float32 (low precision) or the dtype, then one final rounding.
                acc_eps = TOL["float32" if dtype in ("float16", "bfloat16") else dtype]
                bound = (k + 1) * acc_eps * mags
                if dtype in ("float16", "bfloat16"):
                    bound = bound + TOL[dtype] * np.maximum(np.abs(refs), 2.0 ** -14)
                for isa in each_isa():
                    got = to_f64(run_reduce(inputs, dtype, "sum", scale=scale), dtype)
                    err = np.abs(got - refs)
                    assert np.all(err <= bound), (isa, k, n, scale, float(np.max(err - bound)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_in_place(dtype):
    """dst may be any source exactly, including in the grouped (k > 8) and streamed paths."""
    rng = np.random.default_rng(3)
    big = (4 << 20) // storage(dtype).itemsize + 37  # past the non-temporal-store threshold
    for k, n in ((2, 1021), (3, 65537), (9, 4099), (17, 1021), (2, big), (9, big)):
        inputs = exact_inputs(rng, dtype, "sum", k, n)
        want = reference(inputs, dtype, "sum")
        for j in (0, k - 1):
            for _ in each_isa():
                srcs = [x.copy() for x in inputs]
                run_reduce(srcs, dtype, "sum", out=srcs[j])
                assert_same_bits(srcs[j], want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_streamed_misaligned(dtype):
    """Outputs past the streaming threshold, with dst and sources off the 64-byte grid."""
    rng = np.random.default_rng(4)
    n = (4 << 20) // storage(dtype).itemsize + 101
    for k in (1, 2, 3, 9):
        inputs = [x[1:] for x in exact_inputs(rng, dtype, "max", k, n + 1)]
        want = reference(inputs, dtype, "max")
        for scale in ((1.0, 2.0) if dtype in FLOATS else (1.0,)):
            want_s = want if scale == 1.0 else reference(inputs, dtype, "max", scale)
            for _ in each_isa():
                out = np.zeros(n + 3, storage(dtype))[3:]
                run_reduce(inputs, dtype, "max", out=out, scale=scale)
                assert_same_bits(out, want_s, dtype)


def special_bits(dtype, rng, n):
    """Random 16-bit patterns with extra NaNs, infinities, zeros and subnormals."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    if dtype == "float16":
        extras = [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x0001, 0x8001, 0x03FF, 0x0000, 0x8000, 0x7BFF]
    else:
        extras = [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x0001, 0x8001, 0x007F, 0x0000, 0x8000, 0x7F7F]
    bits[: len(extras)] = extras
    return bits


def as_f32(bits, dtype):
    return bf16_to_f32(bits) if dtype == "bfloat16" else bits.view(np.float16).astype(np.float32)


def round_f32(x, dtype):
    return bf16_rne(x) if dtype == "bfloat16" else x.astype(np.float16).view(np.uint16)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_low_precision_rounding(dtype):
    """One float32 operation then round-to-nearest-even, bit-exact against numpy (float16) or the
    reference conversion (bfloat16), on every bit pattern class; and identical bits (NaN payloads
    included) on every ISA."""
    rng = np.random.default_rng(5)
    n = 70001
    a, b = special_bits(dtype, rng, n), special_bits(dtype, rng, n)[::-1].copy()
    fa, fb = as_f32(a, dtype), as_f32(b, dtype)
    with np.errstate(all="ignore"):
        cases = [("sum", [a, b], 1.0, fa + fb),
                 ("prod", [a, b], 1.0, fa * fb),
                 ("sum", [a], 1.1, fa * np.float32(1.1)),
                 ("sum", [a, b], 0.3, (fa + fb) * np.float32(0.3))]
        for op, srcs, scale, f32 in cases:
            want = round_f32(f32, dtype)
            outs = []
            for _ in each_isa():
                outs.append(run_reduce(srcs, dtype, op, scale=scale))
                assert_same_bits(outs[-1], want, dtype)
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])


def test_bf16_reference_conversion():
    """The numpy reference itself: ties to even, overflow to infinity."""
    f = np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20, 3.3961e38, 3.3999e38,
                  -1.5], dtype=np.float32)
    np.testing.assert_array_equal(bf16_rne(f), [0x3F80, 0x3F82, 0x3F81, 0x7F7F, 0x7F80, 0xBFC0])


@pytest.mark.parametrize("dtype", FLOATS)
def test_min_max_propagate_nan(dtype):
    a = from_f64(np.array([1.0, np.nan, 3.0, np.nan, -1.0, 5.0]), dtype)
    b = from_f64(np.array([np.nan, 2.0, 1.0, np.nan, 0.0, np.inf]), dtype)
    for op, fn in (("min", np.minimum), ("max", np.maximum)):
        want = from_f64(fn(to_f64(a, dtype), to_f64(b, dtype)), dtype)
        for _ in each_isa():
            got = run_reduce([a, b], dtype, op)
            np.testing.assert_array_equal(np.isnan(to_f64(got, dtype)), [1, 1, 0, 1, 0, 0])
            assert_same_bits(got, want, dtype)


@pytest.mark.parametrize("dtype", ("int32", "int64"))
def test_integer_wraparound(dtype):
    info = np.iinfo(dtype)
    half = 1 << (info.bits // 2)
    a = np.array([info.max, info.min, half, -1, 7], dtype=dtype)
    b = np.array([1, -1, half, info.min, 3], dtype=dtype)
    for _ in each_isa():
        np.testing.assert_array_equal(run_reduce([a, b], dtype, "sum"),
                                      [info.min, info.max, 2 * half, info.max, 10])
        np.testing.assert_array_equal(run_reduce([a, b], dtype, "prod"),
                                      [info.max, info.min, 0, info.min, 21])


# ------------------------------------------------------------------------------ scale, axpy, norm2

@pytest.mark.parametrize("dtype", FLOATS)
def test_scale_and_axpy(dtype):
    """Bit-exact against numpy float32/float64 arithmetic (no FMA) rounded to the dtype."""
    rng = np.random.default_rng(6)
    ftype = np.float64 if dtype == "float64" else np.float32
    for n in (0, 1, 31, 33, 1021, 65537):
        x = from_f64(rng.standard_normal(n), dtype)
        y = from_f64(rng.standard_normal(n), dtype)
        fx, fy = to_f64(x, dtype).astype(ftype), to_f64(y, dtype).astype(ftype)
        alpha = ftype(-0.37)
        want_scale = from_f64((fx * alpha).astype(np.float64), dtype)
        want_axpy = from_f64((fy + alpha * fx).astype(np.float64), dtype)
        for _ in each_isa():
            xs = x.copy()
            _C.scale(xs.ctypes.data, n, CODE[dtype], -0.37)
            assert_same_bits(xs, want_scale, dtype)
            ys = y.copy()
            _C.axpy(ys.ctypes.data, x.ctypes.data, n, CODE[dtype], -0.37)
            assert_same_bits(ys, want_axpy, dtype)


def test_scale_axpy_wrappers():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert K.scale_(x, 2.0) is x
    np.testing.assert_array_equal(x, np.arange(6).reshape(2, 3) * 2)
    y = np.ones((2, 3), np.float32)
    assert K.axpy_(y, 0.5, x) is y
    np.testing.assert_array_equal(y, 1 + np.arange(6).reshape(2, 3))
    xt = np.arange(12, dtype=np.float64).reshape(3, 4).T  # non-contiguous: copied and written back
    K.scale_(xt, -1.0)
    np.testing.assert_array_equal(xt, -np.arange(12).reshape(3, 4).T)
    with pytest.raises(TypeError):
        K.scale_(np.ones(3, np.int32), 2.0)
    with pytest.raises(TypeError):
        K.axpy_(np.ones(3, np.int64), 2.0, np.ones(3, np.int64))
    with pytest.raises(MlfabricError):
        K.axpy_(np.ones(3, np.float32), 1.0, np.ones(4, np.float32))
    with pytest.raises(MlfabricError):
        K.axpy_(y, 1.0, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm2(dtype):
    rng = np.random.default_rng(7)
    for n in (0, 1, 15, 17, 33, 1021, 65537):
        if dtype.startswith("int"):
            x = rng.integers(-1000, 1000, n).astype(dtype)
        else:
            x = from_f64(rng.standard_normal(n) * 3, dtype)
        want = float(np.sqrt(np.sum(to_f64(x, dtype) ** 2)))
        got = []
        for _ in each_isa():
            got.append(_C.norm2(x.ctypes.data, n, CODE[dtype]))
            assert got[-1] == pytest.approx(want, rel=1e-12, abs=0)
        assert len(set(got)) == 1  # the same summation order on every ISA
    assert K.norm2(np.array([3.0, 4.0])) == 5.0


# ------------------------------------------------------------------------------ wrappers, torch

def test_reduce_wrapper_shapes_and_out():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones((3, 4), np.float32)
    out = K.reduce([a, b])
    assert out.shape == (3, 4) and out.dtype == np.float32
    np.testing.assert_array_equal(out, a + 1)
    res = K.reduce([a, b], op="max", out=a)
    assert res is a
    np.testing.assert_array_equal(a, np.maximum(np.arange(12).reshape(3, 4), 1))
    out_nc = np.zeros((4, 3), np.float32).T  # non-contiguous output, written back
    K.reduce([b, b, b], op="avg", out=out_nc)
    np.testing.assert_array_equal(out_nc, np.ones((3, 4)))
    np.testing.assert_array_equal(K.reduce([a.T, b.T], op="min"), np.minimum(a.T, b.T))


def test_reduce_wrapper_errors():
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError):
        K.reduce([])
    with pytest.raises(ValueError):
        K.reduce([a], op="median")
    with pytest.raises(TypeError):
        K.reduce([a, np.ones(4, np.float64)])
    with pytest.raises(MlfabricError):
        K.reduce([a, np.ones(5, np.float32)])
    with pytest.raises(TypeError):
        K.reduce([np.ones(4, np.int32)], op="avg")
    with pytest.raises(TypeError):
        K.reduce([np.ones(4, np.int32)], scale=2.0)
    for bad in (np.ones(4, np.complex64), np.ones(4, np.int8), np.ones(4, np.uint16)):
        with pytest.raises(TypeError):
            K.reduce([bad, bad])
    with pytest.raises(TypeError):
        K.reduce([[1.0, 2.0]])
    big = np.ones(8, np.float32)
    with pytest.raises(MlfabricError):  # partial overlap with an input
        K.reduce([big[:6], big[2:]], out=big[1:7])
    with pytest.raises(ValueError):
        K.set_isa("sse9")


def test_binding_argument_checks():
    a = np.ones(4, np.float32)
    p = a.ctypes.data
    with pytest.raises(ValueError):
        _C.reduce(p, [p], 4, 6, 0)
    with pytest.raises(ValueError):
        _C.reduce(p, [p], 4, -1, 0)
    with pytest.raises(ValueError):
        _C.reduce(p, [p], 4, 0, 4)
    with pytest.raises(ValueError):
        _C.reduce(p, [], 4, 0, 0)
    with pytest.raises(ValueError):
        _C.reduce(p, [p], 4, 4, 0, 2.0)  # scale on an integer dtype
    with pytest.raises(ValueError):
        _C.scale(p, 4, 4, 2.0)
    with pytest.raises(ValueError):
        _C.axpy(p, p, 4, 5, 2.0)
    with pytest.raises(ValueError):
        _C.norm2(p, 4, 9)
    assert _C.set_isa("nope") is False
    assert isinstance(_C.cuda_built(), bool)
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, np.uint8)
    _C.copy(dst.ctypes.data, src.ctypes.data, 100)
    np.testing.assert_array_equal(dst, src)
    big = np.arange(3 << 20, dtype=np.int32)  # 12 MiB: the streaming copy
    big_dst = np.zeros(big.size + 1, np.int32)[1:]
    _C.copy(big_dst.ctypes.data, big.ctypes.data, big.nbytes)
    np.testing.assert_array_equal(big_dst, big)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_tensors():
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
               torch.int64):
        a = torch.arange(-50, 50).to(dt).reshape(10, 10)
        b = torch.full((10, 10), 3).to(dt)
        for _ in each_isa():
            assert torch.equal(K.reduce([a, b]), a + b)
            assert torch.equal(K.reduce([a, b], op="max"), torch.maximum(a, b))
            assert torch.equal(K.reduce([a, b, a], op="min"), torch.minimum(a, b))
            assert torch.equal(K.reduce([a.t(), b]), a.t() + b)  # non-contiguous input
        if dt.is_floating_point:
            y = b.clone()
            K.axpy_(y, 2.0, a)
            assert torch.equal(y, b + 2 * a)
            assert K.norm2(a) == pytest.approx(float(a.double().norm()), rel=1e-12)
            out = torch.zeros(10, 10, dtype=dt).t()
            K.reduce([a, b], op="avg", out=out)
            assert torch.equal(out, ((a.float() + b.float()) / 2).to(dt))
    with pytest.raises(TypeError):
        K.reduce([torch.ones(3, dtype=torch.complex64)] * 2)
    with pytest.raises(TypeError):
        K.reduce([torch.ones(3), torch.ones(3, dtype=torch.float64)])


def test_outputs_that_cannot_take_the_result_are_refused_before_any_work():
    """In-place kernels and reduce's out: a read-only array, or one whose elements share memory
    (expanded, zero strides), is a ValueError up front, the data untouched."""
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    expanded = torch.ones(1).expand(4)
    broadcast = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (4,), (0,))  # writable
    for call in (lambda: K.scale_(ro, 3.0), lambda: K.axpy_(ro, 2.0, np.ones(4, np.float32)),
                 lambda: K.reduce([np.ones(4, np.float32)] * 2, out=ro)):
        with pytest.raises(ValueError, match="read-only"):
            call()
        assert ro.tolist() == [1.0] * 4
    for call in (lambda: K.scale_(expanded, 3.0), lambda: K.axpy_(expanded, 2.0, torch.ones(4)),
                 lambda: K.reduce([np.ones(4, np.float32)] * 2, out=broadcast)):
        with pytest.raises(ValueError, match="elements of it share memory"):
            call()
    assert expanded.tolist() == [1.0] * 4 and broadcast.tolist() == [0.0] * 4


def test_threads_share_kernels():
    """The kernels run without the GIL; concurrent calls give the right answers."""
    from concurrent.futures import ThreadPoolExecutor

    arrays = [np.full(1 << 20, i, np.float32) for i in range(4)]

    def work(i):
        return K.reduce([arrays[i], arrays[(i + 1) % 4]])

    with ThreadPoolExecutor(4) as pool:
        for i, out in enumerate(pool.map(work, range(4))):
            assert np.all(out == i + (i + 1) % 4)


def test_env_selects_isa():
    code = "from mlfabric import _C; print(_C.isa())"
    for want in ISAS:
        env = dict(os.environ, MLFABRIC_ISA=want)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == want
    env = dict(os.environ, MLFABRIC_ISA="sse9")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ISAS[-1]
    assert "MLFABRIC_ISA=sse9" in out.stderr


@pytest.mark.parametrize("arrays", [True, False])
def test_gather_scatter_and_copy_pieces_move_the_bytes_they_are_told(arrays):
    # the grouped calls' copies: pieces back to back (gather), out again (scatter), and
    # arbitrary pieces to arbitrary places (copy_pieces; uint64 arrays only)
    rng = np.random.default_rng(5)
    pieces = [rng.integers(0, 255, n, dtype=np.uint8) for n in (5, 0, 17, 1, 64)]
    sizes = [p.nbytes for p in pieces]

    def addresses(bufs):
        a = [b.ctypes.data for b in bufs]
        return np.array(a, np.uint64) if arrays else a

    nbytes = np.array(sizes, np.uint64) if arrays else sizes
    flat = np.zeros(sum(sizes), np.uint8)
    _C.gather(flat.ctypes.data, addresses(pieces), nbytes)
    assert np.array_equal(flat, np.concatenate(pieces))
    back = [np.zeros_like(p) for p in pieces]
    _C.scatter(flat.ctypes.data, addresses(back), nbytes)
    assert all(np.array_equal(a, b) for a, b in zip(back, pieces))
    with pytest.raises(ValueError, match="differ in length"):
        _C.gather(flat.ctypes.data, addresses(pieces), nbytes[:-1])
    if arrays:
        out = [np.zeros_like(p) for p in reversed(pieces)]
        _C.copy_pieces(addresses(out), addresses(list(reversed(pieces))),
                       np.array(sizes[::-1], np.uint64))
        assert all(np.array_equal(a, b) for a, b in zip(out, reversed(pieces)))
        with pytest.raises(ValueError, match="differ in length"):
            _C.copy_pieces(addresses(out), addresses(pieces)[:-1], nbytes)
