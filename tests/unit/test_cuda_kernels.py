"""Tests of the CUDA kernels (mlfabric._C.cuda_*, and mlfabric.kernels on CUDA torch tensors)
against numpy / the CPU kernels. Skipped unless this build has CUDA kernels and torch sees a GPU;
the no-GPU behaviour of a CUDA build (device count 0, errors as RuntimeError) is tested here too."""
import numpy as np
import pytest

from mlfabric import _C
from mlfabric import kernels as K

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

CUDA_BUILT = _C.cuda_built()
HAVE_GPU = CUDA_BUILT and torch is not None and torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA build of mlfabric and a GPU")
pytestmark = pytest.mark.cuda

OPS = ("sum", "prod", "min", "max")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
TORCH = {}
if torch is not None:
    TORCH = dict(zip(DTYPES, (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                              torch.int32, torch.int64)))


@pytest.mark.skipif(not CUDA_BUILT or HAVE_GPU, reason="for CUDA builds on machines without a GPU")
def test_no_gpu_is_reported_not_crashed():
    assert _C.cuda_device_count() == 0
    a = np.ones(4, np.float32)
    with pytest.raises(RuntimeError, match="CUDA error"):
        _C.cuda_reduce(a.ctypes.data, [a.ctypes.data], 4, 0, 0)
    with pytest.raises(RuntimeError, match="CUDA error"):
        _C.cuda_norm2(a.ctypes.data, 4, 0)
    with pytest.raises(ValueError):
        _C.cuda_reduce(a.ctypes.data, [a.ctypes.data], 4, 7, 0)
    with pytest.raises(ValueError):
        _C.cuda_reduce(a.ctypes.data, [], 4, 0, 0)


def exact_inputs(gen, dtype, op, k, n):
    """CPU tensors whose reduction is exact in every dtype."""
    if dtype.startswith("int"):
        info = torch.iinfo(TORCH[dtype])
        return [torch.randint(info.min, info.max, (n,), dtype=TORCH[dtype], generator=gen)
                for _ in range(k)]
    if op == "prod":
        vals = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])
        return [vals[torch.randint(0, 6, (n,), generator=gen)].to(TORCH[dtype]) for _ in range(k)]
    return [torch.randint(-8, 9, (n,), generator=gen).to(TORCH[dtype]) for _ in range(k)]


def same(a, b):
    a, b = a.cpu(), b.cpu()
    if a.is_floating_point():
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
            a[~torch.isnan(a)], b[~torch.isnan(b)])
    return torch.equal(a, b)


@gpu
def test_device_count():
    assert _C.cuda_device_count() == torch.cuda.device_count()


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_cuda_reduce_matches_cpu(dtype, op):
    gen = torch.Generator().manual_seed(DTYPES.index(dtype) * 4 + OPS.index(op))
    code = DTYPES.index(dtype)
    for k in (1, 2, 3, 5, 40):  # 40: the source pointers go through device memory
        for n in (0, 1, 7, 1021, 65537):
            cpu = exact_inputs(gen, dtype, op, k, n + 1)
            want = K.reduce(cpu, op=op)  # the CPU kernels, tested against numpy
            for offset in (0, 1):  # 16-byte-aligned vector path, then the element path
                dev = [t.cuda()[offset:offset + n] for t in cpu]
                out = torch.empty(n + 1, dtype=TORCH[dtype], device="cuda")[offset:offset + n]
                _C.cuda_reduce(out.data_ptr(), [t.data_ptr() for t in dev], n, code,
                               OPS.index(op))
                torch.cuda.synchronize()
                assert same(out, want[offset:offset + n]), (k, n, offset)


@gpu
@pytest.mark.parametrize("dtype", DTYPES[:4])
def test_cuda_scale_axpy_norm2(dtype):
    gen = torch.Generator().manual_seed(11)
    code = DTYPES.index(dtype)
    for n in (0, 1, 7, 1021, 65537):
        x = torch.randn(n, generator=gen).to(TORCH[dtype])
        y = torch.randn(n, generator=gen).to(TORCH[dtype])
        want_scale = K.scale_(x.clone(), 0.37)
        want_axpy = K.axpy_(y.clone(), -1.5, x)
        xd, yd = x.cuda(), y.cuda()
        _C.cuda_scale(xd.data_ptr(), n, code, 0.37)
        _C.cuda_axpy(yd.data_ptr(), x.cuda().data_ptr(), n, code, -1.5)
        torch.cuda.synchronize()
        assert same(xd, want_scale)
        assert same(yd, want_axpy)
        got = _C.cuda_norm2(x.cuda().data_ptr(), n, code)
        assert got == pytest.approx(K.norm2(x), rel=1e-12, abs=0)
    assert _C.cuda_norm2(torch.arange(5, dtype=torch.int64, device="cuda").data_ptr(), 5, 5) == \
        pytest.approx(float(np.sqrt(30)))


@gpu
def test_cuda_rounding_and_nan():
    """bfloat16/float16 round once from float32; min/max propagate NaN."""
    a = torch.tensor([1.0, 1.0 + 2 ** -8, float("nan"), 3.0], dtype=torch.float32)
    b = torch.tensor([2 ** -9, 2 ** -9, 1.0, float("nan")], dtype=torch.float32)
    for dt in (torch.bfloat16, torch.float16):
        ad, bd = a.to(dt).cuda(), b.to(dt).cuda()
        got = K.reduce([ad, bd])
        assert same(got, (ad.float() + bd.float()).to(dt))
        for op, fn in (("min", torch.minimum), ("max", torch.maximum)):
            assert same(K.reduce([ad, bd], op=op), fn(ad, bd))


@gpu
def test_cuda_wrappers_and_streams():
    a = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    b = torch.ones(3, 4, device="cuda")
    assert torch.equal(K.reduce([a, b]), a + b)
    assert torch.equal(K.reduce([a, b], op="avg"), (a + b) / 2)
    out = torch.zeros(4, 3, device="cuda").t()  # non-contiguous out
    K.reduce([a, b], op="max", out=out)
    assert torch.equal(out, torch.maximum(a, b))
    torch.cuda.synchronize()  # a and b were made on the default stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        c = K.reduce([a.t(), b.t()], op="prod")
        K.scale_(c, 2.0)
        K.axpy_(c, 1.0, a.t().contiguous())
    s.synchronize()
    assert torch.equal(c, 2 * a.t() * b.t() + a.t())
    assert K.norm2(a) == pytest.approx(float(a.double().norm()))
    with pytest.raises(RuntimeError):  # a host pointer is refused, not dereferenced
        host = np.ones(4, np.float32)
        _C.cuda_reduce(host.ctypes.data, [host.ctypes.data], 4, 0, 0)
    with pytest.raises(TypeError):
        K.reduce([a, a.double()])
