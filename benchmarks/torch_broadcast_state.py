"""broadcast_optimizer_state against the ways of sending an optimizer's state by pickling it,
side by side in one MPI job, variants alternating round by round:
  mlfabric  hvd.broadcast_optimizer_state: the state's tensors broadcast as tensors (fused per
            dtype), only its structure and plain values pickled
  pickled   hvd.broadcast_object(optimizer.state_dict()) + load_state_dict: the whole state
            pickled
  gloo      torch.distributed.broadcast_object_list([state_dict]) on a gloo group, then
            load_state_dict: what a torch.distributed script writes
The state is Adam's after one step on an MLP of --layers square layers per --hidden width (two
float32 moments per parameter). Every result is checked on every rank against the root's state.

    mpirun -n 2 python benchmarks/torch_broadcast_state.py [--hidden 512,1024,2048
        --layers 4 --rounds 5] [--threads N] [--out FILE.json]

Times: per round, one call, the slowest rank's; the figure reported is the median over rounds.
Rank 0 prints the table and writes the JSON ({"meta": command, host, git state, parameters,
load; "results": per width: state bytes, medians, per-round times, wrong}). Exit status 0, 1
when a result was wrong, 2 for a bad command line.
"""
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from mpi4py import MPI

import mlfabric.torch as hvd
import mlfabric.torch.backend  # noqa: F401 - registers the "mlfabric" backend
from mlfabric.bench import harness
from mlfabric.bench.script import int_list, positive_int

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_optimizer import finish_run, start_run  # noqa: E402

VARIANTS = ("mlfabric", "pickled", "gloo")


def options(p):
    p.add_argument("--hidden", type=int_list, default=[512, 1024, 2048],
                   help="MLP widths, comma-separated")
    p.add_argument("--layers", type=positive_int, default=4, help="square layers")
    harness.add_rounds(p, 5)
    harness.add_threads(p)
    harness.add_out(p)


def check(p, args):
    args.iters = 1  # (for finish_run's record)


def adam(hidden, layers, rank):
    """Adam after one step; rank r's gradients were r + 1, so a rank that kept its own state
    shows in its moments."""
    torch.manual_seed(0)
    mods = [torch.nn.Linear(hidden, hidden) for _ in range(layers)] + [torch.nn.Linear(hidden, 1)]
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.full_like(p, rank + 1.0)
    opt.step()
    return opt


def digest(opt):
    return [float(t.double().sum()) for s in opt.state.values() for t in s.values()]


def run(world, args):
    comm, host, started, load_before = start_run(args)
    warnings.simplefilter("ignore", FutureWarning)
    dist.init_process_group("mlfabric")  # the world; gloo is a group beside it
    gloo = dist.new_group(backend="gloo")
    rank = comm.rank

    def pickled(opt):
        opt.load_state_dict(hvd.broadcast_object(opt.state_dict() if rank == 0 else None, 0))

    def over_gloo(opt):
        box = [opt.state_dict() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=gloo)
        opt.load_state_dict(box[0])

    work = {"mlfabric": lambda opt: hvd.broadcast_optimizer_state(opt, 0),
            "pickled": pickled, "gloo": over_gloo}
    results, wrong_total = [], 0
    for hidden in args.hidden:
        root = comm.bcast(digest(adam(hidden, args.layers, 0)), root=0)
        times, wrong = {v: [] for v in VARIANTS}, {v: 0 for v in VARIANTS}
        for r in range(args.rounds + 1):  # round 0 warms up
            for v in (VARIANTS if r % 2 else VARIANTS[::-1]):
                opt = adam(hidden, args.layers, rank)
                comm.Barrier()
                t0 = time.perf_counter()
                work[v](opt)
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if r:
                    times[v].append(dt)
                wrong[v] += digest(opt) != root
        wrong = {v: comm.allreduce(w) for v, w in wrong.items()}
        wrong_total += sum(wrong.values())
        state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                          for t in s.values())
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        results.append({"hidden": hidden, "layers": args.layers, "state_bytes": state_bytes,
                        "median_ms": med, "wrong": wrong,
                        "per_round_ms": {v: [t * 1e3 for t in ts] for v, ts in times.items()},
                        "ratios": {f"{v} / mlfabric": med[v] / med["mlfabric"]
                                   for v in VARIANTS[1:]}})
        if rank == 0:
            print(f"\n# Adam state, {state_bytes / 1e6:.1f} MB ({args.layers} x {hidden}^2 "
                  f"layers), {comm.size} ranks: median ms per call")
            for v in VARIANTS:
                flag = f"  WRONG: {wrong[v]}" if wrong[v] else ""
                print(f"{v:>9}: {med[v]:8.1f}  (rounds {min(times[v]) * 1e3:.1f}.."
                      f"{max(times[v]) * 1e3:.1f}){flag}")
            print("  " + ", ".join(f"{k}: {x:.2f}" for k, x in results[-1]["ratios"].items()))
    dist.destroy_process_group()
    return finish_run(comm, args, results, wrong_total, started, load_before, host)


ENTRY = harness.Entry("torch_broadcast_state", __doc__, options, run, check)

if __name__ == "__main__":
    harness.main(ENTRY)
