"""The paper's Fig. 9 at this machine's scale: data sent to the replica vs Div_max, mlfabric-A
with one replica, against sending every applied update to the replica on its own.

    mpirun --oversubscribe -n 8 python benchmarks/paper/fig9_replica.py [--div-max 0,1,2,4,inf]
        [--quick] [--out benchmarks/results/paper/fig9_replica.json]

Paper (§7.3, Fig. 9, 30 workers): the saving from aggregation grows with Div_max and plateaus at
5.6x. Here: benchmarks/ps_modes.py's replica experiment, by import (its jobs, its records and its
PNG, written beside --out): 5 workers with one replica, C1-N1, 4 MB updates, Div_max in units of a
typical update's norm (gamma = 0, so Div_max = k lets the replica lag about k updates), and a
reference job with no aggregators (every copy on its own, measured).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def parse_args(argv):
    p = common.parser("benchmarks/paper/fig9_replica.py", __doc__)
    p.add_argument("--div-max", default="0,1,2,4,8,16,inf",
                   help="Div_max values in units of a typical update norm")
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--compute-ms", type=float, default=50.0)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, two Div_max (tests)")
    p.add_argument("--out", default=common.result_path("fig9_replica.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.div_max, args.size, args.compute_ms, args.iterations = "0,inf", 4096, 1.0, 3
    return args


def main(argv=None):
    from benchmarks import ps_modes
    from mlfabric.bench import harness
    comm, args, _, host, t_start = common.begin(parse_args, argv)
    pargv = ["replica", "--div-max", args.div_max, "--size", str(args.size), "--compute-ms",
             str(args.compute_ms), "--iterations", str(args.iterations), "--seed",
             str(args.seed), "--out", args.out, "--quiet"]
    pa = harness.parse(ps_modes.ENTRY, pargv)
    jobs = ps_modes.Jobs(comm, pa, ps_modes.job_count(pa))
    res = ps_modes.exp_replica(jobs, pa)   # also plots the PNG beside --out
    if comm.rank != 0:
        return 0
    rows = res["rows"]
    best = max((r["saving"] for r in rows if r["saving"]), default=None)
    last = rows[-1]["saving"]
    res["plateau_saving"] = last
    res["max_saving"] = best
    res["paper_plateau_saving"] = common.PAPER_FIG9_PLATEAU
    print("saving at the largest Div_max: %s (max %s); the paper's plateau: %.1fx at 30 workers"
          % ("-" if last is None else "%.2fx" % last, "-" if best is None else "%.2fx" % best,
             common.PAPER_FIG9_PLATEAU))
    doc = {"meta": {**common.base_meta("fig9_replica.py", argv, comm.size,
                                       experiment="fig9_replica", workers=pa.workers,
                                       preset=pa.preset, model_elements=pa.size,
                                       compute_ms=pa.compute_ms, iterations=pa.iterations,
                                       div_max=pa.div_max, seed=pa.seed, quick=args.quick,
                                       ps_modes_command="mpirun -n %d python benchmarks/"
                                       "ps_modes.py %s" % (comm.size, " ".join(pargv)),
                                       regime=ps_modes.REGIME["replica"],
                                       total_wall_s=time.monotonic() - t_start), **host},
           "results": res, "jobs": jobs.records}
    common.write_json(args.out, doc)
    print("wrote %s and %s" % (common.relpath(args.out),
                               common.relpath(os.path.splitext(args.out)[0] + ".png")))
    return 0 if all(j["summary"]["balanced"] for j in jobs.records) else 1


if __name__ == "__main__":
    common.run_main(main)
