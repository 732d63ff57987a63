"""The paper's §7.4 scheduler cost per batch, beside its numbers: mlfabric.bench.sched's benchmark
(the paper's setup: |U| updates over |U|/2 hosts, deadlines Uniform(1, 2|U|)), by import.

    python benchmarks/paper/sched_cost.py [--sizes 10,30,100,500,1000] [--repeat 10] [--quick]
        [--out benchmarks/results/paper/sched_cost.json]

Paper: < 5 ms per batch in its 30-worker runs (batches of < 10 updates); 30 / 440 / 1460 ms at
|U| = 100 / 500 / 1000. The scheduler is not scaled down: this is the real cost of one call on
this machine (ms_median: the fast path; ms_reference: the Python loops the tests keep as the
specification; match: their plans are identical). Single process, no MPI traffic.
"""
import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    from mlfabric.bench import sched
    p = argparse.ArgumentParser(prog="benchmarks/paper/sched_cost.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=sched.parse_sizes, default=[10, 30, 100, 500, 1000])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="sizes 10,30, 2 repeats (tests)")
    p.add_argument("--out", default=common.result_path("sched_cost.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeat = [10, 30], 2
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    from mlfabric.sched import fast
    if not fast.available():
        print("sched_cost: this build has no scheduler fast path; rebuild with `python setup.py "
              "build_ext --inplace`", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    rows = [sched.bench_one(n, args.seed, "N1", args.repeat, profile=False) for n in args.sizes]
    sched.print_table(rows)
    doc = {"meta": common.base_meta("sched_cost.py", argv, None, experiment="sched_cost",
                                    sizes=args.sizes, repeat=args.repeat, seed=args.seed,
                                    rates="N1", update_bytes=sched.UPDATE_BYTES,
                                    quick=args.quick, total_wall_s=time.monotonic() - t0,
                                    timestamp=datetime.datetime.now(
                                        datetime.timezone.utc).isoformat(timespec="seconds")),
           "results": rows}
    common.write_json(args.out, doc)
    print("wrote %s" % common.relpath(args.out))
    return 0 if all(r["match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
