"""The one driver of the MPI benchmark scripts under benchmarks/ (after nccl-tests' `struct
testColl`: a benchmark is an entry of a table, the driver owns everything around it).

A script declares an Entry: its name, its docstring, the options it adds to the shared parser,
an optional check of the parsed arguments, and run(comm, args) -> records (a dict of the
script's own top-level JSON keys, on rank 0; None elsewhere), or (records, exit status).
main(entry) does the rest alike for every script:

  * parses the command line on every rank (help and errors printed by rank 0 only, every rank
    exits alike: 0 for --help, 2 for a usage error);
  * runs the entry; one rank's failure takes the whole job down (script.run_main);
  * writes the JSON on rank 0 to --out (alias --json): the script's records under their own
    keys, with the common envelope merged into "meta" (the script's own meta keys kept as
    they are; see envelope()).

The shared pieces the scripts use instead of copies of their own: git_state, jsonable,
write_json, stats (n / mean / median / p90 / max / min of a sample), and the round-robin
timing helpers (alternating, time_rounds, median_rounds, sleep_barrier)."""
import datetime
import hashlib
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from . import script

SCHEMA = "mlfabric.bench/1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the keys envelope() puts in every written document's "meta"
ENVELOPE_KEYS = ("schema", "benchmark", "command", "argv", "hostname", "cpu", "cpu_count",
                 "machine", "gpu", "git", "mlfabric_version", "ranks", "timestamp")


@dataclass
class Entry:
    """One benchmark: `name` (the script's file name without .py), `doc` (its module docstring:
    the first paragraph is the --help description), `options(parser)` adds its options (the
    common ones through add_out / add_iters / ..., spelled the same in every script), `check
    (parser, args)` rejects bad combinations with parser.error, `run(comm, args)` measures."""
    name: str
    doc: str
    options: Callable
    run: Callable
    check: Optional[Callable] = None
    prog: Optional[str] = None  # the usage line's program (default: mpirun -n N python ...)

    @property
    def script(self):
        return "benchmarks/%s.py" % self.name


# --- the common options ---------------------------------------------------------------------------

def add_out(parser, help="JSON file to write (rank 0)", metavar=None):
    """--out FILE (alias --json): checked writable before any work (script.output_path)."""
    kw = {"metavar": metavar} if metavar else {}
    parser.add_argument("--out", "--json", dest="out", type=script.output_path, help=help, **kw)


def add_iters(parser, default, help="timed calls per variant per round", type=None):
    parser.add_argument("--iters", type=type or script.positive_int, default=default, help=help)


def add_rounds(parser, default, help="rounds (alternating variant order)", type=None):
    parser.add_argument("--rounds", type=type or script.positive_int, default=default, help=help)


def add_warmup(parser, default, help="untimed calls before the timed ones", type=None):
    parser.add_argument("--warmup", type=type or script.nonnegative_int, default=default,
                        help=help)


def add_threads(parser, default=1, help="torch threads per rank", type=None):
    parser.add_argument("--threads", type=type or script.positive_int, default=default,
                        help=help)


# --- the envelope ---------------------------------------------------------------------------------

_current = {}  # the entry and argv being run (one benchmark per process)


def git_state():
    """{"commit", "dirty", "modified", "diff_sha1"} of the checkout the benchmark runs from, or
    None outside a git checkout. The tree may hold uncommitted work: the diff's hash tells two
    runs' code apart."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, timeout=10).stdout

    try:
        diff = git("diff", "HEAD")
        modified = [ln[3:] for ln in git("status", "--porcelain",
                                         "--untracked-files=no").decode().splitlines()
                    if ln.strip()]
        return {"commit": git("rev-parse", "HEAD").decode().strip() or None,
                "dirty": bool(modified), "modified": modified,
                "diff_sha1": hashlib.sha1(diff).hexdigest() if diff else None}
    except Exception:  # noqa: BLE001 - not a git checkout (or no git): say so in the JSON
        return None


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name():
    """The first CUDA device's name when the benchmark has torch loaded and sees a GPU, else
    None (torch is not imported here: a benchmark without it pays nothing)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - a broken CUDA setup is not the benchmark's failure
        pass
    return None


def mpi_size():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.size
    return int(_current.get("ranks", 1))


def command_line(name=None, argv=None, ranks=None):
    """The command that reruns this benchmark: `mpirun -n N python benchmarks/NAME.py ARGS`."""
    name = name or _current.get("name", "?")
    argv = _current.get("argv", sys.argv[1:]) if argv is None else argv
    return " ".join(["mpirun", "-n", str(ranks or mpi_size()), "python",
                     "benchmarks/%s.py" % name, *argv])


def envelope():
    """The common "meta" of every written document: what ran (schema, benchmark, command: the
    mpirun line that reruns it, argv: this process's exact command line), where (hostname, cpu:
    the CPU model, cpu_count, machine: the architecture, gpu: the device name or None), from
    which code (git, mlfabric_version), on how many ranks and when (timestamp, UTC). Local:
    rank 0 calls it alone."""
    from .report import mlfabric_version
    return {"schema": SCHEMA, "benchmark": _current.get("name"), "command": command_line(),
            "argv": [sys.executable, *sys.argv], "hostname": socket.gethostname(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "gpu": gpu_name(), "git": git_state(), "mlfabric_version": mlfabric_version(),
            "ranks": mpi_size(),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")}


def jsonable(x):
    """x as JSON can hold it: non-finite floats as "inf" / "-inf" / "nan", numpy scalars as
    Python numbers, tuples as lists, keys as strings; dict keys starting with "_" (a record's
    private working state) left out."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.generic):
        return jsonable(x.item())
    return x


def document(records):
    """The document written for `records`: its keys in order, "meta" first, holding the
    envelope with the script's own meta keys over it."""
    doc = {"meta": {**envelope(), **(records.get("meta") or {})}}
    doc.update((k, v) for k, v in records.items() if k != "meta")
    return doc


def write_json(path, records):
    with open(path, "w") as f:
        json.dump(jsonable(document(records)), f, indent=1)


# --- the driver -----------------------------------------------------------------------------------

def make_parser(entry):
    p = script.parser(entry.prog or "mpirun -n N python " + entry.script, entry.doc)
    entry.options(p)
    return p


def parse(entry, argv):
    """Every rank parses: help and errors printed once (rank 0), every rank exits alike."""
    p = make_parser(entry)
    args = p.parse_args(argv)
    if entry.check is not None:
        entry.check(p, args)
    return args


def _main(entry, argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.rank  # asked now: run() may finalize MPI
    _current.update(name=entry.name, argv=argv, ranks=comm.size)
    args = parse(entry, argv)
    out = entry.run(comm, args)
    records, status = out if isinstance(out, tuple) else (out, 0)
    if rank == 0 and records is not None and getattr(args, "out", None):
        write_json(args.out, records)
    return status or 0


def main(entry, argv=None):
    """Run `entry` as this process's benchmark and exit with its status (see the module)."""
    script.run_main(lambda: _main(entry, argv))


# --- shared measurement helpers -------------------------------------------------------------------

def stats(xs, with_min=True):
    """n, mean, median, p90, max (and min) of a sample; None for an empty one."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        return None
    out = {"n": len(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs),
           "p90": xs[min(len(xs) - 1, int(math.ceil(0.9 * len(xs))) - 1)], "max": xs[-1]}
    if with_min:
        out["min"] = xs[0]
    return out


def alternating(names, rounds):
    """The variants' order per round: as given, then reversed, and so on, so that every variant
    sees the same drift in machine load."""
    for r in range(rounds):
        yield list(names) if r % 2 == 0 else list(reversed(list(names)))


def sleep_barrier(comm):
    """A barrier that sleeps instead of spinning: ranks waiting here leave their core to the
    ranks still working (Open MPI's Barrier busy-polls)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def median_rounds(per_rank):
    """per_rank: each rank's list of per-round times -> (per-round slowest rank, median)."""
    rounds = [max(ts) for ts in zip(*per_rank)]
    return rounds, statistics.median(rounds)


def time_rounds(comm, work, names, rounds, iters):
    """{name: seconds per call of work[name]() in each round}: one warm-up call each, then
    rounds of iters calls per variant, the order alternating, a barrier before each."""
    for fn in work.values():  # warm-up
        comm.Barrier()
        fn()
    times = {name: [] for name in names}
    for order in alternating(names, rounds):
        for name in order:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                work[name]()
            times[name].append((time.perf_counter() - t0) / iters)
    return times


__all__ = ["Entry", "main", "parse", "make_parser", "add_out", "add_iters", "add_rounds",
           "add_warmup", "add_threads", "envelope", "git_state", "jsonable", "document",
           "write_json", "stats", "alternating", "sleep_barrier", "median_rounds",
           "time_rounds", "command_line"]
