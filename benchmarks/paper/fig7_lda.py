"""The paper's Fig. 7 (c, d) at this machine's scale: distributed LDA, iterations and time to a
converged held-out log-likelihood for RR-Sync, mlfabric-A-30, mlfabric-A-60 and vanilla Async.

    mpirun --oversubscribe -n 8 python benchmarks/paper/fig7_lda.py [--quick]
        [--target LL] [--out benchmarks/results/paper/fig7_lda.json]

Paper (§7.1): NYTimes (102,660 words, 300K documents), 100 topics, 30 workers, C1-N1; converged
at log-likelihood -7.94 on 1,500 test documents: RR-Sync 145 iterations (182 s), MLfabric-A-30
188 (139 s), MLfabric-A-60 239 (169 s), Async 300 (1080 s). Its regime (§2): compute 180 ms per
iteration, a PS round 10x the compute at 10 Gbps (so an update of ~70 MB: 56 ms).

Here: a corpus drawn from LDA's generative model (1,200 training documents of 60 tokens, 1,000
words, 20 topics; 150 held-out documents), 6 workers, C1-N1, compute 180 ms (emulated, plus the
real Gibbs sweep), updates padded to 2.8 MB (56 ms at the 50 MB/s that stands for 10 Gbps);
tau_max = 6 and 12 are the workers and twice the workers, as the paper's 30 and 60 with 30
workers. Converged = the plateau of RR-Sync's computation run offline on rank 0 (no network; the
mean of its last 5 of --max-iterations), minus --tolerance, unless --target gives it. Iterations
to target are a worker's iterations when the model it held first reached the target (every
worker of RR-Sync holds the same model). Job lengths come from the offline run: RR-Sync its
crossing plus --margin, the parameter-server modes --ps-factor times the crossing per worker.
"""
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

# (label, mode, tau_max in units of the workers; None: no bound)
MODES = [("rr-sync", "rr-sync", None), ("mlfabric-A-30", "mlfabric-A", 1),
         ("mlfabric-A-60", "mlfabric-A", 2), ("async", "async", None)]


def parse_args(argv):
    p = common.parser("benchmarks/paper/fig7_lda.py", __doc__)
    p.add_argument("--preset", default="C1-N1")
    p.add_argument("--target", type=float, help="log-likelihood per token to reach (default: "
                   "the offline plateau minus --tolerance)")
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--payload-mb", type=float, default=2.8)
    p.add_argument("--compute-ms", type=float, default=180.0)
    p.add_argument("--docs", type=int, default=1200)
    p.add_argument("--doc-len", type=int, default=60)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--topics", type=int, default=20)
    p.add_argument("--max-iterations", type=int, default=60)
    p.add_argument("--margin", type=int, default=3)
    p.add_argument("--ps-factor", type=float, default=2.5)
    p.add_argument("--pull-admission", choices=("on", "off"), default="on",
                   help="mlfabric-A hands out a model only while the update computed from it "
                   "can still meet tau_max (mlfabric.runtime.pulls; off: every pull batch "
                   "answered whole, as the paper)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny corpus and payload (tests)")
    p.add_argument("--out", default=common.result_path("fig7_lda.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.doc_len, args.vocab, args.topics = 120, 20, 100, 5
        args.payload_mb, args.compute_ms, args.max_iterations = 0.1, 20.0, 12
        args.ps_factor, args.tolerance = 1.0, max(args.tolerance, 0.05)
    try:
        common.emulation(args.preset, args.seed)
    except ValueError as e:
        p.error("--preset must be like C1-N1: %s" % e)
    if min(args.docs, args.doc_len, args.vocab, args.topics, args.max_iterations) < 1:
        p.error("--docs, --doc-len, --vocab, --topics, --max-iterations must be >= 1")
    if args.payload_mb <= 0 or args.compute_ms < 0 or args.ps_factor <= 0 or args.margin < 0:
        p.error("need --payload-mb > 0, --compute-ms >= 0, --ps-factor > 0, --margin >= 0")
    return args


def main(argv=None):
    comm, args, workers, host, t_start = common.begin(parse_args, argv)
    task = common.LdaTask(workers, payload_bytes=args.payload_mb * 1e6, docs=args.docs,
                          test_docs=max(10, args.docs // 8), doc_len=args.doc_len,
                          vocab=args.vocab, topics=args.topics, seed=args.seed)
    offline = None
    if comm.rank == 0:
        _, curve = task.sync_curve(args.max_iterations)
        plateau = sum(curve[-5:]) / len(curve[-5:])
        target = plateau - args.tolerance if args.target is None else args.target
        hit = next((i + 1 for i, v in enumerate(curve) if v >= target), None)
        offline = {"curve": curve, "plateau": plateau, "target": target, "crossing": hit}
    common.idle_barrier(comm)
    offline = comm.bcast(offline, root=0)
    target = offline["target"]
    if offline["crossing"] is None:
        if comm.rank == 0:
            print("fig7_lda: synchronous LDA does not reach %.4f within %d iterations (best "
                  "%.4f): lower --target" % (target, args.max_iterations, max(offline["curve"])),
                  file=sys.stderr)
        return 2
    rr_iters = offline["crossing"] + args.margin
    ps_iters = max(2, int(math.ceil(args.ps_factor * offline["crossing"])))
    common.log(comm, "fig7_lda: %d workers, %s, target %.4f (offline plateau %.4f): synchronous "
               "LDA reaches it after %d iterations; RR-Sync runs %d, the PS modes %d per worker"
               % (workers, args.preset, target, offline["plateau"], offline["crossing"],
                  rr_iters, ps_iters))
    em = common.emulation(args.preset, args.seed)
    jobs = []
    for label, mode, tau in MODES:
        t0 = time.monotonic()
        job = common.traced_job(comm, mode, task,
                                iterations=rr_iters if mode == "rr-sync" else ps_iters,
                                compute_s=args.compute_ms / 1e3, emulation=em,
                                tau_max=tau * workers if tau else math.inf, seed=args.seed,
                                pull_admission=(args.pull_admission == "on"
                                                if mode == "mlfabric-A" else None))
        if comm.rank == 0:
            job["label"] = label
            job["target"] = common.target_summary(job, target)
            jobs.append(job)
            tt = job["target"]
            common.log(comm, "[%d/%d] %-14s %5.1f s  target %s  best %.4f  %s" % (
                len(jobs), len(MODES), label, time.monotonic() - t0,
                "at %.2f s (it %d)" % (tt["t"], tt["iteration"]) if tt["reached"]
                else "NOT reached", tt["best"], job["summary"]["dropped"] or ""))
    if comm.rank != 0:
        return 0
    rows = summarize(jobs)
    print_table(rows, target, args)
    doc = {"meta": {**common.base_meta("fig7_lda.py", argv, comm.size, experiment="fig7_lda",
                                       workers=workers, preset=args.preset, target=target,
                                       compute_ms=args.compute_ms, payload_mb=args.payload_mb,
                                       rr_iterations=rr_iters, ps_iterations=ps_iters,
                                       seed=args.seed, pull_admission=args.pull_admission,
                                       task=task.describe(), quick=args.quick,
                                       total_wall_s=time.monotonic() - t_start), **host},
           "offline": offline, "rows": rows, "jobs": jobs}
    common.write_json(args.out, doc)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(png, jobs, target, args)
    print("wrote %s and %s" % (common.relpath(args.out), common.relpath(png)))
    return 0 if all(j["summary"]["balanced"] for j in jobs) else 1


def summarize(jobs):
    """One row per mode: ours beside the paper's, and the ratios the paper quotes."""
    rows = {}
    for job in jobs:
        tt, s = job["target"], job["summary"]
        p_it, p_s = common.PAPER_LDA[job["label"]]
        rows[job["label"]] = {
            "paper_iterations": p_it, "paper_s": p_s,
            "iterations": tt["iteration"], "t": tt["t"], "reached": tt["reached"],
            "best": tt["best"], "job_s": job["job_s"],
            "iteration_s": job["iteration_s"]["mean"] if job["iteration_s"] else None,
            "wait_s": job.get("wait_s_per_iteration"),
            "dropped": s["dropped_total"], "pushed": s["pushed"], "aggregated": s["aggregated"],
            "max_delay": s["max_delay"],
            # a dropped LDA delta is lost for good (counts are state, not gradients); a dropped
            # first sweep loses all of that worker's initial counts
            "dropped_iterations": sorted(i for _, i in job["dropped_updates"])}
    rr = rows.get("rr-sync")
    for label, r in rows.items():
        p_rr_s = common.PAPER_LDA["rr-sync"][1]
        r["paper_time_vs_rr"] = r["paper_s"] / p_rr_s
        r["time_vs_rr"] = (r["t"] / rr["t"]) if rr and rr["t"] and r["t"] else None
    return rows


def fmt(x, f="%.2f"):
    return "-" if x is None else f % x


def print_table(rows, target, args):
    print("\nFig. 7 (LDA) at 8 ranks, %s: iterations and seconds to log-likelihood %.4f"
          % (args.preset, target))
    print("%-14s %10s %8s %8s %8s %10s %10s %8s %8s %9s" % (
        "mode", "paper it", "paper s", "ours it", "ours s", "paper/RR", "ours/RR", "s/it",
        "wait", "dropped"))
    for label, r in rows.items():
        print("%-14s %10d %8.0f %8s %8s %10.2f %10s %8s %8s %9s" % (
            label, r["paper_iterations"], r["paper_s"],
            fmt(r["iterations"], "%d") if r["reached"] else "not",
            fmt(r["t"]) if r["reached"] else ">%.1f" % r["job_s"], r["paper_time_vs_rr"],
            fmt(r["time_vs_rr"]), fmt(r["iteration_s"], "%.3f"), fmt(r["wait_s"], "%.3f"),
            "%d/%d" % (r["dropped"], r["pushed"])))


def plot(path, jobs, target, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    common.plot_curves(a1, jobs, target, lambda j: j["label"], xkey="iteration")
    a1.set_xlabel("iteration (of the worker holding the model)")
    common.plot_curves(a2, jobs, target, lambda j: j["label"])
    a2.set_xlabel("job time (s)")
    for a in (a1, a2):
        a.set_ylabel("held-out log-likelihood per token")
        lo = min(p["value"] for j in jobs for p in j["points"] if p["iteration"] >= 2) \
            if any(p["iteration"] >= 2 for j in jobs for p in j["points"]) else None
        if lo is not None:
            a.set_ylim(bottom=lo)
    fig.suptitle("Fig. 7 (c, d) at this machine's scale: LDA, %s, 6 workers" % args.preset)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    common.run_main(main)
