"""DistributedOptimizer: Horovod's wrapper that averages (or sums) gradients over all ranks before
the wrapped optimizer's step().

How it works:
- gradient buckets are fixed at construction: the parameters in reverse order (gradients become
  ready roughly from the last layer back), fused per dtype into buckets of at most
  MLFABRIC_FUSION_THRESHOLD bytes (default 64 MiB). Every rank builds the same buckets from the
  same model, and buckets always start in bucket order, so every rank issues the same
  allreduces in the same order whatever order its hooks fire in;
- a hook after each gradient accumulation (register_post_accumulate_grad_hook) counts the
  backward passes of its parameter; when the last parameter of a bucket has had
  backward_passes_per_step passes, the bucket (and any ready buckets after it) starts an async
  allreduce, so communication overlaps the rest of backward;
- synchronize() starts the buckets still waiting (parameters without a gradient contribute
  zeros and get a zero gradient, as in Horovod), waits for all, and writes the results into
  .grad; step() calls it unless inside skip_synchronize(), then runs the wrapped step();
- zero_grad() while gradients are being reduced is an error (Horovod's guard).

Gradients of the backward_passes_per_step passes add up locally (no division), then op Average
divides by size() (gradient_predivide_factor f: multiplied by 1/f before the sum and f/size
after), op Sum does not.
"""
import contextlib
import weakref

import torch

from ..errors import MlfabricError
from . import ops
from .compression import Compression, check as _check_compression


class _Bucket:
    __slots__ = ("index", "params", "name", "waiting", "pending")

    def __init__(self, index, params, names):
        self.index, self.params = index, params
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        self.name = f"gradients[{index}]: {shown}"
        self.waiting = len(params)  # parameters not yet through all their backward passes
        self.pending = None         # (handle, buffer, compression ctx) once started


def _hook(ref, param):
    opt = ref()
    if opt is not None:
        opt._mlf_grad_ready(param)


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's class (see DistributedOptimizer())."""

    def _mlf_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor):
        op = ops._resolve_op(op, None)
        if op not in (ops.Average, ops.Sum):
            raise ValueError(f"DistributedOptimizer supports op Average or Sum, got {op}")
        if gradient_predivide_factor != 1.0 and op != ops.Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                             f"{backward_passes_per_step!r}")
        params, seen = [], set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        names = _names(named_parameters, params)
        self._mlf_op = op
        self._mlf_compression = _check_compression(compression)
        self._mlf_passes = backward_passes_per_step
        self._mlf_predivide = float(gradient_predivide_factor)
        # Buckets from the parameters in reverse order: the last layers' gradients come first.
        order = params[::-1]
        self._mlf_buckets = [
            _Bucket(b, [order[i] for i in members], [names[id(order[i])] for i in members])
            for b, members in enumerate(ops.fuse(order, ops.fusion_threshold()))]
        self._mlf_bucket_of = {id(p): b for b in self._mlf_buckets for p in b.params}
        # Every bucket's allreduce carries the whole model's dtypes and shapes: ranks holding
        # different models fail together at the first bucket.
        self._mlf_signature = tuple((str(p.dtype), tuple(p.shape)) for p in params)
        self._mlf_delay = {id(p): backward_passes_per_step for p in params}
        self._mlf_next = 0              # the next bucket to start
        self._mlf_synchronized = False  # reduced since the last backward pass / step()
        self._mlf_should_sync = True    # False inside skip_synchronize()
        ref = weakref.ref(self)
        self._mlf_hooks = [p.register_post_accumulate_grad_hook(
            lambda param, ref=ref: _hook(ref, param)) for p in params]

    # --- reduction ---------------------------------------------------------------------------

    def _mlf_grad_ready(self, p):
        key = id(p)
        if self._mlf_delay[key] <= 0:
            raise MlfabricError(
                "gradients were computed more than backward_passes_per_step "
                f"({self._mlf_passes}) times before step() or synchronize(); raise "
                "backward_passes_per_step to accumulate more passes locally")
        self._mlf_delay[key] -= 1
        self._mlf_synchronized = False
        if self._mlf_delay[key] == 0:
            self._mlf_bucket_of[key].waiting -= 1
            self._mlf_start(force=False)

    def _mlf_start(self, force):
        """Start buckets in bucket order: each one once it is ready (or now, if force)."""
        buckets = self._mlf_buckets
        while self._mlf_next < len(buckets):
            b = buckets[self._mlf_next]
            if b.waiting and not force:
                return
            self._mlf_next += 1
            grads = [(p.grad.detach() if p.grad is not None
                      else torch.zeros_like(p, memory_format=torch.contiguous_format))
                     for p in b.params]
            for p, g in zip(b.params, grads):
                if g.layout != torch.strided:
                    raise MlfabricError(f"the gradient of a parameter in {b.name} is sparse; "
                                        "DistributedOptimizer reduces dense gradients only")
            buf = torch.cat([g.reshape(-1) for g in grads])
            post = 1.0
            if self._mlf_predivide != 1.0:
                buf.mul_(1.0 / self._mlf_predivide)
                post = self._mlf_predivide
            sent, cctx = self._mlf_compression.compress(buf)
            handle = ops._allreduce_call(sent, self._mlf_op, None, b.name, 1.0, post, True, True,
                                         layout=(b.index, self._mlf_signature))
            b.pending = (handle, sent, cctx)

    def synchronize(self):
        """Finish reducing the gradients and write them into .grad. Called by step() unless
        inside skip_synchronize(); calling it again before the next backward pass does nothing."""
        if self._mlf_synchronized:
            return
        self._mlf_start(force=True)
        error = None
        for b in self._mlf_buckets:
            if b.pending is None:  # its start failed (the error was raised then)
                continue
            handle, _, cctx = b.pending
            b.pending = None
            try:
                reduced = self._mlf_compression.decompress(ops.synchronize(handle), cctx)
            except Exception as exc:  # noqa: BLE001 - wait for every bucket, then raise
                error = error or exc
                continue
            off = 0
            with torch.no_grad():
                for p in b.params:
                    g = reduced[off:off + p.numel()].view(p.shape)
                    off += p.numel()
                    if p.grad is None:
                        p.grad = g.to(p.dtype).clone()
                    else:
                        p.grad.copy_(g)
        self._mlf_reset()
        if error is not None:
            raise error
        self._mlf_synchronized = True

    def _mlf_reset(self):
        for key in self._mlf_delay:
            self._mlf_delay[key] = self._mlf_passes
        for b in self._mlf_buckets:
            b.waiting = len(b.params)
        self._mlf_next = 0

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
        if self._mlf_should_sync:
            self.synchronize()
        self._mlf_synchronized = False
        return super().step(closure)

    # torch's Optimizer wraps a class's step() to run step hooks; the wrapped optimizer's own
    # step() (called above) already does, so this one is marked as done.
    step.hooked = True

    def zero_grad(self, set_to_none=True):
        if self._mlf_next or any(d == 0 for d in self._mlf_delay.values()):
            raise MlfabricError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients are being reduced. "
                "Call step() (or synchronize()) first")
        self._mlf_reset()  # an accumulation of backward passes starts again
        return super().zero_grad(set_to_none)


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


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=ops.Average,
                         gradient_predivide_factor=1.0):
    """Wrap optimizer so that step() first averages (op=Average) or sums (op=Sum) the
    gradients over all ranks. Returns an object of a subclass of the optimizer's class sharing
    its parameter groups and state; use it in place of the optimizer.

    named_parameters: model.named_parameters(), for names in messages (optional).
    compression: Compression.none or Compression.fp16 (gradients sent as float16).
    backward_passes_per_step: backward passes accumulated locally before reducing.
    gradient_predivide_factor: with op=Average, scale by 1/f before the sum and f/size after.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # shares param_groups, state and hooks
    wrapped._mlf_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor)
    return wrapped
