"""Elastic training, as horovod.torch.elastic, for ranks that die: training goes on with the
survivors.

Usage::

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                step(...)            # collectives as usual, on hvd.rank() / hvd.size()
                state.commit()       # a copy of the model, optimizer and attributes in memory
            state.batch = 0

    train(state)

Run it under ULFM: `mpirun --with-ft ulfm --mca mpi_ft_detector true -n 4 python train.py`. When
a rank dies, the survivors' next collective fails (at once over MPI, within MLFABRIC_TIMEOUT
seconds through shared memory); run() then rolls every survivor back to its last commit(),
revokes and shrinks the communicator mlfabric was initialised on to the survivors (ULFM's
MPI_Comm_revoke / MPI_Comm_shrink), re-initialises mlfabric on it (hvd.rank() and hvd.size()
change; so do the torchrun variables mlfabric exported under mpirun, RANK, WORLD_SIZE,
MASTER_ADDR, ..., never one the user set), calls the reset callbacks, makes every rank hold the
new rank 0's committed state (sync()), and calls the function again. Process sets do not
survive a reset (add them again in a reset callback).

With MLFABRIC_ELASTIC_REPLACE=N the survivors also spawn new processes in place of the dead
(up to N over the job; mlfabric/comm/respawn.py) before re-initialising: each runs the program from
its start, joins at its hvd.init() (after the survivors' ranks) and gets their state at the first
sync of its run(); the job goes on at its full size. Such a program must make no collective call
before entering run() (as Horovod's elastic programs: the first sync does the broadcasting).

Owns State / ObjectState / TorchState, ElasticSampler and run(). Differences from Horovod:
no hosts are discovered or added beyond those replacements, so there are no host updates to
check; the failure that triggers a reset is mlfabric's (PeerTimeoutError, or an error caused
by a failed or revoked MPI process), and without ULFM a reset is refused with an error saying
so (Open MPI ends the whole job when a rank dies, unless run with --with-ft ulfm); sync() first
checks that every rank's state has the same attributes and samplers (a MismatchError on every
rank otherwise, where Horovod lets the difference pass unnoticed).
"""
import copy
import functools
import os
import sys

import torch
from mpi4py import MPI

from ..comm import context as _context
from .._core import exit_guard
from ..comm import launch, respawn
from ..errors import MismatchError, MlfabricError, PeerTimeoutError

_FAILED = {MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED}

# Horovod's names, for elastic code written against horovod.common.exceptions:
# HorovodInternalError is what a collective raises when a peer failed; mlfabric's own such error
# is PeerTimeoutError (a dead or stuck peer; is_failure below also counts MPI's process-failed
# errors, which ULFM raises as mpi4py's MPI.Exception). An alias, so `except
# hvd.HorovodInternalError` catches it and the name needs no translating.
HorovodInternalError = PeerTimeoutError


class HostsUpdatedInterrupt(MlfabricError):
    """Horovod's interrupt for hosts added or removed while training. mlfabric discovers no
    hosts, so it never raises this; it exists so that Horovod elastic code that names it
    imports and runs. skip_sync: Horovod's flag (whether the reset may skip state.sync())."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


def is_failure(exc):
    """True when exc (or an error it was raised from) says a peer died or the communicator was
    revoked: what run() recovers from. Mismatches and bad arguments are not failures."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PeerTimeoutError):
            return True
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in _FAILED:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class State:
    """What run() rolls back, shares and resets. Subclasses define save / restore / sync."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions (no arguments) run after every reset, before sync(): e.g. to scale the
        learning rate to the new hvd.size()."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Keep a copy of the state (in memory) to roll back to if a rank dies."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Horovod's hook for added hosts: none can be added here."""

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def _layout(self):
        """What sync() needs alike on every rank, besides the values it sends (see _same_layout)."""
        return {"class": type(self).__name__}


def _same_layout(state):
    """A MismatchError on every rank, before sync() moves anything, when the ranks' states differ
    in layout: otherwise a rank's attribute rank 0 lacks would silently never be synced, and
    samplers with different datasets or seeds would split the indices wrongly (each rank
    draws its own order), with no error anywhere."""
    from .functions import allgather_object
    every = allgather_object(state._layout(), name="elastic.layout")
    odd = [r for r, layout in enumerate(every) if layout != every[0]]
    if odd:
        raise MismatchError(f"elastic: rank(s) {odd} hold a state unlike rank 0's (the class, its "
                            f"attributes, and its samplers' dataset size, shuffle and seed must be "
                            f"the same on every rank): rank 0 {every[0]}, "
                            + ", ".join(f"rank {r} {every[r]}" for r in odd))


class ObjectState(State):
    """Attributes given as keyword arguments (state.epoch, state.batch, ...): committed as deep
    copies, synced from rank 0 by broadcast_object."""

    def __init__(self, **kwargs):
        super().__init__()
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved = None
        ObjectState.save(self)

    def save(self):
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}

    def restore(self):
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def _layout(self):
        return dict(super()._layout(), attributes=sorted(self._names))

    def sync(self):
        _same_layout(self)
        self._sync_attributes()

    def _sync_attributes(self):
        from .functions import broadcast_object
        self._saved = broadcast_object(self._saved, root_rank=0, name="elastic.state")
        ObjectState.restore(self)


class TorchState(ObjectState):
    """A model's and an optimizer's state (each optional), ElasticSamplers and any other
    attributes, all passed by keyword: the model and optimizer committed as deep copies of their
    state_dict()s and synced by broadcast_parameters / broadcast_optimizer_state from rank 0; a
    sampler committed as its state_dict() and synced to the union of every rank's processed
    samples (see ElasticSampler); the others as ObjectState's."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        self._torch_saved = {}
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._samplers})
        self._save_torch()

    def _save_torch(self):
        held = {"model": self.model, "optimizer": self.optimizer, **self._samplers}
        self._torch_saved = {name: copy.deepcopy(obj.state_dict())
                             for name, obj in held.items() if obj is not None}

    def save(self):
        self._save_torch()
        super().save()

    def restore(self):
        for name, saved in self._torch_saved.items():
            getattr(self, name).load_state_dict(copy.deepcopy(saved))
        super().restore()

    def _layout(self):
        samplers = {name: {"dataset size": len(s.dataset), "shuffle": bool(s.shuffle),
                           "seed": s.seed} for name, s in self._samplers.items()}
        return dict(super()._layout(), model=self.model is not None,
                    optimizer=self.optimizer is not None, samplers=samplers)

    def sync(self):
        from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                broadcast_parameters)
        _same_layout(self)
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for name, sampler in self._samplers.items():
            done = set().union(*allgather_object(sampler.processed_indices,
                                                 name=f"elastic.{name}"))
            mine = broadcast_object(dict(sampler.state_dict(), processed_indices=done),
                                    root_rank=0, name=f"elastic.{name}")
            sampler.load_state_dict(mine)
        self._sync_attributes()
        self._save_torch()  # what every rank now holds is the commit to roll back to


class ElasticSampler(torch.utils.data.Sampler):
    """A sampler splitting a dataset's indices over the ranks that are there now: Horovod's
    hvd.elastic.ElasticSampler. Each epoch it takes the indices not yet processed in it
    (shuffled by seed + epoch when shuffle), pads them by repeating the first few to a multiple
    of size(), and gives this rank every size()-th one from its rank on. record_batch(i, n)
    marks the i-th batch of n processed, of every rank's indices (the ranks step together: a
    dead rank's batches before the last commit are in the committed model, so they are not
    redone; Horovod's records this rank's only, and a reset redoes the dead rank's); in a
    TorchState a reset then re-splits what no rank had processed at the last commit over the
    survivors. Call set_epoch(e + 1) at the end of epoch e (it forgets the processed
    indices)."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices = set()
        self.indices = []
        self.reset()

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Mark every rank's batch_idx-th batch of batch_size indices processed (since the last
        reset): in the padded order the ranks' batches of one step are one run."""
        step = self.num_replicas
        start = batch_idx * batch_size * step
        self.record_indices(self._order[start:min(start + batch_size * step, self.total_size)])

    def record_indices(self, indices):
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx, batch_size):
        """This rank's indices of its batch_idx-th batch of batch_size (since the last reset)."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self):
        """Re-split the indices not yet processed over the ranks there now."""
        from . import rank, size
        self.rank, self.num_replicas = rank(), size()
        self.remaining_indices = [i for i in range(len(self.dataset))
                                  if i not in self.processed_indices]
        self.num_samples = -(-len(self.remaining_indices) // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._mine()

    def _mine(self):
        order = list(self.remaining_indices)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
        if order:
            while len(order) < self.total_size:  # pad, as torch's DistributedSampler
                order += order[:self.total_size - len(order)]
        self._order = order  # every rank's, interleaved (record_batch)
        return order[self.rank:self.total_size:self.num_replicas]

    def __iter__(self):
        self.indices = self._mine()
        return iter(self.indices)

    def __len__(self):
        return self.num_samples


def run(func):
    """Decorate a training function func(state, ...): it runs after state.sync(); when a rank
    dies inside it, the survivors restore the last commit, shrink to themselves, re-initialise,
    run the reset callbacks, sync, and call func again. Returns func's result once every rank
    has returned from it (a barrier). A live rank slower than MLFABRIC_TIMEOUT looks dead to the
    others: they reset, it fails its next call and resets with them, and all go on (at the same
    size, from the last commit). An error that is not a failure leaves run() on the rank that
    raised it; its peers get a MismatchError naming that rank from their next call (and leave
    too), not a reset."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        from . import dispatch, ops
        if not all(callable(getattr(state, m, None)) for m in ("sync", "restore", "on_reset")):
            # The others are in sync()'s first collective: they hear of it there, at once,
            # instead of timing out and taking this live rank for a dead one (a reset).
            dispatch.reject_call(None, "elastic.run", False)
            raise TypeError(f"elastic.run: state must be an elastic State (TorchState, "
                            f"ObjectState...), got {type(state).__name__}")
        while True:
            try:
                state.sync()
                respawn.joining = False  # a replacement now holds the others' state
                result = func(state, *args, **kwargs)
                # Done only when every rank is: a rank whose last call failed (a peer slower
                # than MLFABRIC_TIMEOUT looks dead too) is shrinking, and would wait forever for
                # one that had returned; this barrier fails there too and brings it along.
                ops.barrier()
                return result
            except Exception as exc:  # noqa: BLE001 - only failures are handled, see below
                if not is_failure(exc):
                    if not _peers_told(exc):
                        # An error of this rank alone (a bug in func, a local refusal): the
                        # peers, in their next call, hear of it at once (a MismatchError
                        # naming this rank) instead of timing out, taking this live rank for
                        # dead and waiting forever to shrink with it.
                        try:
                            dispatch.reject_call(None, "elastic.run", False)
                        except Exception:  # noqa: BLE001 - none to tell (not initialised...)
                            pass
                    raise
                state.restore()
                _shrink_and_reinit(exc)
                state.on_reset()
    return wrapper


def _peers_told(exc):
    """Whether every rank already knows of exc: an error of a call's control round over every
    rank (control.agree and control.reject mark it with the state whose ranks took part: a process
    set's leaves the others unaware), or another mismatch (the object helpers', over every
    rank)."""
    from . import dispatch
    told = getattr(exc, "_mlf_peers_told", None)
    if told is not None:
        return told is dispatch.state()
    return isinstance(exc, MismatchError)


def _ulfm_enabled():
    """Whether this job can revoke and shrink communicators: under Open MPI, when mpirun was
    given --with-ft ulfm (it sets OMPI_MCA_mpi_ft_enable); other MPIs are trusted to."""
    if "Open MPI" not in MPI.Get_library_version():
        return True
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on")


def _shrink_and_reinit(cause):
    """Revoke mlfabric's communicator and the user's, shrink the latter to the ranks alive,
    and initialise mlfabric on that. Collective over the survivors (each gets here when its own
    call fails: ULFM's shrink waits for all of them)."""
    from . import dispatch, init, shutdown
    exit_guard.peer_failed()  # Open MPI's finalize may now wait on the dead forever
    ctx = _context.get()
    user = ctx.user_comm
    if not _ulfm_enabled():  # Open MPI's shrink would wait forever without it
        raise MlfabricError(
            "elastic: a peer failed, and recovering needs ULFM, which this job was not started "
            "with: run it as mpirun --with-ft ulfm --mca mpi_ft_detector true ...") from cause
    try:
        ctx.comm.Revoke()  # a survivor still inside a call on it leaves it at once
        # and a live rank that left run() for good, waiting in its exit's agreement round on
        # this one, leaves that round (its process then ends, and the shrink below with it)
        ctx.exit_comm.Revoke()
        user.Revoke()
        survivors = user.Shrink()
    except (MPI.Exception, NotImplementedError, AttributeError) as exc:
        raise MlfabricError(
            "elastic: a peer failed and the survivors cannot shrink the communicator to "
            f"themselves ({exc}); run under ULFM: mpirun --with-ft ulfm --mca mpi_ft_detector "
            "true ...") from cause
    # so their close frees nothing collectively: the dead would not join (process sets too)
    ctx.abandoned = True
    for _, sub in dispatch.state().sets.values():
        if sub is not None:
            sub.ctx.abandoned = True
    shutdown()
    init(_replaced(survivors, user.size - survivors.size))
    launch.refresh_torch_env(_context.get())  # a replacement does the same in its init()


_JOINED = []  # a replacement's merge whose torchrun variables were set (one a process)


def joined():
    """In a replacement process, right after the init() that merged it with the survivors (the
    point where they are in _shrink_and_reinit, after theirs): its torchrun variables, as the
    survivors refresh theirs. Collective with them, once (a later init on the same merged
    communicator is no world change the survivors take part in)."""
    if not _JOINED:
        _JOINED.append(True)
        launch.refresh_torch_env(_context.get(), joined=True)


def _replaced(survivors, lost):
    """survivors merged with replacements for the `lost` ranks (MLFABRIC_ELASTIC_REPLACE,
    respawn.py), or survivors alone when none are spawned: replacing is off or used up, or MPI
    cannot start them (said on stderr; the job goes on smaller)."""
    try:
        merged = respawn.spawn(survivors, lost)
    except MlfabricError as exc:
        if survivors.rank == 0:
            print(f"mlfabric elastic: could not spawn {lost} replacement(s) ({exc}); going on "
                  f"with {survivors.size} rank(s)", file=sys.stderr, flush=True)
        return survivors
    return survivors if merged is None else merged
