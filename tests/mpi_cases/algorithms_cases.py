"""Multi-rank cases for mlfabric.comm.algorithms (run by tests/mpi/test_algorithms.py under mpirun).

Every case runs on every rank of COMM_WORLD. Each rank rebuilds every rank's input from a seed and
the rank number, so it computes the float64 reference locally; inputs are small integers, halves or
powers of two, exact in every dtype (bfloat16 included), so any order of reduction gives the same
exact answer and results are compared exactly. Every case also checks that all ranks hold the same
bytes (a hash per result, allgathered once per case).
"""
import contextlib
import hashlib
import os
import time

import numpy as np
from mpi4py import MPI

from mlfabric._core import dtypes as _dtypes
from mlfabric.comm import algorithms as alg
from mlfabric.comm import p2p
from mlfabric.errors import PeerTimeoutError

world = MPI.COMM_WORLD
N, RANK = world.Get_size(), world.Get_rank()

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
OPS = ("sum", "prod", "min", "max")
SIZES = sorted({0, 1, 7, 1021, 65537, max(N - 1, 0)})


# ---------------------------------------------------------------------------------------------
# inputs and references

def values(seed, rank, op, dtype, count):
    """float64 values for one rank's input, exact in every dtype, and so are the reductions of
    up to 8 ranks' inputs."""
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


class Checker:
    """What one case found on this rank: a hash of every result (ranks must agree on it) and the
    mismatches against the reference. Recording instead of raising keeps a failing rank in step
    with the others, so it cannot leave them stuck in a collective; @collective_case settles it."""

    def __init__(self):
        self.h, self.n, self.errors = hashlib.sha256(), 0, []

    def add(self, arr):
        self.h.update(np.ascontiguousarray(arr).tobytes())
        self.n += 1

    def finish(self, raised):
        got = world.allgather((self.n, self.h.hexdigest(), self.errors[:3]))
        if raised is not None:
            raise raised
        if self.errors:
            raise AssertionError("; ".join(self.errors[:3]) + f" ({len(self.errors)} in all)")
        agree = [(n, h) for n, h, _ in got]
        if any(e for _, _, e in got):
            return  # another rank reports its own mismatches
        assert all(g == agree[0] for g in agree), f"ranks disagree bitwise: {agree}"


CHECK = Checker()


def collective_case(fn):
    """A case whose checks are recorded in CHECK and settled (allgathered) at its end."""
    def run():
        global CHECK
        CHECK = Checker()
        raised = None
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - raised again after the allgather
            raised = e
        CHECK.finish(raised)
    run.__name__ = fn.__name__
    return run


def check_equal(got, want, what):
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want) if got.shape == want.shape else [0]
        i = bad[0] if len(bad) else 0
        CHECK.errors.append(f"{what}: {len(bad)} wrong of {want.size}"
                            + (f", first at {i}: got {got[i]} want {want[i]}" if want.size else ""))


def run_allreduce(algorithm, op, dtype, count, seed):
    code = _dtypes.DTYPE_CODES[dtype]
    arr = to_storage(values(seed, RANK, op, dtype, count), dtype)
    out = alg.allreduce(world, arr, code, op, algorithm)
    assert out is arr
    what = f"{algorithm} allreduce {op} {dtype} count={count}"
    ref = reference(seed, op, dtype, count)
    got = from_storage(arr, dtype)
    if op == "avg":
        tol = {"float32": 1e-6, "float64": 1e-12, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
        if not np.allclose(got, ref, rtol=tol, atol=tol):
            CHECK.errors.append(f"{what}: max error {np.max(np.abs(got - ref))}")
    else:
        check_equal(got, ref, what)
    CHECK.add(arr)


# ---------------------------------------------------------------------------------------------
# allreduce

def _matrix(algorithm):
    for dtype in DTYPES:
        for op in OPS:
            for count in SIZES:
                run_allreduce(algorithm, op, dtype, count, 1)


@collective_case
def case_ring_allreduce_matrix():
    _matrix("ring")


@collective_case
def case_rhd_allreduce_matrix():
    _matrix("rhd")


@collective_case
def case_tree_allreduce_matrix():
    _matrix("tree")


@collective_case
def case_auto_allreduce():
    for count in (0, 3, 1021, 65537):
        run_allreduce("auto", "sum", "float32", count, 2)


@collective_case
def case_large_float32_sum():
    """Primes and sizes past several message segments (pipelined receive/reduce paths)."""
    for algorithm in alg.ALGORITHMS:
        for count in (65537, 300007):
            run_allreduce(algorithm, "sum", "float32", count, 3)
    run_allreduce("ring", "max", "float64", 65537, 3)


@collective_case
def case_avg():
    for algorithm in alg.ALGORITHMS:
        for dtype in ("float32", "float64", "float16", "bfloat16"):
            run_allreduce(algorithm, "avg", dtype, 1021, 4)


@collective_case
def case_tiny_segments():
    """Every path that cuts messages into segments, at small sizes: segments of 24 bytes."""
    saved = p2p.SEGMENT_BYTES
    p2p.SEGMENT_BYTES = 24
    try:
        for algorithm in alg.ALGORITHMS:
            for dtype in ("float64", "bfloat16", "int32"):
                for count in (1, 7, 101):
                    run_allreduce(algorithm, "sum", dtype, count, 5)
        code = _dtypes.DTYPE_CODES["float32"]
        for root in range(N):
            a = to_storage(values(6, RANK, "max", "float32", 101), "float32")
            alg.tree_reduce(world, a, code, "max", root)
            if RANK == root:
                check_equal(from_storage(a, "float32"), reference(6, "max", "float32", 101),
                            "reduce")
            b = np.arange(53, dtype=np.float64) * (root + 1) if RANK == root else np.zeros(53)
            alg.tree_broadcast(world, b, root)
            check_equal(b, np.arange(53, dtype=np.float64) * (root + 1), "broadcast")
    finally:
        p2p.SEGMENT_BYTES = saved


@collective_case
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
    for bad, exc in ((np.zeros(3, np.float32), TypeError),
                     (np.zeros((2, 2), np.int64), ValueError)):
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
    for n in (1, 2, 3, 4, 8, 64):
        for nbytes in (0, 8, 4096, 1 << 16, 1 << 20, 1 << 30):
            assert alg.choose_allreduce(nbytes, n) in alg.ALGORITHMS
    assert alg.choose_allreduce(8, 4) != "ring"
    assert alg.choose_allreduce(256 << 20, 4) == "ring"


# ---------------------------------------------------------------------------------------------
# tree reduce / broadcast, allgather, reduce-scatter

@collective_case
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


@collective_case
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


@collective_case
def case_ring_allgather():
    for dtype in ("float32", "bfloat16", "int64", "uint8"):
        for m in (0, 1, 7, 1021):
            def piece(r):
                storage = np.uint16 if dtype == "bfloat16" else dtype
                return (np.arange(m) * 3 + r * 1000).astype(storage)
            out = np.zeros(N * m, piece(0).dtype)
            assert alg.ring_allgather(world, piece(RANK), out) is out
            check_equal(out, np.concatenate([piece(r) for r in range(N)]), f"allgather {dtype} {m}")
            # inp may be out's own slot
            out2 = np.zeros(N * m, piece(0).dtype)
            out2[RANK * m:(RANK + 1) * m] = piece(RANK)
            alg.ring_allgather(world, out2[RANK * m:(RANK + 1) * m], out2)
            check_equal(out2, out, "allgather in place")


@collective_case
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

def _expect_timeout(fn, bound, *needles):
    t0 = time.perf_counter()
    try:
        fn()
    except PeerTimeoutError as e:
        took = time.perf_counter() - t0
        assert bound <= took < bound + 1.0, f"timed out after {took:.3f}s, bound {bound}s"
        for s in needles:
            assert s in str(e), f"{s!r} not in {str(e)!r}"
    else:
        raise AssertionError("no PeerTimeoutError")


@contextlib.contextmanager
def mlfabric_timeout(seconds):
    """MLFABRIC_TIMEOUT set to `seconds` inside the block, restored after."""
    saved = os.environ.get("MLFABRIC_TIMEOUT")
    os.environ["MLFABRIC_TIMEOUT"] = str(seconds)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MLFABRIC_TIMEOUT", None)
        else:
            os.environ["MLFABRIC_TIMEOUT"] = saved


def case_timeout():
    """Rank 0 waits on a peer that never sends: PeerTimeoutError within the bound, naming the
    operation and the peer; its receive is cancelled, so the communicator still works after.
    Failures are kept until the end so every rank goes through the same collective calls."""
    sub = world.Dup()
    bound = 0.3
    failure = None
    try:
        with mlfabric_timeout(bound):
            if RANK == 0:
                # p2p level: a receive nobody matches (from rank 0 itself when alone).
                peer = 1 % N
                _expect_timeout(lambda: p2p.wait([p2p.irecv(sub, np.zeros(8, np.uint8), peer)],
                                                 [peer], "test receive", [True]),
                                bound, "test receive", f"[{peer}]")
                if N > 1:
                    # Algorithm level: a broadcast from rank 1, which is not broadcasting. Rank 0
                    # has virtual rank n-1 in that tree: a leaf, so it only receives (from its
                    # parent) and leaves no stray message behind.
                    v = N - 1
                    parent = (v - (v & -v) + 1) % N
                    _expect_timeout(lambda: alg.tree_broadcast(sub, np.zeros(16, np.float32), 1),
                                    bound, "tree_broadcast", f"[{parent}]")
    except Exception as e:  # noqa: BLE001 - re-raised below, after the collective calls
        failure = e
    world.Barrier()
    # The late peer arrives now: rank 1 sends what rank 0 waited for. The cancelled receive must
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
    if failure is not None:
        raise failure


def case_diverged_sizes():
    """Ranks that disagree on the size get an error, never a hang: the root broadcasts 16 floats
    where the others expect 8; its children see a truncated message (MlfabricError), and their
    subtrees, never served, time out (PeerTimeoutError, a subclass)."""
    from mlfabric.errors import MlfabricError

    sub = world.Dup()
    failure = None
    with mlfabric_timeout(0.3):
        a = np.zeros(16 if RANK == 0 else 8, np.float32)
        try:
            alg.tree_broadcast(sub, a, 0)
        except MlfabricError as e:
            if RANK == 0:
                failure = AssertionError(f"root failed: {e}")
            elif "tree_broadcast" not in str(e):
                failure = AssertionError(f"error does not name the operation: {e}")
        else:
            if RANK != 0:
                failure = AssertionError("a truncated broadcast passed silently")
    world.Barrier()
    sub.Free()
    if failure is not None:
        raise failure
