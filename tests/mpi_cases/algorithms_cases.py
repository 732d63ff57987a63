"""Multi-rank cases for mlfabric.comm.algorithms (run by tests/test_algorithms.py under mpirun).

Every case runs on every rank of COMM_WORLD. Each rank rebuilds every rank's input from a seed and
the rank number, so it computes the float64 reference locally; inputs are small integers, halves or
powers of two, exact in every dtype (bfloat16 included), so any order of reduction gives the same
exact answer and results are compared exactly. Every case also checks that all ranks hold the same
bytes (a hash per result, allgathered once per case).
"""
import hashlib
import os
import time

import numpy as np
from mpi4py import MPI

from mlfabric import _dtypes
from mlfabric.comm import algorithms as alg
from mlfabric.comm import p2p
from mlfabric.errors import PeerTimeoutError

world = MPI.COMM_WORLD
N, RANK = world.Get_size(), world.Get_rank()

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
OPS = ("sum", "prod", "min", "max")
SIZES = sorted({0, 1, 7, 1021, max(N - 1, 0)})


# ---------------------------------------------------------------------------------------------
# inputs and references

def values(seed, rank, op, dtype, count):
    """float64 values for one rank's input, exact in every dtype and after reducing n <= 8 of them."""
    rng = np.random.default_rng([seed, rank, OPS.index(op) if op in OPS else 9,
                                 DTYPES.index(dtype), count])
    integer = dtype.startswith("int")
    if op in ("sum", "avg"):
        v = rng.integers(-1000, 1001, count) if integer else rng.integers(-16, 17, count) * 0.5
    elif op == "prod":
        pool = [-2.0, -1.0, 1.0, 2.0] if integer else [-2.0, -1.0, -0.5, 0.5, 1.0, 2.0]
        v = rng.choice(pool, count)
    else:
        v = rng.integers(-2**30, 2**30, count) if integer else rng.integers(-128, 129, count) * 0.5
    return v.astype(np.int64) if integer else v.astype(np.float64)


def to_storage(v, dtype):
    if dtype == "bfloat16":  # exact: the values have at most 8 significant bits
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(dtype)


def from_storage(a, dtype):
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.int64 if dtype.startswith("int") else np.float64)


def reference(seed, op, dtype, count, n=N):
    vs = [values(seed, r, op, dtype, count) for r in range(n)]
    if op in ("sum", "avg"):
        ref = np.sum(vs, axis=0, dtype=vs[0].dtype)
        return ref / n if op == "avg" else ref
    f = {"prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    ref = vs[0].copy()
    for v in vs[1:]:
        ref = f(ref, v)
    return ref


class Agreement:
    """Collects a hash of every result; check() asserts all ranks collected the same ones."""

    def __init__(self):
        self.h = hashlib.sha256()
        self.n = 0

    def add(self, arr):
        self.h.update(np.ascontiguousarray(arr).tobytes())
        self.n += 1

    def check(self):
        got = world.allgather((self.n, self.h.hexdigest()))
        assert all(g == got[0] for g in got), f"ranks disagree bitwise: {got}"


def check_equal(got, want, what):
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        raise AssertionError(f"{what}: {bad.size} wrong of {want.size}, first at {bad[0]}: "
                             f"got {got[bad[0]]} want {want[bad[0]]}")


def run_allreduce(algorithm, op, dtype, count, seed, agree):
    code = _dtypes.DTYPE_CODES[dtype]
    arr = to_storage(values(seed, RANK, op, dtype, count), dtype)
    out = alg.allreduce(world, arr, code, op, algorithm)
    assert out is arr
    what = f"{algorithm} allreduce {op} {dtype} count={count}"
    ref = reference(seed, op, dtype, count)
    got = from_storage(arr, dtype)
    if op == "avg":
        tol = {"float32": 1e-6, "float64": 1e-12, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
        assert np.allclose(got, ref, rtol=tol, atol=tol), what
    else:
        check_equal(got, ref, what)
    agree.add(arr)


# ---------------------------------------------------------------------------------------------
# allreduce

def _matrix(algorithm):
    agree = Agreement()
    for dtype in DTYPES:
        for op in OPS:
            for count in SIZES:
                run_allreduce(algorithm, op, dtype, count, 1, agree)
    agree.check()


def case_ring_allreduce_matrix():
    _matrix("ring")


def case_rhd_allreduce_matrix():
    _matrix("rhd")


def case_tree_allreduce_matrix():
    _matrix("tree")


def case_auto_allreduce():
    agree = Agreement()
    for count in (0, 3, 1021, 65537):
        run_allreduce("auto", "sum", "float32", count, 2, agree)
    agree.check()


def case_large_float32_sum():
    """Primes and sizes past several message segments (pipelined receive/reduce paths)."""
    agree = Agreement()
    for algorithm in alg.ALGORITHMS:
        for count in (65537, 300007):
            run_allreduce(algorithm, "sum", "float32", count, 3, agree)
    run_allreduce("ring", "max", "float64", 65537, 3, agree)
    agree.check()


def case_avg():
    agree = Agreement()
    for algorithm in alg.ALGORITHMS:
        for dtype in ("float32", "float64", "float16", "bfloat16"):
            run_allreduce(algorithm, "avg", dtype, 1021, 4, agree)
    agree.check()


def case_tiny_segments():
    """Every path that cuts messages into segments, at small sizes: segments of 24 bytes."""
    saved = p2p.SEGMENT_BYTES
    p2p.SEGMENT_BYTES = 24
    try:
        agree = Agreement()
        for algorithm in alg.ALGORITHMS:
            for dtype in ("float64", "bfloat16", "int32"):
                for count in (1, 7, 101):
                    run_allreduce(algorithm, "sum", dtype, count, 5, agree)
        code = _dtypes.DTYPE_CODES["float32"]
        for root in range(N):
            a = to_storage(values(6, RANK, "max", "float32", 101), "float32")
            alg.tree_reduce(world, a, code, "max", root)
            if RANK == root:
                check_equal(from_storage(a, "float32"), reference(6, "max", "float32", 101), "reduce")
            b = np.arange(53, dtype=np.float64) * (root + 1) if RANK == root else np.zeros(53)
            alg.tree_broadcast(world, b, root)
            check_equal(b, np.arange(53, dtype=np.float64) * (root + 1), "broadcast")
        agree.check()
    finally:
        p2p.SEGMENT_BYTES = saved


def case_op_codes_and_errors():
    a = to_storage(values(7, RANK, "sum", "int64", 5), "int64")
    alg.ring_allreduce(world, a, _dtypes.DTYPE_CODES["int64"], _dtypes.OP_CODES["sum"])
    check_equal(a, reference(7, "sum", "int64", 5), "op given as a code")
    try:
        alg.allreduce(world, a, 5, "sum", "butterfly")
    except ValueError as e:
        assert "ring" in str(e) and "rhd" in str(e) and "tree" in str(e), e
    else:
        raise AssertionError("unknown algorithm accepted")
    for bad, exc in ((np.zeros(3, np.float32), TypeError), (np.zeros((2, 2), np.int64), ValueError)):
        try:
            alg.ring_allreduce(world, bad, 5, "sum")
        except exc:
            pass
        else:
            raise AssertionError(f"bad array accepted: {bad.dtype} {bad.shape}")
    try:
        alg.tree_allreduce(world, np.zeros(3, np.int32), 4, "avg")
    except TypeError:
        pass
    else:
        raise AssertionError("avg on int32 accepted")
    assert alg.choose_allreduce(8, N) in alg.ALGORITHMS
    assert alg.choose_allreduce(1 << 30, 4) == "ring"


# ---------------------------------------------------------------------------------------------
# tree reduce / broadcast, allgather, reduce-scatter

def case_tree_reduce_every_root():
    for root in range(N):
        for dtype in DTYPES:
            for op in OPS:
                count = 1021 if dtype == "float32" else 7
                a = to_storage(values(8 + root, RANK, op, dtype, count), dtype)
                alg.tree_reduce(world, a, _dtypes.DTYPE_CODES[dtype], op, root)
                if RANK == root:
                    check_equal(from_storage(a, dtype), reference(8 + root, op, dtype, count),
                                f"tree_reduce root={root} {op} {dtype}")


def case_tree_broadcast_every_root():
    for root in range(N):
        for count in (0, 1, 7, 65537):
            want = np.random.default_rng([20, root, count]).integers(0, 256, count).astype(np.uint8)
            a = want.copy() if RANK == root else np.zeros(count, np.uint8)
            assert alg.tree_broadcast(world, a, root) is a
            check_equal(a, want, f"tree_broadcast root={root} count={count}")
        w64 = np.arange(1021, dtype=np.int64) - root
        a = w64.copy() if RANK == root else np.zeros(1021, np.int64)
        alg.tree_broadcast(world, a, root)
        check_equal(a, w64, "tree_broadcast int64")


def case_ring_allgather():
    for dtype in ("float32", "bfloat16", "int64", "uint8"):
        for m in (0, 1, 7, 1021):
            def piece(r):
                return (np.arange(m) * 3 + r * 1000).astype(np.uint16 if dtype == "bfloat16" else dtype)
            out = np.zeros(N * m, piece(0).dtype)
            assert alg.ring_allgather(world, piece(RANK), out) is out
            check_equal(out, np.concatenate([piece(r) for r in range(N)]), f"allgather {dtype} {m}")
            # inp may be out's own slot
            out2 = np.zeros(N * m, piece(0).dtype)
            out2[RANK * m:(RANK + 1) * m] = piece(RANK)
            alg.ring_allgather(world, out2[RANK * m:(RANK + 1) * m], out2)
            check_equal(out2, out, "allgather in place")


def case_ring_reduce_scatter_unequal():
    layouts = [[(3 * r + 1) % 5 for r in range(N)],   # unequal, with zeros for some n
               [0] * (N - 1) + [9],                     # everything on the last rank
               [1021 // N + (r < 1021 % N) for r in range(N)]]
    for counts in layouts:
        total = sum(counts)
        off = sum(counts[:RANK])
        for dtype in DTYPES:
            for op in OPS:
                a = to_storage(values(30, RANK, op, dtype, total), dtype)
                chunk = alg.ring_reduce_scatter(world, a, _dtypes.DTYPE_CODES[dtype], op, counts)
                assert chunk.size == counts[RANK]
                want = reference(30, op, dtype, total)[off:off + counts[RANK]]
                check_equal(from_storage(chunk, dtype), want,
                            f"reduce_scatter counts={counts} {op} {dtype}")
    try:
        alg.ring_reduce_scatter(world, np.zeros(5, np.float32), 0, "sum", [1] * (N + 1))
    except ValueError:
        pass
    else:
        raise AssertionError("bad counts accepted")


# ---------------------------------------------------------------------------------------------
# bounded waits

def case_timeout():
    """Rank 0 waits on a peer that never sends: PeerTimeoutError within the bound, naming the
    operation and the peer; its receive is cancelled, so the communicator still works after."""
    sub = world.Dup()
    saved = os.environ.get("MLFABRIC_TIMEOUT")
    bound = 0.3
    os.environ["MLFABRIC_TIMEOUT"] = str(bound)
    try:
        if RANK == 0:
            # p2p level: a receive nobody will match (from rank 0 itself when alone).
            peer = 1 % N
            buf = np.zeros(8, np.uint8)
            t0 = time.perf_counter()
            try:
                p2p.wait([p2p.irecv(sub, buf, peer)], [peer], "test receive")
            except PeerTimeoutError as e:
                took = time.perf_counter() - t0
                assert bound <= took < bound + 1.0, took
                assert "test receive" in str(e) and f"[{peer}]" in str(e), str(e)
            else:
                raise AssertionError("no PeerTimeoutError")
            if N > 1:
                # algorithm level: a broadcast from rank 1, which is not broadcasting. Rank 0 is
                # a leaf of that tree, so it only receives and leaves no stray message behind.
                t0 = time.perf_counter()
                try:
                    alg.tree_broadcast(sub, np.zeros(16, np.float32), 1)
                except PeerTimeoutError as e:
                    took = time.perf_counter() - t0
                    assert bound <= took < bound + 1.0, took
                    assert "tree_broadcast" in str(e) and "[1]" in str(e), str(e)
                else:
                    raise AssertionError("no PeerTimeoutError")
    finally:
        if saved is None:
            os.environ.pop("MLFABRIC_TIMEOUT", None)
        else:
            os.environ["MLFABRIC_TIMEOUT"] = saved
    world.Barrier()
    # The late peers arrive now: rank 1 sends what rank 0 waited for. The cancelled receives must
    # not swallow it: rank 0 gets it with a fresh receive, and the next collective is clean.
    if N > 1:
        if RANK == 1:
            p2p.wait([p2p.isend(sub, np.full(8, 7, np.uint8), 0)], [0], "late send")
        elif RANK == 0:
            late = np.zeros(8, np.uint8)
            p2p.wait([p2p.irecv(sub, late, 1)], [1], "drain")
            assert (late == 7).all()
    a = to_storage(values(40, RANK, "sum", "float32", 33), "float32")
    alg.ring_allreduce(sub, a, 0, "sum")
    check_equal(from_storage(a, "float32"), reference(40, "sum", "float32", 33), "after timeout")
    sub.Free()
