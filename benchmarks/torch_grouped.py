"""mlfabric.torch's grouped allgather and reducescatter against one call per tensor and against
one tensor of the same total size, side by side in one MPI job, variants alternating round by
round so that all of them see the same machine load:

  for each op (allgather, reducescatter) and each --small size, --count float32 tensors of
  `small` elements (rows of 4 elements: allgather gathers rows, reducescatter splits them):
    one        the op on one tensor of count x small elements: the floor fusion aims at
    grouped    grouped_<op> of the count tensors (one fused collective)
    unfused    count separate calls
  Every result is checked against the float64 expectation (`wrong` counts misses).

    mpirun -n 2 python benchmarks/torch_grouped.py [--count 100 --small 256,4096]
        [--iters 20 --rounds 7] [--threads N] [--out FILE.json]

Times: per round, the mean over the round's iterations, the slowest rank's; the figure
reported is the median over rounds (helpers from torch_optimizer.py). Rank 0 prints the table
and writes the JSON ({"meta": command, host, git state, parameters, load; "results": per op
and size: medians, per-round times, ratios to one, wrong}). Exit status 0, 1 when a result was
wrong, 2 for a bad command line.
"""
import os
import sys

import torch

import mlfabric.torch as hvd
from mlfabric.bench import harness
from mlfabric.bench.harness import median_rounds, time_rounds
from mlfabric.bench.script import int_list, positive_int
from mlfabric.comm.collectives import split_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_optimizer import finish_run, start_run  # noqa: E402

VARIANTS = ("one", "grouped", "unfused")
ROW = 4  # elements per row
TOL = 1e-5  # float32 holds the inputs (r + 1 + i / count) to ~5e-7


def options(p):
    p.add_argument("--count", type=positive_int, default=100, help="tensors per group")
    p.add_argument("--small", type=int_list, default=[256, 4096],
                   help="elements per tensor (float32, a multiple of 4), comma-separated")
    harness.add_iters(p, 20, "calls per variant per round")
    harness.add_rounds(p, 7)
    harness.add_threads(p)
    harness.add_out(p)


def check(p, args):
    if any(s % ROW for s in args.small):
        p.error(f"--small: each size must be a multiple of {ROW}")


def work(op, comm, count, small):
    """(the variants' calls, a check of their last results -> number of wrong elements)."""
    rank, size = comm.rank, comm.size
    rows = small // ROW
    # rank r's tensor i holds r + 1 + i / count (float32)
    pieces = [torch.full((rows, ROW), rank + 1 + i / count) for i in range(count)]
    one = torch.cat(pieces)
    last = {}
    if op == "allgather":
        calls = {"one": lambda: last.__setitem__("one", [hvd.allgather(one)]),
                 "grouped": lambda: last.__setitem__("grouped", hvd.grouped_allgather(pieces)),
                 "unfused": lambda: last.__setitem__("unfused",
                                                     [hvd.allgather(t) for t in pieces])}

        def expected(i, q):  # tensor i's rows from rank q
            return q + 1 + i / count
    else:
        calls = {"one": lambda: last.__setitem__("one", [hvd.reducescatter(one, op=hvd.Sum)]),
                 "grouped": lambda: last.__setitem__(
                     "grouped", hvd.grouped_reducescatter(pieces, op=hvd.Sum)),
                 "unfused": lambda: last.__setitem__(
                     "unfused", [hvd.reducescatter(t, op=hvd.Sum) for t in pieces])}

        def expected(i, q):  # the sum over ranks of tensor i
            return size * (size + 1) / 2 + size * i / count

    def check():
        wrong = {}
        for name, outs in last.items():
            bad = 0
            if name == "one" and op == "allgather":
                got = outs[0].view(size, count, rows, ROW)
                want = torch.tensor([[expected(i, q) for i in range(count)]
                                     for q in range(size)], dtype=torch.float64)
                bad = int((got.double() - want[:, :, None, None]).abs().gt(TOL).sum())
            elif name == "one":
                # this rank's block of rows of the sum: rows of tensors in order
                first = sum(split_rows(count * rows, size)[:rank])
                idx = (torch.arange(outs[0].shape[0]) + first) // rows
                want = size * (size + 1) / 2 + size * idx.double() / count
                bad = int((outs[0].double() - want[:, None]).abs().gt(TOL).sum())
            else:
                for i, t in enumerate(outs):
                    if op == "allgather":
                        want = torch.cat([torch.full((rows,), expected(i, q), dtype=torch.float64)
                                          for q in range(size)])
                        bad += int((t.double()[:, 0] - want).abs().gt(TOL).sum())
                    else:
                        bad += int((t.double() - expected(i, rank)).abs().gt(TOL).sum())
            wrong[name] = bad
        return wrong

    return calls, check


def measure(comm, args, op, small):
    calls, check = work(op, comm, args.count, small)
    times = time_rounds(comm, calls, VARIANTS, args.rounds, args.iters)
    wrong = comm.gather(check(), root=0)
    all_times = comm.gather(times, root=0)
    if comm.rank != 0:
        return None
    out = {"op": op, "count": args.count, "elements": small, "variants": {}}
    for name in VARIANTS:
        per_round, med = median_rounds([t[name] for t in all_times])
        out["variants"][name] = {"median_us": med * 1e6,
                                 "per_round_us": [t * 1e6 for t in per_round]}
    v = {n: out["variants"][n]["median_us"] for n in VARIANTS}
    out["ratios"] = {"grouped / one": v["grouped"] / v["one"],
                     "unfused / one": v["unfused"] / v["one"],
                     "unfused / grouped": v["unfused"] / v["grouped"]}
    out["wrong"] = {k: sum(w[k] for w in wrong) for k in VARIANTS}
    return out


def run(world, args):
    comm, host, t_start, load_before = start_run(args)
    results = []
    for op in ("allgather", "reducescatter"):
        for small in args.small:
            res = measure(comm, args, op, small)
            if comm.rank == 0:
                results.append(res)
                v = {n: res["variants"][n]["median_us"] for n in VARIANTS}
                print(f"{op:13s} {args.count} x {small:6d} float32: one {v['one']:9.1f} us  "
                      f"grouped {v['grouped']:9.1f} us  unfused {v['unfused']:9.1f} us  "
                      f"grouped/one {res['ratios']['grouped / one']:.2f}  unfused/grouped "
                      f"{res['ratios']['unfused / grouped']:.2f}  "
                      f"wrong {sum(res['wrong'].values())}", flush=True)
    wrong = comm.rank == 0 and any(any(r["wrong"].values()) for r in results)
    return finish_run(comm, args, results, wrong, t_start, load_before, host)


ENTRY = harness.Entry("torch_grouped", __doc__, options, run, check)

if __name__ == "__main__":
    harness.main(ENTRY)
