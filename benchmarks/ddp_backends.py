"""DDP step time over torch's gloo backend vs the "mlfabric" backend (mlfabric/torch/backend.py),
same model, same data, one MPI job: the world group is mlfabric, gloo is a new_group beside it,
and the two alternate round by round so both see the same machine load. A step is forward,
backward (DDP allreduces the gradient buckets, overlapped with the backward pass) and an SGD
update; the time per step is the median over rounds of each round's mean.

    mpirun -n 2 python benchmarks/ddp_backends.py [--hidden 1024 --layers 4 --batch 32
                                                   --steps 10 --rounds 7 --dtype float32]
                                                  [--out FILE.json]

Rank 0 prints one line per backend (median ms per step), a "local" line (the same steps without
DDP: compute only), and the ratio gloo / mlfabric of the step times and of the time DDP adds
over local (above 1: mlfabric is faster). The two DDP trainings should end at the same weights
(max abs difference printed). The JSON ("results": per backend the median and per-round ms per
step, the parameters and the weight difference) is written by rank 0 with --out.
"""
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mlfabric.torch.backend  # noqa: F401 - registers the "mlfabric" backend
from mlfabric.bench import harness
from mlfabric.bench.script import positive_int


def model(args):
    torch.manual_seed(0)
    layers, width = [], args.inputs
    for _ in range(args.layers):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.ReLU()]
        width = args.hidden
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers).to(getattr(torch, args.dtype))


def run_steps(ddp, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def options(p):
    p.add_argument("--inputs", type=positive_int, default=256)
    p.add_argument("--hidden", type=positive_int, default=1024)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--steps", type=positive_int, default=10, help="steps per round")
    harness.add_rounds(p, 7)
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    harness.add_out(p)


def run(comm, args):
    warnings.simplefilter("ignore", FutureWarning)

    dist.init_process_group("mlfabric")  # under mpirun: MPI gives ranks, nothing to set
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.new_group(backend="gloo"),
              "mlfabric": dist.distributed_c10d._get_default_group()}
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, args.inputs, generator=gen, dtype=dtype),
                torch.randn(args.batch, 1, generator=gen, dtype=dtype))
               for _ in range(args.steps)]
    runs = {}
    for name, group in groups.items():
        ddp = DDP(model(args), process_group=group)
        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
        run_steps(*runs[name], batches[:2])  # warm-up: buckets built, first-call costs paid
    local = model(args)  # the same steps with no communication: what DDP adds is the rest
    runs["local"] = (local, torch.optim.SGD(local.parameters(), lr=1e-3))
    run_steps(*runs["local"], batches[:2])

    times = {name: [] for name in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(list(runs)))
        for name in order:
            dist.barrier(group=groups["gloo"])
            t0 = time.perf_counter()
            run_steps(*runs[name], batches)
            times[name].append((time.perf_counter() - t0) / args.steps)

    params = sum(p.numel() for p in runs["gloo"][0].parameters())
    diff = max((a - b).abs().max().item() for a, b in
               zip(runs["gloo"][0].parameters(), runs["mlfabric"][0].parameters()))
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    records = None
    if rank == 0:
        mb = params * torch.finfo(dtype).bits / 8 / 1e6
        print(f"# {size} ranks; MLP {args.inputs}-{'x'.join([str(args.hidden)] * args.layers)}-1 "
              f"{args.dtype}, {params} parameters ({mb:.1f} MB of gradients per step), "
              f"batch {args.batch}, {args.steps} steps x {args.rounds} rounds")
        for name in ("local", "gloo", "mlfabric"):
            spread = f"{min(times[name]) * 1e3:.2f}..{max(times[name]) * 1e3:.2f}"
            extra = "" if name == "local" else f", {med[name] - med['local']:+.2f} over local"
            print(f"{name:>9}: {med[name]:8.2f} ms/step (rounds {spread}{extra})")
        print(f"gloo / mlfabric: {med['gloo'] / med['mlfabric']:.2f} per step, "
              f"{(med['gloo'] - med['local']) / max(med['mlfabric'] - med['local'], 1e-9):.2f} "
              f"on the time DDP adds (max |weight difference| gloo vs mlfabric: {diff:.2e})")
        records = {"meta": {"ranks": size, "parameters": params, "dtype": args.dtype,
                            "batch": args.batch, "steps": args.steps, "rounds": args.rounds},
                   "results": {name: {"median_ms": med[name],
                                      "per_round_ms": [t * 1e3 for t in times[name]]}
                               for name in ("local", "gloo", "mlfabric")},
                   "ratios": {"gloo / mlfabric": med["gloo"] / med["mlfabric"]},
                   "max_abs_weight_diff": diff}
    dist.destroy_process_group()
    return records


ENTRY = harness.Entry("ddp_backends", __doc__, options, run)

if __name__ == "__main__":
    harness.main(ENTRY)
