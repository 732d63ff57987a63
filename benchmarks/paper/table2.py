"""The paper's Table 2 at this machine's scale: speedup in time to a target accuracy of
mlfabric-A over RR-Sync, under the 9 compute x network straggler settings (C1-C3 x N1-N3).

    mpirun --oversubscribe -n 8 python benchmarks/paper/table2.py [--cells C1-N1,C2-N3] [--quick]
        [--target 0.76] [--out benchmarks/results/paper/table2.json]

Paper (§7.1): ResNet-50 on ImageNet from a pre-trained model (epoch 50 of synchronous SGD), time
to 74% top-1, 30 workers, MLfabric-A with tau_max = 30. Here: an MLP on a synthetic 10-class task
(common.ClassifierTask: its test accuracy plateaus near 78%, as ResNet-50's near 76%) from a
pre-trained model (to the same start accuracy whatever the workers), time to 76% test accuracy,
6 workers, tau_max = 6 (= the workers, as the paper's 30), updates padded to 4 MB (80 ms at the
50 MB/s that stands for 10 Gbps, as 100 MB at 10 Gbps), compute 100 ms per iteration
(ResNet-50's step on a P100, paper §2). Both modes of a cell run the same seeded stragglers and
NIC rates, one after the other (order alternating from cell to cell). The model over time is
recorded on the workers and evaluated after each job (common.traced_job).

Job lengths are set, not guessed: rank 0 first runs RR-Sync's computation in one process (no
network) to find after how many iterations it reaches the target; RR-Sync then runs that many
plus --margin. mlfabric-A's workers run for a time, --a-factor times RR-Sync's ideal time to that
crossing (common.ring_ideal: RR-Sync on an infinitely fast CPU under the cell's emulation), not
for a quota of iterations: in asynchronous training a fast worker does not idle while a slow one
finishes its share. The target counts as reached when the model held, averaged over a trailing
--window, is at or above it (common.held_at_or_above: the first touch of a noisy metric near its
plateau is luck, and more luck for the mode that makes more models). A job that ends below the
target is reported as such, never hidden. Each cell also gives mlfabric-A against RR-Sync's ideal,
so that a direction which rests on this machine's CPU overhead shows. Rank 0 writes the JSON
(every job: accounting, iteration times, commits, the evaluated points) and a PNG beside it.

At the paper's 30 workers (32 ranks; 1 MB at 12.5 MB/s is still 80 ms a transfer, with a quarter
of the copying):

    mpirun --oversubscribe -n 32 python benchmarks/paper/table2.py --payload-mb 1 \
        --base-rate-mb 12.5 --out benchmarks/results/paper/table2-30.json

At the learning rate where both modes are at their best (benchmarks/paper/lr_grid.py: 0.04; at
the default 0.08 both overshoot and oscillate near the target, so that the updates a run needs to
reach it, and with them most cells' directions, change between identical runs), from the initial
model (from the pre-trained one, 0.04 reaches the target in 2-3 synchronous iterations: the
comparison would be of start-up), REPRODUCTION.md's first Table 2:

    mpirun --oversubscribe -n 32 python benchmarks/paper/table2.py --payload-mb 1 \
        --base-rate-mb 12.5 --pretrain 0 --lr 0.04 --out benchmarks/results/paper/table2-30-lr.json

32 processes on 2 cores pay CPU time that the paper's cluster did not (RR-Sync measured at up to
1.7x its ideal). --dilate K runs every time of the setting K times the paper's - compute, the
transfers (the base rate divided by K), the scheduler's batch interval and monitor lag, the NIC
rate period, the trailing window - so every ratio is unchanged and that CPU time weighs K times
less (reproduce.py's table2-30-dilated: K = 3).
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

CELLS = [c + "-" + n for c in ("C1", "C2", "C3") for n in ("N1", "N2", "N3")]


def parse_args(argv):
    p = common.parser("benchmarks/paper/table2.py", __doc__)
    p.add_argument("--cells", default=",".join(CELLS), help="compute-network settings")
    p.add_argument("--dataset", choices=("synthetic", "digits"), default="synthetic",
                   help="common.ClassifierTask says why synthetic is the default")
    p.add_argument("--target", type=float, default=0.76, help="test accuracy to reach (the "
                   "synthetic task plateaus near 0.78, as ResNet-50 near 76%% for the paper's "
                   "74%%)")
    p.add_argument("--lr", type=float, default=0.08, help="per-update learning rate")
    p.add_argument("--start-accuracy", type=float, default=0.645,
                   help="pre-train synchronously until the test accuracy is this (12 iterations "
                   "with 6 workers, 6 with 30), as the paper's jobs start from a pre-trained "
                   "model")
    p.add_argument("--pretrain", type=int, help="pre-train this many synchronous iterations "
                   "instead")
    p.add_argument("--payload-mb", type=float, default=4.0, help="update size (MB)")
    p.add_argument("--base-rate-mb", type=float, default=common.BASE_RATE / 1e6,
                   help="MB/s standing for the paper's 10 Gbps (keep payload / rate = 80 ms: "
                   "the 30-worker run uses 1 MB at 12.5 MB/s, a quarter of the copying)")
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--dilate", type=float, default=1.0, help="run emulated time this many "
                   "times slower than the paper's: compute, transfers (the base rate divided "
                   "by it), the scheduler's batch interval and monitor lag, the NIC rate period "
                   "and --window all scale by it, so every ratio of the setting is unchanged "
                   "while the CPU's own costs (up to 32 processes on 2 cores) weigh that much "
                   "less; times are reported as run (divide by it for paper seconds)")
    p.add_argument("--tau-max", type=float, help="mlfabric-A's bound (default: the workers)")
    p.add_argument("--margin", type=int, default=5, help="RR-Sync iterations past the offline "
                   "crossing")
    p.add_argument("--a-factor", type=float, default=2.2, help="mlfabric-A's workers run for "
                   "this many times RR-Sync's ideal time to its offline crossing (a time, not "
                   "a quota of iterations: fast workers do more)")
    p.add_argument("--window", type=float, default=0.5, help="seconds: the target counts as "
                   "reached when the model held, averaged over this trailing window, is at or "
                   "above it (0: first touched; common.held_at_or_above says why)")
    p.add_argument("--max-iterations", type=int, default=150,
                   help="give up (error) if the offline run needs more")
    p.add_argument("--pull-objective", choices=("makespan", "mean", "fast-first"),
                   help="mlfabric-A's pull trees (mlfabric.sched.distribute): least makespan "
                   "(the paper's), least mean delivery, or the fast requesters first (the "
                   "runtime's default for mlfabric-A)")
    p.add_argument("--slow-drop", choices=("on", "off"), default="on",
                   help="mlfabric-A drops an update whose own link is slower than the next "
                   "batch's (mlfabric.sched.scheduler; off: the paper's batch alone)")
    p.add_argument("--pull-admission", choices=("on", "off"), default="on",
                   help="mlfabric-A hands out a model only while the update computed from it "
                   "can still meet tau_max (mlfabric.runtime.pulls; off: every pull batch "
                   "answered whole, as the paper)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny: one cell, small payload (tests)")
    p.add_argument("--out", default=common.result_path("table2.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.cells, args.payload_mb, args.compute_ms = "C2-N1", 0.2, 20.0
        args.pretrain, args.target = 4, min(args.target, 0.5)
        args.window = min(args.window, 0.05)      # its jobs last well under a second
    if args.pretrain is not None:
        args.start_accuracy = None
    args.cells = [c.strip().upper() for c in args.cells.split(",") if c.strip()]
    bad = [c for c in args.cells if c not in CELLS]
    if bad or not args.cells:
        p.error("--cells must be among %s, got %s" % (", ".join(CELLS), ",".join(bad) or "none"))
    if not 0 < args.target < 1:
        p.error("--target is an accuracy in (0, 1)")
    if args.window < 0:
        p.error("--window must be >= 0 seconds")
    if (args.payload_mb <= 0 or args.compute_ms <= 0 or args.margin < 0 or args.a_factor <= 0
            or args.base_rate_mb <= 0 or args.dilate <= 0):
        p.error("need --payload-mb > 0, --base-rate-mb > 0, --compute-ms > 0, --margin >= 0, "
                "--a-factor > 0, --dilate > 0")
    return args


def main(argv=None):
    comm, args, workers, host, t_start = common.begin(parse_args, argv)
    tau_max = float(workers) if args.tau_max is None else args.tau_max
    task = common.ClassifierTask(comm, workers, payload_bytes=args.payload_mb * 1e6, lr=args.lr,
                                  pretrain=args.pretrain, seed=args.seed, dataset=args.dataset,
                                  start_accuracy=args.start_accuracy)
    start = task.start
    # RR-Sync's model sequence does not depend on timing: find its crossing offline
    offline = None
    if comm.rank == 0:
        _, curve = task.sync_curve(start, args.max_iterations, args.lr)
        hit = next((i + 1 for i, v in enumerate(curve) if v >= args.target), None)
        offline = {"start_accuracy": task.evaluate(start), "crossing": hit, "curve": curve}
    common.idle_barrier(comm)
    offline = comm.bcast(offline, root=0)
    if offline["crossing"] is None:
        if comm.rank == 0:
            print("table2: synchronous SGD does not reach %.3f within %d iterations (best "
                  "%.3f): lower --target" % (args.target, args.max_iterations,
                                               max(offline["curve"])), file=sys.stderr)
        return 2
    rr_iters = offline["crossing"] + args.margin
    dil = args.dilate   # every time of the setting, stretched alike (--dilate)
    compute_s = dil * args.compute_ms / 1e3
    base_rate = args.base_rate_mb * 1e6 / dil
    # the paper's 100 ms batches, run_job's 0.2 s monitor lag
    timing = dict(batch_interval=dil * 0.1, t_lag=dil * 0.2)
    window = dil * args.window
    common.log(comm, "table2: %d workers, start accuracy %.3f (%d synchronous iterations of "
               "pre-training), target %.3f: synchronous SGD reaches it after %d iterations; "
               "RR-Sync runs %d, mlfabric-A's workers %.1fx RR-Sync's ideal time to that" % (
                   workers, offline["start_accuracy"], task.pretrain, args.target,
                   offline["crossing"], rr_iters, args.a_factor))
    jobs, cells, durations = [], {}, {}
    for k, cell in enumerate(args.cells):
        em = common.emulation(cell, args.seed, base_rate=base_rate, period=dil * 5.0)
        # every rank works out the same ideal (deterministic, milliseconds)
        ideal = common.ring_ideal(em, workers, compute_s, task.size * 4, rr_iters)
        durations[cell] = args.a_factor * ideal[offline["crossing"] - 1]
        order = ["mlfabric-A", "rr-sync"] if k % 2 == 0 else ["rr-sync", "mlfabric-A"]
        got = {}
        for mode in order:
            t0 = time.monotonic()
            if mode == "mlfabric-A":   # for a time: the cap on iterations never binds
                run = dict(duration_s=durations[cell],
                           iterations=int(durations[cell] / compute_s) + 2,
                           pull_objective=args.pull_objective,
                           slow_drop=args.slow_drop == "on",
                           pull_admission=args.pull_admission == "on")
            else:
                run = dict(iterations=rr_iters)
            job = common.traced_job(comm, mode, task, compute_s=compute_s, emulation=em,
                                    tau_max=tau_max, seed=args.seed, **timing, **run)
            if comm.rank == 0:
                job["cell"] = cell
                job["target"] = common.target_summary(job, args.target, window)
                jobs.append(job)
                got[mode] = job
                tt = job["target"]
                # a job that ended before its first evaluation point has no best yet
                best = "-" if tt["best"] is None else "%.3f" % tt["best"]
                common.log(comm, "[%d/%d] %s %-10s %5.1f s  target %s  best %s  %s" % (
                    len(jobs), 2 * len(args.cells), cell, mode, time.monotonic() - t0,
                    "at %.2f s (it %d)" % (tt["t"], tt["iteration"]) if tt["reached"]
                    else "NOT reached", best, job["summary"]["dropped"] or ""))
        if comm.rank == 0:
            cells[cell] = cell_result(cell, got["mlfabric-A"], got["rr-sync"], ideal, args.target,
                                      window)
    if comm.rank != 0:
        return 0
    print_table(cells, args, comm.size)
    doc = {"meta": {**common.base_meta("table2.py", argv, comm.size,
                                       experiment="table2", workers=workers, tau_max=tau_max,
                                       target=args.target, compute_ms=dil * args.compute_ms,
                                       payload_mb=args.payload_mb, rr_iterations=rr_iters,
                                       margin=args.margin,
                                       base_rate=base_rate, dilate=dil,
                                       start_accuracy=args.start_accuracy,
                                       pretrain=task.pretrain,
                                       a_factor=args.a_factor, a_duration_s=durations,
                                       window_s=window, cells=args.cells, seed=args.seed,
                                       pull_objective=args.pull_objective,
                                       slow_drop=args.slow_drop,
                                       pull_admission=args.pull_admission,
                                       task=task.describe(), quick=args.quick,
                                       total_wall_s=time.monotonic() - t_start), **host},
           "offline": offline, "cells": cells, "jobs": jobs}
    common.write_json(args.out, doc)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(png, cells, jobs, args)
    print("wrote %s and %s" % (common.relpath(args.out), common.relpath(png)))
    balanced = all(j["summary"]["balanced"] for j in jobs)
    return 0 if balanced else 1


def direction(speedup, paper):
    return "as the paper" if (speedup > 1) == (paper > 1) else "opposite"


def cell_result(cell, a, rr, ideal, target, window):
    """The cell's speedup, its direction, and the profile behind it. ideal: RR-Sync's iteration
    end times on an infinitely fast CPU (common.ring_ideal); window: the run's trailing window
    (s) for the target."""
    ta, tr = a["target"], rr["target"]
    ours = common.speedup(tr["t"], ta["t"])
    paper = common.PAPER_TABLE2[cell]
    # RR-Sync's model sequence does not depend on timing: its ideal run holds the same models,
    # model i from the ideal end of iteration i on; the same rule says when it reached target
    held = {p["iteration"]: p["value"] for p in rr["points"]}
    hit = common.reached_at([{"t": ideal[i - 1] if i else 0.0, "value": v, "iteration": i}
                             for i, v in held.items()], target, window)
    t_ideal = hit["t"] if hit else None
    vs_ideal = common.speedup(t_ideal, ta["t"])
    out = {"paper_speedup": paper, "speedup": ours,
           "t_mlfabric_A": ta["t"], "t_rr_sync": tr["t"],
           "t_rr_sync_ideal": t_ideal, "speedup_vs_rr_ideal": vs_ideal,
           "rr_ideal_iteration_s": ideal[-1] / len(ideal),
           "direction_vs_rr_ideal": None if vs_ideal is None else direction(vs_ideal, paper),
           "a_reached": ta["reached"], "rr_reached": tr["reached"],
           # profile: why the cell comes out the way it does
           "rr_iteration_s": rr["iteration_s"]["mean"] if rr["iteration_s"] else None,
           "rr_iterations_to_target": tr["iteration"],
           "a_worker_iteration_s": a["iteration_s"]["mean"] if a["iteration_s"] else None,
           # iteration minus the worker's own emulated compute: RR-Sync's allreduce with the
           # wait for the slowest worker, a PS worker's wait for the model (push returns at once)
           "rr_wait_s": rr.get("wait_s_per_iteration"), "a_wait_s": a.get("wait_s_per_iteration"),
           "compute_s_mean": rr["compute_s_mean"],
           "a_updates_to_target": ta["updates_applied"],
           "rr_updates_to_target": tr["updates_applied"],
           "a_applied_per_s": ta["applied_per_s"], "rr_applied_per_s": tr["applied_per_s"],
           "a_dropped": a["summary"]["dropped_total"], "a_pushed": a["summary"]["pushed"],
           "a_aggregated": a["summary"]["aggregated"], "a_max_delay": a["summary"]["max_delay"],
           # against a model transfer's payload / base rate (80 ms)
           "a_fetch_s_median": float(np.median(common.fetch_times(a)))}
    if ours is None:
        # one side never reached the target: give the bound the run does support
        if ta["reached"] and not tr["reached"]:
            out["bound"] = ">= %.2f" % (tr["job_s"] / ta["t"])
        elif tr["reached"] and not ta["reached"]:
            out["bound"] = "<= %.2f" % (tr["t"] / ta["job_s"])
        out["direction"] = "undetermined"
    else:
        out["direction"] = direction(ours, paper)
    return out


def fmt(x, f="%.2f"):
    return "-" if x is None else f % x


def print_table(cells, args, ranks):
    print("\nTable 2 at %d ranks: speedup in time to %.3f test accuracy, mlfabric-A over RR-Sync"
          % (ranks, args.target))
    print("(s/it: a worker's iteration; wait: of it, not computing - RR-Sync's allreduce and "
          "stragglers, mlfabric-A's model fetch; ideal: RR-Sync on an infinitely fast CPU)")
    head = ("cell", "paper", "ours", "vs ideal", "t_A s", "t_RR s", "RR ideal", "RR s/it",
            "RR wait", "A s/it", "A wait", "A upd/s", "RR upd/s", "A dropped", "direction")
    print("%-6s %6s %7s %8s %7s %7s %8s %8s %8s %7s %7s %8s %8s %9s  %s" % head)
    for cell, c in cells.items():
        print("%-6s %6.2f %7s %8s %7s %7s %8s %8s %8s %7s %7s %8s %8s %9s  %s" % (
            cell, c["paper_speedup"], fmt(c["speedup"]) if c["speedup"] else c.get("bound", "-"),
            fmt(c["speedup_vs_rr_ideal"]),
            fmt(c["t_mlfabric_A"]), fmt(c["t_rr_sync"]), fmt(c["t_rr_sync_ideal"]),
            fmt(c["rr_iteration_s"], "%.3f"),
            fmt(c["rr_wait_s"], "%.3f"), fmt(c["a_worker_iteration_s"], "%.3f"),
            fmt(c["a_wait_s"], "%.3f"), fmt(c["a_applied_per_s"], "%.1f"),
            fmt(c["rr_applied_per_s"], "%.1f"), "%d/%d" % (c["a_dropped"], c["a_pushed"]),
            c["direction"]))


def plot(path, cells, jobs, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(cells)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = range(len(names))
    a1.bar([i - 0.2 for i in x], [cells[c]["paper_speedup"] for c in names], 0.4,
           label="paper (30 workers, ResNet-50)")
    a1.bar([i + 0.2 for i in x], [cells[c]["speedup"] or 0 for c in names], 0.4,
           label="ours (%d workers, MLP)" % jobs[0]["workers"])
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_xticks(list(x), names)
    a1.set_ylabel("speedup to target (RR-Sync time / mlfabric-A time)")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3, axis="y")
    first = names[0]
    common.plot_curves(a2, [j for j in jobs if j["cell"] == first], args.target,
                       lambda j: j["mode"])
    a2.set_xlabel("job time (s)")
    a2.set_ylabel("test accuracy")
    a2.set_title("%s: the model over time" % first, fontsize=9)
    fig.suptitle("Table 2 at this machine's scale (target %.3f%s)" % (
        args.target, ", time dilated %gx" % args.dilate if args.dilate != 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    common.run_main(main)
