"""The nccl-tests-style driver behind `mpirun -n N python -m mlfabric.bench COLL ...`. Owns the CLI,
the size sweep, the table of collectives (how a size maps to element counts, the input pattern, the
expected output, the busbw factor), the (dtype, op) cases of -d all / -o all, the buffer device
(--device cpu, or cuda / nccl-tests' -g 1: GPU buffers, refused on every rank where a rank has no
GPU), warm-up, timing (per-iteration mean, combined over ranks as nccl-tests' -a: max by default)
and the element-wise result check (off with -c 0). Every record names the allreduce algorithm
asked for ("algorithm") and the backend mlfabric resolved it to for that buffer ("backend").
impls.py supplies the calls; report.py prints and saves the results. open_run() is the piece the
benchmarks/gpu_collectives.py wrapper shares.
"""
import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import impls, report
from .script import output_path, parse_size

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
# Machine epsilon (ulp of 1.0) of the floating dtypes: op avg, the only inexact check, allows 2.
EPS = {"float32": 2.0 ** -23, "float64": 2.0 ** -52, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
OPS = ("sum", "prod", "min", "max", "avg")
# nccl-tests' -d names (and the long ones) -> mlfabric.bench's; its other types have no buffer here
DTYPE_NAMES = {"float": "float32", "half": "float16", "double": "float64", "float32": "float32",
               "float16": "float16", "float64": "float64", "bfloat16": "bfloat16",
               "int32": "int32", "int": "int32", "int64": "int64"}
# nccl-tests' -a: how one time is made of the ranks' times
AVERAGE_MODES = {0: "rank 0", 1: "mean over ranks", 2: "min over ranks", 3: "max over ranks"}
DEVICES = ("cpu", "cuda")
ALGORITHMS = ("auto", "shm", "ring", "rhd", "tree", "nccl")
GPU_ALGORITHMS = ("auto", "nccl")   # GPU buffers move over NCCL, which picks its own algorithm
SENTINEL = 16384    # written to outputs before a run: exact in every dtype, and no input or
                    # expected value reaches it (|values| <= 256 up to 256 ranks, <= n beyond)
CHUNK = 1 << 20     # elements per step when filling and checking, to bound temporary memory


class UsageError(Exception):
    """A bad command line; raised identically on every rank, reported by rank 0, exit status 2."""


# --- sizes ---------------------------------------------------------------------------------------

def size_sweep(begin, end, factor, increment=None):
    """begin, begin*factor, ... up to end (inclusive), as nccl-tests' -b/-e/-f; with increment
    (nccl-tests' -i, used when there is no factor) begin, begin+increment, ... instead."""
    if end < begin:
        raise ValueError(f"-e ({end}) is smaller than -b ({begin})")
    if increment is not None:
        return list(range(begin, end + 1, increment))
    if factor < 2 and end != begin:
        raise ValueError(f"-f must be >= 2, got {factor}")
    sizes, s = [], begin
    while s <= end:
        sizes.append(s)
        if factor < 2:
            break
        s *= factor
    return sizes


# --- data pattern: small integers, exact in every dtype, so results are checked for equality -----

def _mix(x):
    """A 64-bit mixing hash (wrapping uint64 arithmetic), so no shift of the data goes unnoticed."""
    x = np.asarray(x, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return x ^ (x >> np.uint64(31))


def amplitude(p):
    """Inputs lie in [-a, a]. Sums over n ranks must stay exact in bfloat16 (|int| <= 256), which
    holds up to 256 ranks (float16: 2048)."""
    if p.op in ("sum", "avg"):
        return max(1, min(30, 256 // p.nranks))
    return 30


def pattern(p, rank, idx):
    """Rank `rank`'s input value at element indices idx (rank may be an array like idx), int64.

    prod: 1 almost everywhere; per element one rank holds 2 and one holds -1 (ranks are distinct
    modulo nranks+1), so every product is exact. Everything else: hashed integers in [-a, a]."""
    h = _mix(idx)
    r = np.asarray(rank, dtype=np.uint64)
    if p.op == "prod":
        m = (h + r) % np.uint64(max(p.nranks, 2) + 1)
        return np.where(m == 0, 2, np.where(m == 1, -1, 1)).astype(np.int64)
    a = amplitude(p)
    v = _mix(h ^ (r * np.uint64(0xD1B54A32D192ED03) + np.uint64(1)))
    return (v % np.uint64(2 * a + 1)).astype(np.int64) - a


def reduce_over_ranks(p, idx):
    """op over every rank's pattern at idx, in float64 (exact), avg divided by nranks."""
    acc = pattern(p, 0, idx).astype(np.float64)
    for q in range(1, p.nranks):
        v = pattern(p, q, idx)
        if p.op in ("sum", "avg"):
            acc += v
        elif p.op == "prod":
            acc *= v
        elif p.op == "min":
            np.minimum(acc, v, out=acc)
        else:
            np.maximum(acc, v, out=acc)
    return acc / p.nranks if p.op == "avg" else acc


def sentinel(lo, hi):
    return np.full(hi - lo, SENTINEL, dtype=np.int64)


# --- the collectives table (nccl-tests' per-collective byte count, init, check and bw factor) ----

@dataclass(frozen=True)
class Params:
    """One case: what every rank agrees on, plus this rank's index."""
    coll: str
    dtype: str
    op: Optional[str]   # None for collectives that do not reduce
    root: int           # -1 where there is no root
    nranks: int
    rank: int
    count: int          # elements in the buffer the size refers to (the "count" column)
    send_count: int     # elements of this rank's input
    recv_count: int     # elements of this rank's output

    @property
    def nbytes(self):
        return self.count * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Coll:
    name: str
    reduces: bool
    rooted: bool
    granule: Callable[[int], int]              # count is rounded down to a multiple of this
    counts: Callable[[int, int], tuple]        # (count, nranks) -> (send_count, recv_count)
    busbw_factor: Callable[[int], float]
    inputs: Callable[[Params, int, int], np.ndarray]     # this rank's input [lo, hi)
    expected: Callable[[Params, int, int], np.ndarray]   # this rank's output [lo, hi), float64
    time_divisor: int = 1                      # pingpong times a round trip and reports half
    checked: Callable[[Params], bool] = lambda p: True   # the ranks whose output is checked


def _idx(lo, hi):
    return np.arange(lo, hi, dtype=np.int64)


def _allgather_expected(p, lo, hi):
    k = _idx(lo, hi)
    return pattern(p, k // p.send_count, k % p.send_count).astype(np.float64)


def _reduce_scatter_expected(p, lo, hi):
    return reduce_over_ranks(p, _idx(lo, hi) + p.rank * p.recv_count)


def _alltoall_expected(p, lo, hi):
    """Block j of this rank's output is block `rank` of rank j's input."""
    k, chunk = _idx(lo, hi), p.count // p.nranks
    return pattern(p, k // chunk, p.rank * chunk + k % chunk).astype(np.float64)


def _sendrecv_expected(p, lo, hi):
    """What the previous rank (in a ring) sent."""
    return pattern(p, (p.rank - 1) % p.nranks, _idx(lo, hi)).astype(np.float64)


def _own_input(p, lo, hi):
    return pattern(p, p.rank, _idx(lo, hi))


def _pingpong_inputs(p, lo, hi):
    return pattern(p, 0, _idx(lo, hi)) if p.rank == 0 else sentinel(lo, hi)


COLLS = {
    "allreduce": Coll(
        "allreduce", True, False, lambda n: 1, lambda c, n: (c, c),
        lambda n: 2 * (n - 1) / n,
        lambda p, lo, hi: pattern(p, p.rank, _idx(lo, hi)),
        lambda p, lo, hi: reduce_over_ranks(p, _idx(lo, hi))),
    "broadcast": Coll(
        "broadcast", False, True, lambda n: 1, lambda c, n: (c, c),
        lambda n: 1.0,
        lambda p, lo, hi: (pattern(p, p.root, _idx(lo, hi)) if p.rank == p.root
                           else sentinel(lo, hi)),
        lambda p, lo, hi: pattern(p, p.root, _idx(lo, hi)).astype(np.float64)),
    "allgather": Coll(  # size = the gathered output; each rank sends size / nranks
        "allgather", False, False, lambda n: n, lambda c, n: (c // n, c),
        lambda n: (n - 1) / n,
        lambda p, lo, hi: pattern(p, p.rank, _idx(lo, hi)),
        _allgather_expected),
    "reduce_scatter": Coll(  # size = the input; each rank receives size / nranks
        "reduce_scatter", True, False, lambda n: n, lambda c, n: (c, c // n),
        lambda n: (n - 1) / n,
        lambda p, lo, hi: pattern(p, p.rank, _idx(lo, hi)),
        _reduce_scatter_expected),
    "pingpong": Coll(  # ranks 0 and 1; time = half the round trip
        "pingpong", False, False, lambda n: 1, lambda c, n: (c, c),
        lambda n: 1.0,
        _pingpong_inputs,
        lambda p, lo, hi: pattern(p, 0, _idx(lo, hi)).astype(np.float64),
        time_divisor=2, checked=lambda p: p.rank < 2),
    "alltoall": Coll(  # size = each rank's input (= output); size / nranks goes to each peer
        "alltoall", False, False, lambda n: n, lambda c, n: (c, c),
        lambda n: (n - 1) / n,
        _own_input, _alltoall_expected),
    "reduce": Coll(  # the result lands on the root only, the only rank checked
        "reduce", True, True, lambda n: 1, lambda c, n: (c, c),
        lambda n: 1.0,
        _own_input,
        lambda p, lo, hi: reduce_over_ranks(p, _idx(lo, hi)),
        checked=lambda p: p.rank == p.root),
    "sendrecv": Coll(  # every rank sends to the next and receives from the previous (a ring)
        "sendrecv", False, False, lambda n: 1, lambda c, n: (c, c),
        lambda n: 1.0,
        _own_input, _sendrecv_expected),
}


def plan_counts(coll, sizes, dtype, nranks):
    """Element counts for the byte sizes, rounded down to the collective's granule; sizes that
    round to zero elements are dropped, as are repeats. Returns (counts, dropped sizes)."""
    counts, dropped = [], []
    g = coll.granule(nranks)
    for s in sizes:
        c = (s // ITEMSIZE[dtype]) // g * g
        if c == 0:
            dropped.append(s)
        elif c not in counts:
            counts.append(c)
    return counts, dropped


def make_params(coll, args, count, nranks, rank):
    send, recv = coll.counts(count, nranks)
    return Params(coll.name, args.dtype, args.op if coll.reduces else None,
                  args.root if coll.rooted else -1, nranks, rank, count, send, recv)


# --- filling, timing, checking -------------------------------------------------------------------

def _chunks(n):
    for lo in range(0, n, CHUNK):
        yield lo, min(n, lo + CHUNK)


def fill_case(coll, p, case):
    """Clear the output to SENTINEL, then write this rank's input pattern."""
    if case.outbuf is not None:
        impls.fill_const(case.outbuf, SENTINEL)
    if case.inbuf is not None:
        for lo, hi in _chunks(impls.length(case.inbuf)):
            impls.write(case.inbuf, lo, coll.inputs(p, lo, hi))


def count_wrong(got, want, dtype, op):
    """Mismatching elements: exact equality, except avg (sum / n rounds): within 2 ulp."""
    if op == "avg":
        tol = 2 * EPS[dtype] * np.maximum(1.0, np.abs(want))
        return int(np.count_nonzero(~(np.abs(got - want) <= tol)))
    return int(np.count_nonzero(got != want))


def check_output(coll, p, out):
    """#wrong on this rank: every element of `out` against the expected result."""
    if not coll.checked(p):
        return 0
    if out is None:
        return p.recv_count
    if impls.length(out) != p.recv_count or (len(out.shape) != 1):
        return p.recv_count
    wrong = 0
    for lo, hi in _chunks(p.recv_count):
        wrong += count_wrong(impls.read(out, lo, hi), coll.expected(p, lo, hi), p.dtype, p.op)
    return wrong


def inject_error(coll, p, out):
    """Corrupt element 0 of rank 0's output (the hidden --inject-error flag, for tests)."""
    if p.rank == 0 and out is not None and p.recv_count > 0 and coll.checked(p):
        impls.write(out, 0, coll.expected(p, 0, 1) + 7)


def time_batch(comm, run, warmup, iters, average=3):
    """Seconds per call: warm up, barrier, time `iters` calls; combined over ranks as nccl-tests'
    -a does (0: rank 0's, 1: the mean, 2: the min, 3: the max)."""
    from mpi4py import MPI
    for _ in range(warmup):
        run()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    local = (time.perf_counter() - t0) / iters
    if average == 0:
        return comm.bcast(local, root=0)
    if average == 1:
        return comm.allreduce(local, op=MPI.SUM) / comm.size
    return comm.allreduce(local, op=MPI.MIN if average == 2 else MPI.MAX)


def agree(comm, problem):
    """Every rank's (kind, message) problem or None -> the first one (with its rank) or None."""
    for r, pr in enumerate(comm.allgather(problem)):
        if pr is not None:
            return pr[0], f"{pr[1]} (rank {r})" if comm.size > 1 else pr[1]
    return None


def _attempt(fn):
    """(result, None) or (None, (kind, message)): Unsupported is a skip, anything else an error."""
    try:
        return fn(), None
    except impls.Unsupported as e:
        return None, ("skip", str(e))
    except Exception as e:
        return None, ("error", f"{type(e).__name__}: {e}")


def bench_case(comm, coll, family, variant, p, args):
    """Run one (size, impl) case on every rank: (record, None) or (None, (kind, message))."""
    from mpi4py import MPI
    case, problem = _attempt(lambda: family.prepare(variant, coll.name, p))
    problem = agree(comm, problem)
    if problem:
        return None, problem
    in_place = impls.same_memory(case.inbuf, case.output())   # rank 0's view is reported
    fill_case(coll, p, case)
    seconds = time_batch(comm, case.run, args.warmup, args.iters,
                         args.average) / coll.time_divisor
    if not args.check:  # -c 0: timed only, #wrong unknown
        return make_record(coll, family, variant, p, args, seconds, None, in_place,
                           case.backend), None
    fill_case(coll, p, case)  # the timed in-place iterations accumulated: start over for the check
    comm.Barrier()
    case.run()
    out = case.output()
    if args.inject_error:
        inject_error(coll, p, out)
    wrong = comm.allreduce(check_output(coll, p, out), op=MPI.SUM)
    return make_record(coll, family, variant, p, args, seconds, wrong, in_place,
                       case.backend), None


def add_in_place(records):
    """An out-of-place record whose impl also has an in-place variant (mpi-oop beside mpi) also
    carries that variant's results, under inplace_* keys."""
    for _, oop, ip in report.pairs(records):
        if oop is not None and ip is not None:
            oop.update({"inplace_" + k: ip[k] for k in report.FORM_KEYS + ["impl"]})


def make_record(coll, family, variant, p, args, seconds, wrong, in_place=False, backend=None):
    algbw = p.nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "impl": variant, "family": family.name, "coll": coll.name, "dtype": p.dtype,
        "op": p.op or "none", "root": p.root, "bytes": p.nbytes, "count": p.count,
        "send_count": p.send_count, "recv_count": p.recv_count, "ranks": p.nranks,
        "time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * coll.busbw_factor(p.nranks),
        "busbw_factor": coll.busbw_factor(p.nranks), "wrong": wrong, "checked": wrong is not None,
        "in_place": in_place,
        "iters": args.iters, "warmup": args.warmup, "average": args.average,
        "algorithm": family.algorithm(variant, coll.name), "backend": backend,
        "device": args.device,
    }


# --- command line --------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse that prints (help, usage, errors) on rank 0 only, and exits on every rank alike."""
    rank = 0

    def _print_message(self, message, file=None):
        if self.rank == 0:
            super()._print_message(message, file)


def build_parser(rank=0):
    p = _Parser(
        prog="python -m mlfabric.bench",
        description="Collective microbenchmarks in the style of nccl-tests: run under "
                    "`mpirun -n N`, on CPU buffers or (--device cuda, -g 1) one GPU per rank. "
                    "(`python -m mlfabric.bench kernels -h`: the single-process kernel "
                    "benchmark.)",
        epilog="Sizes are bytes of the per-rank buffer: allreduce/broadcast/reduce the buffer, "
               "allgather the gathered output, reduce_scatter and alltoall the input, pingpong "
               "and sendrecv the message. See "
               "benchmarks/README.md.")
    p.rank = rank
    p.add_argument("coll", choices=list(COLLS), help="the collective to measure")
    p.add_argument("-b", "--minbytes", default="8", help="first size (K/M/G suffixes; default 8)")
    p.add_argument("-e", "--maxbytes", default="128M", help="last size (default 128M)")
    p.add_argument("-f", "--stepfactor", type=int, default=None,
                   help="size factor (default 2 unless -i is given)")
    p.add_argument("-i", "--stepbytes", default=None,
                   help="size increment (an additive sweep, as nccl-tests' -i; not with -f > 1)")
    p.add_argument("--impl", default=None,
                   help="comma-separated families or variants. CPU: "
                        f"{impls.known_names('cpu')}; default {impls.DEFAULT_IMPLS['cpu']}. "
                        f"GPU: {impls.known_names('cuda')}; default "
                        f"{impls.DEFAULT_IMPLS['cuda']}")
    p.add_argument("--dtype", "-d", default="float32", type=dtype_name,
                   help=f"{', '.join(DTYPES)}, nccl-tests' float, half, double, or all "
                        "(default float32)")
    p.add_argument("--op", "-o", default="sum", choices=OPS + ("all",),
                   help="reduction op (allreduce, reduce_scatter, reduce), or all")
    p.add_argument("--root", "-r", type=int, default=0,
                   help="broadcast and reduce root (default 0)")
    p.add_argument("--iters", "-n", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("--warmup", "-w", type=int, default=5, help="warm-up iterations (default 5)")
    p.add_argument("--check", "-c", type=int, default=1, choices=(0, 1),
                   help="check every result (1, the default) or not (0: #wrong is N/A)")
    p.add_argument("--average", "-a", type=int, default=3, choices=sorted(AVERAGE_MODES),
                   help="the time of a case: 0 rank 0's, 1 the mean, 2 the min, 3 the max over "
                        "ranks (default 3)")
    p.add_argument("--timeout", "-T", type=float, default=None, metavar="SECONDS",
                   help="seconds a rank waits for its peers in one call (MLFABRIC_TIMEOUT)")
    p.add_argument("--ngpus", "-g", type=int, default=None,
                   help="GPUs per rank, as nccl-tests' -g: 0 (CPU buffers) or 1 (= --device "
                        "cuda)")
    p.add_argument("--device", default=None, choices=DEVICES,
                   help="buffer device: cpu (the default) or cuda (one GPU per rank: mlfabric's "
                        "NCCL path beside torch.distributed's NCCL backend)")
    p.add_argument("--algorithm", default="auto", choices=ALGORITHMS,
                   help="mlfabric allreduce algorithm asked for (default auto; GPU buffers: "
                        "auto or nccl); records also name the backend it resolves to")
    p.add_argument("--baseline", default=None,
                   help="impl (family or variant) the summary divides by (default mpi; GPU: "
                        "torch-nccl)")
    p.add_argument("--json", "-J", metavar="FILE", type=output_path,
                   help="write the records as a JSON list (rank 0)")
    p.add_argument("--plot", metavar="FILE.png", type=output_path,
                   help="plot busbw vs size per impl (matplotlib)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)
    return p


def dtype_name(text):
    """argparse type: a dtype by mlfabric.bench's or nccl-tests' name, or 'all'."""
    if text == "all" or text in DTYPE_NAMES:
        return DTYPE_NAMES.get(text, text)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a dtype mlfabric.bench measures; known: {', '.join(DTYPE_NAMES)}, all")


def resolve_steps(args):
    """(factor, increment) of the sweep: -f wins when > 1, else -i, else a factor of 2."""
    if args.stepfactor is not None and args.stepfactor > 1:
        return args.stepfactor, None
    if args.stepbytes is not None:
        inc = parse_size(args.stepbytes)
        return 1, inc
    return (2 if args.stepfactor is None else args.stepfactor), None


def combos(args):
    """The (dtype, op) cases of the run: one, or every supported one for -d all / -o all (op
    None for collectives that do not reduce); avg only on floating dtypes."""
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    if args.dtype == "all" and impls.import_torch() is None:
        dtypes.remove("bfloat16")
    ops = list(OPS) if args.op == "all" else [args.op]
    if not COLLS[args.coll].reduces:
        ops = ops[:1]
    return [(d, o) for d in dtypes for o in ops if not (o == "avg" and d.startswith("int"))
            or not COLLS[args.coll].reduces]


def resolve_device(args):
    """The buffer device of --device and nccl-tests' -g (GPUs per rank: 0 or 1), which must
    agree; fills in the device's default --impl and --baseline."""
    if args.ngpus is not None and args.ngpus not in (0, 1):
        raise UsageError(f"-g {args.ngpus}: mlfabric.bench uses one GPU per rank (-g 1) or none "
                         "(-g 0); run one rank per GPU")
    from_g = None if args.ngpus is None else ("cuda" if args.ngpus == 1 else "cpu")
    if args.device is not None and from_g is not None and args.device != from_g:
        raise UsageError(f"-g {args.ngpus} contradicts --device {args.device}")
    args.device = args.device or from_g or "cpu"
    if args.impl is None:
        args.impl = impls.DEFAULT_IMPLS[args.device]
    if args.baseline is None:
        args.baseline = "torch-nccl" if args.device == "cuda" else "mpi"
    if args.device == "cuda" and args.algorithm not in GPU_ALGORITHMS:
        raise UsageError(f"--algorithm {args.algorithm}: GPU buffers move over NCCL, which "
                         "picks its own algorithm (--algorithm auto or nccl)")
    if args.device == "cpu" and args.algorithm == "nccl":
        raise UsageError("--algorithm nccl moves GPU buffers: add --device cuda")
    return args.device


def validate(args, nranks):
    """Resolve the device, sizes and impls; UsageError (the same on every rank) for anything
    wrong."""
    device = resolve_device(args)
    try:
        factor, inc = resolve_steps(args)
        args.stepfactor, args.stepbytes = factor, inc
        sizes = size_sweep(parse_size(args.minbytes), parse_size(args.maxbytes), factor, inc)
        variants = impls.resolve(args.impl, device)
    except ValueError as e:
        raise UsageError(str(e))
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"-T must be > 0 seconds, got {args.timeout}")
    if args.op == "avg" and args.dtype.startswith("int"):
        raise UsageError(f"--op avg needs a floating dtype, got {args.dtype}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    if COLLS[args.coll].rooted and not 0 <= args.root < nranks:
        raise UsageError(f"--root {args.root} is not a rank of {nranks}")
    if args.coll == "pingpong" and nranks < 2:
        raise UsageError("pingpong needs at least 2 ranks (ranks 0 and 1 take part)")
    if args.coll == "sendrecv" and nranks < 2:
        raise UsageError("sendrecv needs at least 2 ranks (each sends to the next)")
    if args.dtype == "bfloat16" and impls.import_torch() is None:
        raise UsageError("bfloat16 buffers need torch, which is not installed")
    return sizes, variants


def resolve_baseline(name, variant_names, device="cpu"):
    """The variant the summary divides by: a variant name, or the first variant of a family."""
    if name in variant_names:
        return name
    for v in variant_names:
        if impls.variant_family(device).get(v) == name:
            return v
    return None


# --- the run -------------------------------------------------------------------------------------

class Run:
    """One invocation: sets the families up, sweeps sizes x impls, reports, shuts down."""

    def __init__(self, args, comm, sizes, variants):
        self.args, self.comm, self.rank = args, comm, comm.rank
        self.coll = COLLS[args.coll]
        self.sizes, self.variants = sizes, variants
        self.families, self.active, self.records = {}, [], []
        self.ran = []   # every variant that ran a case, in order (the summary's columns)
        self.failed = False
        self.headed = None  # the collective whose table header was printed last
        self.named = {s.strip() for s in args.impl.split(",")}
        self.out = sys.stdout

    def say(self, line):
        if self.rank == 0:
            print(line, file=self.out, flush=True)

    def note(self, kind, message):
        self.say(f"# {'ERROR' if kind == 'error' else 'note'}: {message}")
        self.failed = self.failed or kind == "error"

    def setup(self):
        """Set each family up once (all ranks agree first that it can be)."""
        for fam_name, _ in self.variants:
            if fam_name not in self.families:
                self.families[fam_name] = self._setup_family(fam_name)

    def select(self, args):
        """Make `args` (one collective, dtype and op) the current case; keep the variants that
        support this collective, dtype and op."""
        self.args, self.active = args, []
        self.coll = COLLS[args.coll]
        for fam_name, variant in self.variants:
            family = self.families[fam_name]
            if family is None:
                continue
            reason = (family.missing(self.coll.name)
                      or family.supports(variant, self.coll.name, self.args.dtype, self.args.op))
            if reason:
                if variant in self.named or family.name == variant:  # not if a family expanded
                    self.note("skip", f"{variant} skipped for {self.coll.name}/"
                                      f"{self.args.dtype}: {reason}")
            else:
                self.active.append((family, variant))
                if variant not in self.ran:
                    self.ran.append(variant)

    def _setup_family(self, name):
        family = impls.families(self.args.device)[name]()
        problem = agree(self.comm, _kind_of(name, family.available()))
        if problem is None:
            _, problem = _attempt(lambda: family.setup(self.comm, self.args))
            problem = agree(self.comm, problem)
        if problem:
            self.note(*problem)
            return None
        return family

    def shutdown(self):
        for family in reversed([f for f in self.families.values() if f is not None]):
            try:
                family.shutdown()
            except Exception as e:
                print(f"[rank {self.rank}] {family.name} shutdown failed: {e}", file=sys.stderr)

    def sweep(self, reverse=False):
        """Every size of the current case, the variants in order (reversed with `reverse`, so
        that alternate sweeps give each variant the same drift in machine load). Returns the
        records made."""
        counts, dropped = plan_counts(self.coll, self.sizes, self.args.dtype, self.comm.size)
        for s in dropped:
            self.note("skip", f"size {s} B holds no whole element per rank for "
                              f"{self.coll.name}/{self.args.dtype} on {self.comm.size} ranks")
        if self.headed != self.coll.name:
            self.say(report.table_header(self.coll.name))
            self.headed = self.coll.name
        made = []
        for k, count in enumerate(counts):
            p = make_params(self.coll, self.args, count, self.comm.size, self.rank)
            self.progress(k, len(counts), p.nbytes)
            done = []
            for family, variant in (self.active[::-1] if reverse else self.active):
                rec, problem = bench_case(self.comm, self.coll, family, variant, p, self.args)
                if problem:
                    self.note(problem[0], f"{variant} at {p.nbytes} B: {problem[1]}")
                    continue
                done.append(rec)
            self.records += done
            made += done
            add_in_place(done)
            if done:
                self.say(report.table_rows(done))
        return made

    def progress(self, k, total, nbytes):
        if self.rank == 0 and not self.args.quiet:
            w = len(str(total))
            print(f"[{k + 1:{w}d}/{total}] {self.coll.name} {report.human_size(nbytes)}",
                  file=sys.stderr, flush=True)

    def finish(self, host):
        """Summary, JSON and plot (rank 0); the exit status."""
        for r in self.records:
            r.update(host)
        names = self.ran
        wrong = sum(r["wrong"] or 0 for r in self.records)
        if self.rank == 0:
            base = resolve_baseline(self.args.baseline, names, self.args.device)
            if base is None and names:
                self.note("skip", f"baseline {self.args.baseline!r} did not run; "
                                  f"using {names[0]}")
                base = names[0]
            self.say(report.summary(self.records, names, base))
            if self.args.check:
                self.say(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
            else:
                self.say("# Out of bounds values : N/A (not checked: -c 0)")
            if self.args.json:
                report.write_json(self.args.json, self.records)
            if self.args.plot:
                report.plot(self.args.plot, self.records, names, report.plot_title(self.records))
        return 1 if wrong or self.failed else 0


def _kind_of(family_name, reason):
    """An unavailable family: a skip for gloo and torch-nccl (torch is optional), an error for
    mlfabric."""
    if reason is None:
        return None
    return ("skip" if family_name in ("gloo", "torch-nccl") else "error", reason)


def check_cuda(comm):
    """UsageError, the same on every rank, unless every rank sees a GPU."""
    problems = comm.allgather(impls.cuda_problem())
    bad = [r for r, problem in enumerate(problems) if problem]
    if not bad:
        return
    if len(bad) == comm.size:
        who = "every rank" if comm.size > 1 else "rank 0"
    else:
        who = ("rank " if len(bad) == 1 else "ranks ") + ", ".join(map(str, bad))
    raise UsageError(f"no CUDA device: {problems[bad[0]]} ({who}); --device cuda (-g 1) "
                     "needs one GPU per rank")


def open_run(args, comm):
    """Validate `args` (UsageError), claim the GPUs (--device cuda), print the preamble and set
    the families up: (Run, host description, the (dtype, op) cases). The caller sweeps, then
    calls Run.shutdown() and Run.finish(host)."""
    sizes, variants = validate(args, comm.size)
    if args.device == "cuda":
        check_cuda(comm)
    impls.limit_threads()
    if args.plot and comm.rank == 0:
        missing = report.plot_unavailable()
    else:
        missing = None
    missing = comm.bcast(missing, root=0)
    if missing:
        raise UsageError(missing)
    if args.timeout is not None:  # read by mlfabric when its families set up
        os.environ["MLFABRIC_TIMEOUT"] = repr(args.timeout)
    args.cuda_device = None
    host = report.host_info(comm)
    if args.device == "cuda":  # before any family creates an NCCL communicator
        args.cuda_device, shared = impls.cuda_setup(comm)
        host.update(report.gpu_info(comm, args.cuda_device, shared))
    cases = combos(args)
    bench = Run(args, comm, sizes, variants)
    shown = argparse.Namespace(**dict(vars(args), dtype=",".join(sorted({d for d, _ in cases},
                                                                        key=DTYPES.index)),
                                      op=",".join(dict.fromkeys(o for _, o in cases))))
    bench.say(report.preamble(shown, comm.size, sizes, variants, host))
    bench.setup()
    return bench, host, cases


def run(args, comm):
    bench, host, cases = open_run(args, comm)
    for dtype, op in cases:
        bench.select(argparse.Namespace(**dict(vars(args), dtype=dtype, op=op)))
        bench.sweep()
    bench.shutdown()  # not on an exception: shutdown is collective, and main() aborts instead
    return bench.finish(host)


def main(argv=None):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    try:
        args = build_parser(comm.rank).parse_args(argv)
        return run(args, comm)
    except UsageError as e:
        if comm.rank == 0:
            print(f"mlfabric.bench: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        # Ranks may now be out of step: report, then take the whole job down rather than hang.
        sys.stderr.write(f"[rank {comm.rank}] mlfabric.bench failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.Abort(1)
