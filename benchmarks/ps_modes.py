"""The parameter-server runtime's training modes side by side (paper §7), one MPI job, every mode
on the same workers, the same emulated stragglers and NIC rates (mlfabric.emulate), the same updates
(mlfabric.ps.driver.run_job runs every job). Four experiments:

  sync     per-iteration time of mlfabric-S vs Tr-Sync vs RR-Sync (rounds, order alternating)
  async    update commit rate at the server of mlfabric-A vs vanilla async, with a model so large
           that the server's links, not compute, are the bottleneck; drops and the largest delay
  replica  replica traffic (bytes into the replica) vs Div_max, mlfabric-A with one replica,
           against sending every applied update to the replica unaggregated (table + PNG)
  control  the control plane's round trip per batch: ready latency (worker -> scheduler),
           planning time, plan latency (scheduler -> worker)

    mpirun -n 8 python benchmarks/ps_modes.py sync|async|replica|control [options] --out FILE.json

Rank 0 prints a progress line per job (stderr) and a table per experiment (stdout), and writes the
JSON: {"meta": {command, host, git state, parameters, the regime and why}, "jobs": [every job's
record: mode, settings, accounting, timings], "results": {the experiment's summary}}. Exit status:
0 when every job's accounting balanced (pushed = applied + dropped, id by id), 1 otherwise, 2 for a
bad command line (reported once, by rank 0). An exception in a job aborts the whole MPI job.
"""
import math
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from mlfabric.bench import harness
from mlfabric.bench.harness import stats
from mlfabric.bench.report import host_info
from mlfabric.bench.script import positive_int
from mlfabric.emulate import Emulation
from mlfabric.ps.driver import default_update, run_job
from mlfabric.runtime.core import PS_MODES
from mlfabric.runtime.roles import Roles

DTYPE = np.float32

# Defaults per experiment. The time scale is the paper's: base_rate 50 MB/s stands for 10 Gbps and
# a 1M-element float32 model (4 MB) for ResNet-50's 100 MB, so one model transfer at the base rate
# takes 80 ms, as 100 MB does at 10 Gbps (paper §2); emulated times are then paper times, and the
# CPU work per emulated second (copies, event loops of 8 processes on 2 cores) stays small.
DEFAULTS = {
    "sync": dict(preset="C2-N1", size=1_000_000, compute_ms=100.0, iterations=8, rounds=3,
                 modes="mlfabric-S,tr-sync,rr-sync", tau_max=math.inf),
    "async": dict(preset="C1-N1", size=4_000_000, compute_ms=20.0, iterations=6, rounds=2,
                  modes="mlfabric-A,async", tau_max=None),   # None: the worker count (below)
    "replica": dict(preset="C1-N1", size=1_000_000, compute_ms=50.0, iterations=8, rounds=1,
                    modes="mlfabric-A", tau_max=math.inf, div_max="0,1,2,4,8,16,inf"),
    "control": dict(preset="C1-N1", size=262_144, compute_ms=50.0, iterations=20, rounds=1,
                    modes="mlfabric-A,mlfabric-S", tau_max=None),
}

REGIME = {
    "sync": "ResNet-50's regime (paper §2): a 100 MB model over 10 Gbps takes 80 ms, the compute "
            "of a 32-image step on a P100 'less than 100 ms'; so compute = 1.25 model transfers "
            "at the base rate and communication dominates the iteration (the ring's 2 model "
            "transfers are 160 ms). Scaled 1:1 in time: 4 MB at 50 MB/s = 80 ms, compute 100 ms. "
            "The paper's text gives compute ~1.25x one transfer, not 'several times': we follow "
            "the paper (override with --compute-ms). C2-N1 is the setting where the paper found "
            "mlfabric-S ahead (16% vs RR-Sync).",
    "async": "Server-link-bound (the regime in which the paper's vanilla Async was 'prohibitive'): "
             "one update (16 MB) takes 320 ms at the base rate, 16x the 20 ms compute, so with "
             "every worker pushing the server's ingress (and its egress for model pulls) is the "
             "bottleneck and the commit rate measures how the runtime uses those links.",
    "replica": "mlfabric-A with one replica, tau_max = inf so no update is dropped and every "
               "applied update must reach the replica; Div_max in units of a typical update's L2 "
               "norm (0.01 * sqrt(size) for run_job's default updates), so Div_max = k lets "
               "the replica lag about k updates "
               "(gamma = 0: eq. 11 is the sum of the lagging norms). The unaggregated reference "
               "is every applied update sent to the replica on its own, what chain replication "
               "or a server forwarding each update costs (replicated x update bytes); a job with "
               "aggregators=0 measures it. Div_max = 0 is not that worst case: the replica must "
               "keep up with the server (no lead allowed), but a batch's copies are still "
               "aggregated by the replica's own aggregators; what a larger Div_max can buy is "
               "punting copies to later batches, where more of them aggregate (paper Fig. 9).",
    "control": "A small model (1 MB, 20 ms at the base rate) so the data plane loads the CPU "
               "little: the latencies are the control plane's own (pickled messages, the "
               "daemons' event loops) on 8 processes sharing 2 cores.",
}


# A mode name may end in "/saf": the same mode with store-and-forward relays (cut_through=False),
# to measure what cut-through buys side by side; or in "/whole": mlfabric-A answering every pull
# batch whole, without its pull admission (pull_admission=False), the paper's way.
SAF = "/saf"
SUFFIXES = {SAF: {"cut_through": False}, "/whole": {"pull_admission": False}}


def split_mode(mode):
    """(runtime mode, extra ps.init settings) of a mode name."""
    for suffix, extra in SUFFIXES.items():
        if mode.endswith(suffix):
            return mode[:-len(suffix)], dict(extra)
    return mode, {}


def options(p):
    p.add_argument("experiment", choices=sorted(DEFAULTS))
    p.add_argument("--preset", help="compute-network emulation preset, e.g. C2-N1")
    p.add_argument("--base-rate", type=float, default=50e6,
                   help="bytes/s standing for the paper's 10 Gbps (default 50e6)")
    p.add_argument("--size", type=positive_int, help="model elements (float32)")
    p.add_argument("--compute-ms", type=float, help="nominal compute time per iteration")
    p.add_argument("--iterations", type=int, help="iterations per worker per job")
    p.add_argument("--rounds", type=int, help="repeats of the mode list (order alternating)")
    p.add_argument("--modes", help="comma-separated modes (experiment default)")
    p.add_argument("--servers", type=int, default=1, help="servers (sync, async, control)")
    p.add_argument("--tau-max", type=float, help="mlfabric-A's delay bound (default: async and "
                   "control the worker count, as the paper's MLfabric-A-30 with 30 workers; "
                   "replica inf)")
    p.add_argument("--div-max", help="replica: comma-separated Div_max values in units of a "
                   "typical update norm ('inf' allowed)")
    p.add_argument("--batch-interval", type=float, default=0.1, help="scheduler batch period s")
    p.add_argument("--seed", type=int, default=0)
    harness.add_out(p, "write the JSON here (replica: and a PNG beside it)", metavar="FILE.json")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")


def check(p, args):
    d = DEFAULTS[args.experiment]
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        compute, network = args.preset.upper().split("-")
        args.emulation = Emulation(compute, network, base_rate=args.base_rate, seed=args.seed)
    except ValueError as e:
        p.error("--preset must be like C2-N1 (C0-C3, N0-N3): %s" % e)
    if args.size < 1 or args.iterations < 2 or args.rounds < 1 or args.compute_ms < 0:
        p.error("need --size >= 1, --iterations >= 2 (the first is warm-up), --rounds >= 1, "
                "--compute-ms >= 0")
    if args.batch_interval <= 0:
        p.error("--batch-interval must be > 0")
    known = {"sync": ("mlfabric-S", "tr-sync", "rr-sync", "ssp", "mlfabric-A", "async"),
             "async": ("mlfabric-A", "async", "ssp"), "replica": ("mlfabric-A", "ssp"),
             "control": ("mlfabric-A", "mlfabric-S", "ssp")}[args.experiment]
    bad = [m for m in args.modes if split_mode(m)[0] not in known
           or (m.endswith(SAF) and not m.startswith(("mlfabric", "ssp")))
           or (m.endswith("/whole") and not m.startswith("mlfabric-A"))]
    if bad or not args.modes:
        p.error("%s: modes must be among %s, got %s" % (args.experiment, ", ".join(known),
                                                        ",".join(args.modes) or "none"))
    if args.experiment == "replica":
        args.servers = 1
        try:
            args.div_max = [float(x) for x in args.div_max.split(",")]
        except ValueError:
            p.error("--div-max takes comma-separated numbers, got %r" % args.div_max)
        if not args.div_max or min(args.div_max) < 0:
            p.error("--div-max values must be >= 0")
    replicas = 1 if args.experiment == "replica" else 0
    try:
        roles = Roles(MPI.COMM_WORLD.size, args.servers, replicas)
    except Exception as e:
        p.error(str(e))
    args.workers = len(roles.worker_ranks)
    if args.tau_max is None:
        args.tau_max = float(args.workers)


# --- one job -------------------------------------------------------------------------------------

def summary_record(s):
    return {"pushed": s.pushed, "applied": s.applied, "aggregated": s.aggregated,
            "replicated": s.replicated, "dropped": dict(s.dropped),
            "dropped_total": sum(s.dropped.values()), "max_delay": s.max_delay,
            "balanced": bool(s.balanced), "missing": len(s.missing), "twice": len(s.twice),
            "server_bytes_in": s.server_bytes_in, "replica_bytes_in": s.replica_bytes_in,
            "relayed": dict(getattr(s, "relayed", {})),
            "nic_bytes": {str(r): v for r, v in getattr(s, "nic_bytes", {}).items()},
            "staleness": staleness_record(getattr(s, "control", None) or {})}


def staleness_record(control):
    """The staleness budget of a scheduled asynchronous job, from the scheduler's profile
    (runtime/scheduler.py): each update's lag when planned (a histogram: lag -> updates; over
    tau_max it is dropped), the updates in flight (planned, not applied) at each plan, and a
    model fetch split into the wait at the server before the pull batch left and the whole
    request (seconds). None for jobs without one (allreduce baselines, vanilla async)."""
    lag = control.get("lag_at_plan")
    if not lag:
        return None
    return {"lag_at_plan": {str(k): v for k, v in sorted(lag.items())},
            "in_flight_at_plan": stats(control.get("in_flight_at_plan", [])),
            # seconds from an update's plan to the server's report that it is applied, and
            # that report's lateness against its commit's planned arrival
            "commit_latency": stats(control.get("commit_latency", [])),
            "commit_late": stats(control.get("commit_late", [])),
            "get_latency": stats(control.get("get_latency", [])),
            "pull_wait": stats(control.get("pull_wait", [])),
            # get requests that mlfabric-A's pull admission sent back to a later batch
            "deferred_pulls": control.get("deferred_pulls", 0),
            # ... and those it parked: their uplink slow, their update would be dropped
            "parked_pulls": control.get("parked_pulls", 0),
            # the rest of the control path: a worker's report reaching the scheduler, the
            # scheduler's plans reaching the workers, its seconds per plan, and a pull batch's
            # round trip to the scheduler for its tree
            "ready_latency": stats(control.get("ready_latency", [])),
            "plan_latency": stats(control.get("plan_latency", [])),
            "plan_time": stats(control.get("plan_time", [])),
            "pull_plan": stats(control.get("pull_plan", []))}


class Jobs:
    """Runs jobs on every rank and keeps rank 0's records of them."""

    def __init__(self, comm, args, total):
        self.comm, self.args, self.total = comm, args, total
        self.records = []

    def run(self, mode, label, **kw):
        a, comm = self.args, self.comm
        named = mode  # the name the records use ("/saf" kept)
        mode, extra = split_mode(mode)
        settings = dict(size=a.size, iterations=a.iterations, compute_s=a.compute_ms / 1e3,
                        dtype=DTYPE, emulation=a.emulation, servers=a.servers,
                        batch_interval=a.batch_interval, seed=a.seed, **extra)
        if mode == "mlfabric-A":  # the one mode it bounds (the runtime refuses it elsewhere)
            settings["tau_max"] = a.tau_max
        if mode in PS_MODES:   # every commit: the commit rates are read off the log
            settings["applied_log_max"] = None
        settings.update(kw)
        comm.Barrier()
        t0 = time.monotonic()
        res = run_job(mode, **settings)
        wall = time.monotonic() - t0
        mine = {"role": res.role, "rank": comm.rank, "iter_times": list(res.iter_times),
                "loop_wall": res.wall,
                # (updates in the commit, job time) per commit: servers and replicas
                "commits": [(len(e[0]), e[2]) for e in res.applied_log]}
        parts = comm.gather(mine, root=0)
        comm.Barrier()
        if comm.rank != 0:
            return None
        rec = self._record(named, label, settings, res.summary, wall, parts)
        self.records.append(rec)
        if not a.quiet:
            print("[%2d/%d] %-22s %-10s %6.2f s  %s%s" % (
                len(self.records), self.total, label, named, wall, res.summary,
                "" if rec["summary"]["balanced"] else "  <- UNBALANCED"),
                file=sys.stderr, flush=True)
        return rec

    def _record(self, mode, label, settings, summary, wall, parts):
        workers = [p for p in parts if p["role"] == "worker"]
        servers = [p for p in parts if p["role"] == "server"]
        replicas = [p for p in parts if p["role"] == "replica"]
        # Iteration 0 is warm-up: a PS worker's first get needs no preceding push; from iteration
        # 1 on every iteration is a full cycle in every mode (push of i-1 applied, model out,
        # compute; or compute then allreduce).
        steady = [t for p in workers for t in p["iter_times"][1:]]
        em = settings["emulation"]
        rec = {"label": label, "mode": mode,
               "settings": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                            for k, v in settings.items() if k not in ("emulation", "dtype")},
               "emulation": {"compute": em.compute, "network": em.network,
                             "base_rate": em.base_rate, "period": em.period, "seed": em.seed},
               "workers": len(workers), "wall_s": wall,
               "summary": summary_record(summary),
               "iteration_s": stats(steady),
               "iteration_s_all": stats([t for p in workers for t in p["iter_times"]]),
               "worker_loop_wall_s": max((p["loop_wall"] for p in workers), default=None),
               "server_commits": [c for p in servers for c in p["commits"]],
               "replica_commits": [c for p in replicas for c in p["commits"]]}
        control = getattr(summary, "control", None)
        if control:
            rec["control"] = {"batches": control.get("batches"),
                              "ready_latency_s": stats(control.get("ready_latency", [])),
                              "plan_time_s": stats(control.get("plan_time", [])),
                              "plan_latency_s": stats(control.get("plan_latency", [])),
                              "get_latency_s": stats(control.get("get_latency", [])),
                              "pull_wait_s": stats(control.get("pull_wait", []))}
        return rec


# --- the experiments -----------------------------------------------------------------------------

def alternating(modes, rounds):
    """Round r runs the modes forward when r is even, backward when odd (A B C, C B A, ...), so a
    slow drift of the shared machine hits every mode alike."""
    return [(r, m) for r in range(rounds) for m in (modes if r % 2 == 0 else modes[::-1])]


def exp_sync(jobs, args):
    for r, m in alternating(args.modes, args.rounds):
        jobs.run(m, "round %d" % r)
    if jobs.comm.rank != 0:
        return None
    recs = jobs.records
    per_mode = {m: [x for x in recs if x["mode"] == m] for m in args.modes}
    pooled = {}
    for m, xs in per_mode.items():
        times = []
        for x in xs:
            times.append(x["iteration_s"]["mean"])
        pooled[m] = {"mean_s": statistics.fmean(times),
                     "median_s": statistics.median(
                         [x["iteration_s"]["median"] for x in xs]),
                     "per_round_mean_s": times}
    ref = args.modes[0]
    ratios = {}
    for m in args.modes[1:]:
        per_round = [a / b for a, b in zip(pooled[ref]["per_round_mean_s"],
                                           pooled[m]["per_round_mean_s"])]
        ratios["%s / %s" % (ref, m)] = {"of_means": pooled[ref]["mean_s"] / pooled[m]["mean_s"],
                                        "per_round": per_round,
                                        "median_of_rounds": statistics.median(per_round)}
    out = {"per_mode": pooled, "ratios": ratios,
           "metric": "per-iteration time, iterations 1.. of every worker (iteration 0 is warm-up),"
                     " mean per job; modes' means averaged over rounds; ratio < 1: %s faster"
                     % ref}
    print("\nsync: per-iteration time (s), %d workers, %s, model %.1f MB, compute %g ms, %d "
          "iterations" % (args.workers, args.preset, args.size * 4 / 1e6, args.compute_ms,
                          args.iterations))
    print("%-8s %-12s %9s %9s %9s %9s  %s" % ("round", "mode", "mean", "median", "p90",
                                              "wall", "accounting"))
    for x in recs:
        it = x["iteration_s"]
        print("%-8s %-12s %9.3f %9.3f %9.3f %9.2f  %s" % (
            x["label"], x["mode"], it["mean"], it["median"], it["p90"], x["wall_s"],
            "balanced" if x["summary"]["balanced"] else "UNBALANCED"))
    print("%-21s %9s %9s" % ("mode", "mean", "median"))
    for m in args.modes:
        print("%-21s %9.3f %9.3f" % (m, pooled[m]["mean_s"], pooled[m]["median_s"]))
    for k, v in ratios.items():
        print("%-21s %9.3f   per round: %s" % (k, v["of_means"],
                                               " ".join("%.3f" % r for r in v["per_round"])))
    return out


def commit_rate(commits):
    """Updates applied per second at the server between its first and last commit (the first
    commit's updates start the clock, so they are not counted)."""
    if len(commits) < 2:
        return None
    commits = sorted(commits, key=lambda c: c[1])
    span = commits[-1][1] - commits[0][1]
    return sum(n for n, _ in commits[1:]) / span if span > 0 else None


def nic_busy(rec, roles, base_rate):
    """(egress, ingress) seconds of NIC time at the base rate per second of the job's wall, for
    the servers (mean) and the workers (mean)."""
    nb, wall = rec["summary"]["nic_bytes"], rec["wall_s"]

    def mean(ranks):
        got = [nb[str(r)] for r in ranks if str(r) in nb]
        return tuple(sum(g[i] for g in got) / len(got) / base_rate / wall if got else 0.0
                     for i in (0, 1))
    return {"server": mean(roles.server_ranks), "workers": mean(roles.worker_ranks)}


def exp_async(jobs, args):
    for r, m in alternating(args.modes, args.rounds):
        jobs.run(m, "round %d" % r)
    if jobs.comm.rank != 0:
        return None
    recs = jobs.records
    for x in recs:
        s = x["summary"]
        x["commit_rate"] = commit_rate(x["server_commits"])
        x["commit_rate_over_wall"] = s["applied"] / x["wall_s"]
        x["updates_per_commit"] = (s["applied"] / len(x["server_commits"])
                                   if x["server_commits"] else None)
    per_mode = {}
    for m in args.modes:
        xs = [x for x in recs if x["mode"] == m]
        per_mode[m] = {"commit_rate": statistics.fmean([x["commit_rate"] or 0 for x in xs]),
                       "commit_rate_over_wall": statistics.fmean(
                           [x["commit_rate_over_wall"] for x in xs]),
                       "per_round": [x["commit_rate"] for x in xs],
                       "dropped": [x["summary"]["dropped_total"] for x in xs],
                       "max_delay": [x["summary"]["max_delay"] for x in xs]}
    ref = args.modes[0]
    ratios = {}
    for m in args.modes[1:]:
        per_round = [(a / b if a and b else None) for a, b in
                     zip(per_mode[ref]["per_round"], per_mode[m]["per_round"])]
        ratios["%s / %s" % (ref, m)] = {
            "of_means": per_mode[ref]["commit_rate"] / per_mode[m]["commit_rate"]
            if per_mode[m]["commit_rate"] else None,
            "over_wall": per_mode[ref]["commit_rate_over_wall"]
            / per_mode[m]["commit_rate_over_wall"],
            "per_round": per_round}
    transfer = args.size * 4 / args.base_rate
    print("\nasync: commit rate at the server (updates/s), %d workers, %s, update %.0f MB = "
          "%.0f ms at the base rate, compute %g ms, tau_max %g" % (
              args.workers, args.preset, args.size * 4 / 1e6, transfer * 1e3, args.compute_ms,
              args.tau_max))
    print("%-8s %-11s %8s %8s %8s %8s %8s %9s %9s %8s" % (
        "round", "mode", "pushed", "applied", "dropped", "maxdelay", "agg'd", "rate", "rate/wall",
        "wall"))
    for x in recs:
        s = x["summary"]
        print("%-8s %-11s %8d %8d %8d %8s %8d %9.2f %9.2f %8.2f" % (
            x["label"], x["mode"], s["pushed"], s["applied"], s["dropped_total"],
            s["max_delay"], s["aggregated"], x["commit_rate"] or float("nan"),
            x["commit_rate_over_wall"], x["wall_s"]))
    for k, v in ratios.items():
        print("%s: %.2fx (of means; per round %s; over wall time %.2fx)" % (
            k, v["of_means"] or float("nan"),
            " ".join("%.2f" % r if r else "-" for r in v["per_round"]), v["over_wall"]))
    # where the bytes went: NIC time used over the job's wall, at the base rate (the profile
    # behind the rates: a server link busy all along bounds vanilla async; relays load workers)
    roles = Roles(jobs.comm.size, args.servers, 0)
    for x in recs:
        x["nic_busy"] = nic_busy(x, roles, args.base_rate)
    print("NIC time used / wall, at the base rate (egress, ingress); a get's latency and, of it, "
          "the wait at the server for the previous pull batch to leave (mean s):")
    for x in recs:
        b, c = x["nic_busy"], x.get("control") or {}
        gets, waits = c.get("get_latency_s") or {}, c.get("pull_wait_s") or {}
        print("  %-8s %-14s server %.2f, %.2f   workers (mean) %.2f, %.2f   get %.3f, wait %.3f"
              % (x["label"], x["mode"], *b["server"], *b["workers"],
                 gets.get("mean", float("nan")), waits.get("mean", float("nan"))))
    # every iteration also pulls the whole model; pulls answered one by one all leave through
    # the server's egress, which then bounds the job's wall time whatever the pushes do
    pulls = args.workers * args.iterations           # per server, each of 1/servers of the model
    pull_s = pulls * transfer / args.servers
    print("(one update at a time through a server's ingress: %.2f updates/s at most; the %d "
          "model pulls through its egress, if each is sent on its own: %.1f s of the wall time)"
          % (args.servers / transfer, pulls, pull_s))
    return {"per_mode": per_mode, "ratios": ratios, "single_update_bound": args.servers / transfer,
            "pull_bound_s": pull_s,
            "metric": "commit_rate: updates applied per second at the server between its first "
                      "and last commit (applied_log times); commit_rate_over_wall: "
                      "summary.applied / the job's wall time"}


def exp_replica(jobs, args):
    size, nbytes = args.size, args.size * np.dtype(DTYPE).itemsize
    # a typical update's norm: the mean over a few of the very updates the workers push
    upd = default_update(size, DTYPE, args.seed)
    unit = float(np.mean([np.linalg.norm(upd(r, i, None).astype(np.float64))
                          for r in (3, 4) for i in (0, 1)]))
    mode = args.modes[0]
    for k in args.div_max:
        jobs.run(mode, "div_max %g" % k, replicas=1, div_max=k * unit)
    ref = jobs.run(mode, "unaggregated", replicas=1, div_max=math.inf, aggregators=0)
    if jobs.comm.rank != 0:
        return None
    rows = []
    for k, x in zip(args.div_max, jobs.records):
        s = x["summary"]
        # the replica's ingress also took the initial model from its server (one model)
        copies = s["replica_bytes_in"] - nbytes
        plain = s["replicated"] * nbytes
        rows.append({"div_max_units": k if math.isfinite(k) else "inf",
                     "div_max": k * unit if math.isfinite(k) else "inf",
                     "applied": s["applied"], "replicated": s["replicated"],
                     "replica_bytes_in": s["replica_bytes_in"], "replica_update_bytes": copies,
                     "unaggregated_bytes": plain,
                     "saving": plain / copies if copies > 0 else None,
                     "replica_commits": len(x["replica_commits"]),
                     "wall_s": x["wall_s"]})
    rs = ref["summary"]
    reference = {"replicated": rs["replicated"], "replica_update_bytes":
                 rs["replica_bytes_in"] - nbytes, "expected": rs["replicated"] * nbytes,
                 "wall_s": ref["wall_s"]}
    print("\nreplica: bytes into the replica vs Div_max, %s, %d workers, %s, update %.1f MB, "
          "Div_max unit = typical update norm %.3f" % (mode, args.workers, args.preset,
                                                       nbytes / 1e6, unit))
    print("%10s %8s %8s %11s %11s %8s %8s %8s" % ("Div_max", "applied", "replctd", "replica MB",
                                                  "unagg. MB", "saving", "commits", "wall"))
    for r in rows:
        print("%10s %8d %8d %11.1f %11.1f %7.2fx %8d %8.2f" % (
            r["div_max_units"], r["applied"], r["replicated"], r["replica_update_bytes"] / 1e6,
            r["unaggregated_bytes"] / 1e6, r["saving"] or float("nan"), r["replica_commits"],
            r["wall_s"]))
    print("reference (aggregators=0, every copy on its own): %.1f MB measured for %d updates "
          "(%.1f MB expected)" % (reference["replica_update_bytes"] / 1e6, rs["replicated"],
                                  reference["expected"] / 1e6))
    if args.out:
        png = os.path.splitext(args.out)[0] + ".png"
        plot_replica(png, rows, unit, "%s, %d workers, %s, %.1f MB updates" % (
            mode, args.workers, args.preset, nbytes / 1e6))
        print("plot: %s" % png)
    return {"unit_norm": unit, "update_bytes": nbytes, "rows": rows, "reference": reference,
            "metric": "saving = replicated updates x update bytes / bytes of update copies into "
                      "the replica (replica_bytes_in minus the initial model)"}


def plot_replica(path, rows, unit, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [str(r["div_max_units"]) for r in rows]
    x = list(range(len(rows)))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(x, [r["replica_update_bytes"] / 1e6 for r in rows], "o-", label="mlfabric-A")
    a1.plot(x, [r["unaggregated_bytes"] / 1e6 for r in rows], "s--", label="unaggregated")
    a1.set_ylabel("bytes into the replica (MB)")
    a1.legend()
    a2.plot(x, [r["saving"] or 0 for r in rows], "o-")
    a2.set_ylabel("saving (unaggregated / mlfabric)")
    for a in (a1, a2):
        a.set_xticks(x, labels)
        a.set_xlabel("Div_max (units of an update norm, %.3g)" % unit)
        a.grid(alpha=0.3)
    a1.set_ylim(bottom=0)
    a2.set_ylim(bottom=0)
    fig.suptitle("replica traffic vs Div_max: " + title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def exp_control(jobs, args):
    for m in args.modes:
        jobs.run(m, "control")
    if jobs.comm.rank != 0:
        return None
    out = {}
    print("\ncontrol plane per batch (ms), %d ranks, %s, model %.1f MB, compute %g ms, batch "
          "interval %g ms" % (jobs.comm.size, args.preset, args.size * 4 / 1e6, args.compute_ms,
                              args.batch_interval * 1e3))
    print("%-11s %-28s %6s %8s %8s %8s %8s" % ("mode", "leg", "n", "mean", "median", "p90",
                                                 "max"))
    for x in jobs.records:
        c = x.get("control") or {}
        legs = {"ready latency (w -> sched)": c.get("ready_latency_s"),
                "plan time (sched)": c.get("plan_time_s"),
                "plan latency (sched -> w)": c.get("plan_latency_s")}
        for name, st in legs.items():
            if st:
                print("%-11s %-28s %6d %8.3f %8.3f %8.3f %8.3f" % (
                    x["mode"], name, st["n"], st["mean"] * 1e3, st["median"] * 1e3,
                    st["p90"] * 1e3, st["max"] * 1e3))
            else:
                print("%-11s %-28s %6s" % (x["mode"], name, "-"))
        have = [st for st in legs.values() if st]
        rt = {"median_ms": sum(st["median"] for st in have) * 1e3,
              "mean_ms": sum(st["mean"] for st in have) * 1e3,
              "p90_ms": sum(st["p90"] for st in have) * 1e3,
              "legs": [k for k, v in legs.items() if v], "batches": c.get("batches")}
        print("%-11s %-28s %6s %8.3f %8.3f %8.3f   (%s batches)" % (
            x["mode"], "round trip (sum of legs)", "", rt["mean_ms"], rt["median_ms"],
            rt["p90_ms"], rt["batches"]))
        out[x["mode"]] = rt
    return {"round_trip": out,
            "metric": "round trip = ready latency + plan time + plan latency (each leg's "
                      "statistic summed); ready latency counts from push() on the worker, plan "
                      "latency from the scheduler's send to the worker's receipt; the wait for "
                      "the next batch tick is by design and not counted; all three from the "
                      "job's summary.control"}


EXPERIMENTS = {"sync": exp_sync, "async": exp_async, "replica": exp_replica,
               "control": exp_control}


def job_count(args):
    if args.experiment == "replica":
        return len(args.div_max) + 1
    if args.experiment == "control":
        return len(args.modes)
    return len(args.modes) * args.rounds


def meta_of(comm, args, host, t0):
    nbytes = args.size * np.dtype(DTYPE).itemsize
    return {"command": harness.command_line(),
            "experiment": args.experiment, "ranks": comm.size, "workers": args.workers,
            "servers": args.servers, "preset": args.preset, "base_rate": args.base_rate,
            "model_elements": args.size, "model_bytes": nbytes, "dtype": np.dtype(DTYPE).name,
            "transfer_s_at_base_rate": nbytes / args.base_rate,
            "compute_ms": args.compute_ms, "iterations": args.iterations,
            "rounds": args.rounds, "modes": args.modes, "tau_max": args.tau_max,
            "batch_interval": args.batch_interval, "seed": args.seed,
            "regime": REGIME[args.experiment],
            "total_wall_s": time.monotonic() - t0, **host}


def document(meta, records, results, error=None):
    doc = {"meta": meta, "jobs": records, "results": results}
    if error is not None:
        doc["error"] = error
    return doc


def run(comm, args):
    host = host_info(comm)
    jobs = Jobs(comm, args, job_count(args))
    t0 = time.monotonic()
    try:
        results = EXPERIMENTS[args.experiment](jobs, args)
    except Exception as e:
        # a job failed (its ranks all raise): keep what the finished jobs measured
        if comm.rank == 0 and args.out:
            error = "job %d failed: %s: %s" % (len(jobs.records) + 1, type(e).__name__, e)
            harness.write_json(args.out, document(meta_of(comm, args, host, t0), jobs.records,
                                                  None, error=error))
        raise
    ok = comm.bcast(all(x["summary"]["balanced"] for x in jobs.records) if comm.rank == 0
                    else None, root=0)
    if comm.rank != 0:
        return None, 0 if ok else 1
    if not ok:
        print("UNBALANCED accounting in: %s" % ", ".join(
            "%s %s" % (x["label"], x["mode"]) for x in jobs.records
            if not x["summary"]["balanced"]))
    return document(meta_of(comm, args, host, t0), jobs.records, results), 0 if ok else 1


ENTRY = harness.Entry("ps_modes", __doc__, options, run, check, prog="benchmarks/ps_modes.py")

if __name__ == "__main__":
    harness.main(ENTRY)
