"""Multi-rank cases for the torch.distributed backend "mlfabric" (mlfabric/torch/backend.py): every
collective through the torch.distributed API against a float64 numpy reference, futures, bad
input as an error on every rank, and DDP over mlfabric against DDP over gloo in the same job.

The world group is init_process_group("mlfabric") with none of torch's env:// variables set; the
gloo group the DDP comparison needs is a new_group beside it (it uses the TCPStore the mlfabric
rendezvous serves)."""
import contextlib
import os
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions
from torch.nn.parallel import DistributedDataParallel as DDP

import mlfabric as mf
from mlfabric.torch import backend

from .common import assert_close, magnitude, reference, same_everywhere, values

R = dist.ReduceOp
TORCH_OPS = {"sum": R.SUM, "avg": R.AVG, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
                "int64": torch.int64, "bfloat16": torch.bfloat16}
_groups = {}


def setup():
    for var in backend._ENV_VARS:  # the point: nothing set, MPI supplies ranks and store
        os.environ.pop(var, None)
    dist.init_process_group("mlfabric")
    _groups["gloo"] = dist.new_group(backend="gloo")


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


def _n_r():
    return dist.get_world_size(), dist.get_rank()


def _input(rank, count, dtype, op, salt=0):
    """Rank's input as a torch tensor of dtype, and its exact float64 values."""
    v = values(rank, count, dtype, op, salt)
    return torch.from_numpy(v).to(TORCH_DTYPES[dtype]), v


def _expect_everywhere(exc_types, fn, *needles):
    """fn raises on this rank (one of exc_types, message naming needles); returns the message."""
    with pytest.raises(exc_types) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def _still_works():
    n, _ = _n_r()
    t = torch.ones(100, dtype=torch.float64)
    dist.all_reduce(t)
    assert (t == n).all()


@contextlib.contextmanager
def _naming(what):
    """A failed check inside (pytest's "DID NOT RAISE" too) names the call it was about."""
    try:
        yield
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{what}: {exc}") from None


def _refused_on(bad, what, fn, *needles, call=None):
    """fn raises on rank `bad` its own ValueError (naming needles), on every other rank a
    MismatchError naming `bad` (and the call, if given); then the group still works."""
    _, r = _n_r()
    with _naming(what):
        if r == bad:
            _expect_everywhere(ValueError, fn, *needles)
        else:
            _expect_everywhere(mf.MismatchError, fn, f"rank(s) [{bad}] rejected",
                               *([f"{call}: "] if call else []))
    _still_works()


# --- setup ------------------------------------------------------------------------------------

def case_init_without_env_vars_takes_mpi_ranks():
    n, r = _n_r()
    assert (r, n) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size) == (mf.rank(), mf.size())
    assert dist.get_backend() == "mlfabric"
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, backend.MlfabricProcessGroup) and pg.getBackendName() == "mlfabric"
    assert not any(os.environ.get(v) for v in backend._ENV_VARS)


def case_env_rendezvous_untouched_when_its_variables_are_set():
    # The MPI fallback only takes over where env:// would fail for want of every variable.
    rdzv = backend._rdzv
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    try:
        _expect_everywhere(ValueError, lambda: next(rdzv.rendezvous("env://")), "RANK")
    finally:
        del os.environ["MASTER_ADDR"]


# --- reductions -------------------------------------------------------------------------------

def case_all_reduce_every_op_and_dtype():
    n, r = _n_r()
    for dtype in TORCH_DTYPES:
        for op, rop in TORCH_OPS.items():
            if op == "avg" and dtype.startswith("int"):
                continue
            for count in (0, 1, 7, 1021):
                t, _ = _input(r, count, dtype, op)
                dist.all_reduce(t, op=rop)
                inputs = [values(q, count, dtype, op) for q in range(n)]
                what = f"all_reduce {op} {dtype} n={count}"
                assert_close(t, reference(op, inputs, n), dtype, what, magnitude(op, inputs, n))
                same_everywhere(t, what)


def case_all_reduce_async_future_and_noncontiguous():
    n, r = _n_r()
    base, v = _input(r, 60, "float64", "sum")
    want = reference("sum", [values(q, 60, "float64", "sum") for q in range(n)], n)
    t = base.reshape(6, 10).t()  # a non-contiguous view: results must land in base
    work = dist.all_reduce(t, async_op=True)
    doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
    assert work.wait() is True and work.is_completed()
    assert_close(base, want, "float64", "non-contiguous all_reduce")
    assert_close(doubled.wait().t().reshape(-1), 2 * want, "float64", "future chain")


def case_future_callback_may_wait_for_another_collective():
    n, _ = _n_r()
    a, b = torch.ones(4), torch.full((4,), 2.0)

    def then(fut):  # runs once `a` is reduced; waits for a second collective inside
        return fut.value()[0] + dist.all_reduce(b, async_op=True).get_future().wait()[0]
    got = dist.all_reduce(a, async_op=True).get_future().then(then).wait()
    assert torch.equal(got, torch.full((4,), 3.0 * n))
    work = dist.broadcast(torch.arange(3.0), src=0, async_op=True)
    assert torch.equal(work.result()[0], torch.arange(3.0)) and work.is_completed()


def case_all_reduce_list_and_coalesced():
    n, r = _n_r()
    # gloo's per-device form: every tensor gets the reduction over ranks and list entries.
    a, va = _input(r, 9, "float64", "sum", salt=1)
    b, vb = _input(r, 9, "float64", "sum", salt=2)
    dist.distributed_c10d._get_default_group().allreduce([a, b]).wait()
    want = sum(values(q, 9, "float64", "sum", s) for q in range(n) for s in (1, 2))
    assert_close(a, want, "float64", "list allreduce")
    assert_close(b, want, "float64", "list allreduce")
    # Coalesced: several tensors of one dtype, any shapes, one call.
    shapes = [(3,), (2, 5), (0,), (4, 1, 2)]
    ts = [_input(r, int(np.prod(s)), "float32", "max", salt=i)[0].reshape(s)
          for i, s in enumerate(shapes)]
    dist.all_reduce_coalesced(ts, op=R.MAX)
    for i, (s, t) in enumerate(zip(shapes, ts)):
        c = int(np.prod(s))
        want = reference("max", [values(q, c, "float32", "max", salt=i) for q in range(n)], n)
        assert_close(t.reshape(-1), want, "float32", f"coalesced {s}")


def case_reduce_scatter_forms():
    n, r = _n_r()
    for op in ("sum", "avg", "min"):
        c = 5
        # list form: input i goes to rank i
        inputs = [_input(r, c, "float64", op, salt=i)[0] for i in range(n)]
        out = torch.empty(c, dtype=torch.float64)
        dist.reduce_scatter(out, inputs, op=TORCH_OPS[op])
        want = reference(op, [values(q, c, "float64", op, salt=r) for q in range(n)], n)
        assert_close(out, want, "float64", f"reduce_scatter {op}")
        # tensor form: rank i gets block i
        full, _ = _input(r, n * c, "float64", op, salt=9)
        out = torch.empty(c, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, full, op=TORCH_OPS[op])
        want = reference(op, [values(q, n * c, "float64", op, salt=9) for q in range(n)], n)
        assert_close(out, want[r * c:(r + 1) * c], "float64", f"reduce_scatter_tensor {op}")
    # coalesced pairs, as FSDP issues them
    sizes = (3, 1, 4)
    ins = [_input(r, n * k, "float32", "sum", salt=20 + i)[0] for i, k in enumerate(sizes)]
    outs = [torch.empty(k) for k in sizes]
    dist.distributed_c10d._get_default_group().reduce_scatter_single_coalesced(
        outs, ins, ReduceScatterOptions()).wait()
    for i, (k, o) in enumerate(zip(sizes, outs)):
        want = reference("sum", [values(q, n * k, "float32", "sum", salt=20 + i)
                                 for q in range(n)], n)
        assert_close(o, want[r * k:(r + 1) * k], "float32", f"coalesced reduce_scatter {k}")


def case_gather_and_scatter_in_place_in_one_tensor():
    """torch's in-place forms (FSDP's): all_gather_into_tensor whose input is this rank's part
    of the output, reduce_scatter_tensor whose output is this rank's part of the input."""
    n, r = _n_r()
    c = 4
    for op in ("sum", "max"):
        full, _ = _input(r, n * c, "float64", op, salt=30)
        mine = full[r * c:(r + 1) * c]
        dist.reduce_scatter_tensor(mine, full, op=TORCH_OPS[op])
        want = reference(op, [values(q, n * c, "float64", op, salt=30) for q in range(n)], n)
        assert_close(mine, want[r * c:(r + 1) * c], "float64", f"reduce_scatter_tensor {op}")
    out = torch.zeros(n * c, dtype=torch.float64)
    out[r * c:(r + 1) * c] = _input(r, c, "float64", "sum", salt=31)[0]
    dist.all_gather_into_tensor(out, out[r * c:(r + 1) * c])
    want = np.concatenate([values(q, c, "float64", "sum", salt=31) for q in range(n)])
    assert_close(out, want, "float64", "all_gather_into_tensor in place")


def case_reduce_to_each_root():
    n, r = _n_r()
    for root in range(n):
        t, v = _input(r, 11, "int64", "sum", salt=root)
        dist.reduce(t, dst=root)
        if r == root:
            want = reference("sum", [values(q, 11, "int64", "sum", root) for q in range(n)], n)
            assert_close(t, want, "int64", "reduce")
        else:
            assert (t.numpy() == v).all(), "reduce changed a non-root tensor"


# --- data movement ----------------------------------------------------------------------------

def _rank_tensor(rank, dtype, count=6):
    """A tensor of any dtype whose values say which rank made it."""
    v = torch.arange(count) + 10 * rank
    if dtype == torch.bool:
        return (v + rank) % 2 == 0
    if dtype.is_complex:
        return torch.complex(v.double(), -v.double()).to(dtype)
    return v.to(dtype)


CARRIED = (torch.float64, torch.float16, torch.int64, torch.uint8, torch.int8, torch.bool,
           torch.complex64)


def case_broadcast_from_each_root_any_dtype():
    n, r = _n_r()
    for root in range(n):
        for dtype in CARRIED:
            t = _rank_tensor(r, dtype)
            dist.broadcast(t, src=root)
            assert torch.equal(t, _rank_tensor(root, dtype)), f"broadcast {dtype} root {root}"
    base = torch.arange(12.0).reshape(3, 4) + r
    view = base[:, 1]  # non-contiguous
    dist.broadcast(view, src=n - 1)
    assert torch.equal(view, torch.tensor([1.0, 5.0, 9.0]) + n - 1)
    assert torch.equal(base[:, 0], torch.tensor([0.0, 4.0, 8.0]) + r)  # the rest untouched


def case_all_gather_forms():
    n, r = _n_r()
    for dtype in CARRIED:
        outs = [torch.empty(6, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, _rank_tensor(r, dtype))
        for q in range(n):
            assert torch.equal(outs[q], _rank_tensor(q, dtype)), f"all_gather {dtype}"
        out = torch.empty(n, 6, dtype=dtype)
        dist.all_gather_into_tensor(out, _rank_tensor(r, dtype))
        assert torch.equal(out, torch.stack([_rank_tensor(q, dtype) for q in range(n)]))
    # coalesced pairs, as FSDP issues them
    ins = [torch.arange(k, dtype=torch.float64) + 100 * r for k in (2, 0, 5)]
    outs = [torch.empty(n * i.numel(), dtype=torch.float64) for i in ins]
    dist.distributed_c10d._get_default_group().all_gather_single_coalesced(
        outs, ins, AllgatherOptions()).wait()
    for i, o in zip(ins, outs):
        want = torch.cat([torch.arange(i.numel(), dtype=torch.float64) + 100 * q
                          for q in range(n)])
        assert torch.equal(o, want)
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "name": f"r{r}"})
    assert objs == [{"rank": q, "name": f"r{q}"} for q in range(n)]


def case_gather_scatter_to_each_root():
    n, r = _n_r()
    for root in range(n):
        outs = [torch.empty(6, dtype=torch.int32) for _ in range(n)] if r == root else None
        dist.gather(_rank_tensor(r, torch.int32), outs, dst=root)
        if r == root:
            assert all(torch.equal(outs[q], _rank_tensor(q, torch.int32)) for q in range(n))
        out = torch.empty(6, dtype=torch.float32)
        pieces = [_rank_tensor(q, torch.float32) * 3 for q in range(n)] if r == root else None
        dist.scatter(out, pieces, src=root)
        assert torch.equal(out, _rank_tensor(r, torch.float32) * 3)
    objs = [f"obj{root}" for root in range(n)] if r == 0 else [None] * n
    dist.broadcast_object_list(objs, src=0)
    assert objs == [f"obj{q}" for q in range(n)]


def case_all_to_all_equal_splits():
    n, r = _n_r()
    k = 3
    inp = torch.arange(n * k, dtype=torch.float64) + 1000 * r  # block j goes to rank j
    out = torch.empty(n * k, dtype=torch.float64)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(r * k, (r + 1) * k, dtype=torch.float64) + 1000 * j
                      for j in range(n)])
    assert torch.equal(out, want)
    ins = [torch.full((2, 2), 10 * r + j, dtype=torch.int64) for j in range(n)]
    outs = [torch.empty(2, 2, dtype=torch.int64) for _ in range(n)]
    dist.all_to_all(outs, ins)
    assert all(torch.equal(outs[j], torch.full((2, 2), 10 * j + r)) for j in range(n))


# all_to_all with split sizes of any kind: every rank regenerates every rank's input (its rows for
# each peer, from a seed), so each computes its own reference.
A2A_DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.complex64,
              torch.bool, torch.uint8)


def _a2a_splits(n, salt):
    """rows[i][j]: rows rank i sends rank j (0 to 3; salt 1: the last rank sends nothing and the
    first receives nothing, salt 2: all equal, salt 3: the last rank neither sends nor receives,
    rank 0 sends itself some)."""
    if salt == 2:
        return [[2] * n for _ in range(n)]
    rows = np.random.default_rng(zlib.crc32(f"splits/{n}/{salt}".encode())).integers(0, 4, (n, n))
    rows[0, n - 1] = 0
    if salt == 1:
        rows[n - 1, :] = 0
        rows[:, 0] = 0
    if salt == 3:
        rows[n - 1, :] = rows[:, n - 1] = 0
        rows[0, 0] = 2 if n > 1 else 0
    return rows.tolist()


def _a2a_block(i, j, rows, trail, dtype, salt=0):
    """The rows rank i sends rank j: values exact in every dtype, different for every (i, j)."""
    rng = np.random.default_rng(zlib.crc32(f"block/{i}/{j}/{dtype}/{trail}/{salt}".encode()))
    shape = (rows, *trail)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, shape).astype(bool))
    v = torch.from_numpy(rng.integers(-100 if dtype != torch.uint8 else 0, 100, shape))
    if dtype.is_complex:
        w = torch.from_numpy(rng.integers(-100, 100, shape))
        return torch.complex(v.double(), w.double()).to(dtype)
    return v.to(dtype)


def _a2a_inputs(r, rows, trail, dtype, salt=0):
    return torch.cat([_a2a_block(r, j, rows[r][j], trail, dtype, salt)
                      for j in range(len(rows))])


def _a2a_want(r, rows, trail, dtype, salt=0):
    return torch.cat([_a2a_block(j, r, rows[j][r], trail, dtype, salt)
                      for j in range(len(rows))])


@contextlib.contextmanager
def _allgather_bytes(limit):
    """Equal splits moved by an allgather up to `limit` bytes (the same on every rank)."""
    old, backend._ALLGATHER_BYTES = backend._ALLGATHER_BYTES, limit
    try:
        yield
    finally:
        backend._ALLGATHER_BYTES = old


def case_all_to_all_single_unequal_splits():
    """Unequal split sizes (zeros too: a rank that sends nothing, one that receives nothing),
    every carried dtype, rows of several shapes: exactly the rows each rank sent this one, in
    rank order; also async, into a non-contiguous output, and with no splits given (equal),
    by the allgather and by the alltoall."""
    n, r = _n_r()
    for salt in (0, 1, 2, 3):
        rows = _a2a_splits(n, salt)
        send, recv = rows[r], [rows[j][r] for j in range(n)]
        for dtype in A2A_DTYPES:
            for trail in ((), (3,), (2, 2)):
                for limit in (0, 1 << 30):  # equal splits: by the alltoall, by the allgather
                    what = f"all_to_all_single rows={rows} {dtype} rows of {trail} {limit}"
                    inp = _a2a_inputs(r, rows, trail, dtype)
                    out = torch.empty(sum(recv), *trail, dtype=dtype)
                    with _naming(what), _allgather_bytes(limit):
                        dist.all_to_all_single(out, inp, recv, send)
                    assert torch.equal(out, _a2a_want(r, rows, trail, dtype)), what
                    if salt != 2:
                        break
    rows = _a2a_splits(n, 0)
    send, recv = rows[r], [rows[j][r] for j in range(n)]
    want = _a2a_want(r, rows, (3,), torch.float64)
    # async: the future gives the output; into a non-contiguous one (a transposed view)
    base = torch.zeros(3, sum(recv), dtype=torch.float64)
    work = dist.all_to_all_single(base.t(), _a2a_inputs(r, rows, (3,), torch.float64), recv,
                                  send, async_op=True)
    assert torch.equal(work.get_future().wait()[0], want) and work.wait()
    assert torch.equal(base.t(), want)
    # an output whose rows have another shape, as many elements per peer (rows of 1 element)
    flat = torch.empty(3 * sum(recv), dtype=torch.float64)
    dist.all_to_all_single(flat, _a2a_inputs(r, rows, (3,), torch.float64),
                           [3 * k for k in recv], send)
    assert torch.equal(flat, want.reshape(-1))
    # no splits: equal parts
    eq = _a2a_splits(n, 2)
    for limit in (0, 1 << 30):
        out = torch.empty(2 * n, 2, dtype=torch.int64)
        with _allgather_bytes(limit):
            dist.all_to_all_single(out, _a2a_inputs(r, eq, (2,), torch.int64))
        assert torch.equal(out, _a2a_want(r, eq, (2,), torch.int64)), limit
    # nothing anywhere
    out = torch.empty(0, 4)
    dist.all_to_all_single(out, torch.empty(0, 4), [0] * n, [0] * n)


def case_all_to_all_list_of_unequal_sizes():
    """dist.all_to_all: input_tensors[j] of any size goes to rank j; output_tensors[j] gets rank
    j's (any shape, as many elements; non-contiguous too), every carried dtype; equal sizes by
    the allgather and by the alltoall."""
    n, r = _n_r()
    for salt in (0, 1, 2, 3):
        rows = _a2a_splits(n, salt)
        for dtype in A2A_DTYPES:
            for limit in (0, 1 << 30):
                what = f"all_to_all rows={rows} {dtype} {limit}"
                ins = [_a2a_block(r, j, rows[r][j], (2,), dtype) for j in range(n)]
                outs = [torch.empty(2 * rows[j][r], dtype=dtype) if j % 2 else
                        torch.empty(2, rows[j][r], dtype=dtype).t() for j in range(n)]
                with _naming(what), _allgather_bytes(limit):
                    dist.all_to_all(outs, ins)
                for j, o in enumerate(outs):
                    want = _a2a_block(j, r, rows[j][r], (2,), dtype)
                    assert torch.equal(o.reshape(want.shape), want), f"{what}: from rank {j}"
                if salt != 2:
                    break


def case_all_to_all_sizes_that_disagree_fail_everywhere():
    """Each rank's arguments fit its own tensors, but the last rank's output_split_sizes (or
    output_tensors) expect rows that are not sent it, or its dtype or rows differ: the same
    MismatchError on every rank, naming the ranks, before any data moves (outputs untouched);
    then the group still works."""
    n, r = _n_r()
    if n == 1:
        return
    last, k = n - 1, 2
    inp = torch.arange(n * k, dtype=torch.float64) + 100 * r
    fit = [k] * n
    bad = fit[:]
    bad[0] += 1  # one row too many from rank 0
    recv = bad if r == last else fit
    out = torch.full((sum(recv),), -1.0, dtype=torch.float64)
    calls = {"sync": lambda: dist.all_to_all_single(out, inp, recv, fit),
             "async": lambda: dist.all_to_all_single(out, inp, recv, fit, async_op=True).wait()}
    for op, call in calls.items():
        with _naming(f"{op} output_split_sizes {bad} on rank {last}"):
            _expect_everywhere(
                mf.MismatchError, call,
                f"output_split_sizes of rank(s) [{last}]",
                f"rank 0 sends {k} row(s) to rank {last}, which expects {k + 1}")
        assert (out == -1).all(), "output written"
        _still_works()
    # as many rows in all, one more from rank 0 and one fewer from rank 1: both named
    bad = [k + 1, k - 1] + [k] * (n - 2)
    with _naming(f"output_split_sizes {bad} on rank {last}"):
        _expect_everywhere(
            mf.MismatchError, lambda: dist.all_to_all_single(
                torch.empty(n * k, dtype=torch.float64), inp, bad if r == last else fit, fit),
            f"rank 0 sends {k} row(s) to rank {last}, which expects {k + 1}",
            f"rank 1 sends {k} row(s) to rank {last}, which expects {k - 1}")
    _still_works()
    # another dtype, rows of another size on the last rank
    dtype = torch.float32 if r == last else torch.float64
    with _naming("dtype"):
        _expect_everywhere(mf.MismatchError, lambda: dist.all_to_all_single(
            torch.empty(n * k, dtype=dtype), inp.to(dtype)), "disagree on dtype",
            f"torch.float32 on rank(s) [{last}]")
    _still_works()
    cols = 3 if r == last else 2
    with _naming("rows"):
        _expect_everywhere(mf.MismatchError, lambda: dist.all_to_all_single(
            torch.empty(n * k, cols), torch.ones(n * k, cols)), "elements of one input row",
            f"3 on rank(s) [{last}]")
    _still_works()
    # the list form: the last rank's output_tensors[0] has one element more
    ins = [torch.ones(3) for _ in range(n)]
    outs = [torch.empty(4 if r == last and j == 0 else 3) for j in range(n)]
    with _naming("all_to_all"):
        _expect_everywhere(mf.MismatchError, lambda: dist.all_to_all(outs, ins),
                           f"output_tensors of rank(s) [{last}]",
                           f"rank 0's input_tensors[{last}] has 3 element(s), rank {last}'s "
                           "output_tensors[0] 4")
    _still_works()


def case_send_recv_ring_and_barrier():
    n, r = _n_r()
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    for dtype in (torch.float64, torch.uint8):
        got = torch.empty(1000, dtype=dtype)
        mine = (torch.arange(1000) % 200 + r).to(dtype)
        if r == 0:  # blocking ones, the ring's cycle broken by rank 0's order
            dist.send(mine, nxt)
            dist.recv(got, prv)
        else:
            dist.irecv(got, prv).wait()
            dist.isend(mine, nxt).wait()
        assert torch.equal(got, (torch.arange(1000) % 200 + prv).to(dtype))
    dist.barrier()


def case_nonblocking_send_recv_posted_when_made():
    """isend / irecv are posted when made, so the patterns gloo runs run here too: every rank
    posting its receive before its send (by hand and through batch_isend_irecv), small and
    large, and a send waited for after a collective that the receiver makes before its recv."""
    n, r = _n_r()
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    for count in (4, 1 << 18):
        mine = torch.arange(count, dtype=torch.float64) + 1000 * r
        got = torch.empty(count, dtype=torch.float64)
        recv = dist.irecv(got, prv)
        send = dist.isend(mine, nxt)
        recv.wait()
        send.wait()
        assert torch.equal(got, torch.arange(count, dtype=torch.float64) + 1000 * prv), count
        got2 = torch.empty(count, dtype=torch.float64)
        ops = [dist.P2POp(dist.irecv, got2, prv), dist.P2POp(dist.isend, mine * 2, nxt)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert torch.equal(got2, 2 * (torch.arange(count, dtype=torch.float64) + 1000 * prv))
    # rank 0 sends to 1 and reduces; rank 1 reduces, then receives
    if r in (0, 1):
        x = torch.full((1 << 18,), 7.0)
        work = dist.isend(x, 1) if r == 0 else None
    t = torch.ones(3)
    dist.all_reduce(t)
    assert (t == n).all()
    if r == 0:
        work.wait()
        assert work.is_completed() and work.get_future().wait() == [x]
    elif r == 1:
        y = torch.empty(1 << 18)
        work = dist.irecv(y, 0)
        fut = work.get_future()  # completes without a wait() of ours
        assert fut.wait() == [y] and (y == 7.0).all() and work.is_completed()
    # a widened receive is complete only once the tensor holds the data; polling
    # is_completed() while the future's thread waits is safe
    got = torch.zeros(4, dtype=torch.int8)
    work = dist.irecv(got, prv)
    fut = work.get_future()
    dist.isend(torch.full((4,), r + 1, dtype=torch.int8), nxt).wait()
    while not work.is_completed():
        pass
    assert torch.equal(got, torch.full((4,), prv + 1, dtype=torch.int8)), got
    assert fut.wait() == [got]
    # many receives whose futures were asked for do not hold up a collective's completion
    bufs = [torch.zeros(2) for _ in range(40)]
    works = [dist.irecv(b, prv, tag=i) for i, b in enumerate(bufs)]
    futs = [w.get_future() for w in works]
    t = torch.ones(3)
    dist.all_reduce(t)  # (its future is completed by the pool the waits must not fill)
    assert (t == n).all()
    for i in range(40):
        dist.isend(torch.full((2,), float(i)), nxt, tag=i).wait()
    assert all(f.wait() == [b] and (b == i).all() for i, (f, b) in enumerate(zip(futs, bufs)))


def case_narrow_dtypes_that_differ_between_ranks_fail_everywhere():
    """Calls that only move data carry narrow dtypes widened (int8, uint8, bool... as int32);
    ranks passing different ones fail on every rank (the header compares the dtype they had),
    never reinterpreting each other's data."""
    n, r = _n_r()
    if n == 1:
        return
    dt = torch.int8 if r == 0 else torch.uint8
    with _naming("broadcast int8 / uint8"):
        _expect_everywhere(mf.MismatchError, lambda: dist.broadcast(torch.zeros(3, dtype=dt), 0),
                           "element type", "int8 on rank(s) [0]")
    dt = torch.int16 if r == 0 else torch.bool
    with _naming("all_gather_into_tensor int16 / bool"):
        _expect_everywhere(mf.MismatchError, lambda: dist.all_gather_into_tensor(
            torch.zeros(2 * n, dtype=dt), torch.zeros(2, dtype=dt)), "element type")
    with _naming("scatter int8 / uint8"):
        out = torch.zeros(2, dtype=torch.int8 if r == 0 else torch.uint8)
        ins = [torch.zeros(2, dtype=torch.int8)] * n if r == 0 else None
        _expect_everywhere(mf.MismatchError, lambda: dist.scatter(out, ins, src=0),
                           "element type")
    if r == 0:
        dist.send(torch.full((3,), -2, dtype=torch.int8), 1)
    elif r == 1:
        with _naming("recv of int8 into uint8"):
            _expect_everywhere(mf.MismatchError, lambda: dist.recv(
                torch.zeros(3, dtype=torch.uint8), 0), "(from int8)", "(from uint8)")
    # and the same dtypes everywhere still move (widened and back)
    for dtype in (torch.int8, torch.uint8, torch.bool, torch.int16):
        t = torch.arange(5).to(dtype) if r == 0 else torch.zeros(5, dtype=dtype)
        dist.broadcast(t, 0)
        assert torch.equal(t, torch.arange(5).to(dtype)), dtype
    _still_works()


BIT_DTYPES = (torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)


def _bits_tensor(rank, dtype):
    """A tensor of dtype whose bit patterns say which rank made it: uint64 values above 2**63
    (negative as int64), and for the float8 kinds every byte (NaNs and infinities among them)."""
    if dtype == torch.uint64:
        return (torch.arange(5, dtype=torch.int64) - 5 - rank).view(torch.uint64)  # 2**64-5-r..
    return ((torch.arange(256) + 7 * rank) % 256).to(torch.uint8).view(dtype)


def _zeros(shape, dtype):
    """A tensor of dtype with every bit 0."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).zero_()
    return t


def _bits(t):
    """t's bytes, to compare exactly (float8 has no ==, and NaN != NaN)."""
    return t.contiguous().view(torch.uint8)


def case_uint64_and_float8_move_bit_exact():
    """uint64 and the float8 kinds travel as their bits (int64; uint8 widened to int32) in every
    call that only moves data - broadcast, all_gather_into_tensor, send / recv, all_to_all_single
    - and arrive bit for bit, into non-contiguous outputs too; a reduction of them is a TypeError
    on every rank, and two ranks passing different ones (float8_e4m3fn against float8_e5m2, or
    against uint8, which also travels widened) a MismatchError on every rank."""
    n, r = _n_r()
    for dtype in BIT_DTYPES:
        with _naming(f"broadcast {dtype}"):
            t = _bits_tensor(r, dtype)
            dist.broadcast(t, src=n - 1)
            assert torch.equal(_bits(t), _bits(_bits_tensor(n - 1, dtype)))
        with _naming(f"all_gather_into_tensor {dtype}"):
            out = _zeros((n, _bits_tensor(0, dtype).numel()), dtype)
            dist.all_gather_into_tensor(out, _bits_tensor(r, dtype))
            for q in range(n):
                assert torch.equal(_bits(out[q]), _bits(_bits_tensor(q, dtype))), q
        with _naming(f"send / recv {dtype} into a non-contiguous tensor"):
            if n > 1 and r == 0:
                dist.send(_bits_tensor(0, dtype), 1)
            elif n > 1 and r == 1:
                base = _zeros(2 * _bits_tensor(0, dtype).numel(), dtype)
                view = base[::2]
                dist.recv(view, 0)
                assert torch.equal(_bits(view), _bits(_bits_tensor(0, dtype)))
                assert (_bits(base[1::2]) == 0).all()  # the rest untouched
        with _naming(f"all_to_all_single {dtype}"):
            inp = torch.cat([_bits_tensor(r, dtype).view(torch.uint8)[:8] for _ in range(n)])
            inp = inp.view(dtype)
            out = _zeros(inp.shape, dtype)
            dist.all_to_all_single(out, inp)
            rows = out.numel() // n
            for q in range(n):
                assert torch.equal(_bits(out[q * rows:(q + 1) * rows]),
                                   _bits(_bits_tensor(q, dtype).view(torch.uint8)[:8].view(dtype)))
        with _naming(f"all_reduce {dtype}"):
            _expect_everywhere(TypeError, lambda: dist.all_reduce(_bits_tensor(r, dtype)),
                               str(dtype).replace("torch.", ""))
    if n > 1:
        for other in (torch.float8_e5m2, torch.uint8):
            dt = torch.float8_e4m3fn if r == 0 else other
            with _naming(f"broadcast float8_e4m3fn / {other}"):
                _expect_everywhere(mf.MismatchError, lambda: dist.broadcast(
                    _zeros(4, dt), 0), "element type")
    _still_works()


def case_functional_collectives_and_dtensor_find_the_group_by_name():
    """torch finds a group by its name (functional collectives, DeviceMesh, DTensor): the
    mlfabric group keeps the name torch gives it, and those APIs run on it."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    n, r = _n_r()
    assert dist.group.WORLD.group_name  # torch's name for the default group
    x, _ = _input(r, 7, "float64", "sum")
    got = fc.all_reduce(x, "sum", dist.group.WORLD)
    want = reference("sum", [values(q, 7, "float64", "sum") for q in range(n)], n)
    assert_close(got.numpy(), want, "float64", "functional all_reduce")
    mesh = init_device_mesh("cpu", (n,))
    whole = torch.arange(4.0 * n, dtype=torch.float64)
    assert torch.equal(distribute_tensor(whole, mesh, [Shard(0)]).full_tensor(), whole)


def case_leaf_that_requires_grad_takes_a_broadcast_in_any_layout():
    """A leaf that requires grad (a parameter) takes results as under gloo, contiguous or not,
    directly written or copied back (complex: carried as float pairs); it stays a leaf."""
    n, r = _n_r()
    root = n - 1

    def leaf(dtype, rank, contiguous):
        v = (torch.arange(12) + 100 * rank).to(dtype).reshape(3, 4)
        t = v.clone() if contiguous else torch.empty_strided((3, 4), (1, 3), dtype=dtype)
        return t.copy_(v).requires_grad_()
    for dtype in (torch.float64, torch.complex64):
        for contiguous in (True, False):
            t = leaf(dtype, r, contiguous)
            assert t.is_contiguous() == contiguous
            dist.broadcast(t, src=root)
            what = f"broadcast {dtype} contiguous={contiguous}"
            assert torch.equal(t.detach(), leaf(dtype, root, True).detach()), what
            assert t.is_leaf and t.requires_grad, what
    t = leaf(torch.float64, r, False)  # all_reduce and all_gather into such leaves too
    dist.all_reduce(t)
    assert torch.equal(t.detach(), sum(leaf(torch.float64, q, True).detach() for q in range(n)))
    outs = [leaf(torch.float64, 0, False) for _ in range(n)]
    dist.all_gather(outs, leaf(torch.float64, r, True).detach())
    assert all(torch.equal(o.detach(), leaf(torch.float64, q, True).detach())
               for q, o in enumerate(outs))


def case_inference_tensors_take_results():
    """Outputs made under torch.inference_mode() (an evaluation loop gathering its metrics):
    the results are copied into them on mlfabric's thread, which is not in that mode."""
    n, r = _n_r()
    with torch.inference_mode():
        outs = [torch.empty(3, dtype=torch.int8) for _ in range(n)]
        dist.all_gather(outs, torch.full((3,), r, dtype=torch.int8))
        assert [o.tolist() for o in outs] == [[q] * 3 for q in range(n)]
        b = torch.full((4,), r, dtype=torch.uint8)
        dist.broadcast(b, src=n - 1)
        assert b.tolist() == [n - 1] * 4
        t = torch.full((3, 2), float(r + 1), dtype=torch.float64).t()  # non-contiguous
        dist.all_reduce(t)
        assert (t == n * (n + 1) / 2).all()


# --- bad input: an error on every rank, then the group goes on working ------------------------

def case_shape_mismatch_errors_on_every_rank():
    n, r = _n_r()
    if n == 1:
        return
    last = n - 1
    count = 10 + (r == last)
    _expect_everywhere(mf.MismatchError, lambda: dist.all_reduce(torch.ones(count)), "shape",
                       f"(11,) on rank(s) [{last}]")
    _still_works()
    _expect_everywhere(mf.MismatchError,
                       lambda: dist.all_gather([torch.empty(count) for _ in range(n)],
                                               torch.ones(count)), "shape")
    _still_works()
    _expect_everywhere(mf.MismatchError,
                       lambda: dist.broadcast(torch.ones(count, dtype=torch.float64), src=0),
                       "shape")
    _still_works()
    _expect_everywhere(mf.MismatchError, lambda: dist.reduce(torch.ones(3), dst=r % 2), "root")
    _still_works()
    # A bad output on one rank only: that rank's own error, a MismatchError on the others.
    out = torch.empty(n * 3 + (r == last))
    exc = ValueError if r == last else mf.MismatchError
    _expect_everywhere(exc, lambda: dist.all_gather_into_tensor(out, torch.ones(3)),
                       "output has" if r == last else f"rank(s) [{last}] rejected")
    _still_works()
    # async: the error comes out of wait() and out of the future
    work = dist.all_reduce(torch.ones(count), async_op=True)
    _expect_everywhere(mf.MismatchError, work.wait, "shape")
    _expect_everywhere(mf.MismatchError, work.get_future().wait, "shape")
    _still_works()


def case_unsupported_ops_and_devices_are_errors():
    n, r = _n_r()
    _expect_everywhere(ValueError, lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32),
                                                           op=R.BAND), "BAND")
    _expect_everywhere(TypeError, lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64),
                                                          op=R.AVG), "avg")
    _expect_everywhere(TypeError, lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint8)),
                       "uint8")
    # A non-CPU tensor (meta: this torch has no GPU) is refused, naming the device.
    _expect_everywhere(mf.MlfabricError,
                       lambda: dist.all_reduce(torch.empty(3, device="meta")), "meta", "CPU")
    _expect_everywhere(NotImplementedError, lambda: dist.recv(torch.ones(3)), "source")
    _still_works()


def case_one_rank_output_that_cannot_take_the_result():
    """An output whose elements share memory (an expanded tensor; strides that overlap) on one
    rank only, in every call that writes one: that rank's own error, a MismatchError naming it
    on the others, before any data moves (else the others took their results and no error)."""
    n, r = _n_r()
    last = n - 1

    def out(*shape):  # last rank: one element seen 4 times (torch.zeros(1).expand(4))
        return torch.zeros(1).expand(*shape) if r == last else torch.zeros(*shape)
    ones = [torch.ones(4) for _ in range(n)]
    calls = {
        "all_reduce": lambda: dist.all_reduce(out(4)),
        "all_reduce, strides that overlap": lambda: dist.all_reduce(
            torch.zeros(5).as_strided((4, 2), (1, 1)) if r == last else torch.zeros(4, 2)),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([torch.zeros(2), out(4)]),
        "reduce": lambda: dist.reduce(out(4), dst=last),
        "broadcast": lambda: dist.broadcast(out(4), src=0),
        "all_gather": lambda: dist.all_gather([out(4) for _ in range(n)], torch.ones(4)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out(4 * n),
                                                                      torch.ones(4)),
        "reduce_scatter": lambda: dist.reduce_scatter(out(4), ones),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out(4), torch.ones(4 * n)),
        "gather": lambda: dist.gather(torch.ones(4), [out(4) for _ in range(n)]
                                      if r == last else None, dst=last),
        "scatter": lambda: dist.scatter(out(4), ones if r == 0 else None, src=0),
        "all_to_all_single": lambda: dist.all_to_all_single(out(4 * n), torch.ones(4 * n)),
        "all_to_all": lambda: dist.all_to_all([out(4) for _ in range(n)], ones),
    }
    if n == 1:  # the last rank is broadcast's root, whose tensor is only read
        del calls["broadcast"]
    pg = dist.distributed_c10d._get_default_group()  # coalesced pairs, FSDP's form
    calls["all_gather_single_coalesced"] = lambda: pg.all_gather_single_coalesced(
        [torch.empty(2 * n), out(2 * n)], [torch.ones(2)] * 2, AllgatherOptions()).wait()
    calls["reduce_scatter_single_coalesced"] = lambda: pg.reduce_scatter_single_coalesced(
        [out(2), torch.empty(2)], [torch.ones(2 * n)] * 2, ReduceScatterOptions()).wait()
    for what, call in calls.items():
        _refused_on(last, what, call, "cannot take the result", "share memory")
    # recv: an error on the receiving rank alone (no send to match: none waits for it)
    _expect_everywhere(ValueError, lambda: dist.recv(torch.zeros(1).expand(4), src=0),
                       "share memory")
    # broadcast's root only reads its tensor: an expanded one is a fine source.
    t = torch.ones(1).expand(4) if r == 0 else torch.zeros(4)
    dist.broadcast(t, src=0)
    assert t.tolist() == [1.0] * 4
    _still_works()


def case_one_rank_all_to_all_splits_that_do_not_fit():
    """all_to_all_single's split sizes that do not fit dimension 0 of the tensors on one rank
    (too few rows in all, one split too many, a negative one), or no splits and a dimension 0
    that does not divide by the group's size: that rank's own error, a MismatchError naming it
    on the others."""
    n, r = _n_r()
    last, k = n - 1, 2
    inp = torch.arange(n * k, dtype=torch.float64) + 100 * r  # block j goes to rank j
    out = torch.empty(n * k, dtype=torch.float64)
    fit = [k] * n
    dist.all_to_all_single(out, inp, fit, fit)  # splits that fit: given explicitly
    assert out.tolist() == [float(r * k + i + 100 * j) for j in range(n) for i in range(k)]
    negative = [[-1, 2 * k + 1] + [k] * (n - 2)] if n > 1 else []  # adds up to n * k
    for bad in [[1] * n, [k] * (n + 1)] + negative:
        for side in ("output", "input"):
            splits = {side: bad if r == last else fit}
            _refused_on(last, f"{side} splits {bad}", lambda: dist.all_to_all_single(
                out, inp, splits.get("output", fit), splits.get("input", fit)),
                f"{side} split sizes {bad}", "dimension 0", call="all_to_all_single")
    if n > 1:  # as many elements everywhere, but 1 row on the last rank: no n equal parts
        shape = (1, n * k) if r == last else (n * k,)
        _refused_on(last, "no splits", lambda: dist.all_to_all_single(
            out.reshape(shape), inp.reshape(shape)), "dimension 0 (1)", f"{n} equal parts")


def case_ranks_naming_different_roots_fail_everywhere():
    """Each rank names a valid root, but not the same one (rank q names q % 2): an error on
    every rank naming the disagreement, for every rooted call (gather's allgather carries no
    root of its own: it was a wrong result on every rank)."""
    n, r = _n_r()
    if n == 1:
        return
    root = r % 2
    want = f"0 on rank(s) {list(range(0, n, 2))}; 1 on rank(s) {list(range(1, n, 2))}"
    ones = [torch.ones(3) for _ in range(n)]
    calls = {
        "gather": lambda: dist.gather(torch.ones(3), [torch.empty(3) for _ in range(n)]
                                      if r == root else None, dst=root),
        "scatter": lambda: dist.scatter(torch.empty(3), ones if r == root else None, src=root),
        "broadcast": lambda: dist.broadcast(torch.ones(3), src=root),
        "reduce": lambda: dist.reduce(torch.ones(3), dst=root),
    }
    for what, call in calls.items():
        with _naming(what):
            _expect_everywhere(mf.MismatchError, call, "disagree on root", want)
        _still_works()


def case_subgroups_run_among_their_ranks():
    """new_group of the even and of the odd ranks (and of the last and first rank): collectives
    among the members only, against float64 references, roots and peers named by global rank as
    torch does; each group independent of the world group; DDP in each group ends at the
    weights of DDP over a gloo group of the same ranks."""
    n, r = _n_r()
    even, odd = list(range(0, n, 2)), list(range(1, n, 2))
    groups = {tuple(even): dist.new_group(even)}
    if odd:
        groups[tuple(odd)] = dist.new_group(odd)
    ends = sorted({0, n - 1})
    ends_group = dist.new_group(ends)
    twins = {ranks: dist.new_group(list(ranks), backend="gloo") for ranks in groups}
    ranks = tuple(even) if r % 2 == 0 else tuple(odd)
    g, k, me = groups[ranks], len(ranks), ranks.index(r)
    assert dist.get_world_size(g) == k and dist.get_rank(g) == me
    t, _ = _input(r, 50, "float64", "sum", salt=3)
    dist.all_reduce(t, group=g)
    want = sum(values(q, 50, "float64", "sum", 3) for q in ranks)
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-13)
    h = dist.all_reduce(torch.ones(4, dtype=torch.float64), group=g, async_op=True)
    _still_works()  # the world group between a group call and its wait
    h.wait()
    b = torch.full((3,), float(r), dtype=torch.float64)
    dist.broadcast(b, src=ranks[-1], group=g)
    assert b.tolist() == [float(ranks[-1])] * 3
    outs = [torch.empty(2, dtype=torch.float64) for _ in ranks]
    dist.all_gather(outs, torch.full((2,), float(r), dtype=torch.float64), group=g)
    assert [o.tolist() for o in outs] == [[float(q)] * 2 for q in ranks]
    out = torch.empty(2, dtype=torch.float64)
    dist.reduce_scatter_single(out, torch.arange(2.0 * k, dtype=torch.float64), group=g)
    assert out.tolist() == [float(k * (2 * me)), float(k * (2 * me + 1))]
    rows = [[(i + 2 * j) % 3 for j in range(k)] for i in range(k)]  # unequal, by group rank
    recv = [rows[j][me] for j in range(k)]
    out = torch.empty(sum(recv), dtype=torch.float64)
    dist.all_to_all_single(out, torch.cat([torch.full((rows[me][j],), 10.0 * r + j)
                                           for j in range(k)]).double(), recv, rows[me], group=g)
    assert out.tolist() == [10.0 * ranks[j] + me for j in range(k) for _ in range(recv[j])]
    if k > 1:  # a ring of sends inside the group, by global rank
        nxt, prv = ranks[(me + 1) % k], ranks[(me - 1) % k]
        got = torch.empty(1, dtype=torch.float64)
        if me % 2 == 0:
            dist.send(torch.tensor([float(r)], dtype=torch.float64), nxt, group=g)
            dist.recv(got, prv, group=g)
        else:
            dist.recv(got, prv, group=g)
            dist.send(torch.tensor([float(r)], dtype=torch.float64), nxt, group=g)
        assert got.item() == float(prv)
    dist.barrier(group=g)
    if r in ends:
        e = torch.full((2,), float(r + 1), dtype=torch.float64)
        dist.all_reduce(e, group=ends_group)
        assert e.tolist() == [float(sum(q + 1 for q in ends))] * 2
    ours, theirs = _train(g), _train(twins[ranks])
    assert _max_diff(ours, theirs) <= 1e-10, _max_diff(ours, theirs)
    _still_works()


# --- DDP ----------------------------------------------------------------------------------------

def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def _train(group, steps=6, hook=None, bucket_cap_mb=None):
    """DDP-train the same MLP on each rank's own data; return the final parameters."""
    _, r = _n_r()
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model = DDP(_mlp(), process_group=group, **kwargs)
    if hook is not None:
        model.register_comm_hook(group, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + r)  # different data on every rank
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
        y = torch.randn(16, 1, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def case_ddp_matches_gloo():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    world = dist.distributed_c10d._get_default_group()
    start = [p.detach().clone() for p in _mlp().parameters()]
    # The default path (one bucket), and a comm hook (futures) over several small buckets.
    for hook, cap in ((None, None), (default_hooks.allreduce_hook, 0.001)):
        ours = _train(world, hook=hook, bucket_cap_mb=cap)  # small cap: several buckets
        theirs = _train(_groups["gloo"], hook=hook, bucket_cap_mb=cap)
        what = f"DDP hook={getattr(hook, '__name__', None)} bucket_cap_mb={cap}"
        assert _max_diff(ours, start) > 1e-3, f"{what}: the model did not train"
        assert _max_diff(ours, theirs) <= 1e-10, f"{what}: {_max_diff(ours, theirs)}"
        for p in ours:
            same_everywhere(p, what)


def _sparse(rank, size=(9, 3)):
    """Rank's sparse input: 0, 2 or 4 entries (rank 0 none), duplicates possible."""
    g = torch.Generator().manual_seed(rank)
    k = rank % 3 * 2
    return torch.sparse_coo_tensor(torch.randint(0, size[0], (1, k), generator=g),
                                   torch.randn(k, *size[1:], generator=g, dtype=torch.float64),
                                   size, check_invariants=True)


class _EmbeddingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(11, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)
        self.double()

    def forward(self, ids):
        return self.head(self.emb(ids)).sum()


def case_sparse_all_reduce_and_ddp_with_a_sparse_embedding():
    """all_reduce of a sparse COO tensor (gloo's: what DDP calls for an
    nn.Embedding(sparse=True)): the float64 sum / average of every rank's, ranks holding
    different numbers of entries; DDP over such a model trains to gloo's weights; tensors whose
    sizes differ between ranks fail on every rank."""
    n, r = _n_r()
    dense = torch.stack([_sparse(q).to_dense() for q in range(n)])
    for op, want in ((R.SUM, dense.sum(0)), (R.AVG, dense.sum(0) / n)):
        t = _sparse(r)
        work = dist.all_reduce(t, op=op, async_op=True)
        work.wait()
        assert t.layout == torch.sparse_coo and t.is_coalesced()
        assert (t.to_dense() - want).abs().max() < 1e-12, f"{op}"
        assert work.get_future().value()[0] is t
    world = dist.distributed_c10d._get_default_group()
    ids = torch.randint(0, 11, (4, n, 5), generator=torch.Generator().manual_seed(1))
    weights = {}
    for name, group in (("mlfabric", world), ("gloo", _groups["gloo"])):
        model = DDP(_EmbeddingNet(), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(4):
            opt.zero_grad()
            model(ids[s, r]).backward()
            opt.step()
        assert model.module.emb.weight.grad.layout == torch.sparse_coo
        weights[name] = [p.detach().clone() for p in model.parameters()]
    assert _max_diff(weights["mlfabric"], weights["gloo"]) <= 1e-12, "DDP: not gloo's weights"
    assert _max_diff(weights["mlfabric"], list(_EmbeddingNet().parameters())) > 1e-3
    for p in weights["mlfabric"]:
        same_everywhere(p, "DDP with a sparse embedding")
    if n > 1:
        _expect_everywhere(mf.MismatchError, lambda: dist.all_reduce(
            _sparse(r, (9 + (r == n - 1), 3))), "differ in size")
        _still_works()
        _expect_everywhere((ValueError, mf.MismatchError),
                           lambda: dist.all_reduce(_sparse(r), op=R.MAX if r == 0 else R.SUM))
        _still_works()


def case_ddp_with_a_model_that_differs_on_one_rank_fails_everywhere():
    n, r = _n_r()
    if n == 1:
        return
    # DDP's own check of the model across ranks runs on this backend's allgather.
    model = _mlp() if r != n - 1 else torch.nn.Linear(8, 1).double()
    _expect_everywhere(RuntimeError, lambda: DDP(model), "inconsistent")
    _still_works()


# --- last: re-initialising with a rank / world size MPI does not agree with ---------------------

def case_init_with_wrong_world_size_is_an_error():
    n, r = _n_r()
    dist.destroy_process_group()
    _expect_everywhere(mf.MlfabricError,
                       lambda: dist.init_process_group("mlfabric", init_method="mlfabric://",
                                                       rank=r, world_size=n + 1),
                       "disagree with MPI", f"rank {r} of {n}")
    dist.init_process_group("mlfabric", init_method="mlfabric://", rank=r, world_size=n)
    _still_works()
