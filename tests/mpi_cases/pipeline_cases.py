"""Multi-rank cases of the pipeline executor (mlfabric.pipeline.executor / stage), run on every rank
by tests/mpi_cases/runner.py under real mpirun at 2, 3 and 4 ranks. Models are float64; every
rank recomputes a single-process reference (the whole model, its own code, no MPI) and compares
the weights of the pieces it holds:

  Flush, GPipe, interleaved (v=2): synchronous SGD with gradient accumulation over m microbatches
  (momentum too), several steps, to 1e-10;
  2BW: W(t+1) = W(t) - lr * grad f(W(t-1)), W(-1) = W(0);
  PipeDream 1F1B with stashing: stage s uses version max(k - (p-1-s), 0) for microbatch k, in its
  forward and its backward (recorded by the executor); vertical sync: SGD with delay p-1;
  1F1B-RR: microbatch k runs on replica k mod r; a replicated stage under a flush (allreduce among
  replicas) equals synchronous SGD;
  memory: live weight versions and stashed activations per rank equal validate()'s counts;
  errors: a shape mismatch between stages names both stages on every rank; a silent peer gives
  a PipelineTimeoutError naming it and the action; a wrong-sized schedule, ranks with different
  schedules, missing inputs fail on every rank; shapes that vary per microbatch work; the cuts
  and replication can come from a partition.Partition.
"""
import os
import time

import numpy as np
import torch
from mpi4py import MPI
from torch.func import functional_call

from mlfabric.pipeline import (Action, Schedule, flush, gpipe, interleaved, one_f_one_b, two_bw,
                               validate)
from mlfabric.pipeline.executor import PipelineError, PipelineTimeoutError, StageInputError
from mlfabric.pipeline.stage import PipelineModel, split_layers

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
R = WORLD.Get_rank()
TOL = 1e-10
D_IN, H, D_OUT = 5, 6, 3


def setup():
    torch.set_num_threads(1)


# --- the model and the data ---------------------------------------------------------------------

def layers(n, seed=0):
    """n blocks, float64: Linear + Tanh, the last one a plain Linear."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        a, b = (D_IN if i == 0 else H), (D_OUT if i == n - 1 else H)
        lin = torch.nn.Linear(a, b).double()
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g, dtype=torch.float64) * 0.6)
            lin.bias.copy_(torch.randn(b, generator=g, dtype=torch.float64) * 0.1)
        out.append(lin if i == n - 1 else torch.nn.Sequential(lin, torch.nn.Tanh()))
    return out


def data(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(batch, D_OUT, generator=g, dtype=torch.float64)
    return x, y


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


def sgd(lr=0.1, momentum=0.0):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


# --- the single-process reference ---------------------------------------------------------------

def reference(n_pieces, steps, version, xs, ys, lr=0.1, momentum=0.0, runs=1, seed=0):
    """Weights per piece after `runs` runs of `steps` optimizer steps (a list, per step, of
    (microbatches, scale)). version(q, k, t) -> the version (steps of this run before it) whose
    weights piece q uses for microbatch k in step t. Plain loops: forward with those weights,
    gradient, SGD (with momentum buffer b = momentum * b + g)."""
    pieces = split_layers(layers(n_pieces, seed), n_pieces)
    cur = [{n: prm.detach().clone() for n, prm in pc.named_parameters()} for pc in pieces]
    bufs = [{n: None for n in c} for c in cur]
    for _ in range(runs):
        history = [cur]
        for t, (ks, scale) in enumerate(steps):
            grads = [{n: torch.zeros_like(v) for n, v in c.items()} for c in cur]
            for k in ks:
                used = [{n: v.clone().requires_grad_(True)
                         for n, v in history[version(q, k, t)][q].items()}
                        for q in range(n_pieces)]
                x = xs[k]
                for q in range(n_pieces):
                    x = functional_call(pieces[q], used[q], (x,))
                loss = loss_fn(x, ys[k]) * scale
                flat = [v for u in used for v in u.values()]
                for (q, n), g in zip([(q, n) for q in range(n_pieces) for n in used[q]],
                                     torch.autograd.grad(loss, flat)):
                    grads[q][n] += g
            new = []
            for q in range(n_pieces):
                step = {}
                for n, g in grads[q].items():
                    if momentum:
                        b = bufs[q][n]
                        bufs[q][n] = g.clone() if b is None else b * momentum + g
                        g = bufs[q][n]
                    step[n] = history[-1][q][n] - lr * g
                new.append(step)
            history.append(new)
        cur = history[-1]
    return cur


def check_weights(model, want, what):
    for q, module in zip(model.executor.pieces, model.modules):
        for n, prm in module.named_parameters():
            err = (prm.detach() - want[q][n]).abs().max().item()
            assert err <= TOL, "%s: rank %d piece %d %s differs by %.3g" % (what, R, q, n, err)


def check_memory(model, what):
    """Live versions and stashed activations per rank, as validate() counts them."""
    stats = validate(model.schedule)
    ex = model.executor
    assert ex.peak_stash == stats.rank_peak_stash[R], (
        "%s: rank %d stashed up to %d activations, validate says %d"
        % (what, R, ex.peak_stash, stats.rank_peak_stash[R]))
    assert ex.peak_versions == stats.rank_peak_versions[R], (
        "%s: rank %d held up to %d weight versions, validate says %d"
        % (what, R, ex.peak_versions, stats.rank_peak_versions[R]))
    assert ex.stashed == 0 and ex.live_versions == 1, (what, ex.stashed, ex.live_versions)


def run_flushed(sched, batch, runs, momentum, what):
    """Train `runs` train_steps of `sched` (flush policy) and compare with synchronous SGD."""
    pieces = sched.pieces
    model = PipelineModel(layers(pieces), schedule=sched, loss_fn=loss_fn,
                          optimizer=sgd(0.1, momentum))
    x, y = data(batch)
    xs, ys = list(torch.tensor_split(x, sched.microbatches)), \
        list(torch.tensor_split(y, sched.microbatches))
    losses = [model.train_step(x, y) for _ in range(runs)]
    m = sched.m
    steps = [(range(j * m, (j + 1) * m), 1.0 / m) for j in range(sched.batches)]
    want = reference(pieces, steps, lambda q, k, t: t, xs, ys, momentum=momentum, runs=runs)
    check_weights(model, want, what)
    check_memory(model, what)
    if model.is_last:
        assert all(v == v and v > 0 for v in losses), losses
    else:
        assert losses == [None] * runs
    return model


# --- cases ----------------------------------------------------------------------------------------

def case_gpipe_equals_synchronous_sgd():
    run_flushed(gpipe(P, 3, batches=2), 12, runs=2, momentum=0.0, what="gpipe")


def case_flush_equals_synchronous_sgd_with_momentum():
    model = run_flushed(flush(P, 5, batches=2), 20, runs=2, momentum=0.9, what="flush")
    assert model.executor.peak_versions == 1
    assert model.executor.peak_stash <= P - model.stage  # PipeDream-Flush: at most p - s


def case_interleaved_two_chunks_equals_synchronous_sgd():
    run_flushed(interleaved(P, 2 * P, 2, batches=2), 4 * P, runs=2, momentum=0.0,
                what="interleaved v=2")


def case_two_bw_uses_the_weights_of_the_step_before():
    m, batches = P + 1, 4
    sched = two_bw(P, m, batches)
    model = PipelineModel(layers(P), schedule=sched, loss_fn=loss_fn, optimizer=sgd(0.2))
    x, y = data(m * batches * 2)
    xs, ys = list(torch.tensor_split(x, m * batches)), list(torch.tensor_split(y, m * batches))
    model.train_step(x, y)
    steps = [(range(j * m, (j + 1) * m), 1.0 / m) for j in range(batches)]
    # W(t+1) = W(t) - lr grad f(W(t-1)): step t uses version max(t - 1, 0)
    want = reference(P, steps, lambda q, k, t: max(t - 1, 0), xs, ys, lr=0.2)
    check_weights(model, want, "2bw")
    # and it is not plain SGD (the delay matters)
    sync = reference(P, steps, lambda q, k, t: t, xs, ys, lr=0.2)
    diff = max((prm.detach() - sync[q][n]).abs().max().item()
               for q, mod in zip(model.executor.pieces, model.modules)
               for n, prm in mod.named_parameters())
    assert diff > 1e-6, diff
    check_memory(model, "2bw")
    assert model.executor.peak_versions <= 2
    for (q, k), (vf, vb) in model.executor.versions_used.items():
        assert vf == vb == max(k // m - 1, 0), ((q, k), vf, vb)


def case_pipedream_stashing_uses_one_version_per_microbatch():
    M = 2 * P + 1
    sched = one_f_one_b(P, M)
    model = PipelineModel(layers(P), schedule=sched, loss_fn=loss_fn, optimizer=sgd(0.1))
    x, y = data(2 * M)
    xs, ys = list(torch.tensor_split(x, M)), list(torch.tensor_split(y, M))
    model.train_step(x, y)
    used = model.executor.versions_used
    assert sorted(used) == [(R, k) for k in range(M)], sorted(used)
    for (q, k), (vf, vb) in used.items():
        # the backward used the very version its forward stashed; the forward the latest,
        # which at stage s lags p-1-s steps behind microbatch k
        assert vf == vb == max(k - (P - 1 - q), 0), ((q, k), vf, vb)
    steps = [([k], 1.0) for k in range(M)]
    want = reference(P, steps, lambda q, k, t: max(k - (P - 1 - q), 0), xs, ys)
    check_weights(model, want, "1f1b stash")
    check_memory(model, "1f1b stash")
    assert model.executor.peak_versions <= P - R
    assert model.executor.peak_stash <= P - R


def case_vertical_sync_is_sgd_with_delay_p_minus_1():
    M = 2 * P + 2
    sched = one_f_one_b(P, M, vertical_sync=True)
    model = PipelineModel(layers(P), schedule=sched, loss_fn=loss_fn, optimizer=sgd(0.1))
    x, y = data(M)
    xs, ys = list(torch.tensor_split(x, M)), list(torch.tensor_split(y, M))
    model.train_step(x, y)
    for (q, k), (vf, vb) in model.executor.versions_used.items():
        assert vf == vb == max(k - (P - 1), 0), ((q, k), vf, vb)
    steps = [([k], 1.0) for k in range(M)]
    want = reference(P, steps, lambda q, k, t: max(t - (P - 1), 0), xs, ys)
    check_weights(model, want, "1f1b vertical sync")
    check_memory(model, "1f1b vertical sync")


def _replicas():
    """Stage 0 replicated twice, the other ranks one stage each: (2,), (2, 1), (2, 1, 1)."""
    return (2,) + (1,) * (P - 2)


def case_one_f_one_b_rr_routes_microbatch_k_to_replica_k_mod_r():
    """1F1B-RR: input k on replica k mod r, forward and backward with one version; the replicas
    average their gradients at every step, so they end with equal weights (bitwise); inputs
    that would make them step unequally often are refused on every rank."""
    reps = _replicas()
    M = 8
    sched = one_f_one_b(len(reps), M, replicas=reps)
    model = PipelineModel(layers(2 * len(reps)), schedule=sched, loss_fn=loss_fn,
                          optimizer=sgd(0.05))
    x, y = data(M)
    for _ in range(2):
        loss = model.train_step(x, y)
    r = reps[model.stage]
    seen = sorted(k for _, k in model.executor.versions_used)
    assert seen == [k for k in range(M) if k % r == model.replica], (R, seen)
    for (q, k), (vf, vb) in model.executor.versions_used.items():
        assert vf == vb, ((q, k), vf, vb)
    check_memory(model, "1f1b-rr")
    assert (loss is not None) == (model.stage == len(reps) - 1)
    mine = torch.cat([prm.detach().reshape(-1) for m in model.modules for prm in m.parameters()])
    every = MPI.COMM_WORLD.allgather((model.stage, mine.numpy()))
    for stage, w in every:
        if stage == model.stage:
            assert np.array_equal(w, mine.numpy()), (R, "replicas of stage %d differ" % stage)
    if r > 1:
        start = layers(2 * len(reps))
        moved = [p for p in model.modules[0].parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(moved, start[0].parameters()))
    try:
        PipelineModel(layers(2 * len(reps)), schedule=one_f_one_b(len(reps), 7, replicas=reps),
                      loss_fn=loss_fn, optimizer=sgd(0.05))
    except ValueError as e:
        assert "step equally often" in str(e), e
    else:
        raise AssertionError("rank %d: 7 inputs over 2 replicas accepted" % R)


def case_replicated_stage_under_a_flush_equals_synchronous_sgd():
    """A hand-made schedule: 1F1B-RR's order with one step per batch (flush policy), so the
    gradients of the replicas of stage 0 are summed by an allreduce before the step."""
    reps = _replicas()
    p, m, batches = len(reps), 5, 2
    rr = one_f_one_b(p, m * batches, replicas=reps)
    acts = {}
    for rank, lst in rr.actions.items():
        passes = [a for a in lst if a.kind != "S"]
        stage = rr.placement[rank].stage
        out = []
        for j in range(batches):  # the 1F1B-RR order within each batch, then the step
            out += [a for a in passes if a.microbatch // m == j]
            out.append(Action("S", stage))
        acts[rank] = out
    sched = Schedule("rr-flush", p, m, acts, batches=batches, replicas=reps, policy="flush")
    model = PipelineModel(layers(p), schedule=sched, loss_fn=loss_fn,
                          optimizer=sgd(0.1, 0.5))
    x, y = data(3 * m * batches)
    xs = list(torch.tensor_split(x, m * batches))
    ys = list(torch.tensor_split(y, m * batches))
    for _ in range(2):
        model.train_step(x, y)
    steps = [(range(j * m, (j + 1) * m), 1.0 / m) for j in range(batches)]
    want = reference(p, steps, lambda q, k, t: t, xs, ys, momentum=0.5, runs=2)
    check_weights(model, want, "replicated flush")


def case_shapes_may_vary_per_microbatch():
    """Microbatches of different sizes (the stage outputs change shape from one to the next)."""
    sched = flush(P, 3)
    sizes = (1, 4, 2)
    x, y = data(sum(sizes))
    xs, ys = list(torch.split(x, sizes)), list(torch.split(y, sizes))
    model = PipelineModel(layers(P), schedule=sched, loss_fn=loss_fn, optimizer=sgd())
    model.train_step(xs, ys)
    want = reference(P, [(range(3), 1.0 / 3)], lambda q, k, t: t, xs, ys)
    check_weights(model, want, "varying shapes")


def _expect_failure(fn):
    try:
        fn()
    except PipelineError as e:
        return e
    raise AssertionError("rank %d: no PipelineError" % R)


def case_shape_mismatch_names_both_stages_on_every_rank():
    # stage b-1 ends with 6 features, stage b starts with a Linear(7, ...)
    for bad in sorted({1, P - 1}):
        mods = layers(P)
        mods[bad] = torch.nn.Linear(7, D_OUT if bad == P - 1 else H).double()
        model = PipelineModel(mods, schedule=flush(P, 2), loss_fn=loss_fn, optimizer=sgd())
        x, y = data(4)
        t0 = time.monotonic()
        err = _expect_failure(lambda: model.train_step(x, y))
        text = str(err)
        assert "stage %d cannot take the output of stage %d" % (bad, bad - 1) in text, text
        assert "(2, 6)" in text and "float64" in text, text
        assert time.monotonic() - t0 < 10, "the error took %.1f s to spread" % (time.monotonic()
                                                                                - t0)
        if model.stage == bad:
            assert isinstance(err, StageInputError) and err.rank == R, repr(err)
            assert "step x rank" in text and "F0!" in text, text   # the grid, failing step marked
        else:
            assert err.origin == bad, (err.origin, text)
        # unusable afterwards, with a clear message
        again = _expect_failure(lambda: model.train_step(x, y))
        assert "unusable after an earlier failure" in str(again)


def case_a_silent_peer_times_out_naming_it_and_the_action():
    """The last stage stalls in its first loss for 1.5 x MLFABRIC_TIMEOUT: the stage before times
    out waiting for the gradient, naming the peer and the action; every rank raises (the ranks
    agree on the outcome within the timeout once the stalled rank wakes)."""
    last = P - 1
    stalled = []

    def slow_loss(out, y):
        if R == last and not stalled:
            stalled.append(True)
            time.sleep(3.0)
        return loss_fn(out, y)

    model = PipelineModel(layers(P), schedule=flush(P, 2), loss_fn=slow_loss, optimizer=sgd())
    x, y = data(4)
    old = os.environ.get("MLFABRIC_TIMEOUT")
    os.environ["MLFABRIC_TIMEOUT"] = "2"
    try:
        err = _expect_failure(lambda: model.train_step(x, y))
    finally:
        os.environ["MLFABRIC_TIMEOUT"] = old if old is not None else "20"
    # whichever ranks time out first (each waits for the gradient from the next stage) name
    # that peer and the action; the others quote one of them
    errs = WORLD.allgather((isinstance(err, PipelineTimeoutError), str(err), err.origin))
    timed_out = [r for r, e in enumerate(errs) if e[0]]
    assert timed_out, errs
    for r in timed_out:
        text = errs[r][1]
        assert "rank %d (stage %d) at B0" % (r, r) in text, text
        assert "waiting for the gradient of microbatch 0 from rank %d (stage %d)" % (r + 1, r + 1) \
            in text, text
        assert "nothing came within 2 s (MLFABRIC_TIMEOUT)" in text, text
    assert err.origin in timed_out, (err.origin, timed_out)
    if R == 0:
        print("timed out: ranks %s" % timed_out, flush=True)


def case_bad_arguments_fail_on_every_rank():
    from mlfabric import MismatchError
    # a schedule for another number of ranks
    try:
        PipelineModel(layers(P + 1), schedule=flush(P + 1, 2), loss_fn=loss_fn, optimizer=sgd())
    except ValueError as e:
        assert "has %d ranks, but the communicator has %d" % (P + 1, P) in str(e), str(e)
    else:
        raise AssertionError("no error for a schedule of the wrong size")
    # ranks that build different schedules
    try:
        PipelineModel(layers(P), schedule=flush(P, 2 if R == 0 else 3), loss_fn=loss_fn,
                      optimizer=sgd())
    except MismatchError as e:
        assert "ranks disagree on the schedule: schedule flush p=%d m=2" % P in str(e), str(e)
    else:
        raise AssertionError("no error for different schedules")
    # stage 0 without its inputs: every rank hears of it
    model = PipelineModel(layers(P), schedule=flush(P, 2), loss_fn=loss_fn, optimizer=sgd())
    x, y = data(4)
    err = _expect_failure(lambda: model.train_step(None if model.is_first else x, y))
    assert "run() needs inputs as a sequence of 2 microbatches" in str(err), str(err)
    assert err.origin == 0, err.origin


def case_partition_and_schedule_by_name():
    """The cuts and the replication from a partition.Partition; the schedule by name."""
    from mlfabric.pipeline.partition import Partition, Stage
    reps = _replicas()
    part = Partition([Stage(s, s, r) for s, r in enumerate(reps)], noam=P,
                     predicted_time_per_sample=1.0, predicted_throughput=1.0)
    model = PipelineModel(layers(len(reps)), schedule="1f1b", microbatches=6, partition=part,
                          loss_fn=loss_fn, optimizer=sgd())
    assert model.schedule.replicas == reps and model.schedule.microbatches == 6
    x, y = data(12)
    loss = model.train_step(x, y)
    assert (loss is not None) == model.is_last
    # a partition that does not match the schedule is refused
    try:
        PipelineModel(layers(len(reps)), schedule=flush(P, 2), partition=part, loss_fn=loss_fn,
                      optimizer=sgd())
    except ValueError as e:
        assert "must agree" in str(e), str(e)
    else:
        raise AssertionError("no error for a partition that disagrees with the schedule")
