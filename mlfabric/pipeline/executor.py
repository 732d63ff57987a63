"""Runs one rank's part of a pipeline schedule (mlfabric.pipeline.schedules) on PyTorch modules
over MPI. Owns: the activations and gradients that move between stages, the weight versions each
pass uses, the activations stashed between a forward and its backward, the optimizer step (with an
allreduce among a replicated stage's replicas), and turning a failure anywhere into an error on
every rank. It never decides an order: the schedule is the plan, this module only walks it.

Per action of this rank, in its list's order (piece q = chunk * p + stage, microbatch k):
  F  take microbatch k's input (piece 0) or receive the activation of (q-1, k) from the rank that
     ran it; run the piece with the weight version the policy gives; stash what the backward
     needs; send the output to the rank of (q+1, k), or compute the loss (last piece).
  B  receive the gradient of (q, k)'s output from the rank of (q+1, k), or start from the loss;
     backward through the stashed graph; add the weight gradients into the master gradients;
     send the input gradient to the rank of (q-1, k).
  S  the optimizer step of every piece on this rank; on a replicated stage the gradients are
     first combined over the stage's replicas (comm.algorithms.allreduce on their own
     communicator): summed under "flush" and "2bw" (each is already 1/m of its batch's), averaged
     under "stash" (1F1B-RR: replica j's i-th step takes the mean of the replicas' i-th
     microbatch gradients, so the replicas keep equal weights, as data-parallel replicas of a
     PipeDream stage do; the replicas must then run equally many steps).

Messages: each tensor is preceded by a small header (run, kind, piece, microbatch, weight
version, dtype, shape) and both go under a tag derived from (kind, piece, microbatch), so no
tensor is matched to the wrong pass and a stage's output may change shape from one microbatch to
the next (variable sequence lengths, a short last microbatch): the receiver allocates from the
header, it does not need to know the shape in advance (torch.distributed.pipelining asks for it
up front, a common complaint). Tensors are CPU tensors of any dtype.

Sends are non-blocking (MPI Isend, completed later), so a rank never sits in a send while its
peer waits for another message: the schedules interleave F and B across ranks in orders that a
blocking send could deadlock. Every wait is comm/wait.py's, bounded by MLFABRIC_TIMEOUT seconds,
and raises PipelineTimeoutError naming the peer and the action.

Weight versions (the policies of schedules.py; version n = this rank's weights after n steps of
the current run, n = 0 at the start of each run()). The module's own parameters are the master
copy, always at the latest version. A pass runs through torch.func.functional_call with either
those parameters (when no step comes between the version's first and last use on this rank, as
under "flush": no copy at all) or a detached copy taken before the step that would change them.
Backward yields gradients for the tensors the forward used; they are added into the master
parameters' .grad. A copy is dropped when no pass of this rank will use it again. So:
  flush     one version;
  2bw       microbatch k uses version max(k // m - 1, 0): at most two;
  stash     a forward uses the latest version and its backward the same copy (PipeDream's weight
            stashing): up to p - s versions at stage s;
  vertical  every stage uses the version stage 0 had when microbatch k entered the pipeline; the
            tag travels in the activation header and is checked against the plan.
The gradient of one microbatch is scaled by 1/m under flush and 2bw (a batch is m microbatches:
the loss is the mean of the microbatch losses) and by 1 under stash and vertical (every
microbatch is its own batch).

Failures: an error in an action is raised with the schedule's step x rank grid (validate.py's
renderer) with the failing step marked. The failing rank sends its message to every other rank
(they watch for it in every wait) and then all ranks agree on the outcome, so every rank raises:
the failing one its own error, the others a PipelineError quoting it. A stage whose forward
rejects the previous stage's output (a shape mismatch) raises StageInputError naming both stages
and the shape. After a failure the executor is unusable (messages of the failed run may still be
in flight).

A dead peer (Open MPI under --with-ft ulfm, whose failure detector tells every survivor: a
request with the dead process fails, and so does the receive of failure reports, which listens
to any source) ends the run on each survivor with StageDiedError naming the dead rank and stage
and what this rank was doing; the survivors skip the agreement (the dead cannot take part).
Without ULFM, mpirun ends the whole job when a process dies.

Construction compares, in one small bounded allgather of digests, the schedule and whatever the
caller adds (PipelineModel: the layer count, the cuts, each layer's class and parameter shapes);
ranks that differ raise MismatchError on every rank, naming what differs and who passed what.
"""
import functools
import json
import zlib

import numpy as np
import torch
from mpi4py import MPI
from torch.func import functional_call

from .._core import config as _config, dtypes as _dtypes
from ..comm import algorithms, p2p, wait as bounded
from ..errors import MismatchError, MlfabricError, PeerTimeoutError
from .validate import grid, lockstep, validate, weight_versions
from .schedules import Schedule

# Tensor dtypes a header can name (the index is the code on the wire).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}

ACTIVATION, GRADIENT = 0, 1
_KIND_NAME = ("activation", "gradient")
_MAGIC = 0x706970  # "pip": a header that does not start with it is not ours
_MAX_DIMS = 8
_HEADER_WORDS = 8 + _MAX_DIMS  # magic, run, kind, piece, microbatch, version, dtype, ndim, shape
_ABORT_TAG = 0                  # a failing rank's message to the others
_ABORT_BYTES = 1 << 16
_TAG_LIMIT = 1 << 30            # data tags stay below this (MPI_TAG_UB is at least 32767)

_CHECK_S = 20e-3  # a collective's wait asks MPI for dead peers this often

_SCALE_BY_M = {"flush": True, "2bw": True, "stash": False, "vertical": False}


class PipelineError(MlfabricError):
    """A pipeline run failed. On the rank where it happened the message names the rank, the
    action and its position and shows the schedule's step x rank grid with the failing step
    marked; on every other rank `origin` is the failing rank and the message quotes its error.
    `rank`, `action` (an Action or None) and `position` locate the failure on this rank."""

    def __init__(self, message, rank=None, action=None, position=None, origin=None):
        super().__init__(message)
        self.rank, self.action, self.position = rank, action, position
        self.origin = rank if origin is None else origin


class StageInputError(PipelineError):
    """A stage's forward failed on the output of the previous stage (typically a shape mismatch
    at a boundary): names both stages and the shape and dtype that arrived."""


class PipelineTimeoutError(PipelineError, PeerTimeoutError):
    """A peer did not send what an action waits for within MLFABRIC_TIMEOUT seconds."""


class StageDiedError(PipelineTimeoutError):
    """A peer's process died (MPI reported it failed: Open MPI run with --with-ft ulfm, whose
    failure detector tells every survivor). Raised on each surviving rank, naming the dead
    rank(s) and their stages (`dead`, ranks of the pipeline's communicator; `origin` is the
    first) and what this rank was doing. A PipelineTimeoutError: the dead peer will never send
    what is awaited, so code that handles a silent peer handles a dead one. The survivors do not
    agree on an outcome (the dead cannot take part), and the pipeline is unusable afterwards."""

    def __init__(self, message, dead=(), rank=None, action=None, position=None, origin=None):
        dead = sorted(dead)
        super().__init__(message, rank=rank, action=action, position=position,
                         origin=dead[0] if origin is None and dead else origin)
        self.dead = dead


# MPI error classes that mean a peer process died (ULFM)
_FAILED_CLASSES = tuple(getattr(MPI, name) for name in (
    "ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED") if hasattr(MPI, name))
_AGREE_WORDS = 8  # the construction check's digest: field count, then one crc32 per field


class _PeerAborted(Exception):
    """Another rank reported a failure while this one was waiting."""

    def __init__(self, source, text):
        super().__init__(text)
        self.source, self.text = source, text


class PipelineExecutor:
    """Runs this rank's action list of `schedule` (a Schedule; validated here, so a schedule that
    cannot run is refused with validate's ScheduleError before any message moves).

    modules: the v modules of this rank, in chunk order (chunk c is model piece c * p + stage);
        each takes one tensor and returns one tensor (the last piece returns what loss_fn takes).
    loss_fn(output, target) -> scalar tensor, used at the last piece.
    optimizer: a torch optimizer over the trainable parameters of `modules` (None if they have
        none). The executor calls step() and zero_grad(); it owns the gradients.
    comm: an mpi4py intracommunicator with one rank per schedule rank (default COMM_WORLD); the
        executor works on private duplicates of it. Construction is collective over comm: it
        checks that every rank passed the same schedule (and whatever agree_on names) and gives
        replicas of a stage replica 0's weights.
    agree_on: more (name, value, item) triples every rank must pass alike (PipelineModel gives
        the layer count, the cuts and each layer's signature); value is JSON-able (compared by
        its JSON text); item names a list value's elements, so a mismatch shows the first element
        that differs ("layer 3: ..."), or is None (the whole value is shown). Ranks that differ
        raise MismatchError on every rank, naming what differs and which ranks passed what.

    Counters for tests and benchmarks: live_versions / stashed (now), peak_versions /
    peak_stash (the maxima since construction, per rank, as validate() counts them),
    versions_used ({(piece, microbatch): (version of F, version of B)} of the last run) and
    steps (optimizer steps since construction)."""

    def __init__(self, schedule, modules, loss_fn, optimizer=None, comm=None, *, agree_on=()):
        if not isinstance(schedule, Schedule):
            raise ValueError("schedule must be a mlfabric.pipeline.Schedule, got %r"
                             % (type(schedule).__name__,))
        stats = validate(schedule)  # ScheduleError on every rank alike
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise ValueError("comm must be an mpi4py intracommunicator, got %r" % (comm,))
        if comm.Get_size() != schedule.ranks:
            raise ValueError("schedule %s has %d ranks, but the communicator has %d: run it with "
                             "mpirun -n %d" % (schedule.name, schedule.ranks, comm.Get_size(),
                                               schedule.ranks))
        modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
        if len(modules) != schedule.v or not all(isinstance(m, torch.nn.Module)
                                                 for m in modules):
            raise ValueError("modules must be this rank's %d torch modules (one per chunk), got "
                             "%r" % (schedule.v, [type(m).__name__ for m in modules]))
        if not callable(loss_fn):
            raise ValueError("loss_fn must be callable (output, target) -> scalar tensor")
        if optimizer is not None and not callable(getattr(optimizer, "step", None)):
            raise ValueError("optimizer must be a torch optimizer (or None), got %r"
                             % (type(optimizer).__name__,))
        for m in modules:
            for name, prm in m.named_parameters():
                if prm.device.type != "cpu":
                    raise ValueError("parameter %s is on %s: the pipeline executor moves CPU "
                                     "tensors only" % (name, prm.device))

        self.schedule, self.stats = schedule, stats
        self.rank = comm.Get_rank()
        self.stage = schedule.placement[self.rank].stage
        self.replica = schedule.placement[self.rank].replica
        self.modules, self.loss_fn, self.optimizer = modules, loss_fn, optimizer
        self.pieces = schedule.pieces_of(self.rank)
        self.last_piece = schedule.pieces - 1
        self.scale_by_m = _SCALE_BY_M[schedule.policy]
        # master parameters per piece: name -> the module's own trainable Parameter
        self._master = {q: {n: prm for n, prm in modules[i].named_parameters()
                            if prm.requires_grad}
                        for i, q in enumerate(self.pieces)}
        self._plan()
        self._check_replica_steps(schedule)

        who = "PipelineExecutor on " + schedule.rank_label(self.rank)
        req = comm.Ibarrier()  # bounded: a rank that never constructs is an error, not a hang
        p2p.wait([req], p2p.others(comm), who + ": waiting for every rank to start")
        self._comm = comm.Dup()
        self._agree_at_start(who, schedule, agree_on)
        self._replica_comm = self._comm.Split(self.stage, self.replica)
        # TAG_UB is an attribute of COMM_WORLD only (None on COMM_SELF and on split
        # communicators); it holds for every communicator of the job
        self._tag_ub = min(int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)), _TAG_LIMIT)
        self._same_replica_weights(who)

        self._abort_buf = np.zeros(_ABORT_BYTES, np.uint8)
        self._abort_status = MPI.Status()
        self._abort_req = self._comm.Irecv([self._abort_buf, MPI.BYTE], MPI.ANY_SOURCE,
                                           _ABORT_TAG)
        self._abort = None
        self._parked = []      # requests left by a failure (they keep their buffers alive)
        self._broken = None
        self._run_id = 0
        self.steps = 0
        self.peak_versions = 1 if self.pieces else 0
        self.peak_stash = 0
        self.versions_used = {}
        self.losses = {}
        self._reset_run()

    # --- the plan: which version each pass uses, and when a copy is needed -----------------------

    def _plan(self):
        """Per pass of this rank, the version it uses (validate.weight_versions: the schedule's
        contract); per (piece, version), how many passes use it and whether a step of this rank
        comes before its last use (then the version must be a copy, not the master tensors)."""
        sched = self.schedule
        versions = weight_versions(sched)
        self._version_of = {}
        self._uses = {}
        last_use = {}
        steps = 0
        steps_before = []
        for i, a in enumerate(sched.actions[self.rank]):
            steps_before.append(steps)
            if a.kind == "S":
                steps += 1
                continue
            q = sched.vstage(a)
            n = versions[(q, a.microbatch)][0 if a.kind == "F" else 1]
            self._version_of[(a.kind, q, a.microbatch)] = n
            self._uses[(q, n)] = self._uses.get((q, n), 0) + 1
            last_use[(q, n)] = i
        self._needs_copy = {key: steps_before[i] > key[1] for key, i in last_use.items()}

    def _reset_run(self):
        self._steps = 0                  # steps in this run: the current version
        self._remaining = dict(self._uses)
        self._store = {}                 # (piece, version) -> {name: tensor}: copies
        self._stash = {}                 # (piece, microbatch) -> (input, output, version, params)
        self._local = {}                 # messages to this same rank (kind, piece, k) -> tensor
        self._sends = []                 # (requests, keep-alive) of sends in flight
        self.versions_used = {}
        self.losses = {}

    # --- counters ---------------------------------------------------------------------------------

    @property
    def live_versions(self):
        """Distinct weight versions held now, the most over this rank's pieces: the latest (the
        master parameters) plus every older copy a pass of this rank still needs."""
        if not self.pieces:
            return 0
        return max(len({self._steps} | {n for (q2, n) in self._store if q2 == q})
                   for q in self.pieces)

    @property
    def stashed(self):
        """Forwards whose backward has not run yet (their activations are held)."""
        return len(self._stash)

    # --- running ----------------------------------------------------------------------------------

    def run(self, inputs=None, targets=None):
        """Run this rank's whole action list once. inputs: the microbatches (a sequence of
        schedule.microbatches tensors, microbatch k at index k) on ranks holding piece 0 (stage
        0); targets: likewise on ranks holding the last piece; ignored elsewhere (None is fine).
        Returns {microbatch: loss} for the microbatches whose loss this rank computed ({}
        elsewhere). Collective over the communicator; raises PipelineError (on every rank) if
        any rank fails."""
        if self._broken is not None:
            raise PipelineError("this pipeline is unusable after an earlier failure (messages of "
                                "the failed run may still be in flight); build a new one. The "
                                "failure was:\n" + self._broken, rank=self.rank)
        self._run_id += 1
        self._reset_run()
        error, status = None, 0
        try:
            self._check_data(inputs, targets)
            self._run_actions(inputs, targets)
            self._drain_sends()
        except _Located as e:
            error, status = e.error, e.status
        except _PeerAborted as e:
            error, status = self._peer_error(e, None, None), 2
        except Exception as e:  # noqa: BLE001 - every failure is reported to the peers
            error, status = self._located(e, None, None), 1
        if isinstance(error, StageDiedError):
            # the dead take part in nothing: each survivor raises what it saw, no agreement
            self._broken = str(error)
            raise error
        if status == 1:
            self._tell_peers(error)
        self._agree(error, status)
        return dict(self.losses)

    def _check_data(self, inputs, targets):
        n = self.schedule.microbatches
        for name, data, needed in (("inputs", inputs, 0 in self.pieces),
                                   ("targets", targets, self.last_piece in self.pieces)):
            if not needed:
                continue
            if data is None or isinstance(data, torch.Tensor) or not hasattr(data, "__len__") \
                    or len(data) != n:
                raise ValueError("%s holds %s, so run() needs %s as a sequence of %d microbatches "
                                 "(schedule %s: m=%d x batches=%d), got %s"
                                 % (self.schedule.rank_label(self.rank),
                                    "piece 0" if name == "inputs" else "the last piece", name, n,
                                    self.schedule.name, self.schedule.m, self.schedule.batches,
                                    _describe_data(data)))

    def _run_actions(self, inputs, targets):
        for i, a in enumerate(self.schedule.actions[self.rank]):
            try:
                if a.kind == "F":
                    self._forward(a, i, inputs, targets)
                elif a.kind == "B":
                    self._backward(a, i)
                else:
                    self._step(a, i)
            except _PeerAborted as e:
                raise _Located(self._peer_error(e, a, i), 2) from None
            except Exception as e:  # noqa: BLE001
                raise _Located(self._located(e, a, i), 1) from e
            self.peak_versions = max(self.peak_versions, self.live_versions)
            self.peak_stash = max(self.peak_stash, len(self._stash))

    # --- the three actions ------------------------------------------------------------------------

    def _forward(self, a, i, inputs, targets):
        sched = self.schedule
        q, k = sched.vstage(a), a.microbatch
        n = self._version_of[("F", q, k)]
        if q == 0:
            x = inputs[k]
            if not isinstance(x, torch.Tensor):
                x = torch.as_tensor(np.asarray(x))
        else:
            x, tag = self._receive(ACTIVATION, q - 1, k, a, i)
            if sched.policy == "vertical" and tag != n:
                raise PipelineError("microbatch %d arrived tagged with weight version %d, but "
                                    "vertical sync plans version %d at %s" % (k, tag, n,
                                                                              self._piece(q)))
        x_in = x.detach()
        if q > 0 and (x_in.is_floating_point() or x_in.is_complex()):
            x_in.requires_grad_(True)  # its gradient goes back to the previous piece
        params = self._params_for(q, n)
        module = self.modules[q // sched.p]
        with torch.enable_grad():
            try:
                out = functional_call(module, params, (x_in,))
            except Exception as e:
                if q == 0:
                    raise
                raise StageInputError(
                    "%s cannot take the output of %s: microbatch %d arrived with shape %s and "
                    "dtype %s, and %s's forward raised %s: %s"
                    % (self._piece(q), self._piece(q - 1), k, tuple(x.shape),
                       str(x.dtype).replace("torch.", ""), self._piece(q), type(e).__name__,
                       e)) from e
            if q == self.last_piece:
                try:
                    loss = self.loss_fn(out, targets[k])
                except Exception as e:
                    raise PipelineError("loss_fn failed at %s on microbatch %d (output shape %s): "
                                        "%s: %s" % (self._piece(q), k, _shape_of(out),
                                                    type(e).__name__, e)) from e
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise PipelineError("loss_fn must return a scalar tensor, got %s"
                                        % _describe_data(loss))
                self.losses[k] = float(loss.detach())
                out = loss
        if q != self.last_piece:
            if not isinstance(out, torch.Tensor):
                raise PipelineError("%s's forward must return one tensor (it goes to %s), got %s"
                                    % (self._piece(q), self._piece(q + 1), _describe_data(out)))
            self._send(ACTIVATION, q, k, out.detach(), n, a, i)
        self._stash[(q, k)] = (x_in, out, n, params)
        self.versions_used[(q, k)] = (n, None)
        self._used(q, n)

    def _backward(self, a, i):
        sched = self.schedule
        q, k = sched.vstage(a), a.microbatch
        entry = self._stash.pop((q, k), None)
        if entry is None:
            raise PipelineError("no stashed forward of microbatch %d at %s" % (k, self._piece(q)))
        x_in, out, n, params = entry
        if n != self._version_of[("B", q, k)]:
            raise PipelineError("the backward of microbatch %d at %s plans weight version %d, but "
                                "its forward used version %d" % (k, self._piece(q),
                                                                 self._version_of[("B", q, k)], n))
        if q == self.last_piece:
            scale = 1.0 / sched.m if self.scale_by_m else 1.0
            grad_out = torch.full_like(out, scale)
        else:
            grad_out, _ = self._receive(GRADIENT, q, k, a, i)
            if grad_out.shape != out.shape or grad_out.dtype != out.dtype:
                raise PipelineError("the gradient of microbatch %d's output at %s came from %s "
                                    "with shape %s %s, but the output has shape %s %s"
                                    % (k, self._piece(q), self._piece(q + 1),
                                       tuple(grad_out.shape), grad_out.dtype, tuple(out.shape),
                                       out.dtype))
        names = list(params)
        wrt = [params[nm] for nm in names] + ([x_in] if x_in.requires_grad else [])
        if wrt and out.requires_grad:
            grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out, allow_unused=True)
        else:
            grads = (None,) * len(wrt)
        master = self._master[q]
        for nm, g in zip(names, grads):
            if g is None:
                continue
            prm = master[nm]
            if prm.grad is None:
                prm.grad = g.detach().clone()
            else:
                prm.grad.add_(g)
        if q > 0:
            g_in = grads[-1] if x_in.requires_grad else None
            if g_in is None:
                g_in = torch.zeros_like(x_in)
            self._send(GRADIENT, q - 1, k, g_in.detach(), n, a, i)
        del entry, out, grads
        self.versions_used[(q, k)] = (self.versions_used[(q, k)][0], n)
        self._used(q, n)

    def _step(self, a, i):
        # Keep the version about to be replaced if a later pass of this rank still uses it.
        for q in self.pieces:
            key = (q, self._steps)
            if self._remaining.get(key, 0) > 0 and key not in self._store:
                self._store[key] = _copy_params(self._master[q])
        params = [prm for q in self.pieces for prm in self._master[q].values()]
        replicas = self._replica_comm.Get_size()
        if replicas > 1:
            self._sum_over_replicas(params, a, i)
            if not self.scale_by_m:   # stash: one microbatch's gradient per replica -> the mean
                for prm in params:
                    if prm.grad is not None:
                        prm.grad.div_(replicas)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        self.steps += 1

    # --- weight versions --------------------------------------------------------------------------

    def _params_for(self, q, n):
        """The tensors of version n of piece q: the master parameters, or a copy."""
        if n == self._steps:
            if not self._needs_copy[(q, n)]:
                return self._master[q]
            if (q, n) not in self._store:
                self._store[(q, n)] = _copy_params(self._master[q])
            return self._store[(q, n)]
        if n < self._steps and (q, n) in self._store:
            return self._store[(q, n)]
        raise PipelineError("%s needs weight version %d, but this rank has run %d steps and "
                            "holds versions %s" % (self._piece(q), n, self._steps,
                                                   sorted({self._steps} | {v for (q2, v)
                                                                           in self._store
                                                                           if q2 == q})))

    def _used(self, q, n):
        self._remaining[(q, n)] -= 1
        if self._remaining[(q, n)] == 0:
            self._store.pop((q, n), None)

    @staticmethod
    def _check_replica_steps(schedule):
        """Replicas of a stage allreduce at every step, so they must step equally often
        (1F1B-RR: the inputs a multiple of each stage's replica count). The same on every rank,
        so every rank raises."""
        for s in range(schedule.p):
            ranks = schedule.stage_ranks(s)
            steps = [sum(1 for a in schedule.actions[r] if a.kind == "S") for r in ranks]
            if len(set(steps)) > 1:
                raise ValueError(
                    "stage %d's replicas (ranks %s) would step %s times: their gradients are "
                    "combined at every step, so each must step equally often (for 1F1B-RR, make "
                    "the number of inputs a multiple of every stage's replica count)"
                    % (s, ranks, steps))

    def _sum_over_replicas(self, params, a, i):
        """Sum the gradients over this stage's replicas (allreduce on their communicator)."""
        ranks = self.schedule.stage_ranks(self.stage)  # replica j is rank j of _replica_comm
        self._wait([self._replica_comm.Ibarrier()], [False], ranks,
                   "%s: waiting for the other replicas of stage %d (ranks %s) to step"
                   % (self._where(a, i), self.stage, ranks))
        groups = {}
        for prm in params:
            groups.setdefault(prm.dtype, []).append(prm)
        for dtype, group in groups.items():
            name = str(dtype).replace("torch.", "")
            if name not in _dtypes.DTYPE_CODES or name.startswith("int"):
                raise PipelineError("cannot allreduce %s gradients among replicas" % name)
            flat = torch.cat([(prm.grad if prm.grad is not None else torch.zeros_like(prm))
                              .reshape(-1) for prm in group])
            arr = (flat.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16
                   else flat.numpy())
            algorithms.allreduce(self._replica_comm, arr, _dtypes.DTYPE_CODES[name], "sum")
            off = 0
            for prm in group:
                prm.grad = flat[off:off + prm.numel()].view_as(prm).clone()
                off += prm.numel()

    def _same_replica_weights(self, who):
        """Replicas of a stage start from replica 0's weights (one bounded broadcast)."""
        n = self._replica_comm.Get_size()
        if n == 1:
            return
        reqs = []
        with torch.no_grad():
            for q in self.pieces:
                for prm in self._master[q].values():
                    buf = prm.data.reshape(-1).view(torch.uint8).numpy()
                    reqs.append(self._replica_comm.Ibcast([buf, MPI.BYTE], 0))
        if reqs:
            p2p.wait(reqs, p2p.others(self._replica_comm),
                     who + ": broadcasting replica 0's weights")

    # --- the construction check -------------------------------------------------------------------

    def _agree_at_start(self, who, schedule, agree_on):
        """One small bounded allgather of a digest per field (the schedule, then agree_on); if
        any differs, a second exchange of the values themselves so that every rank raises the
        same MismatchError naming which ranks passed what."""
        fields = [("the schedule", "%s, actions %08x" % (
            schedule.header(), zlib.crc32(schedule.to_text().encode())), None)]
        for f in agree_on:
            name, value, item = f
            fields.append((str(name), json.loads(json.dumps(value)), item))
        if len(fields) >= _AGREE_WORDS:
            raise ValueError("at most %d agree_on fields" % (_AGREE_WORDS - 2))
        size = self._comm.Get_size()
        digest = np.zeros(_AGREE_WORDS, np.int64)
        digest[0] = len(fields)
        for i, (name, value, _) in enumerate(fields):
            digest[1 + i] = zlib.crc32(json.dumps([name, value], sort_keys=True).encode())
        every = np.empty((size, _AGREE_WORDS), np.int64)
        p2p.wait([self._comm.Iallgather(digest, every)], p2p.others(self._comm),
                 who + ": comparing the schedule and the model")
        if (every == every[0]).all():
            return
        blob = np.frombuffer(json.dumps([list(f) for f in fields]).encode(), np.uint8).copy()
        sizes = np.empty(size, np.int64)
        p2p.wait([self._comm.Iallgather(np.array([blob.size], np.int64), sizes)],
                 list(range(size)), who + ": exchanging what differs")
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        out = np.empty(int(sizes.sum()), np.uint8)
        p2p.wait([self._comm.Iallgatherv([blob, MPI.BYTE],
                                         [out, sizes.tolist(), displs.tolist(), MPI.BYTE])],
                 list(range(size)), who + ": exchanging what differs")
        per_rank = [json.loads(bytes(out[d:d + n]).decode())
                    for d, n in zip(displs.tolist(), sizes.tolist())]
        raise MismatchError(_disagreement(per_rank))

    # --- messages ---------------------------------------------------------------------------------

    def _tag(self, kind, q, k):
        return 1 + ((k * self.schedule.pieces + q) * 2 + kind) % (self._tag_ub - 1)

    def _peer_rank(self, q, k):
        return self.schedule.rank_of(q % self.schedule.p, k)

    def _send(self, kind, q, k, t, version, a, i):
        """Post (no wait) the header and tensor t of message (kind, q, k) to the rank that
        consumes it. An activation (kind, q, k) is piece q's output: it goes to the rank of
        (q+1, k). A gradient (kind, q, k) is the gradient of piece q's output: it goes to the
        rank of (q, k), which ran that forward."""
        dst = self._peer_rank(q + 1 if kind == ACTIVATION else q, k)
        if t.device.type != "cpu":
            raise PipelineError("the pipeline executor moves CPU tensors only, got one on %s"
                                % t.device)
        if t.dtype not in _DTYPE_CODE:
            raise PipelineError("cannot send a %s tensor (supported: %s)"
                                % (t.dtype, ", ".join(str(d) for d in _DTYPES)))
        if t.dim() > _MAX_DIMS:
            raise PipelineError("cannot send a tensor of %d dimensions (at most %d)"
                                % (t.dim(), _MAX_DIMS))
        t = t.contiguous()
        if dst == self.rank:
            self._local[(kind, q, k)] = (t.clone(), version)
            return
        hdr = np.zeros(_HEADER_WORDS, np.int64)
        hdr[:8] = (_MAGIC, self._run_id, kind, q, k, version, _DTYPE_CODE[t.dtype], t.dim())
        hdr[8:8 + t.dim()] = t.shape
        tag = self._tag(kind, q, k)
        payload = t.reshape(-1).view(torch.uint8).numpy()
        reqs = [self._comm.Isend([hdr, MPI.INT64_T], dst, tag),
                self._comm.Isend([payload, MPI.BYTE], dst, tag)]
        self._sends.append((reqs, dst, (hdr, t, payload)))
        self._prune_sends()

    def _receive(self, kind, q, k, a, i):
        """(tensor, version tag) of (kind, piece q, microbatch k) from the rank that made it."""
        src = self._peer_rank(q if kind == ACTIVATION else q + 1, k)
        if src == self.rank:
            got = self._local.pop((kind, q, k), None)
            if got is None:
                raise PipelineError("%s of microbatch %d for %s was never made on this rank"
                                    % (_KIND_NAME[kind], k, self._piece(q)))
            return got
        what = "%s: waiting for the %s of microbatch %d from %s" % (
            self._where(a, i), _KIND_NAME[kind], k, self.schedule.rank_label(src))
        if self.schedule.v > 1:
            what += " (%s)" % self._piece(q if kind == ACTIVATION else q + 1)
        tag = self._tag(kind, q, k)
        hdr = np.empty(_HEADER_WORDS, np.int64)
        self._wait([self._comm.Irecv([hdr, MPI.INT64_T], src, tag)], [True], [src], what)
        want = (_MAGIC, self._run_id, kind, q, k)
        if tuple(int(x) for x in hdr[:5]) != want or not 0 <= hdr[6] < len(_DTYPES) \
                or not 0 <= hdr[7] <= _MAX_DIMS:
            raise PipelineError("%s: got a message that is not it (header %s, expected "
                                "run/kind/piece/microbatch %s)" % (what, hdr.tolist(), want[1:]))
        ndim = int(hdr[7])
        t = torch.empty(tuple(int(s) for s in hdr[8:8 + ndim]), dtype=_DTYPES[int(hdr[6])])
        buf = t.reshape(-1).view(torch.uint8).numpy()
        self._wait([self._comm.Irecv([buf, MPI.BYTE], src, tag)], [True], [src], what)
        return t, int(hdr[5])

    def _prune_sends(self):
        self._sends = [s for s in self._sends if not MPI.Request.Testall(s[0])]

    def _drain_sends(self):
        """Wait until every send of this run has been taken by its receiver."""
        self._prune_sends()
        if self._sends:
            reqs = [r for s in self._sends for r in s[0]]
            peers = [s[1] for s in self._sends for _ in s[0]]
            self._wait(reqs, [False] * len(reqs), peers, "%s: waiting for ranks %s to take the "
                       "tensors sent to them" % (self.schedule.rank_label(self.rank),
                                                 sorted(set(peers))))
            self._sends = []

    def _wait(self, reqs, is_recv, peers, what, collective=False):
        """Wait for reqs, at most MLFABRIC_TIMEOUT seconds (comm/wait.py). A point-to-point wait
        watches for a peer's failure report (raises _PeerAborted). A collective one (reqs: a
        request over the pipeline's communicator, peers: all its ranks) watches for a peer's
        death instead and ends at once with StageDiedError: a collective with a dead member may
        not fail until much later (seconds), so the any-source receive of failure reports is
        tested alongside, which ULFM fails as soon as a death is known; a report that arrives
        is kept for _check_abort (the outcome is being agreed on). If the wait ends in an
        error, its receives are cancelled and its requests parked with their buffers (MPI may
        still touch them), then PipelineTimeoutError (point-to-point: naming `what` and the
        late peers), comm.p2p's PeerTimeoutError (collective), StageDiedError or _PeerAborted
        is raised."""
        testall = MPI.Request.Testall
        timeout = _config.timeout_s()
        if collective:
            def check():
                dead = self._dead_ranks(settle_s=1.0) if self._failure_reported() else []
                if dead:
                    self._park(reqs, is_recv)
                    raise self._died(what, dead, "MPI reported the process failed")
            every = _CHECK_S
        else:
            check, every = self._check_abort, bounded.WATCH_S
        try:
            if testall(reqs):
                return
            stop = bounded.poll(functools.partial(testall, reqs), timeout, check=check,
                                every=every)
        except _PeerAborted:
            self._park(reqs, is_recv)
            raise
        except MPI.Exception as e:  # a request failed; under ULFM: a peer died
            self._park(reqs, is_recv)
            raise self._mpi_failure(e, what, peers) from e
        if stop is None:
            return
        if collective:  # the error (and the parking) of every other bounded collective
            p2p.give_up(reqs, p2p.others(self._comm), is_recv, what, timeout)
            return  # done in the meantime
        dead = self._dead_ranks()
        if dead:
            self._park(reqs, is_recv)
            raise self._died(what, dead, "found when the wait ran out")
        late = sorted({p for r, p in zip(reqs, peers) if not _done(r)})
        self._park(reqs, is_recv)
        raise PipelineTimeoutError("%s: nothing came within %g s (MLFABRIC_TIMEOUT); %s died, "
                                   "hangs, or runs a different schedule"
                                   % (what, timeout, ", ".join(self.schedule.rank_label(r)
                                                               for r in late) or "a peer"),
                                   rank=self.rank)

    def _park(self, reqs, is_recv):
        """Cancel the unfinished receives among reqs and keep every unfinished request (mpi4py
        requests hold their buffers) for the life of the executor."""
        for r, recv in zip(reqs, is_recv):
            if r == MPI.REQUEST_NULL:
                continue
            if recv:
                try:
                    r.Cancel()
                    r.Test()
                except MPI.Exception:
                    pass
            if r != MPI.REQUEST_NULL:
                self._parked.append(r)

    # --- dead peers (ULFM) ------------------------------------------------------------------------

    def _dead_ranks(self, settle_s=0.0):
        """The ranks of the pipeline's communicator that MPI knows to have died (ULFM's
        MPI_Comm_get_failed; [] without ULFM). settle_s: after an MPI error that says a process
        failed, how long to let the local failure list catch up before giving up on it."""
        dead = self._listed_dead()
        if dead == [] and settle_s > 0:
            back = bounded.Backoff(settle_s)
            while dead == [] and back.pause():
                dead = self._listed_dead()
        return dead or []

    def _listed_dead(self):
        """The dead ranks MPI lists now; None without ULFM."""
        try:
            g = self._comm.Get_failed()
            n = g.Get_size()
            dead = [] if n == 0 else MPI.Group.Translate_ranks(g, list(range(n)),
                                                               self._comm.Get_group())
            return sorted(r for r in dead if r != MPI.UNDEFINED and r >= 0)
        except (AttributeError, NotImplementedError, MPI.Exception):
            return None

    def _died(self, what, dead, how, cause=None):
        """StageDiedError: `what` (this rank's action, or what it waited for) and who died."""
        from .._core import exit_guard
        exit_guard.peer_failed()  # MPI_Finalize may now wait on the dead: bound the exit
        label = ", ".join(self.schedule.rank_label(r) for r in dead)
        text = "%s died (%s%s)" % (label, how, "" if cause is None else ": %s" % cause)
        return StageDiedError("%s: %s; the pipeline cannot go on without %s: restart the job "
                              "(from a checkpoint)" % (what, text,
                                                       "it" if len(dead) == 1 else "them"),
                              dead=dead, rank=self.rank)

    def _mpi_failure(self, e, what, peers):
        """The error for an MPI error `e` in a wait on `peers`: StageDiedError if MPI knows a
        peer died, else a PipelineError naming the peers and MPI's message."""
        cls = e.Get_error_class()
        failed = cls in _FAILED_CLASSES or cls == MPI.ERR_IN_STATUS
        dead = self._dead_ranks(settle_s=1.0 if failed else 0.0)
        if dead:
            return self._died(what, dead, "MPI reported the process failed",
                              e.Get_error_string())
        return PipelineError("%s: MPI error talking to %s: %s"
                             % (what, ", ".join(self.schedule.rank_label(r)
                                                for r in sorted(set(peers))),
                                e.Get_error_string()), rank=self.rank)

    def _failure_reported(self):
        """Whether MPI reports a dead process (ULFM fails the any-source receive of failure
        reports then) or already lists one. A failure report that arrives is kept for
        _check_abort."""
        try:
            self._report_in()
        except MPI.Exception:
            return True
        return bool(self._dead_ranks())

    def _report_in(self):
        """Whether a peer's failure report has come (kept in self._abort)."""
        if self._abort is None and self._abort_req.Test(self._abort_status):
            n = self._abort_status.Get_count(MPI.BYTE)
            self._abort = (self._abort_status.Get_source(),
                           bytes(self._abort_buf[:n]).decode("utf-8", "replace"))
        return self._abort is not None

    def _check_abort(self):
        """Raise _PeerAborted if a peer's failure report has come."""
        if self._report_in():
            raise _PeerAborted(*self._abort)

    # --- failures ---------------------------------------------------------------------------------

    def _tell_peers(self, error):
        """Send this rank's error to every other rank (they see it in their next wait)."""
        data = np.frombuffer(str(error).encode("utf-8")[:_ABORT_BYTES], np.uint8).copy()
        for r in range(self._comm.Get_size()):
            if r != self.rank:
                try:
                    self._parked.append((self._comm.Isend([data, MPI.BYTE], r, _ABORT_TAG),
                                         data))
                except MPI.Exception:  # a dead peer (ULFM): the others still hear of it
                    pass

    def _agree(self, error, status):
        """Every rank says how its run ended; all raise if any failed."""
        size = self._comm.Get_size()
        mine = np.array([status], np.int64)
        every = np.empty(size, np.int64)
        if error is None:
            what = "pipeline %s failed on %s, agreeing on the outcome of the run (it ran all its " \
                "actions)" % (self.schedule.name, self.schedule.rank_label(self.rank))
        else:  # what went wrong here first, then the agreement (a death can be known only then)
            what = "%s; then, agreeing on the outcome of the run" % str(error).splitlines()[0]
        try:
            self._wait([self._comm.Iallgather(mine, every)], [False], list(range(size)), what,
                       collective=True)
        except MlfabricError as e:  # a timeout, or a dead peer (StageDiedError)
            self._broken = str(e)
            raise e from error
        if not every.any():
            return
        for s in self._sends:
            self._parked.append(s)
        self._sends = []
        if error is None:
            failed = [r for r, s in enumerate(every.tolist()) if s == 1]
            try:
                self._await_report(failed)
            except MPI.Exception as e:
                error = self._mpi_failure(e, "%s: waiting for the failure report of rank(s) %s"
                                          % (self.schedule.rank_label(self.rank), failed),
                                          failed)
            except _PeerAborted as e:
                error = PipelineError("%s ran all its actions, but %s failed:\n%s"
                                      % (self.schedule.rank_label(self.rank),
                                         self.schedule.rank_label(e.source), e.text),
                                      rank=self.rank, origin=e.source)
            except PeerTimeoutError as e:
                error = e
        self._broken = str(error)
        raise error

    def _await_report(self, failed):
        """Wait (bounded) for the failure report the failed ranks sent; raises _PeerAborted."""
        timeout = _config.timeout_s()
        bounded.poll(self._report_in, timeout, check=None)
        self._check_abort()
        raise PipelineTimeoutError("%s: rank(s) %s failed but their report did not arrive within "
                                   "%g s (MLFABRIC_TIMEOUT)" % (self.schedule.rank_label(self.rank),
                                                                failed, timeout),
                                   rank=self.rank)

    def _peer_error(self, e, a, i):
        where = self._where(a, i) if a is not None else \
            "%s, after its actions" % self.schedule.rank_label(self.rank)
        return PipelineError("%s: stopped because %s failed:\n%s"
                             % (where, self.schedule.rank_label(e.source), e.text),
                             rank=self.rank, action=a, position=i, origin=e.source)

    def _located(self, e, a, i):
        """e with where it happened and the step x rank grid."""
        if isinstance(e, _Located):
            return e.error
        where = self._where(a, i) if a is not None else \
            "%s, outside its actions" % self.schedule.rank_label(self.rank)
        if not isinstance(e, PipelineError) and isinstance(e, (MPI.Exception, MlfabricError)):
            dead = self._dead_ranks()
            if dead:  # e.g. the replicas' allreduce met a dead replica
                e = self._died(where, dead, "MPI reported the process failed",
                               "%s: %s" % (type(e).__name__, e))
        cls = type(e) if isinstance(e, PipelineError) else PipelineError
        text = str(e) if isinstance(e, PipelineError) else "%s: %s" % (type(e).__name__, e)
        if text.startswith(where):  # a wait's message already says where
            text = text[len(where):].lstrip(": ")
        msg = "pipeline %s failed on %s: %s" % (self.schedule.name, where, text)
        if a is not None:
            msg += "\n" + self.failure_grid(i)
        if isinstance(e, StageDiedError):
            err = cls(msg, dead=e.dead, rank=self.rank, action=a, position=i)
        else:
            err = cls(msg, rank=self.rank, action=a, position=i)
        err.__cause__ = e
        return err

    def failure_grid(self, position):
        """The schedule's step x rank grid up to the lockstep step where this rank's action at
        `position` runs, that action marked '!' (validate.py's renderer)."""
        sched = self.schedule
        if not hasattr(self, "_rows"):
            self._rows, self._step_of = lockstep(sched)
        step = self._step_of[(self.rank, position)]
        return grid(sched, self._rows[:step], {self.rank: sched.actions[self.rank][position]})

    def _where(self, a, i):
        return "%s at %s (position %d)" % (self.schedule.rank_label(self.rank),
                                           a.label(self.schedule.v > 1), i)

    def _piece(self, q):
        s = q % self.schedule.p
        return "stage %d chunk %d" % (s, q // self.schedule.p) if self.schedule.v > 1 \
            else "stage %d" % s

    def replica_sum(self, values):
        """Sum a small float64 array over this stage's replicas (bounded); for reporting."""
        arr = np.ascontiguousarray(values, np.float64).reshape(-1)
        if self._replica_comm.Get_size() == 1:
            return arr
        out = np.empty_like(arr)
        p2p.wait([self._replica_comm.Iallreduce(arr, out, MPI.SUM)],
                 list(range(self._replica_comm.Get_size())),
                 "%s: summing over the replicas" % self.schedule.rank_label(self.rank))
        return out


class _Located(Exception):
    """Carries an already located error out of the action loop (status 1: this rank's own
    failure, 2: a peer's)."""

    def __init__(self, error, status):
        super().__init__(str(error))
        self.error, self.status = error, status


def _disagreement(per_rank):
    """The message of a failed construction check: per field that differs (in the order the
    fields were given), "ranks disagree on NAME: VALUE on rank(s) [...]; ..." (the style of
    mlfabric.comm.header's mismatch messages). per_rank[r]: rank r's [name, value, item] list."""
    names, items = [], {}
    for fields in per_rank:
        for name, _, item in fields:
            if name not in items:
                names.append(name)
                items[name] = item
    lines = []
    for name in names:
        values = [next((v for n, v, _ in fields if n == name), _MISSING) for fields in per_rank]
        texts = [json.dumps(v, sort_keys=True) for v in values]
        if len(set(texts)) == 1:
            continue
        item = items[name]
        index = None
        if item and all(isinstance(v, list) for v in values) \
                and len({len(v) for v in values}) == 1:
            index = next(i for i in range(len(values[0]))
                         if len({json.dumps(v[i], sort_keys=True) for v in values}) > 1)
        groups = {}
        for r, (v, t) in enumerate(zip(values, texts)):
            key = t if index is None else json.dumps(v[index], sort_keys=True)
            groups.setdefault(key, (v if index is None else v[index], []))[1].append(r)
        parts = "; ".join("%s on rank(s) %s" % (_show(v), ranks) for v, ranks in groups.values())
        lines.append("ranks disagree on %s: %s"
                     % (name if index is None else "%s (first at %s %d)" % (name, item, index),
                        parts))
    return ("pipeline construction: %s\nevery rank must build the same schedule and model (the "
            "same layers, cut at the same places); cuts computed per rank from timings "
            "(profile_layers, partition) can differ: compute them on one rank and broadcast "
            "them (comm.bcast)" % "\n".join(lines or ["ranks disagree on the call"]))


_MISSING = "(not given)"


def _show(v):
    if isinstance(v, str):
        return v
    return json.dumps(v)


def _done(req):
    """Whether a request has completed (an MPI error on it counts as not: it never delivered)."""
    if req == MPI.REQUEST_NULL:
        return True
    try:
        return req.Test()
    except MPI.Exception:
        return False


def _copy_params(params):
    return {n: prm.detach().clone().requires_grad_(True) for n, prm in params.items()}


def _shape_of(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _describe_data(x):
    if x is None:
        return "None"
    if isinstance(x, torch.Tensor):
        return "a tensor of shape %s" % (tuple(x.shape),)
    if hasattr(x, "__len__"):
        return "a %s of length %d" % (type(x).__name__, len(x))
    return "a %s" % type(x).__name__
