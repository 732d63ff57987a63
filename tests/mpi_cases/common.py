"""Helpers for the multi-rank cases: deterministic per-rank inputs that every rank can regenerate
(so each rank computes the float64 reference of a collective locally) and tolerance-aware checks."""
import zlib

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

import mlfabric as mf

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
OPS = ("sum", "prod", "min", "max", "avg")
RTOL = {"float32": 2e-6, "float64": 1e-13, "float16": 2e-3, "bfloat16": 1.6e-2}


def values(rank, count, dtype, op, salt=0):
    """float64 values of rank's input: small enough that prod stays finite, exact in the dtype."""
    rng = np.random.default_rng(zlib.crc32(f"{rank}/{count}/{dtype}/{op}/{salt}".encode()))
    if dtype.startswith("int"):
        lo, hi = (-2, 3) if op == "prod" else (-1000, 1000)
        return rng.integers(lo, hi, count).astype(np.float64)
    if op == "prod":
        v = rng.uniform(0.5, 1.5, count)
    else:
        v = rng.normal(0, 10, count)
    return to_dtype(v, dtype).astype(np.float64) if dtype != "bfloat16" else bf16_round(v)


def bf16_round(v):
    t = torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16)
    return t.to(torch.float64).numpy()


def to_dtype(v, dtype):
    """An array of dtype holding v (torch tensor for bfloat16, numpy otherwise)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16)
    return np.asarray(v).astype(dtype)


def to_f64(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.to(torch.float64).numpy()
    return np.asarray(x, np.float64)


def reference(op, inputs, n):
    """float64 reduction of every rank's inputs."""
    stack = np.stack(inputs) if inputs else np.zeros((0,))
    if op in ("sum", "avg"):
        out = stack.sum(axis=0)
        return out / n if op == "avg" else out
    return {"prod": np.prod, "min": np.min, "max": np.max}[op](stack, axis=0)


def magnitude(op, inputs, n):
    """Scale of the rounding error of a reduction: algorithms that round after every step (ring,
    tree in float16) err in proportion to the partial sums, not to the result."""
    if op in ("sum", "avg") and inputs:
        return np.abs(np.stack(inputs)).sum(axis=0) / (n if op == "avg" else 1)
    return None


def assert_close(got, want, dtype, what, mag=None):
    got = to_f64(got)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if dtype.startswith("int"):
        # Integer reductions wrap like the dtype does.
        want = want.astype(np.int64).astype(dtype).astype(np.float64)
        bad = np.flatnonzero(got != want)
    else:
        # Reference rounded to the dtype, plus the rounding of intermediate sums.
        tol = RTOL[dtype] * ((np.abs(want) if mag is None else mag) + 1.0)
        bad = np.flatnonzero(np.abs(got - want) > tol)
    assert bad.size == 0, (f"{what}: {bad.size} wrong of {got.size}; first at {bad[0]}: got "
                           f"{got.flat[bad[0]]}, want {want.flat[bad[0]]}")


def digest(x):
    """Bytes hash of an array, to check every rank got bitwise the same result."""
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()
    return zlib.crc32(np.ascontiguousarray(x).tobytes())


def same_everywhere(x, what):
    from mpi4py import MPI
    # case modules with their own setup() run on MPI_COMM_WORLD
    hashes = (COMM or MPI.COMM_WORLD).allgather(digest(x))
    assert len(set(hashes)) == 1, f"{what}: ranks got different bits: {hashes}"


# The communicator the cases run on (mpi4py's test mixins over a COMM attribute): set by setup()
# from MLFABRIC_TEST_COMM, so one case module runs unchanged on MPI_COMM_WORLD, on a duplicate of
# it, and on a split of it whose ranks are numbered in reverse (so mlfabric's rank differs from the
# world's and two groups run their collectives side by side).
COMM = None


def test_comm(kind):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if kind == "world":
        return world
    if kind == "dup":
        return world.Dup()
    if kind == "split":
        return world.Split(color=world.rank % 2, key=world.size - world.rank)
    raise ValueError(f"MLFABRIC_TEST_COMM must be world, dup or split, got {kind!r}")


def setup():
    import os
    global COMM
    COMM = test_comm(os.environ.get("MLFABRIC_TEST_COMM", "world"))
    mf.init(COMM)


def take_part(role, work, model_size=3):
    """One rank's part in a parameter-server job (mlfabric.ps, init() done): a worker registers,
    runs work() and finishes; a server registers a zero model of model_size and serves; the other
    roles serve. Returns (what work() returned, or None; the job's Summary)."""
    import mlfabric.ps as ps
    if role == "worker":
        ps.register_as_worker()
        out = work()
        return out, ps.finish()
    if role == "server":
        ps.register_as_server(np.zeros(model_size))
    return None, ps.serve()
