"""mlfabric.torch.elastic (Horovod's hvd.elastic).

case_* (run by tests/mpi_cases/runner.py, no failure): commit / restore / sync of TorchState and
ObjectState, run() with nothing failing, which errors count as failures.

As a script (python -m tests.mpi_cases.torch_elastic_cases VICTIM STEPS KILL_AT EVERY, under mpirun
--with-ft ulfm): DistributedOptimizer training inside hvd.elastic.run, committing after every
EVERY steps; the rank VICTIM (of MPI.COMM_WORLD) SIGKILLs itself at the start of step KILL_AT.
The survivors roll back to the last commit (the steps after it are redone without the victim)
and must finish with the weights of one process training in float64 on the concatenated
batches (every rank's up to the commit, the survivors' after it), to 1e-10; the reset callback
must have run once, with the new size, and torchrun's variables must follow the new world (those
mlfabric exported; the user's as they were). Each survivor prints 'RESULT ok' or 'RESULT FAIL
...'."""
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mlfabric.torch as hvd
from mlfabric.errors import MismatchError, PeerTimeoutError
from mlfabric.torch import elastic


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()


def _model(seed=5):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).double()


def _batch(step, slot):
    """The rows slot `slot` trains on at `step` (the same whoever holds that slot)."""
    rng = np.random.default_rng(step * 101 + slot)
    return torch.from_numpy(rng.normal(0, 1, (6, 4))), torch.from_numpy(rng.normal(0, 1, (6, 1)))


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


# --- without failures -------------------------------------------------------------------------

def case_torch_state_commit_restore_sync():
    r = hvd.rank()
    model = _model(seed=r)  # different on every rank until sync
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.TorchState(model, opt, epoch=r, seen=[r])
    state.sync()  # rank 0's model, optimizer and attributes everywhere
    ref = _model(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert state.epoch == 0 and state.seen == [0]
    x, y = _batch(0, 0)
    _loss(model, x, y).backward()
    opt.step()
    state.epoch, state.seen = 7, state.seen + [1]
    state.commit()
    kept = [p.detach().clone() for p in model.parameters()]
    kept_momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    opt.zero_grad()
    _loss(model, x, y).backward()
    opt.step()
    state.epoch = 9
    state.seen.append(2)  # a deep copy was committed: this does not reach it
    state.restore()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), kept))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m)
               for p, m in zip(model.parameters(), kept_momentum))
    assert state.epoch == 7 and state.seen == [0, 1]


def case_run_without_failure_syncs_then_runs_once():
    r = hvd.rank()
    state = elastic.ObjectState(value=r * 10)
    calls = []
    state.register_reset_callbacks([lambda: calls.append("reset")])

    @elastic.run
    def work(state, extra):
        calls.append(state.value)
        return state.value + extra

    assert work(state, 1) == 1
    assert calls == [0]  # synced from rank 0, called once, no reset


def case_only_peer_failures_trigger_a_reset():
    assert elastic.is_failure(PeerTimeoutError("x"))
    try:
        try:
            raise PeerTimeoutError("inner")
        except PeerTimeoutError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as outer:
        assert elastic.is_failure(outer)
    assert not elastic.is_failure(MismatchError("shapes differ"))
    assert not elastic.is_failure(ValueError("bad argument"))
    state = elastic.ObjectState(x=1)

    @elastic.run
    def bad(state):
        raise ValueError("a bug, not a failure")

    with pytest.raises(ValueError, match="a bug"):
        bad(state)


def case_an_error_of_one_rank_is_an_error_everywhere_not_a_reset():
    """A bug on one rank inside run() (not a failure) leaves run() there with its own error;
    the others get a MismatchError naming that rank from their next call, not a
    PeerTimeoutError that would take the live rank for dead and wait for it in a shrink; the
    ranks stay in step."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while state.step < 4:
            if r == n - 1 and state.step == 2:
                raise ValueError("a bug on the last rank")
            hvd.allreduce(torch.ones(1), name="step")
            state.step += 1
            state.commit()

    if r == n - 1:
        with pytest.raises(ValueError, match="a bug on the last rank"):
            train(state)
    else:
        with pytest.raises(hvd.MismatchError, match=rf"rank\(s\) \[{n - 1}\] rejected"):
            train(state)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n] * 2
    if n < 3:
        return
    # A bad argument to a process set's call: its ranks hear of it there (a MismatchError),
    # the ranks outside it from their next global call, all at once
    pair = hvd.add_process_set([0, 1])
    state = elastic.ObjectState(step=0)

    @elastic.run
    def in_a_set(state):
        while state.step < 3:
            if state.step == 1 and r in (0, 1):
                hvd.allreduce(torch.ones(2) if r == 1 else "not a tensor", process_set=pair)
            hvd.allreduce(torch.ones(1), name="step")
            state.step += 1
            state.commit()

    want = {0: (TypeError, "must be a torch.Tensor"),
            1: (hvd.MismatchError, r"rank\(s\) \[0\] rejected")}.get(
        r, (hvd.MismatchError, r"rank\(s\) \[0, 1\] rejected"))
    with pytest.raises(want[0], match=want[1]):
        in_a_set(state)
    assert hvd.remove_process_set(pair) is True
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n] * 2


def case_without_ulfm_a_failure_is_a_clear_error():
    """This job runs without --with-ft ulfm: recovering is refused at once (Open MPI's shrink
    would wait forever), saying how to run, and mlfabric is left as it was."""
    with pytest.raises(hvd.MlfabricError, match="--with-ft ulfm") as info:
        elastic._shrink_and_reinit(PeerTimeoutError("a peer died"))
    assert isinstance(info.value.__cause__, PeerTimeoutError)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


def case_elastic_sampler_splits_and_resplits():
    """Every index once per epoch over the ranks (padded to equal shares); after some are
    recorded, a TorchState sync re-splits the rest over the ranks, none processed again;
    set_epoch forgets what was processed; commit / restore roll the record back."""
    n = hvd.size()
    sampler = elastic.ElasticSampler(range(11), shuffle=True, seed=4)
    mine = list(sampler)
    assert len(mine) == len(sampler) == -(-11 // n)
    shares = hvd.allgather_object(mine)
    assert set().union(*map(set, shares)) == set(range(11))
    assert sum(map(len, shares)) == len(sampler) * n
    state = elastic.TorchState(sampler=sampler, epoch=0)
    sampler.record_batch(0, 2)
    # every rank's first batch, recorded on each (a dead rank's would not be redone)
    assert sampler.processed_indices == {i for share in shares for i in share[:2]}
    done = set().union(*map(set, hvd.allgather_object(sorted(sampler.processed_indices))))
    state.sync()  # the union of every rank's processed indices, then re-split
    assert sampler.processed_indices == done
    rest = hvd.allgather_object(list(sampler))
    assert set().union(*map(set, rest)) == set(range(11)) - done
    state.commit()
    sampler.record_batch(0, 1)
    state.restore()
    assert sampler.processed_indices == done
    sampler.set_epoch(1)
    assert sampler.processed_indices == set() and len(list(sampler)) == -(-11 // n)


# --- a rank killed mid-training (script) --------------------------------------------------------

TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")


def _users_torch_env():
    """torchrun's variables set before mlfabric's init: the user's."""
    return {n: os.environ[n] for n in TORCH_VARS if n in os.environ}


def _torch_env_problems(user):
    """What is wrong with torchrun's variables now (after a reset): each one mlfabric exported
    holds the present world's value (MASTER_ADDR / MASTER_PORT: one store, the same on every
    rank), each of the user's its own. Collective."""
    now = {n: os.environ.get(n) for n in TORCH_VARS}
    want = {"RANK": hvd.rank(), "LOCAL_RANK": hvd.local_rank(), "WORLD_SIZE": hvd.size(),
            "LOCAL_WORLD_SIZE": hvd.local_size()}
    problems = [f"{n}={now[n]!r}, the user's was {v!r}" for n, v in user.items() if now[n] != v]
    problems += [f"{n}={now[n]!r}, not {v}" for n, v in want.items()
                 if n not in user and now[n] != str(v)]
    stores = hvd.allgather_object((now["MASTER_ADDR"], now["MASTER_PORT"]))
    if len(set(stores)) != 1 or None in stores[0]:
        problems.append(f"MASTER_ADDR / MASTER_PORT of the ranks: {stores}")
    return problems


def _reference(world, steps, rollback):
    """The weights one process gets from the same steps on the concatenated batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        slots = world if s < rollback else world - 1
        xs, ys = zip(*(_batch(s, j) for j in range(slots)))
        opt.zero_grad()
        _loss(model, torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _elastic_training(steps, every, at_step):
    """The training the scripts below run: DistributedOptimizer steps on each rank's slot's
    batch inside elastic.run, a commit every `every` steps, at_step(step, resets) at the start
    of each step (where a victim dies). Returns (the model, train() -> the size at the end, the
    sizes the reset callback saw)."""
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = elastic.TorchState(model, opt, step=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @elastic.run
    def train(state):
        while state.step < steps:
            at_step(state.step, resets)
            x, y = _batch(state.step, hvd.rank())
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
            state.step += 1
            if state.step % every == 0:
                state.commit()
        return hvd.size()
    return model, lambda: train(state), resets


def main(victim, steps, kill_at, every, slow=False):
    """slow: the victim does not die but sleeps 2 x MLFABRIC_TIMEOUT: it looks dead to the
    others, who reset; it fails its next call and joins them; nobody is lost. (ULFM's own
    detector would declare it dead after mpi_ft_detector_timeout, 10 s, without MPI calls.)"""
    torch.set_num_threads(1)
    user = _users_torch_env()
    hvd.init()
    me, world = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size

    def at_step(step, resets):
        if me == victim and step == kill_at and not resets:
            if slow:
                time.sleep(2 * float(os.environ["MLFABRIC_TIMEOUT"]))
            else:
                os.kill(os.getpid(), signal.SIGKILL)
    model, train, resets = _elastic_training(steps, every, at_step)
    try:
        size = train()
        left = world if slow else world - 1
        # rolled back to the last commit; after it, `left` ranks' batches
        want = _reference(world, steps, steps if slow else kill_at // every * every)
        diff = max((p.detach() - q).abs().max().item() for p, q in zip(model.parameters(), want))
        problems = []
        # (a live rank that looked dead under load adds a reset at the same size: allowed)
        if size != left or not resets or set(resets) != {left}:
            problems.append(f"size {size}, resets {resets} (expected [{left}])")
        if diff > 1e-10:
            problems.append(f"weights differ from the reference by {diff:.3g}")
        problems += _torch_env_problems(user)
        print(f"RESULT {'FAIL ' + '; '.join(problems) if problems else 'ok'} (rank {me})",
              flush=True)
    except Exception as exc:  # noqa: BLE001 - reported, the test reads it
        print(f"RESULT FAIL rank {me}: {type(exc).__name__}: {exc}", flush=True)


def main_sampler(victim, kill_at, every, samples=40, batch=2):
    """An epoch over an ElasticSampler, one allreduce a batch, a commit every `every` batches:
    the survivors' processed samples must cover the dataset (the victim's share since the last
    commit re-split over them)."""
    hvd.init()
    me = MPI.COMM_WORLD.rank
    state = elastic.TorchState(sampler=elastic.ElasticSampler(range(samples), seed=3), done=0)

    @elastic.run
    def epoch(state):
        for b in range(-(-len(state.sampler) // batch)):
            if me == victim and state.done == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            hvd.allreduce(torch.ones(1), op=hvd.Sum)
            state.sampler.record_batch(b, batch)
            state.done += 1
            if state.done % every == 0:
                state.commit()
        return hvd.allgather_object(sorted(state.sampler.processed_indices))

    try:
        covered = set().union(*epoch(state))
        missing = sorted(set(range(samples)) - covered)
        print(f"RESULT {'FAIL missing samples ' + str(missing) if missing else 'ok'} (rank {me})",
              flush=True)
    except Exception as exc:  # noqa: BLE001 - reported, the test reads it
        print(f"RESULT FAIL rank {me}: {type(exc).__name__}: {exc}", flush=True)


def main_replace(victim, steps, kill_at, every):
    """With MLFABRIC_ELASTIC_REPLACE set: the victim dies at step kill_at; the survivors spawn a
    replacement (this same script, started over), which joins them at its hvd.init() and takes
    their state at its first sync; training goes on at the full size, so the weights must be
    those of training that never lost a rank (the steps since the last commit are redone with
    every slot's batch). Every process, the replacement too, prints its RESULT."""
    from mlfabric.comm import respawn
    torch.set_num_threads(1)
    user = _users_torch_env()
    hvd.init()
    replacement = respawn.joining
    me, world = hvd.rank(), hvd.size()

    def at_step(step, resets):
        if me == victim and not replacement and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    model, train, resets = _elastic_training(steps, every, at_step)
    who = f"{'replacement' if replacement else 'rank'} {me}"
    try:
        size = train()
        want = _reference(world, steps, steps)  # as if no rank had died
        diff = max((p.detach() - q).abs().max().item() for p, q in zip(model.parameters(), want))
        problems = []
        if size != world:
            problems.append(f"size {size} at the end, {world} expected")
        if resets != ([] if replacement else [world]):
            problems.append(f"resets {resets}")
        if diff > 1e-10:
            problems.append(f"weights differ from the reference by {diff:.3g}")
        problems += _torch_env_problems(user)
        print(f"RESULT {'FAIL ' + '; '.join(problems) if problems else 'ok'} ({who})",
              flush=True)
    except Exception as exc:  # noqa: BLE001 - reported, the test reads it
        print(f"RESULT FAIL {who}: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "sampler":
        main_sampler(*(int(a) for a in sys.argv[2:5]))
    elif sys.argv[1] == "replace":
        main_replace(*(int(a) for a in sys.argv[2:6]))
    else:
        main(*(int(a) for a in sys.argv[1:5]), slow=sys.argv[5:] == ["slow"])
