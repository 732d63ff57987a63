"""op=Adasum for allreduce (Horovod's hvd.Adasum): adaptive summation of the ranks' tensors.

Two vectors a and b combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its vector is zero): parallel vectors are averaged, orthogonal ones
summed. The ranks' tensors (flattened) combine as a binary tree over rank order, the pairs at
distance 1 first, then 2, 4, ...: ((t0, t1), (t2, t3)), ... as Horovod's recursive halving does
for a power-of-two count; with other counts the last one of an odd level moves up unpaired.

How it runs: one allgather of the tensors (in the tensor's dtype, on its device, CPU or GPU),
then every rank computes the same tree in float64 (dot products and sums), so every rank gets
the same result, rounded to the tensor's dtype. That moves size() - 1 tensors into each rank,
where a ring allreduce moves about 2: it is meant for moderate rank counts, not for speed.
prescale_factor multiplies each input, postscale_factor the result. A rank inside join()
contributes nothing (the tree is over the ranks that called). Not differentiable; allreduce and
its forms only, and DistributedOptimizer(op=Adasum) (optimizer_step below).

DistributedOptimizer(op=Adasum), as Horovod's: gradients are not reduced; step() runs the
wrapped optimizer on this rank's own gradients (its state, momentum say, stays this rank's),
then each parameter's change over that step is combined over the ranks by Adasum and applied
from where the step started, so every rank ends with the same parameters. Equal to Horovod's,
which steps parameter by parameter from gradient hooks, for optimizers that update each
parameter from its own gradient and state (SGD, Adam, ...: all of torch's but LBFGS).
"""
import math

import torch

from . import arguments, control, dispatch, ops
from .arguments import Adasum  # noqa: F401  (op=Adasum)


def combine(a, b):
    """adasum(a, b) of two float64 1-D tensors."""
    dot = torch.dot(a, b)
    na, nb = torch.dot(a, a), torch.dot(b, b)
    ca = 1 - dot / (2 * na) if na > 0 else 1.0
    cb = 1 - dot / (2 * nb) if nb > 0 else 1.0
    return ca * a + cb * b


def tree(vectors):
    """The ranks' float64 vectors combined pairwise at distance 1, 2, 4, ... in rank order."""
    level = list(vectors)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return level[0]


def call(tensor, name, pre, post, inplace, async_, process_set=None):
    """allreduce(tensor, op=Adasum) in its blocking, async and in-place forms."""
    what = control.call_name("allreduce", name) + " (op Adasum)"

    def plan(st):
        arguments.check_name(name)
        code = arguments.check_tensor(tensor, what)
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"{what}: needs a floating tensor, got {tensor.dtype}")
        if inplace:
            arguments.check_writable(tensor, what)
        factors = (arguments.check_factor(pre, what, "prescale_factor"),
                   arguments.check_factor(post, what, "postscale_factor"))
        shape = tuple(tensor.shape)
        # an allgather of one row per rank; the whole shape (and the op) must agree
        desc = control.describe(control.ALLGATHER, code, shape=(1, math.prod(shape)), name=name,
                                tensor=tensor)
        desc[control.ROW_HASH] = control.stable_hash(("adasum", shape))
        return desc, factors

    def job(st, planned):
        desc, (pre_f, post_f) = planned
        table = control.agree(st, desc, what)
        src = tensor.detach()
        mine = src.reshape(1, src.numel())
        if pre_f != 1.0:
            mine = mine * pre_f
        out = tree(list(ops.gather(table, mine)[0].to(torch.float64)))
        if post_f != 1.0:
            out = out * post_f
        out = out.view(src.shape).to(src.dtype)
        if inplace:
            src.copy_(out)
            return tensor
        return out

    return dispatch.issue(what, plan, job, async_, tensor if isinstance(tensor, torch.Tensor)
                          else None, process_set=process_set)


def optimizer_step(params, inner_step, compression, process_set):
    """DistributedOptimizer(op=Adasum).step(): params, (parameter, name) pairs in the same order
    on every rank; inner_step(), the wrapped optimizer's step; returns its result. The deltas
    travel as `compression` makes them (Compression.fp16: float16)."""
    starts = [p.detach().clone() for p, _ in params]
    loss = inner_step()
    with torch.no_grad():
        pending = []
        for (p, name), start in zip(params, starts):
            sent, cctx = compression.compress(p.detach() - start)
            pending.append((call(sent, f"DistributedOptimizer.{name}", 1.0, 1.0, False, True,
                                 process_set), cctx))
        error = None
        for (p, _), start, (handle, cctx) in zip(params, starts, pending):
            try:
                p.copy_(start + compression.decompress(ops.synchronize(handle), cctx))
            except Exception as exc:  # noqa: BLE001 - wait for every handle, then raise
                error = error or exc
        if error is not None:
            raise error
    return loss
