"""mlfabric.torch.DistributedOptimizer measured against its targets (issue 5), side by side in one
MPI job, variants alternating round by round so that all of them see the same machine load:

  step    time of one training step (zero_grad, forward, backward, gradient reduction, SGD update)
          of an MLP, weak scaling (the same per-rank batch), for each workload (--batches):
            alone         rank 0 alone, no communication, the other ranks asleep: the
                          single-process step
            local         every rank at once, no communication: what sharing the machine costs
            hvd           DistributedOptimizer (hooks, fusion buckets, async allreduce)
            ddp-gloo      DistributedDataParallel on torch's gloo backend
            ddp-mlfabric  DistributedDataParallel on the "mlfabric" torch.distributed backend
          Each step is split (forward / backward / synchronize wait / update) by timestamps: the
          profile that says where a miss comes from. hvd and the DDP runs take the same steps on
          the same data, so they must end at the same weights (checked).
  fusion  allreduce of --count small tensors (--small elements each) against one tensor of the
          same total size:
            one           hvd.allreduce_ of one tensor of count x small elements
            grouped       hvd.grouped_allreduce_ of the count tensors (one fused buffer)
            cat+one       the same fusion done by hand in three torch calls: torch.cat, one
                          hvd.allreduce_, torch._foreach_copy_ back: what fusion costs when
                          the per-tensor work is done in bulk
            unfused       count separate hvd.allreduce_ calls
            unfused-async count hvd.allreduce_async_ calls, then synchronize each
            opt-N / opt-1 DistributedOptimizer's backward + synchronize() on N parameters of
                          `small` elements / on one parameter of N x small, and local-N /
                          local-1 the same backward with no optimizer: opt - local is what the
                          optimizer's reduction adds
            local-N+one   local-N, then hvd.allreduce_ of one tensor of the fused size: a fused
                          allreduce in the optimizer's place, right after backward (the peers'
                          backward passes ending when they do); opt-N adds / (local-N+one -
                          local-N) is the optimizer's own overhead over that
          Every result is checked against the float64 mean over ranks (`wrong` counts misses).

    mpirun -n 2 python benchmarks/torch_optimizer.py [--experiments step,fusion]
        [--inputs 1024 --hidden 1024 --layers 4 --batches 256,8 --steps 4 --rounds 7]
        [--bucket-mib 4] [--count 100 --small 256,4096,32768 --iters 20] [--threads N]
        [--out FILE.json]

With 2 ranks or fewer, Open MPI binds each rank to one core: pass `--bind-to none` so that a
rank's torch threads (--threads, default the host's cores / its ranks) get cores of their own.

Times: per round, the mean over the round's steps (or iterations), the slowest rank's; the
figure reported is the median over rounds. Rank 0 prints the tables and the verdicts and writes
the JSON ({"meta": command, host, git state, parameters, load; "step": per workload; "fusion":
per size; "targets": the three targets' ratios and verdicts}). Exit status 0, 1 when a result
was wrong (a reduction or the hvd/DDP weights), 2 for a bad command line.
"""
import contextlib
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import mlfabric.torch as hvd
from mlfabric.bench import harness
from mlfabric.bench.harness import alternating, median_rounds, sleep_barrier, time_rounds
from mlfabric.bench.report import host_info
from mlfabric.bench.script import int_list
from mlfabric.torch import ops as hvd_ops

STEP_VARIANTS = ("alone", "local", "hvd", "ddp-gloo", "ddp-mlfabric")
FUSION_VARIANTS = ("one", "grouped", "cat+one", "unfused", "unfused-async", "opt-N", "local-N",
                   "opt-1", "local-1", "local-N+one")
# The targets.
SCALING_MAX = 1.2   # hvd step at 2 ranks / single-process step, compute-bound model
FUSION_MAX = 2.0    # 100 small tensors fused / one tensor of the same size
GLOO_MIN = 1.5      # DDP-on-gloo step / hvd step


def options(p):
    p.add_argument("--experiments", default="step,fusion",
                   help="comma-separated: step, fusion (default both)")
    p.add_argument("--inputs", type=int, default=1024, help="MLP input width")
    p.add_argument("--hidden", type=int, default=1024, help="MLP hidden width")
    p.add_argument("--layers", type=int, default=4, help="hidden layers")
    p.add_argument("--batches", type=int_list, default=[256, 8],
                   help="per-rank batch of each workload (default 256: compute-bound, 8: "
                        "communication-bound)")
    p.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=7, help="rounds (order alternating)")
    p.add_argument("--count", type=int, default=100, help="fusion: number of small tensors")
    p.add_argument("--small", type=int_list, default=[256, 4096, 32768],
                   help="fusion: elements per small tensor (float32), comma-separated")
    harness.add_iters(p, 20, "fusion: iterations per variant per round", type=int)
    p.add_argument("--bucket-mib", type=int_list, default=[],
                   help="step: extra hvd variants (hvd@NMiB) whose DistributedOptimizer fuses "
                        "gradients into buckets of at most N MiB (MLFABRIC_FUSION_THRESHOLD at "
                        "construction), to see how far smaller buckets overlap backward")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: the host's "
                   "cores / its ranks)")
    harness.add_out(p, "write the JSON here", metavar="FILE.json")


def check(p, args):
    args.experiments = [e.strip() for e in args.experiments.split(",") if e.strip()]
    bad = [e for e in args.experiments if e not in ("step", "fusion")]
    if bad or not args.experiments:
        p.error(f"--experiments must be among step, fusion; got {args.experiments}")
    for name in ("inputs", "hidden", "layers", "steps", "rounds", "count", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")


# --- helpers --------------------------------------------------------------------------------------

def start_run(args):
    """The start of a side-by-side script's run (torch_grouped.py, torch_sparse.py,
    torch_broadcast_state.py): (comm: a Dup of COMM_WORLD for the script's own barriers and
    gathers, host info, the start time, the load average before)."""
    torch.set_num_threads(args.threads)
    started, load_before = time.monotonic(), os.getloadavg()
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    return comm, host_info(comm), started, load_before


def finish_run(comm, args, results, wrong, started, load_before, host):
    """The end of a side-by-side script's run: (the records, on rank 0: {"meta": parameters,
    load, host; "results"; "wrong"}, the exit status on every rank: 1 when a result was
    wrong); shuts mlfabric down. The harness adds the common envelope (command, git state,
    machine) and writes the JSON."""
    status, records = 0, None
    if comm.rank == 0:
        status = 1 if wrong else 0
        meta = {"command": harness.command_line(), "ranks": comm.size,
                "threads_per_rank": args.threads, "iters": args.iters, "rounds": args.rounds,
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                "total_wall_s": time.monotonic() - started, **host}
        records = {"meta": meta, "results": results, "wrong": wrong}
    status = comm.bcast(status, root=0)
    comm.Free()
    hvd.shutdown()
    return records, status


# --- step experiment ------------------------------------------------------------------------------

def mlp(args):
    torch.manual_seed(0)  # every rank and every variant starts from the same weights
    layers, width = [], args.inputs
    for _ in range(args.layers):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.ReLU()]
        width = args.hidden
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def train_steps(model, opt, batches, split, reduce=None, settle=None):
    """Run the steps; add each phase's seconds to split. reduce: the synchronize() of
    DistributedOptimizer, timed on its own (the wait for the allreduces not hidden by backward).
    settle: called at the end of each step, inside it (on a GPU: a device synchronize, so that
    the step is timed to completion)."""
    for x, y in batches:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()  # DDP: its allreduces run here, and it waits for them at the end
        t2 = time.perf_counter()
        if reduce is not None:
            reduce()
            t3 = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
        else:
            t3 = t2
            opt.step()
        if settle is not None:
            settle()
        t4 = time.perf_counter()
        for key, dt in (("forward", t1 - t0), ("backward", t2 - t1), ("sync", t3 - t2),
                        ("update", t4 - t3)):
            split[key] += dt


def step_variants(args):
    return list(STEP_VARIANTS) + [f"hvd@{m}MiB" for m in args.bucket_mib]


@contextlib.contextmanager
def fusion_threshold(mib):
    """MLFABRIC_FUSION_THRESHOLD set while a DistributedOptimizer is built (it reads it then)."""
    old = os.environ.get("MLFABRIC_FUSION_THRESHOLD")
    if mib is not None:
        os.environ["MLFABRIC_FUSION_THRESHOLD"] = str(mib << 20)
    try:
        yield
    finally:
        if mib is not None:
            if old is None:
                del os.environ["MLFABRIC_FUSION_THRESHOLD"]
            else:
                os.environ["MLFABRIC_FUSION_THRESHOLD"] = old


PHASES = ("forward", "backward", "sync", "update")


def exp_step(comm, args, groups, batch):
    rank = comm.rank
    names = step_variants(args)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(batch, args.inputs, generator=gen),
                torch.randn(batch, 1, generator=gen)) for _ in range(args.steps)]
    runs = {}
    for name in names:
        model = mlp(args)
        if name.startswith("ddp-"):
            model = DDP(model, process_group=groups[name[4:]])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        reduce = None
        if name.startswith("hvd"):
            mib = int(name[4:-3]) if "@" in name else None
            with fusion_threshold(mib):
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            reduce = opt.synchronize
        runs[name] = (model, opt, reduce)
    for name, (model, opt, reduce) in runs.items():  # warm-up: buckets, first-call costs
        sleep_barrier(comm)
        if name != "alone" or rank == 0:
            train_steps(model, opt, batches[:2], dict.fromkeys(PHASES, 0.0), reduce)
    times = {name: [] for name in runs}
    splits = {name: dict.fromkeys(PHASES, 0.0) for name in runs}
    for order in alternating(names, args.rounds):
        for name in order:
            model, opt, reduce = runs[name]
            comm.Barrier()
            t0 = time.perf_counter()
            if name != "alone" or rank == 0:
                train_steps(model, opt, batches, splits[name], reduce)
            elapsed = (time.perf_counter() - t0) / args.steps
            if name == "alone":
                sleep_barrier(comm)  # the others sleep while rank 0 runs alone
                elapsed = elapsed if rank == 0 else 0.0
            times[name].append(elapsed)
    # Every variant took warm-up + rounds x steps steps on the same data: hvd and the two DDPs
    # averaged the same gradients, so they must hold the same weights, on every rank.
    reduced = [n for n in names if n.startswith(("hvd", "ddp-"))]
    flat = {n: torch.cat([p.detach().reshape(-1) for p in runs[n][0].parameters()])
            for n in reduced}
    diff = {f"hvd vs {n}": (flat["hvd"] - flat[n]).abs().max().item()
            for n in reduced if n != "hvd"}
    every = comm.gather(flat["hvd"].numpy(), root=0)
    diff["hvd rank 0 vs others"] = (max(float(abs(every[0] - w).max()) for w in every)
                                    if rank == 0 else 0.0)
    all_times = comm.gather(times, root=0)
    all_splits = comm.gather(splits, root=0)
    all_diff = comm.gather(diff, root=0)
    if rank != 0:
        return None
    n_steps = args.rounds * args.steps
    out = {"batch": batch, "variants": {}}
    for name in names:
        per_round, med = median_rounds([t[name] for t in all_times])
        ranks_split = all_splits[:1] if name == "alone" else all_splits
        per_rank = [{k: s[name][k] / n_steps * 1e3 for k in PHASES} for s in ranks_split]
        out["variants"][name] = {
            "median_ms": med * 1e3, "per_round_ms": [t * 1e3 for t in per_round],
            # mean per step over every step of every round: the mean over ranks, and each rank's
            "split_ms": {k: statistics.mean(r[k] for r in per_rank) for k in PHASES},
            "split_ms_per_rank": per_rank}
    v = {n: out["variants"][n]["median_ms"] for n in names}
    out["ratios"] = {
        "hvd / alone": v["hvd"] / v["alone"],
        "hvd / local": v["hvd"] / v["local"],
        "local / alone": v["local"] / v["alone"],
        "ddp-gloo / hvd": v["ddp-gloo"] / v["hvd"],
        "ddp-mlfabric / hvd": v["ddp-mlfabric"] / v["hvd"],
        # what communication adds over the same steps without it, gloo's over hvd's; None when
        # hvd added nothing measurable (noise made hvd's median <= local's: no ratio to give)
        "ddp-gloo added / hvd added": ((v["ddp-gloo"] - v["local"]) / (v["hvd"] - v["local"])
                                       if v["hvd"] > v["local"] else None),
    }
    for n in names[len(STEP_VARIANTS):]:
        out["ratios"][f"{n} / alone"] = v[n] / v["alone"]
        out["ratios"][f"ddp-gloo / {n}"] = v["ddp-gloo"] / v[n]
    out["max_abs_weight_diff"] = {k: max(d[k] for d in all_diff) for k in all_diff[0]}
    out["wrong"] = int(any(d > 1e-4 for d in out["max_abs_weight_diff"].values()))
    return out


# --- fusion experiment ----------------------------------------------------------------------------

def exp_fusion(comm, args, small):
    rank, size, count = comm.rank, comm.size, args.count
    total = count * small
    # rank r holds r + 1 + i / total in element i: the mean over ranks is (size + 1) / 2 + i / total
    ramp = torch.arange(total, dtype=torch.float64) / total
    expected = (size + 1) / 2 + ramp
    start = (rank + 1 + ramp).float()
    one, one_after = start.clone(), start.clone()
    pieces = {name: [t.clone() for t in start.split(small)]
              for name in ("grouped", "cat+one", "unfused", "unfused-async")}

    def grads_model(n, elems):
        params = [torch.nn.Parameter(torch.zeros(elems)) for _ in range(n)]
        return params, torch.optim.SGD(params, lr=0.0)

    opt_n, opt_1 = grads_model(count, small), grads_model(1, total)
    local_n, local_1 = grads_model(count, small), grads_model(1, total)
    opt_n = (opt_n[0], hvd.DistributedOptimizer(opt_n[1]))
    opt_1 = (opt_1[0], hvd.DistributedOptimizer(opt_1[1]))

    def backward(params, opt, synchronize):
        opt.zero_grad()
        # d(loss)/dp = rank + 1 everywhere: the averaged gradient is (size + 1) / 2
        sum(p.sum() for p in params).mul(rank + 1).backward()
        if synchronize:
            opt.synchronize()

    def cat_one():
        flat = torch.cat(pieces["cat+one"])
        hvd.allreduce_(flat)
        torch._foreach_copy_(pieces["cat+one"], flat.split(small))

    def unfused_async():
        for h in [hvd.allreduce_async_(t) for t in pieces["unfused-async"]]:
            hvd.synchronize(h)

    work = {
        "one": lambda: hvd.allreduce_(one),
        "grouped": lambda: hvd.grouped_allreduce_(pieces["grouped"]),
        "cat+one": cat_one,
        "unfused": lambda: [hvd.allreduce_(t) for t in pieces["unfused"]],
        "unfused-async": unfused_async,
        "opt-N": lambda: backward(*opt_n, True),
        "local-N": lambda: backward(*local_n, False),
        "opt-1": lambda: backward(*opt_1, True),
        "local-1": lambda: backward(*local_1, False),
        # one fused allreduce where the optimizer's runs (right after a backward pass, the peer's
        # backward ending when it does, the library's code out of cache): opt-N's own overhead
        # is what opt-N adds beyond this
        "local-N+one": lambda: (backward(*local_n, False), hvd.allreduce_(one_after)),
    }
    times = time_rounds(comm, work, FUSION_VARIANTS, args.rounds, args.iters)
    # Averages of averages keep the mean: every copy must hold the float64 mean over ranks.
    wrong = {}
    for name, got in [("one", one), ("local-N+one", one_after)] + [
            (n, torch.cat(ts)) for n, ts in pieces.items()]:
        wrong[name] = int((got.double() - expected).abs().gt(1e-5 * expected).sum())
    for name, (params, _) in (("opt-N", opt_n), ("opt-1", opt_1)):
        g = torch.cat([p.grad.reshape(-1) for p in params]).double()
        wrong[name] = int((g - (size + 1) / 2).abs().gt(1e-6).sum())
    all_times = comm.gather(times, root=0)
    all_wrong = comm.gather(wrong, root=0)
    if rank != 0:
        return None
    out = {"count": count, "elements": small, "bytes_each": small * 4, "total_bytes": total * 4,
           "variants": {}}
    for name in FUSION_VARIANTS:
        per_round, med = median_rounds([t[name] for t in all_times])
        out["variants"][name] = {"median_us": med * 1e6,
                                 "per_round_us": [t * 1e6 for t in per_round]}
    v = {n: out["variants"][n]["median_us"] for n in FUSION_VARIANTS}
    added_n, added_1 = v["opt-N"] - v["local-N"], v["opt-1"] - v["local-1"]
    one_after = v["local-N+one"] - v["local-N"]
    out["optimizer_added_us"] = {"opt-N": added_n, "opt-1": added_1,
                                 "one after backward": one_after}
    out["ratios"] = {"grouped / one": v["grouped"] / v["one"],
                     "cat+one / one": v["cat+one"] / v["one"],
                     "opt-N added / one": added_n / v["one"],
                     "opt-N added / opt-1 added": added_n / max(added_1, 1e-9),
                     "opt-N added / one after backward": added_n / max(one_after, 1e-9),
                     "unfused / one": v["unfused"] / v["one"],
                     "unfused-async / one": v["unfused-async"] / v["one"]}
    out["wrong"] = {k: sum(w[k] for w in all_wrong) for k in all_wrong[0]}
    return out


# --- report ---------------------------------------------------------------------------------------

def print_step(res, size):
    print(f"\n# step, batch {res['batch']} per rank, {size} ranks: median ms per step "
          "(forward / backward / sync wait / update: mean per step, mean over ranks)")
    for name in res["variants"]:
        r = res["variants"][name]
        s = r["split_ms"]
        print(f"{name:>13}: {r['median_ms']:8.2f} ms  ({s['forward']:.2f} / {s['backward']:.2f}"
              f" / {s['sync']:.2f} / {s['update']:.2f}; rounds "
              f"{min(r['per_round_ms']):.2f}..{max(r['per_round_ms']):.2f})")
    print("  " + ", ".join(f"{k}: {'n/a' if v is None else f'{v:.2f}'}"
                           for k, v in res["ratios"].items()))
    print("  max |weight difference|: " + ", ".join(
        f"{k} {v:.1e}" for k, v in res["max_abs_weight_diff"].items()))


def print_fusion(res):
    print(f"\n# fusion: {res['count']} x {res['elements']} float32 ({res['total_bytes']} bytes "
          "in all): median us per call")
    for name in FUSION_VARIANTS:
        print(f"{name:>14}: {res['variants'][name]['median_us']:10.1f}")
    print("  " + ", ".join(f"{k}: {v:.2f}" for k, v in res["ratios"].items()))
    print("  optimizer adds (opt - local): " + ", ".join(
        f"{k} {v:.1f} us" for k, v in res["optimizer_added_us"].items()))
    if any(res["wrong"].values()):
        print(f"  WRONG results: {res['wrong']}")


def verdicts(step, fusion, size):
    """The three targets from the measured ratios."""
    out = {}
    if step:
        compute = max(step, key=lambda r: r["batch"])  # the largest batch: compute-bound
        ratio = compute["ratios"]["hvd / alone"]
        out["scaling"] = {"target": f"hvd step at {size} ranks <= {SCALING_MAX}x the "
                                    "single-process step (compute-bound)",
                          "batch": compute["batch"], "ratio": ratio,
                          "met": ratio <= SCALING_MAX}
        out["vs_gloo"] = {"target": f"ddp-gloo step / hvd step >= {GLOO_MIN}",
                          "per_batch": {str(r["batch"]): {
                              "ratio": r["ratios"]["ddp-gloo / hvd"],
                              "met": r["ratios"]["ddp-gloo / hvd"] >= GLOO_MIN,
                              "added_ratio": r["ratios"]["ddp-gloo added / hvd added"]}
                              for r in step}}
    if fusion:
        out["fusion"] = {"target": f"{fusion[0]['count']} small tensors <= {FUSION_MAX}x one "
                                   "fused tensor of the same size",
                         "per_size": {str(r["elements"]): {
                             "grouped / one": r["ratios"]["grouped / one"],
                             "opt-N added / one": r["ratios"]["opt-N added / one"],
                             "met": r["ratios"]["grouped / one"] <= FUSION_MAX
                             and r["ratios"]["opt-N added / one"] <= FUSION_MAX}
                             for r in fusion}}
    return out


def run(world, args):
    warnings.simplefilter("ignore", FutureWarning)
    rank, size = world.rank, world.size
    host_comm = world.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this host
    local_ranks = host_comm.size
    host_comm.Free()
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_ranks)
    torch.set_num_threads(threads)
    t_start = time.monotonic()
    load_before = os.getloadavg()

    dist.init_process_group("mlfabric")  # under mpirun: ranks from MPI, a TCPStore for gloo
    hvd.init()
    comm = world.Dup()  # this script's own barriers and gathers
    groups = {"gloo": dist.new_group(backend="gloo"),
              "mlfabric": dist.distributed_c10d._get_default_group()}
    host = host_info(comm)

    step, fusion = [], []
    if "step" in args.experiments:
        for batch in args.batches:
            res = exp_step(comm, args, groups, batch)
            if rank == 0:
                step.append(res)
                print_step(res, size)
    if "fusion" in args.experiments:
        for small in args.small:
            res = exp_fusion(comm, args, small)
            if rank == 0:
                fusion.append(res)
                print_fusion(res)

    status, records = 0, None
    if rank == 0:
        targets = verdicts(step, fusion, size)
        print("\n# targets")
        for name, t in targets.items():
            print(f"{name}: {json.dumps(t)}")
        wrong = any(r["wrong"] for r in step) or any(any(r["wrong"].values()) for r in fusion)
        status = 1 if wrong else 0
        threshold = os.environ.get("MLFABRIC_FUSION_THRESHOLD")
        meta = {"command": " ".join(
                    ([f"MLFABRIC_FUSION_THRESHOLD={threshold}"] if threshold else [])
                    + [harness.command_line()]),
                "ranks": size, "threads_per_rank": threads,
                "fusion_threshold_bytes": hvd_ops.fusion_threshold(),
                "model": {"inputs": args.inputs, "hidden": args.hidden, "layers": args.layers,
                          "parameters": sum(p.numel() for p in mlp(args).parameters()),
                          "dtype": "float32"},
                "steps": args.steps, "rounds": args.rounds, "iters": args.iters,
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                "total_wall_s": time.monotonic() - t_start, **host}
        records = {"meta": meta, "step": step, "fusion": fusion, "targets": targets,
                   "wrong": wrong}
    status = comm.bcast(status, root=0)
    comm.Free()
    dist.destroy_process_group()
    hvd.shutdown()
    return records, status


ENTRY = harness.Entry("torch_optimizer", __doc__, options, run, check,
                      prog="benchmarks/torch_optimizer.py")

if __name__ == "__main__":
    harness.main(ENTRY)
