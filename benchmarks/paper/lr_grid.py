"""Which learning rate Table 2 runs at: every rate of a grid, offline (one process, no network),
for the two ways the modes apply updates.

    python benchmarks/paper/lr_grid.py [--workers 30] [--pretrain 0] [--target 0.76]
        [--out benchmarks/results/paper/lr-grid.json]

Synchronous SGD (RR-Sync's model sequence, exact: it does not depend on timing): iterations until
the test accuracy, averaged over the last 3 evaluations, is at or above the target. Asynchronous
SGD (mlfabric-A's sequence, simulated): each update is computed from the model `delay` updates
old and applied alone, with delays drawn uniformly from [0, tau_max) - all that the scheduler
guarantees - and from [tau_max / 2, tau_max) - what the 30-worker runs measured (a median lag of
25-28 at tau_max = 30); evaluated every `workers / 2` updates, same 3-point rule. Both are counted
in updates applied (an iteration applies `workers`).

Why it matters: a rate too large for the task makes both modes overshoot and oscillate near the
target, so that the updates a run needs to reach it move by several times between identical runs
(REPRODUCTION.md saw 0.12x-1.4x); at the rate where both are at their best, the two modes need
alike many updates and a cell's speedup is the ratio of update rates the systems sustain.
"""
import datetime
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

GRID = (0.16, 0.08, 0.053, 0.04, 0.027, 0.016)


def parse_args(argv):
    p = common.parser("benchmarks/paper/lr_grid.py", __doc__)
    p.add_argument("--workers", type=int, default=30)
    p.add_argument("--pretrain", type=int, default=0, help="synchronous iterations of "
                   "pre-training at --pretrain-lr before the grid starts (table2.py's start)")
    p.add_argument("--pretrain-lr", type=float, default=0.08)
    p.add_argument("--target", type=float, default=0.76)
    p.add_argument("--tau-max", type=int, help="default: the workers")
    p.add_argument("--grid", default=",".join(map(str, GRID)), help="learning rates")
    p.add_argument("--max-updates", type=int, default=1500)
    p.add_argument("--seeds", type=int, default=2, help="delay draws per asynchronous cell")
    p.add_argument("--quick", action="store_true", help="tiny: 6 workers, two rates, "
                   "target <= 0.5 (tests)")
    p.add_argument("--out", default=common.result_path("lr-grid.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.grid, args.max_updates, args.seeds = 6, "0.08,0.04", 60, 1
        args.target = min(args.target, 0.5)
    args.grid = [float(x) for x in args.grid.split(",") if x.strip()]
    if args.workers < 1 or args.pretrain < 0 or not args.grid or min(args.grid) <= 0:
        p.error("need --workers >= 1, --pretrain >= 0 and learning rates > 0")
    if args.tau_max is None:
        args.tau_max = args.workers
    return args


def held(values, target):
    """Index (1-based) of the first evaluation whose mean with the two before is >= target."""
    for k in range(2, len(values)):
        if np.mean(values[k - 2:k + 1]) >= target:
            return k + 1
    return None


def sync_updates(task, start, lr, target, max_updates):
    _, curve = task.sync_curve(start, max(3, max_updates // task.workers), lr)
    k = held(curve, target)
    return None if k is None else k * task.workers


def async_updates(task, start, lr, target, max_updates, delays, seed):
    """Updates until held at the target, each from the model `delay` updates old (delays: a
    (low, high) range, drawn uniformly), or None within max_updates."""
    rng = np.random.default_rng(seed)
    workers = [task._classifier(w, lr) for w in range(task.workers)]
    models, values = [start], []
    every = max(1, task.workers // 2)
    for i in range(max_updates):
        d = int(rng.integers(delays[0], delays[1] + 1))
        source = models[max(0, len(models) - 1 - d)]
        models.append(models[-1] + workers[rng.integers(task.workers)].step(source))
        if len(models) > delays[1] + 2:
            models.pop(0)   # only the last tau_max models can be read
        if (i + 1) % every == 0:
            values.append(task.evaluate(models[-1]))
            if held(values, target):
                return i + 1
    return None


def main(argv=None):
    from mpi4py import MPI
    t_start = time.monotonic()
    args = parse_args(argv)
    task = common.ClassifierTask(MPI.COMM_SELF, args.workers, payload_bytes=0, lr=args.grid[0],
                                  pretrain=args.pretrain, pretrain_lr=args.pretrain_lr)
    start = task.start
    ranges = {"uniform [0, tau_max)": (0, args.tau_max - 1),
              "uniform [tau_max/2, tau_max)": (args.tau_max // 2, args.tau_max - 1)}
    rows = []
    print("start accuracy %.3f (%d iterations of pre-training), target %.3f, %d workers, "
          "tau_max %d: updates applied to reach it (None: not within %d)" % (
              task.evaluate(start), args.pretrain, args.target, args.workers, args.tau_max,
              args.max_updates))
    for lr in args.grid:
        row = {"lr": lr, "sync": sync_updates(task, start, lr, args.target, args.max_updates)}
        for name, delays in ranges.items():
            row[name] = [async_updates(task, start, lr, args.target, args.max_updates, delays, s)
                         for s in range(args.seeds)]
        rows.append(row)
        print("lr %-6g sync %-5s %s" % (lr, row["sync"], "  ".join(
            "async %s %s" % (name, row[name]) for name in ranges)), flush=True)
    doc = {"meta": common.base_meta("lr_grid.py", argv, None, workers=args.workers,
                                    pretrain=args.pretrain, pretrain_lr=args.pretrain_lr,
                                    target=args.target, tau_max=args.tau_max,
                                    max_updates=args.max_updates, seeds=args.seeds,
                                    quick=args.quick,
                                    start_accuracy=task.evaluate(start),
                                    timestamp=datetime.datetime.now(
                                        datetime.timezone.utc).isoformat(timespec="seconds"),
                                    total_wall_s=time.monotonic() - t_start),
           "rows": rows}
    common.write_json(args.out, doc)
    print("wrote %s" % common.relpath(args.out))
    return 0


if __name__ == "__main__":
    common.run_main(main)
