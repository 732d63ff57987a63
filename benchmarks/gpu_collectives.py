"""GPU collectives: mlfabric (its NCCL path, blocking calls) beside torch.distributed's NCCL
backend (each call followed by a stream synchronize, so both are timed to completion), in one
MPI job, alternating round by round. Per size: the median over rounds of each round's mean time
per call (the slowest rank's), algbw and busbw as nccl-tests define them, and a check of every
result against a float64 reference.

    mpirun -n N python benchmarks/gpu_collectives.py [--colls allreduce,allgather,broadcast
        --min-bytes 1024 --max-bytes 256M --iters 20 --rounds 5 --out results.json]

A wrapper over the microbenchmark driver's GPU mode (`python -m mlfabric.bench COLL --device
cuda`, mlfabric/bench/driver.py): the driver claims the GPUs, sets both libraries up once, and
measures and checks every case with its own timing, data pattern and records; this script adds
the rounds (each a sweep of every size, the implementations' order reversed every other round)
and the per-size medians. Sizes follow the driver: allgather's size is the gathered output,
reduce_scatter's and alltoall's the input. The JSON holds the medians ("rows") and every
round's driver record ("records", each with its "round").

With fewer GPUs than ranks on the host, every rank claims a host of its own for NCCL
(NCCL_HOSTID; mlfabric's MLFABRIC_NCCL_SHARE_GPU=1 does the same), so several ranks share one
GPU through NCCL's socket transport: then the numbers measure the two libraries' overheads over
the same transport, not what a GPU interconnect would carry. Without a GPU on every rank it
stops with "no CUDA device: ..." (exit status 2).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlfabric.bench import driver, harness  # noqa: E402
from mlfabric.bench.script import byte_size, positive_int  # noqa: E402

IMPLS = "mlfabric,torch-nccl"
BASELINE = "torch-nccl"


def options(p):
    p.add_argument("--colls", default="allreduce,allgather,broadcast",
                   help="comma-separated collectives (%s)" % ", ".join(driver.COLLS))
    p.add_argument("--min-bytes", type=byte_size, default="1K")
    p.add_argument("--max-bytes", type=byte_size, default="256M")
    p.add_argument("--factor", type=positive_int, default=4, help="size factor (>= 2)")
    harness.add_iters(p, 20, "timed calls per round")
    harness.add_rounds(p, 5)
    harness.add_out(p)


def check(p, args):
    if args.factor < 2 or args.min_bytes > args.max_bytes:
        p.error("need --factor >= 2 and --min-bytes <= --max-bytes")
    unknown = [c for c in args.colls.split(",") if c not in driver.COLLS]
    if unknown or not args.colls:
        p.error("--colls: unknown collective(s) %s; known: %s"
                % (", ".join(map(repr, unknown)), ", ".join(driver.COLLS)))


def driver_args(args, coll, rank=0):
    """The driver's command line for one collective of this run."""
    return driver.build_parser(rank).parse_args([
        coll, "--device", "cuda", "-b", str(args.min_bytes), "-e", str(args.max_bytes),
        "-f", str(args.factor), "-n", str(args.iters), "-w", "1", "--impl", IMPLS,
        "--baseline", BASELINE, "--quiet"])


def rows_of(records, ranks):
    """Per (collective, size): each implementation's median over rounds (time, algbw, busbw),
    its per-round times and its #wrong (the most of any round); torch-nccl time / mlfabric time."""
    groups = {}
    for r in records:
        groups.setdefault((r["coll"], r["bytes"]), {}).setdefault(r["impl"], []).append(r)
    rows = []
    for (coll, nbytes), by_impl in groups.items():
        row = {"coll": coll, "bytes": nbytes, "ranks": ranks, "wrong": {}}
        for impl, rs in by_impl.items():
            t = statistics.median(r["time_us"] for r in rs) / 1e6
            algbw = nbytes / t / 1e9 if t > 0 else 0.0
            row["wrong"][impl] = max((r["wrong"] or 0) for r in rs)
            row[impl] = {"us": t * 1e6, "algbw_GBs": algbw,
                         "busbw_GBs": algbw * rs[0]["busbw_factor"],
                         "rounds_s": [r["time_us"] / 1e6 for r in rs]}
        if "mlfabric" in row and BASELINE in row:
            row["torch_over_mlfabric"] = row[BASELINE]["us"] / row["mlfabric"]["us"]
        rows.append(row)
    return rows


def line(row):
    cells = ["%-14s %10.1f us busbw %7.2f GB/s" % (impl, row[impl]["us"], row[impl]["busbw_GBs"])
             for impl in row["wrong"]]
    ratio = row.get("torch_over_mlfabric")
    return "%-14s %11d B  %s%s | wrong %s" % (
        row["coll"], row["bytes"], " | ".join(cells),
        "" if ratio is None else " | torch/mlfabric %5.2f" % ratio, row["wrong"])


def run(world, args):
    colls = args.colls.split(",")
    try:
        for coll in colls:  # every collective's arguments, before any work
            driver.validate(driver_args(args, coll, world.rank), world.size)
        bench, host, _ = driver.open_run(driver_args(args, colls[0], world.rank), world)
    except driver.UsageError as e:
        if world.rank == 0:
            print("gpu_collectives: error: %s" % e, file=sys.stderr, flush=True)
        return None, 2
    base = vars(bench.args)
    for coll in colls:
        for rnd in range(args.rounds):
            bench.select(argparse.Namespace(**dict(base, coll=coll)))
            for rec in bench.sweep(reverse=rnd % 2 == 1):
                rec["round"] = rnd
    bench.shutdown()
    for rec in bench.records:
        rec.update(host)
    wrong = sum(rec["wrong"] or 0 for rec in bench.records)
    status = 1 if wrong or bench.failed else 0
    if world.rank != 0:
        return None, status
    rows = rows_of(bench.records, world.size)
    print("#\n# median over %d round(s)" % args.rounds)
    for row in rows:
        print(line(row), flush=True)
    print("# Out of bounds values : %d %s" % (wrong, "OK" if wrong == 0 else "FAILED"))
    doc = {"command": harness.command_line(), "gpu": host.get("gpu"),
           "nccl": host.get("nccl_version"), "ranks_share_one_gpu": host.get("gpus_shared"),
           "impls": {name: fam.version() for name, fam in bench.families.items()
                     if fam is not None},
           "rows": rows, "records": bench.records}
    return doc, status


ENTRY = harness.Entry("gpu_collectives", __doc__, options, run, check)

if __name__ == "__main__":
    harness.main(ENTRY)
