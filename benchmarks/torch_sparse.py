"""DistributedOptimizer over an embedding with sparse gradients: reduced as sparse tensors (the
default, Horovod's: allgathers of the rows present) against densified (sparse_as_dense=True: one
allreduce of the whole table's gradient), side by side in one MPI job, variants alternating round
by round so that all of them see the same machine load:

  model: nn.Embedding(vocab, dim, sparse=True) -> mean over a bag -> nn.Linear(dim, 1), float32;
  each rank looks up --rows random indices a step (its own, from a seed)
    local    the same step with a plain torch optimizer: no communication (the floor)
    sparse   DistributedOptimizer (sparse gradients reduced as sparse tensors)
    dense    DistributedOptimizer(sparse_as_dense=True)
  Every variant runs the same steps on the same indices from the same weights; at the end the
  sparse and dense variants' weights must agree (float32 sums in another order: 1e-5), else the
  run counts as wrong.

    mpirun -n 2 python benchmarks/torch_sparse.py [--vocab 10000,100000 --dim 64 --rows 1024]
        [--iters 10 --rounds 5] [--threads N] [--out FILE.json]

Times: per round, the mean step over the round's iterations, the slowest rank's; the figure
reported is the median over rounds. Rank 0 prints the table and writes the JSON ({"meta":
command, host, git state, parameters, load; "results": per vocab: medians, per-round times,
ratios}). Exit status 0, 1 when the variants' weights disagree, 2 for a bad command line.
"""
import os
import sys

import torch

import mlfabric.torch as hvd
from mlfabric.bench import harness
from mlfabric.bench.harness import median_rounds, time_rounds
from mlfabric.bench.script import int_list, positive_int

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_optimizer import finish_run, start_run  # noqa: E402

VARIANTS = ("local", "sparse", "dense")
TOL = 1e-5
BAG = 8  # indices per bag: a step's --rows indices form rows / BAG samples


def options(p):
    p.add_argument("--vocab", type=int_list, default=[10000, 100000],
                   help="embedding rows, comma-separated")
    p.add_argument("--dim", type=positive_int, default=64, help="embedding width")
    p.add_argument("--rows", type=positive_int, default=1024,
                   help=f"indices looked up per rank per step (a multiple of {BAG})")
    harness.add_iters(p, 10, "steps per variant per round")
    harness.add_rounds(p, 5)
    harness.add_threads(p)
    harness.add_out(p)


def check(p, args):
    if args.rows % BAG or args.rows <= 0:
        p.error(f"--rows must be a positive multiple of {BAG}")


class Model(torch.nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank and in every variant
        self.emb = torch.nn.Embedding(vocab, dim, sparse=True)
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def variant(name, vocab, args, rank):
    """(one training step of the variant, its model)."""
    model = Model(vocab, args.dim)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if name != "local":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       sparse_as_dense=name == "dense")
    gen = torch.Generator().manual_seed(1000 + rank)  # each variant sees the same sequence

    def step():
        ids = torch.randint(0, vocab, (args.rows // BAG, BAG), generator=gen)
        opt.zero_grad()
        model(ids).square().mean().backward()
        opt.step()
    return step, model


def measure(comm, args, vocab):
    steps, models = {}, {}
    for name in VARIANTS:
        steps[name], models[name] = variant(name, vocab, args, comm.rank)
    times = time_rounds(comm, steps, VARIANTS, args.rounds, args.iters)
    diff = max((a - b).abs().max().item() for a, b in zip(models["sparse"].parameters(),
                                                          models["dense"].parameters()))
    diffs = comm.gather(diff, root=0)
    all_times = comm.gather(times, root=0)
    if comm.rank != 0:
        return None
    out = {"vocab": vocab, "dim": args.dim, "rows": args.rows,
           "dense_gradient_mb": vocab * args.dim * 4 / 1e6, "variants": {}}
    for name in VARIANTS:
        per_round, med = median_rounds([t[name] for t in all_times])
        out["variants"][name] = {"median_ms": med * 1e3,
                                 "per_round_ms": [t * 1e3 for t in per_round]}
    v = {n: out["variants"][n]["median_ms"] for n in VARIANTS}
    out["ratios"] = {"dense / sparse": v["dense"] / v["sparse"],
                     "sparse / local": v["sparse"] / v["local"],
                     "dense / local": v["dense"] / v["local"]}
    out["max_weight_diff_sparse_vs_dense"] = max(diffs)
    out["wrong"] = max(diffs) > TOL
    return out


def run(world, args):
    comm, host, t_start, load_before = start_run(args)
    results = []
    for vocab in args.vocab:
        res = measure(comm, args, vocab)
        if comm.rank == 0:
            results.append(res)
            v = {n: res["variants"][n]["median_ms"] for n in VARIANTS}
            print(f"vocab {vocab:8d} x {args.dim} ({res['dense_gradient_mb']:.1f} MB dense), "
                  f"{args.rows} rows/rank: local {v['local']:8.2f} ms  sparse {v['sparse']:8.2f}"
                  f" ms  dense {v['dense']:8.2f} ms  dense/sparse "
                  f"{res['ratios']['dense / sparse']:.2f}  weights differ by "
                  f"{res['max_weight_diff_sparse_vs_dense']:.1e}", flush=True)
    wrong = comm.rank == 0 and any(r["wrong"] for r in results)
    return finish_run(comm, args, results, wrong, t_start, load_before, host)


ENTRY = harness.Entry("torch_sparse", __doc__, options, run, check)

if __name__ == "__main__":
    harness.main(ENTRY)
