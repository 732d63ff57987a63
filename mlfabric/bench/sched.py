"""The scheduler's cost per batch (paper §7.4): the fast path (mlfabric.sched.fast: Alg. 2 and
Alg. 3 in C++ with exact shortcuts), the same C++ running the paper's plain loops, and the Python
reference (mlfabric.sched.schedule), on the paper's §7.4 setup, next to the paper's numbers.
Single process, no MPI traffic. Every run also checks that fast, plain and reference plans agree.

    python -m mlfabric.bench sched [--sizes 10,30,100,500,1000] [--repeat N] [--json FILE]
                                   [--seed S] [--rates N1|N2|N3] [--profile]

The instance for a batch of n updates (§7.4: "batches of |U| updates (with random deadlines from
Uniform(1, 2|U|)) for a network topology with |U|/2 nodes and a congestion-free core"):
- hosts: max(1, n // 2) worker hosts 1..W plus the server on its own host 0 (§7 runs the server
  on a dedicated machine); full-bisection core; every host's egress and ingress rate drawn
  independently from the paper's set {1, 2.5, 3.3, 5, 10} Gbps with the probabilities of preset
  N1 (default: 10% 5 Gbps, 90% 10 Gbps), N2 or N3, constant over the batch (the scheduler plans a
  batch from the monitor's current rates);
- updates: id i from worker host 1 + i mod W (two per host, arriving interleaved), 100 MB each
  (a ResNet-50 update, §2), all ready at the batch's start t = 0;
- deadlines: dl(g) drawn uniformly from the integers 1..2n; v_init = tau_max = 2n and
  v(g) = dl(g), so that dl(g) = v(g) + tau_max - v_init (eq. 9) is the drawn value;
- aggregators: every worker host (aggregators run beside the workers, §4), pre-assigned to
  groups in a random order from the seed (§5.2); mode async, no momentum.

Columns: ms_median is the fast path for the whole batch — ordering, aggregation and building the
Plan and the network after it, as mlfabric.sched.schedule returns them — median of --repeat
runs; ms_plain_cpp the same call with plain=True (median of up to 3); ms_reference one run of
mlfabric.sched.schedule; paper_ms the paper's figure (< 5 ms for 30 workers, whose batches hold
fewer than 10 updates, is used for every n <= 30); match: the three plans are equal, field by
field. --profile splits the fast path's time into reading the input, Alg. 2 and Alg. 3 in C++,
the rest of the native call (copying and exporting), and building the Python objects.
"""
import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time

from .script import output_path

PAPER_MS = {10: 5.0, 30: 5.0, 100: 30.0, 500: 440.0, 1000: 1460.0}  # §7.4
RATES_GBPS = (1.0, 2.5, 3.3, 5.0, 10.0)                               # §7
PRESETS = {"N1": (0, 0, 0, 0.1, 0.9), "N2": (0, 0.1, 0.1, 0.1, 0.7), "N3": (0.5, 0, 0, 0, 0.5)}
UPDATE_BYTES = 100e6                                                  # ResNet-50, §2
COLUMNS = ("updates", "nodes", "aggregators", "ms_median", "ms_plain_cpp", "ms_reference",
           "paper_ms", "speedup_vs_paper", "speedup_vs_reference", "match")


def paper_ms(n):
    """The paper's scheduler time for a batch of n updates, where it gives one (None otherwise)."""
    if n <= 30:
        return PAPER_MS[30]
    return PAPER_MS.get(n)


def instance(n, seed=0, rates="N1"):
    """The benchmark's batch of n updates (see the module header): a dict of the keyword
    arguments of mlfabric.sched.schedule, updates, network and server included."""
    from ..sched import Network, Update, gbps
    if n < 0:
        raise ValueError("a batch holds n >= 0 updates, got %r" % (n,))
    if rates not in PRESETS:
        raise ValueError("rates must be one of %s, got %r" % (", ".join(PRESETS), rates))
    rng = random.Random(seed)
    workers = max(1, n // 2)
    hosts = workers + 1
    draw = lambda: gbps(rng.choices(RATES_GBPS, PRESETS[rates])[0])  # noqa: E731
    network = Network([draw() for _ in range(hosts)], [draw() for _ in range(hosts)])
    tau_max = v_init = 2 * n
    updates = [Update(i, 1 + i % workers, UPDATE_BYTES, version=rng.randint(1, 2 * n))
               for i in range(n)]
    return dict(updates=updates, network=network, server=0, aggregators=list(range(1, hosts)),
                tau_max=tau_max, v_init=v_init, start=0.0, seed=seed)


def same_plan(a, b):
    """Two (plan, network) results are the same, field by field."""
    (pa, na), (pb, nb) = a, b
    return (pa.order == pb.order and pa.dropped == pb.dropped and pa.direct == pb.direct
            and pa.aggregates == pb.aggregates and pa.commits == pb.commits
            and [(p.t, p.v) for p in na.links] == [(p.t, p.v) for p in nb.links])


class _Progress:
    """A line on stderr that counts the seconds while something slow runs."""

    def __init__(self, text):
        self.text, self.done = text, threading.Event()
        self.tty = sys.stderr.isatty()

    def __enter__(self):
        self.t0 = time.perf_counter()
        print(self.text + " ...", end="" if self.tty else "\n", file=sys.stderr, flush=True)
        if self.tty:
            self.thread = threading.Thread(target=self._tick, daemon=True)
            self.thread.start()
        return self

    def _tick(self):
        while not self.done.wait(1.0):
            print("\r%s ... %.0f s" % (self.text, time.perf_counter() - self.t0), end="",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        self.done.set()
        if self.tty:
            self.thread.join()
        print("%s%s: %.1f s" % ("\r" if self.tty else "", self.text,
                                time.perf_counter() - self.t0), file=sys.stderr, flush=True)


def _timed(fn, repeat):
    """(median seconds, last result) of `repeat` calls after one warm-up call."""
    result = fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def bench_one(n, seed, rates, repeat, profile):
    from ..sched import schedule
    kw = instance(n, seed, rates)
    s_fast, fast_res = _timed(lambda: schedule(**kw, engine="fast"), repeat)
    s_plain, plain_res = _timed(lambda: schedule(**kw, engine="plain"), max(1, min(3, repeat)))
    with _Progress("  reference loops (Python), |U| = %d" % n):
        t0 = time.perf_counter()
        ref_res = schedule(**kw, engine="reference")
        s_ref = time.perf_counter() - t0
    paper = paper_ms(n)
    row = {"updates": n, "nodes": kw["network"].hosts, "aggregators": len(kw["aggregators"]),
           "applied": len(ref_res[0].order), "dropped": len(ref_res[0].dropped),
           "aggregates": len(ref_res[0].aggregates),
           "ms_median": 1e3 * s_fast, "ms_plain_cpp": 1e3 * s_plain, "ms_reference": 1e3 * s_ref,
           "paper_ms": paper,
           "speedup_vs_paper": paper / (1e3 * s_fast) if paper else None,
           "speedup_vs_reference": s_ref / s_fast,
           "match": same_plan(fast_res, ref_res) and same_plan(plain_res, ref_res)}
    if profile:
        phases = []
        for _ in range(repeat):
            t = {}
            schedule(**kw, engine="fast", timings=t)
            phases.append(t)
        row["profile_ms"] = {k: 1e3 * statistics.median(p[k] for p in phases) for k in phases[0]}
    return row


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return "%.3g" % v if v < 100 else "%.0f" % v
    return str(v)


def print_table(rows, out=None):
    out = out or sys.stdout
    cells = [COLUMNS] + [tuple(_fmt(r[c]) for c in COLUMNS) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for i, c in enumerate(cells):
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)


def print_profile(rows, out=None):
    out = out or sys.stdout
    print("\nwhere the fast path's time goes (ms, median):", file=out)
    keys = list(rows[0]["profile_ms"])
    print("  ".join(["updates".rjust(7)] + [k.rjust(10) for k in keys]), file=out)
    for r in rows:
        print("  ".join([str(r["updates"]).rjust(7)]
                        + ["%10.3f" % r["profile_ms"][k] for k in keys]), file=out)


def parse_sizes(text):
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("sizes are comma-separated integers, got %r" % text)
    if not sizes or min(sizes) < 0:
        raise argparse.ArgumentTypeError("sizes must be >= 0, got %r" % text)
    return sizes


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlfabric.bench sched",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=[10, 30, 100, 500, 1000],
                   help="batch sizes |U| (default 10,30,100,500,1000)")
    p.add_argument("--repeat", type=int, default=20, help="timed runs of the fast path per size")
    p.add_argument("--seed", type=int, default=0, help="seed of the instance generator")
    p.add_argument("--rates", choices=sorted(PRESETS), default="N1",
                   help="NIC rate preset (§7, default N1)")
    p.add_argument("--json", metavar="FILE", type=output_path,
                   help="also write the results as JSON")
    p.add_argument("--profile", action="store_true",
                   help="also show where the fast path's time goes")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")

    from ..sched import fast
    from .kernels import cpu_name
    if not fast.available():
        print("mlfabric.bench sched: this build has no scheduler fast path (mlfabric._C."
              "sched_run); rebuild with `python setup.py build_ext --inplace`", file=sys.stderr)
        return 2
    rows = [bench_one(n, args.seed, args.rates, args.repeat, args.profile) for n in args.sizes]
    print("mlfabric scheduler cost per batch (paper §7.4 setup, rates %s, seed %d): %s, "
          "Python %s" % (args.rates, args.seed, cpu_name(), platform.python_version()))
    print_table(rows)
    if args.profile:
        print_profile(rows)
    if args.json:
        meta = {"command": "python -m mlfabric.bench sched " + " ".join(argv or sys.argv[2:]),
                "cpu": cpu_name(), "machine": platform.machine(),
                "python": platform.python_version(), "seed": args.seed, "rates": args.rates,
                "repeat": args.repeat, "update_bytes": UPDATE_BYTES,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0 if all(r["match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
