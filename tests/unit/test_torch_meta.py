"""The native reader of tensors' metadata (mlfabric/torch/tensor_meta.py, csrc/torch_meta.cc):
the same dtypes, shapes and addresses as torch's Python API, None for what it cannot read, and
every handle it is given released. One process: it reads tensors, nothing moves."""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mlfabric.torch import arguments, tensor_meta  # noqa: E402


def python_scan(tensors):
    """What arguments.scan_tensors's Python path reads: (codes, shapes) and the addresses (None
    where one is not contiguous)."""
    return ((tuple(arguments.DTYPE_CODE[t.dtype] for t in tensors), tuple(tuple(t.shape)
                                                                          for t in tensors)),
            None if not all(t.is_contiguous() for t in tensors)
            else [t.data_ptr() for t in tensors])


def decoded(got):
    sig, ptrs = got
    return tensor_meta.decode(sig), None if ptrs is None else ptrs.tolist()


def test_the_native_reader_is_on_with_the_pinned_torch():
    # CI pins torch 2.13, which has the shim: a reader silently off would go unnoticed
    assert tensor_meta.available(arguments.dtype_name(c) for c in range(len(arguments.DTYPES)))


def test_it_reads_what_torch_reads():
    base = torch.arange(40, dtype=torch.float64)
    tensors = [torch.randn(3, 4), base[5:17].view(3, 4), base[3], torch.zeros(0),
               torch.zeros(2, 0, 3), torch.nn.Parameter(torch.ones(6)),
               torch.randn(5, requires_grad=True), torch.randn(2, 3, 4, 5, 6, 7, 2, 1, 3)]
    tensors += [torch.zeros(3, dtype=dt) for dt in arguments.DTYPES]
    got = tensor_meta.scan(tensors)
    assert decoded(got) == python_scan(tensors)
    assert got[1].dtype == np.uint64 and int(got[1][1]) == base.data_ptr() + 5 * 8  # a view
    assert got[0] == tensor_meta.signature(*python_scan(tensors)[0])   # the Python path's bytes
    assert decoded(tensor_meta.scan(tuple(tensors))) == decoded(got)
    assert decoded(tensor_meta.scan([])) == (((), ()), [])
    # one tensor not contiguous: no addresses (torch copies), the same signature
    strided = tensors + [base.view(5, 8).t()]
    assert decoded(tensor_meta.scan(strided)) == python_scan(strided)
    for case in (tensors, strided):   # the calls use it; its Python path gives the same
        native = arguments.scan_tensors(case, "x")
        with _reader_off():
            python = arguments.scan_tensors(case, "x")
        assert native[0] == python[0] and decoded(native) == decoded(python)


@contextlib.contextmanager
def _reader_off():
    saved, tensor_meta._SCAN = tensor_meta._SCAN, False
    try:
        yield
    finally:
        tensor_meta._SCAN = saved


@pytest.mark.parametrize("odd", [
    3, None, torch.zeros(2).to_sparse(), torch.zeros(2, dtype=torch.complex64),
    torch.zeros(2, device="meta"), torch.zeros(2, dtype=torch.uint32)])
def test_what_it_cannot_read_is_left_to_the_python_checks(odd):
    dense = torch.zeros(4)
    assert tensor_meta.scan([dense, odd]) is None
    assert dense._use_count() == 1   # the handle made for `dense` was released
    if isinstance(odd, torch.Tensor) and odd.device.type == "meta":
        with pytest.raises(Exception, match="mlfabric.torch moves CPU and CUDA tensors only"):
            arguments.scan_tensors([dense, odd], "grouped_allreduce")
    else:
        with pytest.raises((TypeError, ValueError)):
            arguments.scan_tensors([dense, odd], "grouped_allreduce")


def test_every_handle_is_released():
    tensors = [torch.randn(8) for _ in range(50)]
    for _ in range(100):
        assert tensor_meta.scan(tensors) is not None
    assert {t._use_count() for t in tensors} == {1}


def test_the_setting_turns_it_off_and_a_bad_value_is_an_error(monkeypatch):
    from mlfabric.errors import MlfabricError
    names = [arguments.dtype_name(c) for c in range(len(arguments.DTYPES))]
    monkeypatch.setattr(tensor_meta, "_SCAN", None)
    monkeypatch.setenv("MLFABRIC_TORCH_META", "0")
    assert not tensor_meta.available(names) and tensor_meta.scan([torch.ones(2)]) is None
    tensors = [torch.ones(2, 3), torch.zeros(4, dtype=torch.int64)]
    assert decoded(arguments.scan_tensors(tensors, "x")) == python_scan(tensors)
    monkeypatch.setattr(tensor_meta, "_SCAN", None)
    monkeypatch.setenv("MLFABRIC_TORCH_META", "yes")
    with pytest.raises(MlfabricError, match="MLFABRIC_TORCH_META must be 0 or 1, got 'yes'"):
        tensor_meta.available(names)


def test_a_reader_that_disagrees_with_torch_is_not_used(monkeypatch):
    # as if another torch's shim read differently (say, other dtype numbers): checked once, at
    # start, against torch's own reads; the Python path stays in charge
    import types
    from mlfabric import _C
    names = [arguments.dtype_name(c) for c in range(len(arguments.DTYPES))]

    def shifted(handles):  # the right shapes, every dtype code off by one
        sig, ptrs = _C.torch_scan(handles)
        codes, shapes = tensor_meta.decode(sig)
        return tensor_meta.signature([c + 1 for c in codes], shapes), ptrs

    for scan, on in ((_C.torch_scan, True), (shifted, False)):
        monkeypatch.setattr(tensor_meta, "_SCAN", None)
        monkeypatch.setattr(tensor_meta, "_C", types.SimpleNamespace(
            torch_shim_open=_C.torch_shim_open, torch_scan=scan))
        assert tensor_meta.available(names) is on
