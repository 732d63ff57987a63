"""DistributedOptimizer: Horovod's wrapper that averages (or sums) gradients over all ranks before
the wrapped optimizer's step().

How it works:
- gradient buckets are fixed at construction: the parameters in reverse order (gradients become
  ready roughly from the last layer back), fused per dtype as DDP does: a first bucket of at most
  1 MiB, so that the first allreduce starts early in backward, then buckets of at most
  MLFABRIC_FUSION_THRESHOLD bytes (default 4 MiB; see ops.fusion_threshold); a model whose
  gradients all fit in one such bucket gets just one (_first_cap). Every rank builds the
  same buckets from the same model, and buckets always start in bucket order, so every rank
  issues the same allreduces in the same order whatever order its hooks fire in;
- each bucket owns one flat buffer for the optimizer's lifetime, and each parameter's .grad is a
  view of its slice (DDP's gradient_as_bucket_view): backward accumulates into the bucket, the
  allreduce runs on it in place and leaves the result in .grad, with no copy in or out. The
  optimizer's zero_grad() zeroes the buckets and keeps those views, whatever set_to_none says
  (see zero_grad). Where autograd made a fresh gradient instead (the first step, or after
  model.zero_grad() or p.grad = None), the bucket copies those in when it starts, in one
  torch._foreach_copy_, and points their .grad back at its slices;
- CUDA parameters get buckets on their GPU, reduced over NCCL (ops.py);
- with every rank on one host (MLFABRIC_SHM on), CPU parameters and the same model everywhere,
  the bucket buffers are in shared memory, allocated collectively at construction: each
  bucket's allreduce then reads the peers' buckets in place (zero-copy). mlfabric's finalize
  (hvd.shutdown(), or the end of the process) first moves them to private memory, re-pointing
  the same .grad tensor objects, so gradients stay readable after it;
- a hook after each gradient accumulation (register_post_accumulate_grad_hook) counts the
  backward passes of its parameter; when the last parameter of a bucket has had
  backward_passes_per_step passes, the bucket (and any ready buckets after it) starts an async
  allreduce, so communication overlaps the rest of backward. The last bucket (the first
  layers', whose gradients come last) is not started by hooks: synchronize() runs it, on the
  calling thread. In a one-bucket optimizer (a small model), after the first reduction its
  parameters keep one Python hook between them, the sentinel, for the guards below, and each a
  mark that runs no Python (100 small gradients then cost one Python hook); with more buckets
  every parameter keeps its hook (see below);
- a bucket whose parameters did not all get their gradients on this rank (a branch some ranks
  skip, an expert given no tokens) is not started by the hooks, where on other ranks it is. So
  that every rank issues the same buckets before any other call, once the step's
  backward_passes_per_step passes are over (autograd's graph tasks tell them apart, a reentrant
  checkpoint's nested pass counting as part of its own), the next mlfabric.torch collective (a
  metric's allreduce, another optimizer's bucket, SyncBatchNorm's call in a later pass) and the
  next gradient of another optimizer first start the buckets before the last that the hooks did
  not (dispatch.start_unstarted; missing gradients count as zeros, as at synchronize()). A gradient
  that comes for such a bucket afterwards (a further backward() for the same step) is an
  error. What still needs every rank to compute gradients for the same parameters (as DDP
  without find_unused_parameters): calls issued during the same backward pass (SyncBatchNorm's,
  the hooks of two multi-bucket optimizers). A rank whose pass brings this optimizer no
  gradient at all cannot tell that the pass happened: every rank must bring it at least one in
  each;
- synchronize() starts the buckets the hooks did not, waits for them in order, and runs the
  last (parameters without a gradient contribute zeros and get a zero gradient, as in
  Horovod); step() calls it unless inside skip_synchronize(), then runs the wrapped step(). A
  second call with no gradient since (hooks and marks tell) does nothing: gradients clipped in
  place in between are not reduced again. step() after an explicit synchronize() (with no
  zero_grad() between them), outside skip_synchronize(), warns as Horovod does;
- sparse gradients (nn.Embedding(sparse=True)) are reduced by sparse.py's sparse allreduce
  (allgathers of their indices and values: only the rows touched travel) and .grad becomes the
  reduced sparse tensor; the rest of their bucket is reduced as usual, in one allreduce per run
  of dense neighbours. sparse_as_dense=True copies them into the bucket densified instead, and
  synchronize() gives the reduced gradient back to .grad as a sparse tensor (Horovod's rule:
  torch.optim.SparseAdam takes sparse gradients only). Their slice of the bucket stays
  allocated (buckets are fixed before any gradient is seen);
- zero_grad() while gradients are being reduced is an error (Horovod's guard). Between
  backward() and synchronize() the gradients are being reduced in place: leave .grad alone
  until then (as with DDP's gradient_as_bucket_view).

Gradients of the backward_passes_per_step passes add up locally (no division), then op Average
divides by size() (gradient_predivide_factor f: multiplied by 1/f before the sum and f/size
after), op Sum does not. Compression.fp16 sends each bucket through a float16 buffer of its own,
also kept for the optimizer's lifetime. With process_set= (process_sets.py) everything above
happens among that set's ranks only (its size divides, its shared memory holds the buckets).
"""
import contextlib
import functools
import operator
import types
import warnings
import weakref
import zlib

import numpy as np
import torch

from ..comm import collectives as _coll
from ..comm import context as _context
from ..comm import respawn as _respawn
from ..comm import shared as _shared
from ..errors import MismatchError, MlfabricError
from . import adasum as _adasum
from . import arguments, control, dispatch, ops
from . import sparse as _sparse
from .compression import Compression, check as _check_compression

FIRST_BUCKET = 1 << 20  # bytes, as DDP (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


class _Bucket:
    __slots__ = ("index", "params", "names", "views", "flat", "half", "name", "waiting",
                 "pending", "sparse")

    def __init__(self, index, params, names, fp16, flat):
        self.index, self.params, self.names = index, params, names
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        # an internal name: two optimizers of one model (their buckets named alike) may have
        # their buckets in flight at once, where a user's named calls may not (Horovod's rule)
        self.name = control.InternalName(f"gradients[{index}]: {shown}")
        self._place(flat)
        # fp16 compression: the float16 copy that travels, for floating types other than it
        self.half = (torch.empty(self.flat.numel(), dtype=torch.float16, device=self.flat.device)
                     if fp16 and self.flat.dtype != torch.float16 else None)
        self.waiting = len(params)  # parameters not yet through all their backward passes
        # once started: ([(handle, the tensor reduced, compression ctx, its slice of flat)],
        # {position: its sparse call})
        self.pending = None
        self.sparse = {}  # position -> sparse_dim, for members whose gradients came sparse

    def _place(self, flat):
        """Make flat the bucket's buffer, each parameter's view a slice of it."""
        self.flat = flat
        sizes = [p.numel() for p in self.params]
        self.views = [v.view(p.shape) for v, p in zip(flat.split(sizes), self.params)]

    def unshare(self):
        """Before mlfabric's shared memory is freed (finalize): move the bucket to private
        memory. The same tensor objects are re-pointed (set_), so .grad, and any reference a
        user kept to it, stay readable; only views made from them by hand would not."""
        base = self.flat.storage_offset()  # the bucket is a slice of a larger shared buffer
        storage = self.flat.clone().untyped_storage()
        with torch.no_grad():
            for t in (self.flat, *self.views):
                t.set_(storage, t.storage_offset() - base, t.shape, t.stride())


class _Slot:
    """A parameter's place: its bucket (None in the last bucket, see _mlf_finish_setup), its
    backward passes to go (-1: none, its bucket started without it, see
    _mlf_start_unstarted)."""
    __slots__ = ("bucket", "delay")

    def __init__(self, bucket, delay):
        self.bucket, self.delay = bucket, delay


_graph_task = torch._C._current_graph_task_id  # -1 outside backward
_ENGINE = torch.autograd.Variable._execution_engine  # queue_callback: at the task's end
_current_node = torch._C._current_autograd_node  # in a task's end callback: None unless nested


def _hook(ref, index, param):
    opt = ref()
    if opt is not None:
        opt._mlf_grad_ready(opt._mlf_slots[index])


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's class (see DistributedOptimizer())."""

    def _mlf_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
                   local_layers=None):
        # A rank whose arguments are bad still takes part in the construction round, so that its
        # peers fail at once (MismatchError naming it) instead of waiting for it.
        self._mlf_process_set = process_set
        st = _construction_state(process_set)
        try:
            local = _local_parameters(local_layers)
            op, params, names = self._mlf_check(named_parameters, compression,
                                                backward_passes_per_step, op,
                                                gradient_predivide_factor, local)
            # Buckets from the parameters in reverse order: the last layers' gradients first.
            order = params[::-1]
            if num_groups and groups is not None:
                raise ValueError("pass groups or num_groups (its older name), not both")
            if op == ops.Adasum and (num_groups or groups is not None or sparse_as_dense):
                raise ValueError("DistributedOptimizer(op=Adasum) reduces each parameter's "
                                 "step on its own: groups, num_groups and sparse_as_dense do "
                                 "not apply")
            groups = num_groups if groups is None else groups
            groups = None if isinstance(groups, int) and groups == 0 else groups  # 0: none
            threshold = ops.fusion_threshold()
            plan = ops.fuse(order, threshold, _first_cap(order, threshold)) \
                if groups is None else _grouped_plan(order, groups)
        except Exception as exc:  # noqa: BLE001 - the peers hear of any, then it is raised
            _construction_round(st, 0, torch.device("cpu"), exc)  # raises exc, after the round
            raise
        self._mlf_op = op
        self._mlf_local, self._mlf_names = local, names
        # the parameters reduced; the others of the optimizer (not trainable now) are watched
        # by step() (see _mlf_check_unreduced)
        self._mlf_reduced = frozenset(id(p) for p in params)
        self._mlf_groups = None  # (groups, parameters) when _mlf_unreduced was read
        self._mlf_unreduced = []
        self._mlf_compression = compression
        self._mlf_passes = backward_passes_per_step
        self._mlf_predivide = float(gradient_predivide_factor)
        self._mlf_sparse_as_dense = bool(sparse_as_dense)
        fp16 = compression is Compression.fp16
        # Every bucket's allreduce carries (a hash of) the whole model's names, dtypes and
        # shapes, and of explicit groups: ranks holding different models (or grouping them
        # differently, or the same shapes in another order of names: their gradients would
        # be summed with another layer's) fail together at the first bucket.
        self._mlf_layout = zlib.crc32(repr(
            (tuple((names[id(p)], str(p.dtype), tuple(p.shape)) for p in params),
             None if groups is None else plan)).encode())
        device = params[0].device if params else torch.device("cpu")
        shared = _construction_round(st, self._mlf_layout, device, None)
        if op == ops.Adasum:  # no buckets, no hooks: step() reduces the parameters' deltas
            self._mlf_adasum = [(p, names[id(p)]) for p in params]
            plan = []
        flats = _bucket_buffers(st, [[order[i] for i in m] for m in plan], shared)
        self._mlf_buckets = [
            _Bucket(b, [order[i] for i in members], [names[id(order[i])] for i in members], fp16,
                    flat)
            for (b, members), flat in zip(enumerate(plan), flats)]
        self._mlf_finish_setup(st, flats)

    def _mlf_check(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, local):
        """(op, parameters to reduce, their names), or the error of a bad argument. local: ids
        of parameters that keep this rank's gradient (PartialDistributedOptimizer)."""
        _check_compression(compression)
        op = arguments.resolve_op(op, None)
        if op not in (ops.Average, ops.Sum, ops.Adasum):
            raise ValueError(f"DistributedOptimizer supports op Average, Sum or Adasum, got {op}")
        arguments.check_factor(gradient_predivide_factor, "DistributedOptimizer",
                               "gradient_predivide_factor")
        if gradient_predivide_factor != 1.0 and op != ops.Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        _check_passes(backward_passes_per_step)
        params, seen = [], set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen and id(p) not in local:
                    seen.add(id(p))
                    params.append(p)
        names = _names(named_parameters, params)
        for p in params:  # the buckets live on the parameters' device, in their dtypes
            arguments.check_tensor(p, "DistributedOptimizer", f"parameter {names[id(p)]}")
            if p.device != params[0].device:
                raise ValueError(f"DistributedOptimizer: parameter {names[id(p)]} is on "
                                 f"{p.device}, {names[id(params[0])]} on {params[0].device}; "
                                 "the parameters must share one device")
        return op, params, names

    def _mlf_finish_setup(self, st, flats):
        if flats and _shared.is_shared(flats[0]):
            hooks = st.ctx.on_close
            # drop the hooks of optimizers gone since (a process may build thousands)
            hooks[:] = [f for f in hooks if not (getattr(f, "func", None) is _unshare
                                                 and f.args[0]() is None)]
            hooks.append(functools.partial(_unshare, weakref.ref(self)))
        # Hooks start buckets early, to overlap backward. The last bucket (the first layers'
        # gradients, the last to come) gains nothing from them: synchronize(), right after
        # backward, starts it on the calling thread. In a one-bucket optimizer (a small model)
        # its parameters' Python hooks only serve the guards (too many backward passes,
        # zero_grad() before step()), and one costs ~1-2 us a gradient where the whole
        # reduction of 100 small gradients takes ~30. So after the first reduction only one of
        # them keeps it, the sentinel (_mlf_watch); every one keeps a mark instead, a hook that
        # runs no Python: functools.partial of setattr records the parameter in _mlf_seen, so
        # synchronize() knows whether (and which) gradients came since the last reduction.
        # With buckets before the last, every gradient runs the Python hook: which buckets
        # the hooks started can differ between ranks, and dispatch.start_unstarted must know of
        # every backward pass that brought this rank a gradient (_mlf_enter).
        tail = self._mlf_buckets[-1] if self._mlf_buckets else None
        self._mlf_early = len(self._mlf_buckets) > 1
        self._mlf_params = [p for b in self._mlf_buckets for p in b.params]
        self._mlf_slots = [_Slot(None if b is tail else b, self._mlf_passes)
                           for b in self._mlf_buckets for _ in b.params]
        self._mlf_live = self._mlf_slots  # the slots whose hooks are registered
        self._mlf_last = None           # the last bucket's hooked slot that came, since reset
        self._mlf_sentinel = None       # its one slot still hooked, once the others were removed
        self._mlf_seen = types.SimpleNamespace(param=None)  # its last gradient since the reset
        self._mlf_done = 0              # hooked parameters through all their passes
        self._mlf_next = 0              # the next bucket to start
        self._mlf_synchronized = False  # reduced since the last backward pass / step()
        self._mlf_should_sync = True    # False inside skip_synchronize()
        self._mlf_sync_called = False   # synchronize() ran since the last step()
        self._mlf_ref = ref = weakref.ref(self)
        # With buckets before the last, once the step's backward passes are over, a call issued
        # in this state first starts the buckets the hooks did not (dispatch.start_unstarted). The
        # passes are told apart by autograd's graph tasks (_mlf_enter):
        self._mlf_state = st  # (refreshed by _mlf_pend: an elastic reset makes another)
        self._mlf_open = set()    # tasks that brought a gradient and are still running
        self._mlf_newest = -1     # the newest such task since the reduction (ids only grow)
        self._mlf_passes_seen = 0  # backward passes that brought one, nested ones not counted
        self._mlf_failed = None  # the error of a bucket dispatch.start_unstarted could not start
        # bucket index -> its first slot (the slots are in bucket order)
        self._mlf_first = np.cumsum([0] + [len(b.params) for b in self._mlf_buckets]).tolist()
        self._mlf_hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, ref, i))
                           for i, p in enumerate(self._mlf_params)]
        mark = functools.partial(setattr, self._mlf_seen, "param")
        marks = [p.register_post_accumulate_grad_hook(mark)
                 for p in (tail.params if tail and not self._mlf_early else ())]
        weakref.finalize(self, _remove_hooks, marks)  # (they do not hold the optimizer)

    # --- reduction ---------------------------------------------------------------------------

    def _mlf_grad_ready(self, slot):
        """After autograd accumulated a parameter's gradient: the hot path, once per parameter
        and backward pass, so it only counts (a fresh gradient is copied into the bucket when
        the bucket starts, all in one call)."""
        if slot.delay < 0:  # its bucket was started by dispatch.start_unstarted
            raise MlfabricError(
                f"DistributedOptimizer: a gradient for {slot.bucket.name} came after its "
                "bucket's reduction had started: once the step's backward_passes_per_step "
                f"({self._mlf_passes}) backward passes are over, the next collective call (or "
                "another optimizer's gradient) starts the buckets whose gradients have not all "
                "come on this rank (ranks may differ in which parameters get one). With more "
                "backward passes per step, raise backward_passes_per_step, or issue the call "
                "after step()")
        if slot.delay == 0:
            raise MlfabricError(
                "gradients were computed more than backward_passes_per_step "
                f"({self._mlf_passes}) times before step() or synchronize(); raise "
                "backward_passes_per_step to accumulate more passes locally")
        self._mlf_synchronized = False
        task = _graph_task()  # (~30 ns)
        if self._mlf_early and task not in self._mlf_open:
            self._mlf_enter(task)
        pending = dispatch.UNSTARTED
        if pending and (len(pending) > 1 or pending[0] is not self._mlf_ref):
            # another optimizer's backward passes are over: its buckets start now, before any
            # of this pass's, on every rank (whether this pass's hooks start a bucket, or issue
            # any call before step(), can differ between ranks)
            try:
                dispatch.start_unstarted(dispatch.state(self._mlf_process_set), task)
            except (TypeError, ValueError, MlfabricError):  # not initialised...: none to start
                pass
        slot.delay -= 1
        if slot.delay == 0:
            self._mlf_done += 1
            b = slot.bucket
            if b is None:  # the last bucket: synchronize() starts it
                self._mlf_last = slot
                return
            b.waiting -= 1
            if not b.waiting and b.index == self._mlf_next:
                self._mlf_start_ready()

    def _mlf_enter(self, task):
        """The first gradient for this optimizer from autograd graph task `task`: the task is
        open until it ends (an engine callback). It counts as one of the step's backward passes
        unless it runs inside one (a reentrant checkpoint's pass, nested in the backward pass
        that started it: task ids grow, so it is newer than a pass still open, or an enclosing
        pass seen after it is older). Once the step's passes are all there, a call issued after
        them starts the buckets the hooks did not (dispatch.start_unstarted): counting passes, not
        parameters through theirs, every rank gets there, whichever parameters its passes
        reached."""
        if not self._mlf_open and task > self._mlf_newest:
            self._mlf_passes_seen += 1
            if self._mlf_passes_seen == self._mlf_passes:
                self._mlf_pend()
        self._mlf_newest = max(self._mlf_newest, task)
        self._mlf_open_task(task)

    def _mlf_open_task(self, task):
        self._mlf_open.add(task)
        _ENGINE.queue_callback(functools.partial(self._mlf_leave, task))

    def _mlf_leave(self, task):
        """The end of graph task `task` (an engine callback). A nested one (a reentrant
        checkpoint's) ends inside a node of the pass that encloses it, which still runs: that
        pass is opened, when the node is done (a hook on it, in that pass's task), so that a
        second checkpointed segment's task, starting while nothing else of this optimizer is
        open, is not taken for a new pass."""
        self._mlf_open.discard(task)
        node = _current_node()
        if node is None:  # a pass of its own
            return
        handles = []

        def reopen(*_):
            handles.pop().remove()
            outer = _graph_task()
            if outer >= 0 and outer not in self._mlf_open:
                self._mlf_open_task(outer)
        handles.append(node.register_hook(reopen))

    def _mlf_after(self, task):
        """Whether a call made in graph task `task` (-1: outside backward) comes after this
        optimizer's backward passes: none of them still runs, and the call's pass does not
        enclose them (it would be older than the newest)."""
        return not self._mlf_open and (task < 0 or task > self._mlf_newest)

    def _mlf_pend(self):
        """Have a call issued after backward start the buckets the hooks do not (see
        dispatch.start_unstarted)."""
        try:
            self._mlf_state = dispatch.state(self._mlf_process_set)
        except Exception:  # noqa: BLE001 - not initialised: its calls will say so
            return
        dispatch.UNSTARTED.append(self._mlf_ref)

    def _mlf_start_unstarted(self):
        """Start the buckets before the last that the hooks did not (dispatch.start_unstarted):
        their parameters without a gradient contribute zeros, as at synchronize(). A gradient
        that comes for one of them later is an error (_mlf_grad_ready). A start that fails is
        raised by synchronize(): the call that got here is not this optimizer's."""
        buckets, slots = self._mlf_buckets, self._mlf_slots
        while self._mlf_failed is None and self._mlf_next < len(buckets) - 1:
            b = buckets[self._mlf_next]
            for s in slots[self._mlf_first[b.index]:self._mlf_first[b.index + 1]]:
                if s.delay > 0:
                    s.delay = -1
            try:
                self._mlf_launch(b, True)
            except Exception as exc:  # noqa: BLE001 - see above
                self._mlf_failed = exc

    def _mlf_start_ready(self):
        """Start the buckets that are ready, in bucket order, up to the first that is not."""
        buckets = self._mlf_buckets
        while self._mlf_next < len(buckets) - 1 and not buckets[self._mlf_next].waiting:
            self._mlf_launch(buckets[self._mlf_next], True)

    def _mlf_launch(self, b, async_):
        """Start bucket b's reduction (the next in bucket order); async_=False: run it now."""
        self._mlf_next = b.index + 1
        sparse = _gather(b, self._mlf_sparse_as_dense)
        calls = {i: _sparse.start(g, control.InternalName(b.names[i]), self._mlf_op,
                                  self._mlf_process_set)
                 for i, g in sparse}
        # the dense members (all of them, but for sparse gradients) in one allreduce per run
        # of neighbours; sparse positions are part of what every rank must agree on
        # (with the passes per step: ranks accumulating different counts would pair one rank's
        # step with another's earlier one)
        layout = (b.index, self._mlf_layout, self._mlf_passes) if not calls else \
            (b.index, self._mlf_layout, self._mlf_passes, tuple(calls))
        b.pending = ([self._mlf_allreduce(b, lo, hi, layout, async_)
                      for lo, hi in _dense_runs(b, calls)], calls)

    def _mlf_allreduce(self, b, lo, hi, layout, async_):
        """Start the allreduce of elements [lo, hi) of bucket b (all of it, mostly): (its
        handle, None) if async_, else run it: (None, the result)."""
        whole = lo == 0 and hi == b.flat.numel()
        flat, post = (b.flat if whole else b.flat[lo:hi]), 1.0
        if self._mlf_predivide != 1.0:
            flat.mul_(1.0 / self._mlf_predivide)
            post = self._mlf_predivide
        cctx = None
        if b.half is not None:
            sent = b.half if whole else b.half[lo:hi]
            sent.copy_(flat)
        elif self._mlf_compression is Compression.none:
            sent = flat
        else:
            sent, cctx = self._mlf_compression.compress(flat)
        out = ops.allreduce_call(sent, self._mlf_op, None, b.name, 1.0, post, True, async_,
                                 layout=layout, process_set=self._mlf_process_set)
        return (out, None) if async_ else (None, out), sent, cctx, flat

    def synchronize(self):
        """Finish reducing the gradients (they are then in .grad). Called by step() unless
        inside skip_synchronize(); calling it again before the next backward pass does nothing.
        With op=Adasum gradients stay local (step() reduces the parameters' deltas): nothing to
        do."""
        if self._mlf_op == ops.Adasum or (self._mlf_synchronized and
                                          self._mlf_seen.param is None):
            self._mlf_sync_called = True
            return  # no gradient since (the hooks clear _mlf_synchronized; marks set seen)
        if self._mlf_ref in dispatch.UNSTARTED:  # its own calls below start them, in order
            dispatch.UNSTARTED.remove(self._mlf_ref)
        buckets, error = self._mlf_buckets, self._mlf_failed
        stopped, self._mlf_failed = error is not None, None
        # The buckets before the last that the hooks did not start (a parameter had no gradient
        # yet): started now, all before waiting for any. A start that fails does so on every
        # rank at the same bucket (dispatch.issue's rejection round), so all stop there.
        with dispatch.own_calls():
            while not stopped and self._mlf_next < len(buckets) - 1:
                try:
                    self._mlf_launch(buckets[self._mlf_next], True)
                except Exception as exc:  # noqa: BLE001 - raised after waiting for the started
                    error, stopped = exc, True
        for b in buckets:
            here = b.index == self._mlf_next and not stopped  # the last bucket, run here
            if here:
                # now that the buckets before it are done (waited for in this loop, in order):
                # on this thread, with no hand-off to the queue's
                try:
                    self._mlf_launch(b, False)
                except Exception as exc:  # noqa: BLE001 - as above
                    error, stopped = error or exc, True
            if b.pending is None:  # not started (its start failed, or an earlier one did)
                continue
            runs, calls = b.pending
            b.pending = None
            failed = False
            for (handle, reduced), sent, cctx, flat in runs:
                try:
                    if handle is not None:
                        reduced = ops.synchronize(handle)
                except Exception as exc:  # noqa: BLE001 - wait for every bucket, then raise
                    error, failed = error or exc, True
                    continue
                if sent is not flat:  # compressed: back into the bucket
                    if b.half is None:
                        reduced = self._mlf_compression.decompress(reduced, cctx)
                    flat.copy_(reduced.reshape(-1))
            for i, call in calls.items():
                try:
                    b.params[i].grad = call.wait()
                except Exception as exc:  # noqa: BLE001 - as above
                    error, failed = error or exc, True
            if failed:
                continue
            # (run here: _gather has just made every .grad its view)
            if calls or not (here or _all_views(b)):
                for i, (p, view) in enumerate(zip(b.params, b.views)):
                    if i in calls:
                        continue
                    if p.grad is not view:  # replaced since the bucket started: gets it too
                        if p.grad is None:
                            p.grad = view
                        else:
                            with torch.no_grad():
                                p.grad.copy_(view)
            if b.sparse and self._mlf_sparse_as_dense:
                _resparsify(b)
        fired, last = self._mlf_last, self._mlf_seen.param
        self._mlf_reset()
        if error is not None:
            raise error
        self._mlf_synchronized = self._mlf_sync_called = True
        if not self._mlf_early:
            self._mlf_watch(fired, last)

    def _mlf_watch(self, fired, last):
        """After a reduction, the last bucket's Python hooks (fired: its hooked slot that came
        last, last: its parameter whose gradient came last). The first time gradients came to
        it, keep the hook of the one that came last (the sentinel) and remove the others'.
        Later, where gradients came but not to the sentinel (a branch not taken), move the hook
        to the one that came last. The guards watch the sentinel and the other buckets."""
        if last is None or (self._mlf_sentinel is not None and fired is not None):
            return  # nothing came to the last bucket, or the sentinel saw it
        params, slots, hooks = self._mlf_params, self._mlf_slots, self._mlf_hooks
        tail = len(params) - len(self._mlf_buckets[-1].params)  # the last bucket's first slot
        i = next(k for k in range(tail, len(params)) if params[k] is last)
        if self._mlf_sentinel is None:  # the first time: every one of them is hooked
            for k in range(tail, len(params)):
                if k != i:
                    hooks[k].remove()
        else:
            hooks[slots.index(self._mlf_sentinel)].remove()
            hooks[i] = last.register_post_accumulate_grad_hook(
                functools.partial(_hook, weakref.ref(self), i))
        slots[i].delay = self._mlf_passes
        self._mlf_sentinel = slots[i]
        self._mlf_live = slots[:tail] + [slots[i]]

    def _mlf_reset(self):
        for s in self._mlf_live:
            s.delay = self._mlf_passes
        for b in self._mlf_buckets:
            b.waiting = len(b.params)
        self._mlf_done = 0
        self._mlf_next = 0
        self._mlf_last = self._mlf_seen.param = None
        self._mlf_open = set()
        self._mlf_newest = -1
        self._mlf_passes_seen = 0
        if self._mlf_ref in dispatch.UNSTARTED:  # (zero_grad() after passes that started nothing)
            dispatch.UNSTARTED.remove(self._mlf_ref)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, step() does not synchronize: for code that calls synchronize() itself first
        (e.g. to clip the reduced gradients)."""
        self._mlf_should_sync = False
        try:
            yield
        finally:
            self._mlf_should_sync = True

    # --- the wrapped optimizer's methods --------------------------------------------------------

    def step(self, closure=None):
        if self._mlf_op == ops.Adasum:
            self._mlf_check_unreduced()
            return _adasum.optimizer_step(self._mlf_adasum, lambda: super(
                _DistributedOptimizer, self).step(closure), self._mlf_compression,
                self._mlf_process_set)
        if self._mlf_should_sync:
            if self._mlf_sync_called:
                # Horovod's warning, word for word at its start: code that synchronizes
                # itself (to clip, say) says so with skip_synchronize(), so that step() is
                # not read as reducing the gradients a second time
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). step() reduces only "
                              "gradients that came since; wrap it in `with "
                              "optimizer.skip_synchronize():` when synchronize() was called "
                              "for the step (e.g. to clip the reduced gradients)",
                              UserWarning, stacklevel=2)
            self.synchronize()
        self._mlf_synchronized = self._mlf_sync_called = False
        self._mlf_check_unreduced()
        return super().step(closure)

    def _mlf_check_unreduced(self):
        """Refuse to step parameters whose gradients are not reduced and that require a
        gradient now: they did not when the optimizer was built (a frozen layer unfrozen since,
        as in fine-tuning), or came by add_param_group. Each rank would step on its own
        gradient and the replicas drift apart silently (Horovod's behaviour). requires_grad,
        not a gradient present: that is the same on every rank, so all refuse together."""
        groups = self.param_groups
        shape = (len(groups), sum(len(g["params"]) for g in groups))
        if shape != self._mlf_groups:  # the first step, add_param_group, params added in place
            skip = self._mlf_reduced | self._mlf_local
            self._mlf_unreduced = [p for g in groups for p in g["params"] if id(p) not in skip]
            self._mlf_groups = shape
        if not any(map(_REQUIRES_GRAD, self._mlf_unreduced)):  # a loop in C
            return
        late = [p for p in self._mlf_unreduced if p.requires_grad]
        shown = [self._mlf_names.get(id(p), f"shape {tuple(p.shape)}") for p in late[:5]]
        raise MlfabricError(
            f"DistributedOptimizer: {len(late)} parameter(s) ({', '.join(shown)}) require "
            "gradients that are not reduced over the ranks: they did not when the optimizer "
            "was built, or were added by add_param_group (the gradient buckets are fixed at "
            "construction). Build the DistributedOptimizer again once the parameters to train "
            "are set")

    def set_backward_passes_per_step(self, passes):
        """Horovod's: accumulate `passes` backward passes locally before each reduction, from
        now on. Call it between steps, with the same value on every rank (a rank with another
        count fails at its next reduction with a MismatchError, on every rank)."""
        _check_passes(passes)
        if self._mlf_next or any(s.delay != self._mlf_passes for s in self._mlf_live) or \
                self._mlf_seen.param is not None:
            raise MlfabricError("set_backward_passes_per_step() was called after backward "
                                "passes of this step: call it after step() (or "
                                "synchronize())")
        self._mlf_passes = passes
        self._mlf_reset()

    # torch's Optimizer wraps a class's step() to run step hooks; the wrapped optimizer's own
    # step() (called above) already does, so this one is marked as done.
    step.hooked = True

    def zero_grad(self, set_to_none=True):
        if self._mlf_next or self._mlf_done:
            raise MlfabricError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients are being reduced. "
                "Call step() (or synchronize()) first")
        self._mlf_reset()  # an accumulation of backward passes starts again
        self._mlf_sync_called = False  # (a synchronize() before it was not for the next step)
        if self._mlf_op == ops.Adasum:  # no buckets
            return super().zero_grad(set_to_none)
        # A gradient that is its bucket's view stays one, zeroed, even with set_to_none: backward
        # then accumulates straight into the bucket, and the bucket's start has nothing to copy
        # in or re-point (about 0.5 ms a step for 100 small parameters on the 2-core VM). Every
        # reduced parameter has a gradient after synchronize() anyway (zeros where backward made
        # none, Horovod's rule), so step() sees the same gradients either way.
        kept, zeroed = set(), []
        for b in self._mlf_buckets:
            views = [v for p, v in zip(b.params, b.views) if p.grad is v]
            zeroed += [b.flat] if len(views) == len(b.params) else views
            kept.update(map(id, views))
        if zeroed:
            torch._foreach_zero_(zeroed)
        for group in self.param_groups:  # the others as torch's zero_grad() treats them
            for p in group["params"]:
                g = p.grad
                if g is None or id(g) in kept:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if g.grad_fn is not None:
                        g.detach_()
                    else:
                        g.requires_grad_(False)
                    g.zero_()


class _OutsideOptimizer:
    """Mixed in front of the wrapped optimizer's class on a rank outside the optimizer's
    process_set, as Horovod does there: nothing is reduced, step() steps on this rank's own
    gradients, synchronize() does nothing (so one script can build every rank's optimizer)."""

    def synchronize(self):
        pass

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def set_backward_passes_per_step(self, passes):
        _check_passes(passes)


def _outside(process_set):
    """Whether this rank is outside process_set (registered; else the usual path raises)."""
    if process_set is None or not _context.initialized() or _respawn.joining:
        return False
    included = getattr(process_set, "included", None)
    return callable(included) and included() is False


def _check_passes(passes):
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")


def _construction_state(process_set):
    """The state whose ranks make a DistributedOptimizer's construction round (raising where
    this rank is not in process_set), or None: not initialised, or a replacement rank built
    before its first sync (the others make no construction round, and its buckets stay
    private, as theirs)."""
    st = dispatch.state(process_set) if _context.initialized() else None
    return None if _respawn.joining else st


def _construction_round(st, layout, device, problem):
    """Every rank's construction, compared: one allgather of (the model's hash, whether it is on
    a GPU, whether this rank's arguments were fine), in the calls' queue, in order with them.
    Raises this rank's `problem` after it, or a MismatchError naming the ranks that had one;
    else returns whether the gradient buckets go in shared memory: every rank on this host
    (MLFABRIC_SHM on) and the same CPU model everywhere, so each bucket's allreduce reads the
    peers' buckets in place (zero-copy: 3-6x faster for 16 MB here) instead of copying through
    the engine's segment. Ranks with different models get private buckets, and the first
    bucket's allreduce reports the mismatch on every rank, naming the ranks."""
    if st is None:  # not initialised
        if problem is not None:
            raise problem
        return False
    mine = np.array([layout, device.type != "cpu", problem is None], np.int64)
    every = st.run("DistributedOptimizer (construction)",
                   lambda: _coll.allgather(mine)).reshape(-1, 3)
    if problem is not None:
        raise problem
    bad = np.flatnonzero(every[:, 2] == 0)
    if bad.size:
        raise MismatchError(f"DistributedOptimizer: rank(s) {bad.tolist()} refused their "
                            "arguments (see the error on those ranks); nothing was set up")
    return bool(st.ctx.shm is not None and device.type == "cpu"
                and (every[:, :2] == every[0, :2]).all())


def _first_cap(order, threshold):
    """The first bucket's cap: DDP's 1 MiB, so that the first allreduce starts early in
    backward, unless every gradient fits in one bucket. Then the model gets one bucket, run by
    synchronize() right after backward (as in Horovod, whose 5 ms cycle fuses a small model's
    gradients into one allreduce): a first bucket apart would hide little of so small a
    reduction and cost a second allreduce, its hand-off to the queue thread and a Python hook
    per gradient (100 gradients of 16 KiB: 2.2x the cost of one bucket, BENCHMARKS.md)."""
    if sum(p.numel() * p.element_size() for p in order) <= threshold:
        return threshold
    return min(FIRST_BUCKET, threshold)


def _bucket_buffers(st, buckets, shared):
    """A zeroed flat buffer per bucket (a list of parameters), on the parameters' device; cut
    from one shared buffer per dtype when `shared` (every rank decided the same: the
    allocation is collective, so it runs in the calls' queue; one window per dtype, as a window
    per bucket could run into MPI's limits with many small buckets). When the filesystem behind
    shared memory (/dev/shm) cannot hold them, every rank keeps its buckets in private memory
    instead (the allreduces then copy through the engine's segment), with a warning."""
    specs = [(sum(p.numel() for p in ps), ps[0].dtype) for ps in buckets]

    def private():
        device = buckets[0][0].device if buckets else torch.device("cpu")
        return [torch.zeros(n, dtype=dt, device=device) for n, dt in specs]

    if not shared:
        return private()

    def job():
        totals = {}
        for n, dt in specs:
            totals[dt] = totals.get(dt, 0) + n
        what = "DistributedOptimizer (gradient buckets)"
        try:
            # all dtypes' room agreed at once, so that none is allocated when one would not fit
            st.ctx.shm.check_space(sum(n * dt.itemsize for dt, n in totals.items()), what)
            pools = {dt: _shared.shared_empty(n, dt).zero_() for dt, n in totals.items()}
        except _shared.ShmSpaceError as exc:  # on every rank alike
            if st.ctx.shm.rank == 0:
                warnings.warn(f"DistributedOptimizer keeps its gradient buckets in private "
                              f"memory (allreduces copy them, not zero-copy): {exc}",
                              RuntimeWarning, stacklevel=2)
            return private()
        flats, at = [], dict.fromkeys(pools, 0)
        for n, dt in specs:
            flats.append(pools[dt][at[dt]:at[dt] + n])
            at[dt] += n
        return flats

    return st.run("DistributedOptimizer (gradient buckets)", job)


def _remove_hooks(handles):
    for h in handles:
        h.remove()


def _unshare(ref):
    opt = ref()
    if opt is not None:
        for b in opt._mlf_buckets:
            b.unshare()


def _gather(b, sparse_as_dense):
    """Point every .grad of bucket b at its view of the bucket. Gradients made elsewhere (fresh
    from autograd: the first step, or after model.zero_grad()) are copied in with one call;
    parameters without a gradient get zeros (Horovod's rule). Sparse gradients are densified if
    sparse_as_dense (a COO one's position noted in b.sparse: synchronize() makes its result
    sparse again, _resparsify); else they stay as they are, reduced by sparse.py: returned as
    (position, gradient). A member whose gradients came sparse before and that has none now
    contributes an empty sparse gradient (zeros, as a dense one would), so every rank still
    issues the same calls."""
    if _all_views(b):  # the usual case, from the second step on
        return []
    moved, views, grads, absent, sparse = [], [], [], [], []
    for i, (p, view) in enumerate(zip(b.params, b.views)):
        g = p.grad
        if g is view:
            continue
        if g is None and i in b.sparse and not sparse_as_dense:
            sparse.append((i, _empty_sparse(p, b.sparse[i])))
            continue
        if g is None:
            absent.append(view)
        elif g.layout != torch.strided and not sparse_as_dense:
            b.sparse[i] = g.sparse_dim() if g.layout == torch.sparse_coo else 1
            sparse.append((i, g))
            continue
        elif g.layout != torch.strided:
            if g.layout == torch.sparse_coo:
                b.sparse[i] = g.sparse_dim()
            views.append(view)
            grads.append(g.to_dense())
        else:
            views.append(view)
            grads.append(g)
        moved.append((p, view))
    with torch.no_grad():
        if grads:
            torch._foreach_copy_(views, grads)
        if absent:
            torch._foreach_zero_(absent)
    for p, view in moved:
        p.grad = view
    return sparse


_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _all_views(b):
    """Whether every .grad of bucket b is its view of the bucket; a loop in C (~8 us for 100
    parameters, where a Python loop takes ~25 on the 2-core VM)."""
    return all(map(operator.is_, map(_GRAD, b.params), b.views))


def _resparsify(b):
    """sparse_as_dense: the members of bucket b whose gradients came sparse (COO) get their
    reduced gradient back as a sparse tensor (the rows holding a non-zero), as in Horovod, so
    that optimizers taking only sparse gradients (torch.optim.SparseAdam) step on it. A copy
    of the bucket's slice: the next backward pass accumulates into it, and the bucket's start
    copies it in again, densified."""
    with torch.no_grad():
        for i, sparse_dim in b.sparse.items():
            b.params[i].grad = b.views[i].to_sparse(sparse_dim)


def _empty_sparse(p, sparse_dim):
    """A sparse gradient of p with no entries."""
    return torch.sparse_coo_tensor(
        torch.empty((sparse_dim, 0), dtype=torch.int64, device=p.device),
        torch.empty((0, *p.shape[sparse_dim:]), dtype=p.dtype, device=p.device), p.shape,
        check_invariants=False)  # nothing to check


def _dense_runs(b, sparse):
    """[lo, hi) element ranges of bucket b holding its members other than the positions in
    sparse, neighbours merged: the whole bucket when sparse is empty."""
    if not sparse:
        return [(0, b.flat.numel())]
    runs, at = [], 0
    for i, p in enumerate(b.params):
        n = p.numel()
        if i not in sparse:
            if runs and runs[-1][1] == at:
                runs[-1] = (runs[-1][0], at + n)
            else:
                runs.append((at, at + n))
        at += n
    return runs


def _names(named_parameters, params):
    """id(param) -> name, from named_parameters (checked) or generated."""
    if named_parameters is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if not all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[1], torch.Tensor)
               for e in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, such as "
                         "model.named_parameters()")
    seen, repeated = set(), set()
    for name, _ in named:
        (repeated if name in seen else seen).add(name)
    if repeated:
        raise ValueError(f"parameter names in named_parameters must be unique; repeated: "
                         f"{sorted(repeated)}")
    by_id = {id(p): name for name, p in named}
    missing = [tuple(p.shape) for p in params if id(p) not in by_id]
    if missing:
        raise ValueError(f"named_parameters was given, but {len(missing)} parameter(s) of the "
                         f"optimizer are not in it (shapes {missing[:5]})")
    return by_id


def _local_parameters(local_layers):
    """ids of the parameters of local_layers (None: DistributedOptimizer, nothing local)."""
    if local_layers is None:
        return frozenset()
    if not isinstance(local_layers, (list, tuple)) or not all(
            isinstance(m, torch.nn.Module) for m in local_layers):
        raise TypeError("local_layers must be a list of torch.nn.Module, got "
                        f"{local_layers!r:.80}")
    return frozenset(id(p) for m in local_layers for p in m.parameters())


def _grouped_plan(order, groups):
    """Buckets (lists of indices into order, the parameters in reverse) from Horovod's groups:
    an int k > 0 splits order into k runs of near-equal count; a list of lists of parameters
    makes each list a bucket (one per dtype), and each parameter in none a bucket of its own.
    Explicit groups ignore the fusion threshold. Buckets start in order of their last member
    (the earliest layer's, whose gradient comes last): the order they become ready in."""
    if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
        raise ValueError(f"groups must be an int >= 0 or a list of lists of parameters, got "
                         f"{type(groups).__name__}")
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups (num_groups) must be >= 0, got {groups}")
        runs = [r.tolist() for r in np.array_split(np.arange(len(order)), groups) if r.size]
    else:
        where = {id(p): i for i, p in enumerate(order)}
        runs, placed = [], set()
        for k, group in enumerate(groups):
            if not isinstance(group, (list, tuple)):
                raise ValueError(f"groups[{k}] must be a list of parameters, got "
                                 f"{type(group).__name__}")
            run = []
            for t in group:
                i = where.get(id(t))
                if i is None:
                    raise ValueError(f"groups[{k}] holds a tensor that is not one of the "
                                     "optimizer's parameters needing a gradient (shape "
                                     f"{tuple(getattr(t, 'shape', ()))})")
                if i in placed:
                    raise ValueError(f"groups[{k}]: a parameter (shape {tuple(t.shape)}) is in "
                                     "more than one group")
                placed.add(i)
                run.append(i)
            if run:
                runs.append(sorted(run))
        runs += [[i] for i in range(len(order)) if i not in placed]
    plan = [[run[j] for j in members]
            for run in runs for members in ops.fuse([order[i] for i in run], float("inf"))]
    return sorted(plan, key=lambda members: members[-1])


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=ops.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=None):
    """Wrap optimizer so that step() first averages (op=Average) or sums (op=Sum) the
    gradients over all ranks (op=Adasum: steps on this rank's own gradients, then combines the
    parameters' changes by Adasum; see adasum.py). Returns an object of a subclass of the
    optimizer's class sharing its parameter groups and state; use it in place of the optimizer.

    named_parameters: model.named_parameters(), for names in messages (optional).
    compression: Compression.none or Compression.fp16 (gradients sent as float16).
    backward_passes_per_step: backward passes accumulated locally before reducing.
    gradient_predivide_factor: with op=Average, scale by 1/f before the sum and f/size after.
    groups (or num_groups, its older name): explicit gradient buckets in place of the fusion
    threshold's: an int k splits the parameters (in reverse order) into k buckets of about
    equal count; a list of lists of parameters makes each list a bucket, and each parameter in
    none a bucket of its own. Every rank must pass the same groups.
    sparse_as_dense: densify sparse gradients (nn.Embedding(sparse=True)) and reduce them with
    the dense ones (.grad is then the reduced gradient made sparse again, as in Horovod: the
    rows holding a non-zero); without it (the default) they are reduced as sparse tensors, as
    Horovod does (allgathers of the rows present; .grad becomes the reduced, coalesced sparse
    tensor).
    process_set: reduce among that set's ranks only (process_sets.py); default every rank. On
    a rank outside the set nothing is reduced: step() uses its own gradients (Horovod's rule).

    The parameters' .grad become views of the optimizer's gradient buckets (see the module
    docstring); leave them alone between backward() and step() / synchronize().
    """
    return _wrap(optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
                 None)


def PartialDistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                                backward_passes_per_step=1, op=ops.Average,
                                gradient_predivide_factor=1.0, num_groups=0, groups=None,
                                sparse_as_dense=False, process_set=None, local_layers=None):
    """DistributedOptimizer, except that the parameters of local_layers (a list of
    torch.nn.Module) keep this rank's own gradients: they are not reduced, and may differ in
    number and shape between ranks (a per-rank head, say), as in Horovod's
    PartialDistributedOptimizer. The other arguments are DistributedOptimizer's; groups may not
    name a local parameter."""
    return _wrap(optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
                 [] if local_layers is None else local_layers)


def _wrap(optimizer, named_parameters, compression, backward_passes_per_step, op,
          gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
          local_layers):
    if not isinstance(optimizer, torch.optim.Optimizer):
        problem = TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
    elif isinstance(optimizer, (_DistributedOptimizer, _OutsideOptimizer)):
        problem = ValueError("this optimizer is already a DistributedOptimizer")
    else:
        problem = None
    outside = _outside(process_set)
    if problem is not None and outside:
        raise problem
    if problem is not None:  # in the construction round, so that the peers hear of it
        _construction_round(_construction_state(process_set), 0, torch.device("cpu"), problem)
    mixin = _OutsideOptimizer if outside else _DistributedOptimizer
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # shares param_groups, state and hooks
    if outside:  # its arguments checked as on the set's ranks; no round (theirs is theirs)
        _DistributedOptimizer._mlf_check(wrapped, named_parameters, compression,
                                         backward_passes_per_step, op,
                                         gradient_predivide_factor,
                                         _local_parameters(local_layers))
        return wrapped
    wrapped._mlf_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                       process_set, local_layers)
    return wrapped
