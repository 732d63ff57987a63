"""The paper's §7.2 at this machine's scale: per-iteration time of mlfabric-S vs RR-Sync vs
Tr-Sync under several compute x network settings.

    mpirun --oversubscribe -n 8 python benchmarks/paper/sync_iteration.py [--presets C2-N1,...]
        [--servers 1] [--quick] [--out benchmarks/results/paper/sync_iteration.json]

Paper (§7.2, ResNet-50, 30 workers): RR-Sync is 1.2-2x faster than MLfabric-S in every setting
but C2-N1, where MLfabric-S is 16% faster; under C2-N2 MLfabric-S cuts Tr-Sync's per-iteration
communication time by 18.42% (ResNet-50; 21.7% for ResNet-152, 3.05 s -> 2.38 s).

Here: benchmarks/ps_modes.py's sync experiment, run for each preset by import (the same jobs,
the same records): 6 workers, 4 MB model (80 ms at the 50 MB/s that stands for 10 Gbps), compute
100 ms, modes alternating round by round. Besides ps_modes' per-iteration times, each mode's
'wait' is its iteration minus the workers' own emulated compute (the same seeded trace): the
communication and the wait for stragglers, the nearest we have to the paper's "communication
time" (which it does not define further).
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

PRESETS = "C1-N1,C2-N1,C2-N2"
MODES = ("mlfabric-S", "rr-sync", "tr-sync")


def parse_args(argv):
    p = common.parser("benchmarks/paper/sync_iteration.py", __doc__)
    p.add_argument("--presets", default=PRESETS)
    p.add_argument("--servers", type=int, default=1, help="1: the paper's setting")
    p.add_argument("--size", type=int, default=1_000_000, help="model elements (float32)")
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="one preset, tiny model (tests)")
    p.add_argument("--out", default=common.result_path("sync_iteration.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.presets, args.size, args.compute_ms = "C2-N1", 4096, 1.0
        args.iterations, args.rounds = 3, 1
    args.presets = [x.strip().upper() for x in args.presets.split(",") if x.strip()]
    if not args.presets:
        p.error("--presets: give at least one, e.g. C2-N1")
    return args


def ps_argv(args, preset):
    return ["sync", "--preset", preset, "--modes", ",".join(MODES), "--servers",
            str(args.servers), "--size", str(args.size), "--compute-ms", str(args.compute_ms),
            "--iterations", str(args.iterations), "--rounds", str(args.rounds), "--seed",
            str(args.seed), "--quiet"]


def mean_compute(emulation, workers, compute_s, iterations):
    """A worker's mean emulated compute over iterations 1.. (the steady ones ps_modes times)."""
    if not compute_s:
        return 0.0
    tr = emulation.compute_trace(workers, compute_s)
    return statistics.fmean(tr.time(w, i) for w in range(workers) for i in range(1, iterations))


def main(argv=None):
    from benchmarks import ps_modes
    from mlfabric.bench import harness
    comm, args, _, host, t_start = common.begin(parse_args, argv)
    presets = {}
    for preset in args.presets:
        pa = harness.parse(ps_modes.ENTRY, ps_argv(args, preset))
        jobs = ps_modes.Jobs(comm, pa, ps_modes.job_count(pa))
        common.log(comm, "sync_iteration: %s, %d jobs" % (preset, jobs.total))
        res = ps_modes.exp_sync(jobs, pa)
        if comm.rank == 0:
            compute = mean_compute(pa.emulation, pa.workers, pa.compute_ms / 1e3, pa.iterations)
            presets[preset] = summarize(preset, res, jobs.records, compute)
            presets[preset]["ps_modes_command"] = "mpirun -n %d python benchmarks/ps_modes.py %s" \
                % (comm.size, " ".join(ps_argv(args, preset)))
            presets[preset]["jobs"] = jobs.records
    if comm.rank != 0:
        return 0
    print_table(presets)
    doc = {"meta": {**common.base_meta("sync_iteration.py", argv, comm.size,
                                       experiment="sync_iteration", presets=args.presets,
                                       workers=pa.workers,
                                       servers=args.servers, model_elements=args.size,
                                       model_bytes=args.size * 4, compute_ms=args.compute_ms,
                                       iterations=args.iterations, rounds=args.rounds,
                                       seed=args.seed, quick=args.quick,
                                       total_wall_s=time.monotonic() - t_start), **host},
           "presets": presets}
    common.write_json(args.out, doc)
    print("wrote %s" % common.relpath(args.out))
    ok = all(j["summary"]["balanced"] for p in presets.values() for j in p["jobs"])
    return 0 if ok else 1


def summarize(preset, res, records, compute):
    per = res["per_mode"]
    s, rr, tr = (per[m]["mean_s"] for m in MODES)
    return {"per_mode_s": {m: per[m]["mean_s"] for m in MODES},
            "per_round_s": {m: per[m]["per_round_mean_s"] for m in MODES},
            "wait_s": {m: per[m]["mean_s"] - compute for m in MODES},
            "compute_s_mean": compute,
            "s_over_rr": s / rr, "s_over_tr": s / tr,
            "s_wait_reduction_vs_tr": 1 - (s - compute) / (tr - compute) if tr > compute else None,
            "ratios": res["ratios"]}


def print_table(presets):
    print("\n§7.2 at 8 ranks: mean s per iteration (wait = iteration - own compute)")
    print("%-6s %11s %9s %9s %12s %12s %14s" % ("preset", "mlfabric-S", "RR-Sync", "Tr-Sync",
                                               "S / RR", "S / Tr", "S wait vs Tr"))
    for name, p in presets.items():
        m = p["per_mode_s"]
        red = p["s_wait_reduction_vs_tr"]
        print("%-6s %11.3f %9.3f %9.3f %12.2f %12.2f %14s" % (
            name, m["mlfabric-S"], m["rr-sync"], m["tr-sync"], p["s_over_rr"], p["s_over_tr"],
            "-" if red is None else "%+.1f%%" % (-100 * red)))


if __name__ == "__main__":
    common.run_main(main)
