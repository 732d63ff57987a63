"""Multi-rank cases for bad input: every mismatch is a MismatchError on every rank naming the
ranks, a rank whose own arguments are invalid gets its own error while its peers get a
MismatchError at once (no hang), and the job goes on working afterwards."""
import numpy as np
import pytest

import mlfabric as mf

from .common import setup, torch  # noqa: F401


def _expect_mismatch(fn, *needles):
    with pytest.raises(mf.MismatchError) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def _still_works():
    n = mf.size()
    assert (mf.allreduce(np.ones(1000)) == n).all()


def case_shape_mismatch_names_ranks():
    n, r = mf.size(), mf.rank()
    if n == 1:
        return
    for algorithm in ("auto", "ring", "tree", "rhd"):
        count = 10 if r != n - 1 else 11
        _expect_mismatch(lambda: mf.allreduce(np.ones(count), algorithm=algorithm),
                         "shape", f"(11,) on rank(s) [{n - 1}]")
        _still_works()
    # Same element count, different shape, also refused.
    shape = (2, 6) if r == 0 else (3, 4)
    _expect_mismatch(lambda: mf.allreduce(np.ones(shape)), "shape", "(2, 6) on rank(s) [0]")
    # Larger than one pipeline step: the header round catches it before any data moves.
    big = 2_000_000 + (r == 1)
    _expect_mismatch(lambda: mf.allreduce(np.ones(big, np.float32)), "shape")
    _still_works()


def case_dtype_op_root_kind_algorithm_mismatch():
    n, r = mf.size(), mf.rank()
    if n == 1:
        return
    dtype = np.float32 if r == 0 else np.float64
    _expect_mismatch(lambda: mf.allreduce(np.ones(8, dtype)), "dtype", "float32 on rank(s) [0]",
                     "float64")
    op = "sum" if r == 0 else "max"
    _expect_mismatch(lambda: mf.allreduce(np.ones(8), op=op), "op", "max")
    _expect_mismatch(lambda: mf.broadcast(np.ones(8), root=r), "root")
    if r == 0:
        _expect_mismatch(lambda: mf.broadcast(np.ones(8)), "kind", "broadcast", "allreduce")
    else:
        _expect_mismatch(lambda: mf.allreduce(np.ones(8)), "kind", "broadcast", "allreduce")
    algo = "ring" if r == 0 else "tree"
    _expect_mismatch(lambda: mf.allreduce(np.ones(8), algorithm=algo), "algorithm", "ring", "tree")
    _expect_mismatch(lambda: mf.allgather(np.ones(3 + r)), "shape")
    _expect_mismatch(lambda: mf.reduce_scatter(np.ones((4, 2 + r))), "shape")
    _still_works()


def case_local_rejection_fails_fast_everywhere():
    n, r = mf.size(), mf.rank()
    bad = n - 1
    # An unsupported dtype on one rank: TypeError there, MismatchError naming it elsewhere.
    x = np.ones(8, np.complex64) if r == bad else np.ones(8, np.float32)
    if r == bad:
        with pytest.raises(TypeError, match="unsupported dtype"):
            mf.allreduce(x)
    elif n > 1:
        _expect_mismatch(lambda: mf.allreduce(x), f"rank(s) [{bad}] rejected")
    # Invalid values on one rank: ValueError / TypeError there.
    if r == bad:
        with pytest.raises(ValueError, match="root"):
            mf.broadcast(np.ones(3), root=n + 5)
        with pytest.raises(ValueError, match="unknown reduction op"):
            mf.allreduce(np.ones(3), op="median")
        with pytest.raises(TypeError, match="avg"):
            mf.allreduce(np.ones(3, np.int32), op="avg")
        with pytest.raises(ValueError, match="elements"):
            mf.allreduce(np.ones(3), out=np.ones(4))
        with pytest.raises(ValueError, match="unknown algorithm"):
            mf.allreduce(np.ones(3), algorithm="butterfly")
        with pytest.raises(TypeError, match="numpy array"):
            mf.allreduce([1.0, 2.0, 3.0])
    elif n > 1:
        _expect_mismatch(lambda: mf.broadcast(np.ones(3)), "rejected")
        for _ in range(5):
            kwargs = {}
            _expect_mismatch(lambda: mf.allreduce(np.ones(3), **kwargs), "rejected")
    _still_works()


def case_every_rank_rejects_the_same_way():
    with pytest.raises(TypeError):
        mf.allreduce(np.ones(4, np.uint8))
    with pytest.raises(ValueError):
        mf.reduce_scatter(np.array(3.0))
    _still_works()


def case_send_recv_mismatch():
    n, r = mf.size(), mf.rank()
    if n < 2:
        return
    if r == 0:
        mf.send(np.ones(5, np.float32), 1, tag=7)
        mf.isend(np.ones(7, np.float32), 1, tag=7).wait()  # longer than the receiver's
        mf.isend(np.ones(3, np.int64), 1, tag=7, element=1).wait()
    elif r == 1:
        with pytest.raises(mf.MismatchError, match="5 x float32"):
            mf.recv(np.empty(6, np.float32), 0, tag=7)
        with pytest.raises(mf.MismatchError, match="sent 7 x float32, this rank expects 6"):
            mf.irecv(np.empty(6, np.float32), 0, tag=7).wait()
        with pytest.raises(mf.MismatchError, match=r"3 x int64 \(from int8\), this rank "
                                                   r"expects 3 x int64$"):
            mf.irecv(np.empty(3, np.int64), 0, tag=7).wait()
    _still_works()


def case_meta_tensor_refused():
    if torch is None:
        return
    t = torch.ones(3, device="meta")  # neither a host nor a GPU array: no path moves it
    with pytest.raises(mf.MlfabricError, match="meta: this call moves host arrays only"):
        mf.allreduce(t)
    _still_works()


def case_read_only_buffers_rejected_everywhere():
    n, r = mf.size(), mf.rank()
    x = np.ones(100)
    if r == 0:
        x.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            mf.broadcast(x, root=0)
        with pytest.raises(ValueError, match="read-only"):
            mf.allreduce(x, out=x)
    elif n > 1:
        _expect_mismatch(lambda: mf.broadcast(x, root=0), "rejected")
        _expect_mismatch(lambda: mf.allreduce(x, out=x), "rejected")
    # A read-only input with a fresh output is fine.
    y = np.ones(100)
    y.flags.writeable = False
    assert (mf.allreduce(y) == n).all()
    _still_works()


def case_unhashable_op_rejected_everywhere():
    n, r = mf.size(), mf.rank()
    if r == 0:
        with pytest.raises(ValueError, match="unknown reduction op"):
            mf.allreduce(np.ones(4), op=["sum"])
    elif n > 1:
        _expect_mismatch(lambda: mf.allreduce(np.ones(4)), "rejected")
    _still_works()


def case_shared_empty_mismatch():
    n, r = mf.size(), mf.rank()
    if n == 1:
        return
    _expect_mismatch(lambda: mf.shared_empty(10 + r, np.float32), "shared_empty", "shape")
    if r == 1:
        with pytest.raises(TypeError):
            mf.shared_empty(10, np.complex64)
    else:
        _expect_mismatch(lambda: mf.shared_empty(10, np.float32), "rejected")
    _still_works()


def case_ps_init_refused_on_one_rank_fails_every_rank():
    """mlfabric.ps.init with a setting the last rank's Config refuses: that rank raises its own
    error, the others a MismatchError naming it, before the job's communicator is duplicated
    (MPI's own collective, with no timeout: they used to wait there forever)."""
    from mlfabric import ps
    n, r = mf.size(), mf.rank()
    if n < 3:
        return  # a job needs a scheduler, a server and a worker: every rank refuses the size
    if r == n - 1:
        with pytest.raises(mf.MlfabricError, match="slack"):
            ps.init(slack=-1)
    else:
        _expect_mismatch(ps.init, f"rank(s) [{n - 1}] refused")
    _still_works()


def case_out_sharing_memory_with_x_without_being_x_is_refused():
    """An output that overlaps the input other than as the input itself (the result would
    overwrite input not yet read: silently wrong on the staged paths, at sizes past one step) is
    a ValueError on every rank (each passes it here), the data untouched; the same memory
    through another view of the same extent is in place, and works."""
    n = mf.size()
    big = 200_000  # past one engine step: where the overlap used to give wrong elements
    a = np.arange(2 * big, dtype=np.float64)
    keep = a.copy()
    calls = [("allreduce", lambda: mf.allreduce(a[:big], out=a[big // 2:big // 2 + big])),
             ("allreduce", lambda: mf.allreduce(a[:1000], out=a[500:1500], algorithm="ring")),
             ("reduce", lambda: mf.reduce(a[:1000], root=0, out=a[1:1001])),
             ("allgather", lambda: mf.allgather(a[:10], out=a[5:5 + 10 * n]))]
    for what, call in calls:
        if what == "reduce" and mf.rank() != 0:  # only the root's out is used: it refuses
            _expect_mismatch(lambda: mf.reduce(a[:1000], root=0), "rank(s) [0]")
            continue
        with pytest.raises(ValueError, match=f"{what}: out shares memory with x"):
            call()
        assert np.array_equal(a, keep), what
    y = a[:big]
    mf.allreduce(a[:big], out=y[:])
    assert np.array_equal(a[:big], keep[:big] * n) and np.array_equal(a[big:], keep[big:])
    _still_works()
