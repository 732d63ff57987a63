"""How far the scheduler's heuristics (paper §5: Alg. 2 ordering, Alg. 3 aggregation) are from the
optimum of the §10.1 program on random tiny batches: the distribution of heuristic / optimum for
obj_async (eq. 17, mean commit time, at the heuristic's number of applied updates) and obj_sync
(eq. 16, makespan). Single process, no MPI traffic; the solver is bounded per instance and an
instance that hits the limit is skipped and counted, never waited on.

    python -m mlfabric.bench sched-oracle [--instances N] [--seed S] [--json F]
                                          [--max-updates U] [--time-limit SECONDS]
"""
import argparse
import contextlib
import json
import os
import platform
import random
import sys
import time

from ..sched import oracle
from .script import output_path

OPTIMAL_TOL = 1e-6   # heuristic within this relative distance of the optimum counts as optimal


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mlfabric.bench sched-oracle",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=100, help="random instances (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the instance generator")
    p.add_argument("--json", metavar="F", type=output_path,
                   help="write every instance's record and the summary")
    p.add_argument("--max-updates", type=int, default=5, help="updates per batch: 2..U (default 5)")
    p.add_argument("--time-limit", type=float, default=10.0,
                   help="solver seconds per instance and objective (default 10)")
    a = p.parse_args(argv)
    if a.instances < 1:
        p.error("--instances must be >= 1, got %d" % a.instances)
    if not 2 <= a.max_updates <= 8:
        p.error("--max-updates must be in 2..8 (the oracle is for tiny batches), got %d"
                % a.max_updates)
    if not a.time_limit > 0:
        p.error("--time-limit must be > 0, got %r" % a.time_limit)
    return a


@contextlib.contextmanager
def quiet_stdout():
    """HiGHS occasionally prints debugging lines straight to file descriptor 1; keep the report
    clean by pointing fd 1 at /dev/null while it runs."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def percentile(sorted_values, q):
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(records, objective, key="ratio", label=None):
    """min, median, p90, max and fraction optimal of heuristic / optimum over solved instances."""
    rows = [r[objective] for r in records]
    ratios = sorted(r[key] for r in rows if r[key] is not None)
    out = {"objective": objective, "label": label or "obj_" + objective, "instances": len(rows),
           "solved": len(ratios), "skipped": len(rows) - len(ratios),
           "min": ratios[0] if ratios else None, "median": percentile(ratios, 50),
           "p90": percentile(ratios, 90), "max": ratios[-1] if ratios else None,
           "fraction_optimal": (sum(r <= 1 + OPTIMAL_TOL for r in ratios) / len(ratios)
                                if ratios else None)}
    if objective == "async" and key == "ratio":
        solved = [r for r in rows if r["ratio"] is not None]
        fewer = [r for r in solved if r["applied"] < r["applied_max"]]
        out["applied_fewer_than_possible"] = len(fewer)
        out["updates_dropped_needlessly"] = sum(r["applied_max"] - r["applied"] for r in fewer)
    return out


def record(index, inst, comparisons):
    rec = {"instance": index, "updates": len(inst.updates), "aggregators": len(inst.aggregators),
           "hosts": inst.network.hosts, "tau_max": inst.tau_max}
    for obj, c in comparisons.items():
        rec[obj] = {"status": c.status, "heuristic": c.heuristic, "optimum": _finite(c.optimum),
                    "lower_bound": _finite(c.lower_bound), "ratio": _finite(c.ratio),
                    "applied": c.applied, "applied_max": c.applied_max}
        if obj == "async":
            rec[obj].update(status_same_updates=c.status_same_updates,
                            optimum_same_updates=_finite(c.optimum_same_updates),
                            ratio_same_updates=_finite(c.ratio_same_updates))
    return rec


def _finite(x):
    """JSON has no infinities: a missing optimum or bound is null."""
    return None if x is None or x in (float("inf"), float("-inf")) else float(x)


def _fmt(x, pct=False):
    if x is None:
        return "-"
    return "%.1f%%" % (100 * x) if pct else "%.4f" % x


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else list(argv))
    rng = random.Random(a.seed)
    records = []
    t0 = time.perf_counter()
    for i in range(a.instances):
        inst = oracle.random_instance(rng, updates=(2, a.max_updates))
        with quiet_stdout():
            comparisons = oracle.compare([inst], time_limit=a.time_limit)[0]
        records.append(record(i, inst, comparisons))
    elapsed = time.perf_counter() - t0
    summary = [summarize(records, "async"),
               summarize(records, "async", "ratio_same_updates", "obj_async, same updates"),
               summarize(records, "sync")]
    print("sched-oracle: %d random instances (seed %d; 2-%d updates, 0-2 aggregators, 3-5 hosts, "
          "NIC rates from {1, 2.5, 3.3, 5, 10} Gbps), solver limit %g s, %.1f s in all"
          % (a.instances, a.seed, a.max_updates, a.time_limit, elapsed))
    print("heuristic / optimum (>= 1; 1 = optimal):")
    head = ("objective", "solved", "skipped", "min", "median", "p90", "max", "optimal")
    print("  %-24s %7s %8s %8s %8s %8s %8s %8s" % head)
    for s in summary:
        print("  %-24s %7d %8d %8s %8s %8s %8s %8s"
              % (s["label"], s["solved"], s["skipped"], _fmt(s["min"]),
                 _fmt(s["median"]), _fmt(s["p90"]), _fmt(s["max"]),
                 _fmt(s["fraction_optimal"], pct=True)))
    s = summary[0]
    print("obj_async: the optimum applies as many updates as the heuristic, any of them; "
          "'same updates': exactly the heuristic's, so only order, timing and aggregation differ.")
    print("The heuristic applied fewer updates than possible within tau_max in %d of %d solved "
          "instances (%d updates in all)."
          % (s["applied_fewer_than_possible"], s["solved"], s["updates_dropped_needlessly"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m mlfabric.bench sched-oracle " + " ".join(
                          sys.argv[1:] if argv is None else list(argv)),
                       "seed": a.seed, "instances": a.instances, "max_updates": a.max_updates,
                       "time_limit": a.time_limit, "elapsed_s": elapsed,
                       "hostname": platform.node(), "summary": summary, "records": records},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
