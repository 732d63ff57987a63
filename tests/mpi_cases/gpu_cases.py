"""Multi-rank cases for GPU arrays over NCCL (run by tests/mpi/test_gpu.py on a machine with a GPU;
several ranks on one GPU with MLFABRIC_NCCL_SHARE_GPU=1). Every result against a float64
reference computed locally; the core collectives, mlfabric.torch, DistributedOptimizer, CuPy,
stream ordering, errors on every rank, and the bounded wait (last: it breaks the context)."""
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mlfabric as mf
import mlfabric.torch as hvd

from .common import same_everywhere, values
from .torch_api import (B, Net, _SparseNet, _adasum_reference, _data, _loss, _max_diff,
                        _rows_of, _sparse, _train_reference, broadcast_optimizer_state_pickling,
                        reference)
from .torch_api import check as host_check

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
GPU = None


def setup():
    global GPU
    torch.set_num_threads(1)
    hvd.init()
    GPU = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(GPU)


def on_gpu(v, dtype, shape=None):
    t = torch.from_numpy(np.asarray(v, np.float64)).to(getattr(torch, dtype)).to(GPU)
    return t.reshape(shape) if shape is not None else t


def check(got, want, dtype, what, mag=None):
    """got is on the GPU and, brought to the host, equals want as far as dtype holds it."""
    assert got.is_cuda, f"{what}: result not on the GPU"
    host_check(got.cpu(), want, dtype, what, mag)


# --- the core collectives -------------------------------------------------------------------------

def case_allreduce_ops_dtypes_forms():
    n, r = mf.size(), mf.rank()
    for op in ("sum", "avg", "min", "max", "prod"):
        for dtype in DTYPES:
            if op == "avg" and dtype.startswith("int") or op == "prod" and dtype == "bfloat16":
                continue
            for shape in ((), (0,), (7,), (3, 5), (100_003,)):
                count = int(np.prod(shape, dtype=np.int64))
                stack = np.stack([values(q, count, dtype, op) for q in range(n)])
                want = reference(op, stack).reshape(shape)
                mag = np.abs(stack).sum(0).reshape(shape) / (n if op == "avg" else 1) \
                    if op in ("sum", "avg") else None
                what = f"allreduce {op} {dtype} {shape}"
                x = on_gpu(stack[r], dtype, shape)
                keep = x.clone()
                check(mf.allreduce(x, op=op), want, dtype, what, mag)
                assert torch.equal(x, keep), f"{what}: input modified"
                check(mf.allreduce_async(x, op=op).wait(), want, dtype, what + " async", mag)
                y = x.clone()
                assert mf.allreduce(y, op=op, out=y) is y
                check(y, want, dtype, what + " in place", mag)
                same_everywhere(y.cpu(), what)


def case_non_contiguous_input_and_output():
    n, r = mf.size(), mf.rank()
    base = on_gpu(values(r, 60, "float64", "sum"), "float64", (6, 10))
    x = base[:, ::2]  # non-contiguous: copied on the caller's stream
    want = sum(values(q, 60, "float64", "sum").reshape(6, 10)[:, ::2] for q in range(n))
    check(mf.allreduce(x), want, "float64", "non-contiguous input")
    # A non-contiguous output is refused on its rank; the others hear of it.
    out = torch.empty((6, 10), dtype=torch.float64, device=GPU)[:, ::2] if r == 0 else \
        torch.empty((6, 5), dtype=torch.float64, device=GPU)
    err = ValueError if r == 0 else mf.MismatchError
    with pytest.raises(err, match="non-contiguous GPU array|rejected their arguments"):
        mf.allreduce(x, out=out)


def case_reduce_and_broadcast_every_root():
    n, r = mf.size(), mf.rank()
    for root in range(n):
        x = on_gpu(values(r, 513, "float32", "sum", salt=root), "float32")
        want = sum(values(q, 513, "float32", "sum", salt=root) for q in range(n))
        got = mf.reduce(x, root=root, op="sum")
        if r == root:
            check(got, want, "float32", f"reduce to {root}",
                  sum(np.abs(values(q, 513, "float32", "sum", salt=root)) for q in range(n)))
        else:
            assert got is None
        b = on_gpu(np.full(9, float(r)), "int64", (3, 3))
        assert mf.broadcast(b, root=root) is b
        check(b, np.full((3, 3), float(root)), "int64", f"broadcast from {root}")
        h = mf.broadcast_async(on_gpu(np.full(4, float(r)), "bfloat16"), root=root)
        check(h.wait(), np.full(4, float(root)), "bfloat16", f"broadcast_async from {root}")


def case_allgather_reduce_scatter_alltoall():
    n, r = mf.size(), mf.rank()
    x = on_gpu(np.arange(6) + 100 * r, "float16", (2, 3))
    want = np.concatenate([(np.arange(6) + 100 * q).reshape(2, 3) for q in range(n)])
    check(mf.allgather(x), want, "float16", "allgather")
    check(mf.allgather_async(x).wait(), want, "float16", "allgather_async")
    for rows in (2 * n, 2 * n + 1, 1):  # even blocks (NCCL's reduce-scatter) and uneven ones
        stack = np.stack([values(q, rows * 3, "float64", "sum").reshape(rows, 3)
                          for q in range(n)])
        total = stack.sum(0)
        split = np.array_split(np.arange(rows), n)[r]
        got = mf.reduce_scatter(on_gpu(stack[r], "float64"), op="sum")
        check(got, total[split], "float64", f"reduce_scatter of {rows} rows")
        got = mf.reduce_scatter_async(on_gpu(stack[r], "float64"), op="avg").wait()
        check(got, total[split] / n, "float64", f"reduce_scatter avg of {rows} rows")
    splits = [(r + q) % 3 for q in range(n)]  # rank r sends (r + q) % 3 rows to rank q
    rows = sum(splits)
    x = on_gpu(np.repeat(np.arange(rows) + 1000 * r, 2), "int32", (rows, 2))
    out, got_splits = mf.alltoall(x, splits=splits)
    want = []
    for q in range(n):
        theirs = [(q + k) % 3 for k in range(n)]
        lo = sum(theirs[:r])
        want += [np.repeat(np.arange(lo, lo + theirs[r]) + 1000 * q, 2).reshape(-1, 2)]
    check(out, np.concatenate(want), "int32", "alltoall")
    assert got_splits.tolist() == [(q + r) % 3 for q in range(n)]


def case_inputs_made_on_a_side_stream_are_waited_for():
    """The collective follows the work queued on the caller's current stream, not the default
    stream: a long matmul chain on a side stream produces the input just before the call."""
    n, r = mf.size(), mf.rank()
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device=GPU) / 64
    with torch.cuda.stream(side):
        for _ in range(20):
            a = a @ a.T / 32
        x = torch.full((1 << 20,), float(r + 1), device=GPU) + 0 * a[0, 0]
        y = mf.allreduce(x)
        h = hvd.allreduce_async(x, op=hvd.Sum)
        z = hvd.synchronize(h)
    torch.cuda.synchronize()
    want = np.full(1 << 20, n * (n + 1) / 2)
    check(y, want, "float32", "core allreduce after side-stream work")
    check(z, want, "float32", "hvd allreduce_async after side-stream work")


def case_host_and_gpu_arrays_in_one_call_fail_on_every_rank():
    n, r = mf.size(), mf.rank()
    if n < 2:
        return
    x = torch.ones(5, device=GPU) if r % 2 == 0 else torch.ones(5)
    with pytest.raises(mf.MismatchError, match="disagree on algorithm: .*nccl"):
        mf.allreduce(x)
    with pytest.raises(mf.MismatchError, match="disagree on device: cuda on rank"):
        hvd.allreduce(x)
    # and the next calls are fine
    check(mf.allreduce(torch.ones(3, device=GPU)), np.full(3, n), "float32", "after mismatch")


def case_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    n, r = mf.size(), mf.rank()
    with cupy.cuda.Device(GPU.index):
        x = cupy.asarray(values(r, 1001, "float64", "sum"))
        got = mf.allreduce(x, op="max")
        assert isinstance(got, cupy.ndarray)
        want = np.max([values(q, 1001, "float64", "sum") for q in range(n)], 0)
        assert np.array_equal(cupy.asnumpy(got), want)
        b = cupy.full(7, r, dtype=cupy.int64)
        mf.broadcast(b, root=n - 1)
        assert cupy.asnumpy(b).tolist() == [n - 1] * 7


# --- mlfabric.torch -------------------------------------------------------------------------------

def case_async_call_does_not_wait_for_work_queued_after_it():
    """An *_async call follows the work queued on the caller's stream when it is made, and only
    that: a GPU spin queued right after it (as the rest of backward is after a gradient hook
    starts a bucket) does not hold it back, so synchronize() returns while the spin still runs;
    and what the caller queues after synchronize() reads the reduced values."""
    n, r = mf.size(), mf.rank()
    x = torch.full((1 << 16,), float(r + 1), device=GPU)
    hvd.allreduce(x.clone(), op=hvd.Sum)  # the communicator exists and is connected before
    for form in ("in place", "out of place"):
        x.fill_(float(r + 1))
        h = hvd.allreduce_async_(x, op=hvd.Sum) if form == "in place" else \
            hvd.allreduce_async(x, op=hvd.Sum)
        torch.cuda._sleep(4_000_000_000)  # ~2-3 s of one SM spinning on the caller's stream
        got = hvd.synchronize(h)
        spinning = not torch.cuda.current_stream().query()
        doubled = got * 2
        torch.cuda.synchronize()
        assert spinning, f"{form}: synchronize() waited for work queued after the call"
        check(doubled, np.full(x.numel(), n * (n + 1.0)), "float32", f"{form}: result")
        mf.barrier()


def case_poll_is_false_until_the_gpu_work_is_done():
    """poll() says True only once synchronize() would return at once: not while the call's NCCL
    work, launched, still waits for the caller's stream (busy with a spin queued before the
    call), only after it."""
    import time
    n, r = mf.size(), mf.rank()
    x = torch.full((1 << 12,), float(r + 1), device=GPU)
    torch.cuda._sleep(2_000_000_000)  # ~1-2 s of the caller's stream, ahead of the call
    h = hvd.allreduce_async(x, op=hvd.Sum)
    time.sleep(0.3)  # by now the queue has (as a rule) run the call: launched, not done
    assert not hvd.poll(h), "poll() said done while the GPU had not run the call"
    deadline = time.monotonic() + 60
    while not hvd.poll(h):
        assert time.monotonic() < deadline, "poll() never said done"
        time.sleep(0.01)
    check(hvd.synchronize(h), np.full(x.numel(), n * (n + 1) / 2), "float32", "after poll")
    mf.barrier()


def case_horovod_api_on_cuda_tensors():
    n, r = hvd.size(), hvd.rank()
    fs = [on_gpu(values(r, k, "float32", "sum"), "float32") for k in (3, 1024, 1)]
    for k, (x, o) in enumerate(zip(fs, hvd.grouped_allreduce(fs, op=hvd.Average))):
        want = sum(values(q, x.numel(), "float32", "sum") for q in range(n)) / n
        check(o, want, "float32", f"grouped_allreduce[{k}]",
              sum(np.abs(values(q, x.numel(), "float32", "sum")) for q in range(n)) / n)
    xs = fs + [on_gpu(values(r, 5, "int64", "sum"), "int64")]  # two dtypes: two fused calls
    # the in-place grouped form twice (its staging buffer on the GPU is kept and reused)
    for step in range(2):
        ys = [x.clone() for x in xs]
        hvd.grouped_allreduce_(ys, op=hvd.Sum)
        for k, (x, y) in enumerate(zip(xs, ys)):
            dtype = "int64" if x.dtype == torch.int64 else "float32"
            want = sum(values(q, x.numel(), dtype, "sum") for q in range(n))
            check(y, want, dtype, f"grouped_allreduce_ step {step} [{k}]",
                  sum(np.abs(values(q, x.numel(), dtype, "sum")) for q in range(n)))
    # widened dtypes travel as int64 on the GPU too
    u = torch.full((4,), r + 1, dtype=torch.uint8, device=GPU)
    got = hvd.allreduce(u, op=hvd.Sum)
    assert got.dtype == torch.uint8 and got.is_cuda
    assert got.cpu().tolist() == [n * (n + 1) // 2 % 256] * 4
    g = hvd.allgather(torch.full((r + 1, 2), float(r), device=GPU))  # uneven first dimensions
    want = np.concatenate([np.full((q + 1, 2), float(q)) for q in range(n)])
    check(g, want, "float32", "allgather uneven")
    b = hvd.broadcast(torch.arange(6, device=GPU) * (r + 1), root_rank=0)
    assert b.cpu().tolist() == list(range(6))
    out = hvd.alltoall(torch.arange(n, device=GPU) + 10 * r)
    assert out.cpu().tolist() == [r + 10 * q for q in range(n)]
    # reducescatter: rows that do not divide by size(), Average and Sum, async, widened
    for rows, dtype, op in ((2 * n + 1, "float64", hvd.Average), (max(n - 1, 1), "int8", hvd.Sum)):
        stack = np.stack([values(q, rows * 3, "float64", "sum", salt=rows) if dtype == "float64"
                          else np.abs(values(q, rows * 3, "int32", "sum", salt=rows)) % 100
                          for q in range(n)]).reshape(n, rows, 3)
        lo, k = _rows_of(rows, n, r)
        want = (stack.sum(0) / (n if op == hvd.Average else 1))[lo:lo + k]
        x = on_gpu(stack[r], dtype)
        check(hvd.reducescatter(x, op=op), want, dtype, f"reducescatter {dtype}")
        check(hvd.synchronize(hvd.reducescatter_async(x, op=op)), want, dtype,
              f"reducescatter async {dtype}")
        # grouped: the same tensor twice in one list, with another of a different dtype
        grouped = hvd.grouped_reducescatter([x, on_gpu(stack[r], "float32"), x], op=op)
        assert all(t.is_cuda for t in grouped)
        check(grouped[0], want, dtype, f"grouped_reducescatter {dtype}")
        check(grouped[2], want, dtype, f"grouped_reducescatter {dtype} again")
        check(grouped[1], want, "float32", f"grouped_reducescatter {dtype} as float32")
    # op=Adasum: the tree computed on the GPU, against the host reference
    stack = np.stack([values(q, 8, "float64", "sum", salt=4) for q in range(n)])
    got = hvd.allreduce(on_gpu(stack[r], "float64"), op=hvd.Adasum)
    assert got.is_cuda
    check(got, _adasum_reference(stack), "float64", "adasum")
    # grouped allgather: uneven first dimensions, two dtypes, a tensor with no rows on rank 0
    want = np.concatenate([np.full((q + 1, 2), float(q)) for q in range(n)])
    ga, gb = hvd.grouped_allgather([torch.full((r + 1, 2), float(r), device=GPU),
                                    torch.full((r,), r, dtype=torch.int8, device=GPU)])
    assert ga.is_cuda and gb.is_cuda
    check(ga, want, "float32", "grouped_allgather")
    check(gb, np.concatenate([np.full(q, q) for q in range(n)]), "int8", "grouped_allgather int8")
    # autograd: the gradient of an allreduce is the allreduce of the gradient
    w = torch.ones(3, device=GPU, requires_grad=True)
    (hvd.allreduce(w * (r + 1), op=hvd.Sum) * (r + 1)).sum().backward()
    check(w.grad, np.full(3, n * (n + 1) / 2 * (r + 1)), "float32", "autograd")
    # of a reducescatter, Horovod's: the allgather of the gradient times size() for op Sum;
    # grad="local": the allgather of the gradient (the local derivative)
    gathered = np.repeat(np.arange(1.0, n + 1), 2).reshape(n, 2)
    for grad, times in (("horovod", n), ("local", 1)):
        w = torch.ones(n, 2, device=GPU, requires_grad=True)
        kw = {"grad": "local"} if grad == "local" else {}
        (hvd.reducescatter(w, op=hvd.Sum, **kw) * (r + 1)).sum().backward()
        check(w.grad, gathered * times, "float32", f"reducescatter autograd ({grad})")


def case_sync_batch_norm_on_gpu():
    """SyncBatchNorm on CUDA tensors (uneven batches) against torch's BatchNorm1d in float64 on
    the concatenated batch: output, input gradient, the summed weight gradient, running stats."""
    n, r = hvd.size(), hvd.rank()
    batches = [torch.from_numpy(values(q, (2 + q) * 3, "float64", "sum", salt=9)).view(-1, 3)
               for q in range(n)]
    dys = [torch.from_numpy(values(q, (2 + q) * 3, "float64", "sum", salt=10)).view(-1, 3)
           for q in range(n)]
    ref = torch.nn.BatchNorm1d(3).double()
    xs = torch.cat(batches).requires_grad_(True)
    (ref(xs) * torch.cat(dys)).sum().backward()
    lo = sum(b.shape[0] for b in batches[:r])
    bn = hvd.SyncBatchNorm(3).to(GPU)
    x = batches[r].float().to(GPU).requires_grad_(True)
    out = bn(x)
    (out * dys[r].float().to(GPU)).sum().backward()
    assert out.is_cuda and x.grad.is_cuda
    want = ref(xs.detach())[lo:lo + batches[r].shape[0]]  # ref now in train mode: same stats
    assert torch.allclose(out.double().cpu(), want.detach(), atol=1e-5), "output"
    assert torch.allclose(x.grad.double().cpu(), xs.grad[lo:lo + batches[r].shape[0]],
                          atol=1e-5), "input gradient"
    wsum = hvd.allreduce(bn.weight.grad, op=hvd.Sum)
    assert torch.allclose(wsum.double().cpu(), ref.weight.grad, atol=1e-5), "weight gradient"
    # ref ran forward twice; its running stats after one step are those of a fresh layer
    once = torch.nn.BatchNorm1d(3).double()
    once(xs.detach())
    assert torch.allclose(bn.running_mean.double().cpu(), once.running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var.double().cpu(), once.running_var, atol=1e-6)


def case_process_sets_on_gpu():
    """Collectives among the even and the odd ranks on CUDA tensors (each set gets an NCCL
    communicator of its own), interleaved with a global one, against float64 references."""
    n, r = hvd.size(), hvd.rank()
    even = hvd.add_process_set(list(range(0, n, 2)))
    odd = hvd.add_process_set(list(range(1, n, 2))) if n > 1 else None
    mine = even if r % 2 == 0 else odd
    x = torch.from_numpy(values(r, 1000, "float64", "sum", salt=11))
    h = hvd.allreduce_async(x.to(GPU), op=hvd.Sum, process_set=mine)
    total = hvd.allreduce(x.to(GPU), op=hvd.Sum)
    got = hvd.synchronize(h)
    want = sum(torch.from_numpy(values(q, 1000, "float64", "sum", salt=11)) for q in mine.ranks)
    assert got.is_cuda and torch.allclose(got.cpu(), want, rtol=1e-12), "set allreduce"
    every = sum(torch.from_numpy(values(q, 1000, "float64", "sum", salt=11)) for q in range(n))
    assert torch.allclose(total.cpu(), every, rtol=1e-12), "global allreduce"
    gathered = hvd.allgather(torch.full((2,), float(r), device=GPU), process_set=mine)
    assert gathered.cpu().tolist() == [float(q) for q in mine.ranks for _ in range(2)]
    root = mine.ranks[-1]
    b = hvd.broadcast(torch.full((3,), float(r), device=GPU), root, process_set=mine)
    assert b.cpu().tolist() == [float(root)] * 3
    for ps in (even, odd):
        if ps is not None:
            hvd.remove_process_set(ps)


def case_join_on_gpu():
    n, r = hvd.size(), hvd.rank()
    for s in range(r + 1):
        active = list(range(s, n))
        xs = {q: values(q, 9, "float64", "sum", salt=s) for q in range(n)}
        got = hvd.allreduce(on_gpu(xs[r], "float64"), op=hvd.Sum)
        check(got, sum(xs[q] for q in active), "float64", f"join sum step {s}")
        got = hvd.allgather(torch.full((2,), float(r), device=GPU))
        check(got, np.repeat([float(q) for q in active], 2), "float32", f"join allgather {s}")
        lo, k = _rows_of(2 * n, n, r)
        got = hvd.reducescatter(on_gpu(np.full((2 * n, 2), r + 1.0), "float32"), op=hvd.Max)
        check(got, np.full((k, 2), float(n)), "float32", f"join reducescatter max {s}")
    # all_calls: the joined ranks take part in the others' allgathers too
    assert hvd.join(all_calls=True) == n - 1


def case_distributed_optimizer_on_gpu_matches_single_process():
    n, r = hvd.size(), hvd.rank()
    for passes, threshold in ((1, None), (2, "64")):
        if threshold is not None:
            os.environ["MLFABRIC_FUSION_THRESHOLD"] = threshold
        try:
            model = Net(seed=5).double()
            model.bn = torch.nn.Identity()
            model = model.to(GPU)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9),
                                           named_parameters=model.named_parameters(),
                                           backward_passes_per_step=passes)
            assert all(b.flat.is_cuda for b in opt._mlf_buckets)
            x, y = _data(n, 3, passes)
            mine = slice(r * B, (r + 1) * B)
            for s in range(3):
                opt.zero_grad()
                for m in range(passes):
                    _loss(model, x[s, m, mine].to(GPU), y[s, m, mine].to(GPU)).backward()
                opt.step()
        finally:
            os.environ.pop("MLFABRIC_FUSION_THRESHOLD", None)
        want = _train_reference(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                hvd.Average, passes, 3)
        diff = _max_diff(model.cpu(), want)
        assert diff < 1e-10, f"passes={passes}: GPU weights differ from one process by {diff}"


def case_sparse_gradients_on_gpu():
    """sparse_allreduce_async of CUDA sparse tensors (ranks with 0, 2 or 4 entries) against the
    float64 average; DistributedOptimizer over an embedding with sparse gradients on the GPU
    (a rank skipping it in one step): the weights of one process on the concatenated batch."""
    n, r = hvd.size(), hvd.rank()
    want = torch.stack([_sparse(q).to_dense() for q in range(n)]).sum(0) / n
    got = hvd.synchronize(hvd.sparse_allreduce_async(_sparse(r).to(GPU), op=hvd.Average))
    assert got.is_cuda and got.layout == torch.sparse_coo
    assert (got.to_dense().cpu() - want).abs().max() < 1e-12, "sparse allreduce"
    ids = torch.randint(0, 11, (3, n, 5), generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, n, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    uses = lambda s, q: not (s == 1 and q == n - 1 and n > 1)  # noqa: E731
    ref, mine = _SparseNet(), _SparseNet().to(GPU)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.1))
    for s in range(3):
        ref_opt.zero_grad()
        (sum(ref.loss(ids[s, q], x[s, q], uses(s, q)) for q in range(n)) / n).backward()
        ref_opt.step()
        opt.zero_grad()
        mine.loss(ids[s, r].to(GPU), x[s, r].to(GPU), uses(s, r)).backward()
        opt.step()
        assert mine.emb.weight.grad.is_cuda and mine.emb.weight.grad.layout == torch.sparse_coo
    diff = max((a.cpu() - b).abs().max().item() for a, b in zip(mine.parameters(),
                                                                 ref.parameters()))
    assert diff < 1e-12, f"GPU weights differ from one process by {diff}"


def case_ddp_over_the_mlfabric_backend_on_gpu():
    import torch.distributed as dist
    n, r = hvd.size(), hvd.rank()
    if not dist.is_initialized():
        dist.init_process_group("mlfabric")
    model = Net(seed=5).double()
    model.bn = torch.nn.Identity()
    ddp = torch.nn.parallel.DistributedDataParallel(model.to(GPU), device_ids=[GPU.index],
                                                    find_unused_parameters=True)  # Net.unused
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(n, 3, 1)
    mine = slice(r * B, (r + 1) * B)
    for s in range(3):
        opt.zero_grad()
        _loss(ddp, x[s, 0, mine].to(GPU), y[s, 0, mine].to(GPU)).backward()
        opt.step()
    want = _train_reference(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                            hvd.Average, 1, 3)
    diff = _max_diff(ddp.module.cpu(), want)
    assert diff < 1e-10, f"DDP on GPU over mlfabric: weights differ from one process by {diff}"


def case_broadcast_parameters_mixing_gpu_and_host_tensors():
    """Buffers are fused per device and dtype: CUDA parameters beside a CPU tensor (as an
    optimizer's state holds CPU step counts beside CUDA moments) all get the root's values."""
    n, r = hvd.size(), hvd.rank()
    named = [("w", torch.full((5,), float(r), device=GPU)),
             ("step", torch.tensor(float(10 + r))),
             ("b", torch.full((2, 2), float(r), device=GPU, dtype=torch.float64))]
    hvd.broadcast_parameters(named, root_rank=n - 1)
    assert named[0][1].is_cuda and named[0][1].cpu().tolist() == [n - 1.0] * 5
    assert not named[1][1].is_cuda and named[1][1].item() == 10.0 + n - 1
    assert named[2][1].cpu().tolist() == [[n - 1.0] * 2] * 2


def case_broadcast_optimizer_state_of_cuda_parameters():
    """The root's Adam state (moments on its GPU) is sent as host copies, broadcast as tensors
    (pickled as CUDA tensors it would land on the root's GPU index on every rank), and loaded
    onto each rank's own parameters' GPU, with the root's values."""
    n, r = hvd.size(), hvd.rank()
    model = torch.nn.Linear(4, 3).to(GPU)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == n - 1:
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
    sent = broadcast_optimizer_state_pickling(opt, n - 1)
    if r == n - 1:  # what went pickled: the structure, with no tensor in it
        pickled = [t for s in sent[0]["state"].values() for t in s.values()
                   if isinstance(t, torch.Tensor)]
        assert sent[0]["state"] and not pickled, [t.device for t in pickled]
    assert opt.param_groups[0]["lr"] == 0.01 * n
    state = opt.state_dict()["state"]
    assert sorted(state) == [0, 1]
    for p, s in zip(model.parameters(), (state[0], state[1])):
        for key in ("exp_avg", "exp_avg_sq"):
            assert s[key].device == p.device, (key, s[key].device)
            got = hvd.broadcast(s[key], root_rank=n - 1)  # the root's, to compare with
            assert torch.equal(s[key], got), key
        assert float(s["step"]) == 1.0
    model(torch.ones(2, 4, device=GPU)).sum().backward()
    opt.step()  # the loaded state works with this rank's parameters


def case_first_gpu_call_an_alltoall_where_a_rank_moves_nothing():
    """A fresh context's NCCL communicator is made at its first GPU call on every rank, even
    where a rank then has nothing to send or receive (making it is collective)."""
    n, r = hvd.size(), hvd.rank()
    if n < 2:
        return
    hvd.shutdown()   # (destroys the communicator made so far)
    hvd.init()
    assert mf.context.get().nccl is None
    splits = [0] * n if r == 0 else [0] + [1] * (n - 1)   # rank 0 moves nothing at all
    x = torch.arange(sum(splits), device=GPU, dtype=torch.float32) + 100 * r
    out, got = mf.alltoall(x, splits)
    assert got.tolist() == ([0] * n if r == 0 else [0] + [1] * (n - 1))
    want = [] if r == 0 else [100.0 * q + (r - 1) for q in range(1, n)]
    assert out.is_cuda and out.cpu().tolist() == want
    assert mf.context.get().nccl is not None and mf.context.get().nccl.failed is None


# --- last: a hung NCCL collective is bounded, and leaves the context unusable -------------------

def case_zz_hung_nccl_collective_times_out_and_aborts():
    """Only rank 0 launches an NCCL allreduce (below the public API, which would have refused
    the mismatch): it must raise PeerTimeoutError within MLFABRIC_TIMEOUT, abort the
    communicator, and refuse later GPU calls at once."""
    n, r = mf.size(), mf.rank()
    if n < 2:
        return
    ctx = mf.context.get()
    x = torch.ones(1 << 16, device=GPU)
    mf.allreduce(x)  # the communicator exists, and has run this very call, on every rank
    comm = ctx.nccl
    os.environ["MLFABRIC_TIMEOUT"] = "3"
    ev = torch.cuda.Event()
    ev.record()
    world = MPI.COMM_WORLD
    if r == 0:
        with pytest.raises(mf.PeerTimeoutError, match="did not finish within 3 s"):
            comm.allreduce("allreduce (test)", mf._device.devices_of(x), ev, x.data_ptr(),
                           x.data_ptr(), x.numel(), 0, 0, False)
        assert comm.failed
        with pytest.raises(mf.MlfabricError, match="NCCL communicator is unusable"):
            comm.allreduce("again", mf._device.devices_of(x), None, x.data_ptr(), x.data_ptr(),
                           x.numel(), 0, 0, False)
        assert ctx.broken()
    world.Barrier()  # the peers leave the communicator alone until rank 0 has timed out
    if r != 0:
        comm.abort("the test's peer timed out")  # as a rank learning of the failure would
        assert ctx.broken()
