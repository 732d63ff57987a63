"""The native reader of tensors' metadata (mlfabric/torch/tensor_meta.py, csrc/torch_meta.cc):
the same dtypes, shapes and addresses as torch's Python API, None for what it cannot read, and
every handle it is given released. One process: it reads tensors, nothing moves."""
import pytest

torch = pytest.importorskip("torch")

from mlfabric.torch import ops, tensor_meta  # noqa: E402


def python_scan(tensors):
    """What ops._scan's Python path reads: ((codes, shapes), addresses or None)."""
    return ((tuple(ops._DTYPE_CODE[t.dtype] for t in tensors), tuple(tuple(t.shape)
                                                                     for t in tensors)),
            [t.data_ptr() if t.is_contiguous() else None for t in tensors])


def test_the_native_reader_is_on_with_the_pinned_torch():
    # CI pins torch 2.13, which has the shim: a reader silently off would go unnoticed
    assert tensor_meta.available(ops._dtype_name(c) for c in range(len(ops._DTYPES)))


def test_it_reads_what_torch_reads():
    base = torch.arange(40, dtype=torch.float64)
    tensors = [torch.randn(3, 4), base[5:17].view(3, 4), base.view(5, 8).t(), base[3],
               torch.zeros(0), torch.zeros(2, 0, 3), torch.nn.Parameter(torch.ones(6)),
               torch.randn(5, requires_grad=True), torch.randn(2, 3, 4, 5, 6, 7, 2, 1, 3)]
    tensors += [torch.zeros(3, dtype=dt) for dt in ops._DTYPES]
    got = tensor_meta.scan(tensors)
    assert got == python_scan(tensors)
    assert got[1][2] is None and got[1][1] == base.data_ptr() + 5 * 8   # an offset view
    assert tensor_meta.scan(tuple(tensors)) == got
    assert tensor_meta.scan([]) == (((), ()), [])
    assert ops._scan(tensors, "x") == got   # ops uses it


@pytest.mark.parametrize("odd", [
    3, None, torch.zeros(2).to_sparse(), torch.zeros(2, dtype=torch.complex64),
    torch.zeros(2, device="meta"), torch.zeros(2, dtype=torch.uint32)])
def test_what_it_cannot_read_is_left_to_the_python_checks(odd):
    dense = torch.zeros(4)
    assert tensor_meta.scan([dense, odd]) is None
    assert dense._use_count() == 1   # the handle made for `dense` was released
    if isinstance(odd, torch.Tensor) and odd.device.type == "meta":
        with pytest.raises(Exception, match="mlfabric.torch moves CPU and CUDA tensors only"):
            ops._scan([dense, odd], "grouped_allreduce")
    else:
        with pytest.raises((TypeError, ValueError)):
            ops._scan([dense, odd], "grouped_allreduce")


def test_every_handle_is_released():
    tensors = [torch.randn(8) for _ in range(50)]
    for _ in range(100):
        assert tensor_meta.scan(tensors) is not None
    assert {t._use_count() for t in tensors} == {1}
