"""mlfabric.torch's tensor collectives, with horovod.torch's names and semantics: allreduce,
grouped_allreduce, allgather, broadcast, alltoall, reducescatter (and their in-place `_` and
`_async` forms), synchronize / poll on integer handles, join and barrier, the reduction ops
(Average, Sum, Min, Max, Product, Adasum), on top of mlfabric's collectives.

Each call checks its arguments (arguments.py), is issued in order on its process set's queue
(dispatch.py), agrees with the other ranks on what it is in a control round (control.py), and
then moves its data: fused with like calls where it can be (fusion.py), on mlfabric's GPU
streams for CUDA tensors (streams.py). This module owns what each call does with its data,
and these semantics:

- join (Horovod's): a joined rank takes part in the others' calls until every rank has
  joined. In an allreduce or reducescatter it contributes the op's identity (zeros for Sum and
  Average, as in Horovod; +inf / -inf / 1 for Min / Max / Product; its own rows of a
  reducescatter are dropped), and Average still divides by size(), the joined ranks included:
  Horovod averages over all ranks too. An allgather, alltoall or broadcast while a rank is
  joined is an error on the active ranks, as in Horovod (a MismatchError saying why; the joined
  rank stays joined), unless every joined rank joined with join(all_calls=True): then it
  contributes no rows to an allgather or alltoall and receives in a broadcast (a joined root
  is an error on every rank).
  While joined, a rank waits for the others' next call at most MLFABRIC_TIMEOUT seconds.
- devices: CPU tensors move through mlfabric's host paths, CUDA tensors over NCCL (every rank's
  tensor of a call on the same kind of device: the descriptor carries it).
- dtypes: float32, float64, float16, bfloat16, int32 and int64 travel as they are; uint8, int8,
  int16 and bool travel widened to int64 and come back narrowed (exact: integer sums wrap the way
  the dtype does).
- scaling (Horovod's): prescale_factor multiplies each rank's input, postscale_factor the reduced
  result, and Average is a Sum whose result is multiplied by 1 / size() (with postscale_factor:
  by postscale_factor / size()). A floating tensor scales in its own precision (float16 on the
  CPU through float32), an integer tensor in float64, truncated toward zero back to its dtype
  (so an integer Average of 7 and 8 over two ranks is 7). Every rank gets the same bits. A bool
  tensor takes no Average or factors.
- autograd: allreduce, grouped_allreduce, allgather, broadcast, alltoall and reducescatter are
  differentiable as in Horovod (>= 0.22): the gradient of an allreduce is the allreduce (same op
  and factors) of the gradient; of an allgather, this rank's rows of the averaged gradient; of a
  broadcast, the averaged gradient on the root and zeros elsewhere; of an alltoall, the alltoall
  back; of a reducescatter, Horovod's: the allgather of the gradient, times prescale_factor and
  postscale_factor, and times size() for op Sum (reducescatter's grad="local" gives the local
  derivative instead, size() times smaller).

The ``*_call`` functions are the calls' common form, for the other modules of mlfabric.torch.
"""
import math
import zlib

import numpy as np
import torch
from torch.autograd.graph import increment_version as _increment_version

from .. import _C
from ..comm import collectives as _coll
from ..errors import MlfabricError
from . import adasum as _adasum
from . import control as _control
from . import dispatch as _dispatch
from . import fusion as _fusion
from . import tensor_meta as _meta
from .arguments import (CORE_OPS, DTYPE_CODE, DTYPES, ReducePlan, check_name, check_rows,
                        check_tensor, check_writable, resolve_op, scan_tensors, wire_dtype)
from .arguments import Adasum, Average, Max, Min, Product, Sum  # noqa: F401  (hvd.Average, ...)
from .compression import Compression, check as _check_compression
from .control import (ACTIVE, ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, DEVICE, DIMS,
                      DTYPE, JOINED, JOINED_AT, KIND, MAX_DIMS, NDIM, OP, REDUCESCATTER, ROOT,
                      ROW_LEN, ROWS, STATE, W, call_name, control_round, describe, disagreement,
                      everyone, stable_hash)
from .dispatch import reject_call
from .fusion import fuse, fusion_threshold  # noqa: F401  (ops.fusion_threshold(), ops.fuse())


# --- handles --------------------------------------------------------------------------------------

def synchronize(handle):
    """Wait for an ``*_async`` call and return its result: what the blocking form returns (for
    ``alltoall_async``, ``(output, received_splits)``). Raises the call's error, if any."""
    st = _dispatch.state()
    h = st.handles.pop(handle, None)
    if h is None:
        raise ValueError(f"unknown handle {handle!r}: not from an *_async call since init(), or "
                         "already synchronized")
    return h.wait()


def poll(handle):
    """True once the call behind handle has finished (synchronize() then returns at once)."""
    st = _dispatch.state()
    h = st.handles.get(handle)
    if h is None:
        raise ValueError(f"unknown handle {handle!r}: not from an *_async call since init(), or "
                         "already synchronized")
    return h.done()


# --- allreduce ------------------------------------------------------------------------------------

def _wire_copy(t, plan):
    """A new contiguous wire-dtype copy of t (same shape), prescaled."""
    buf = torch.empty(t.shape, dtype=wire_dtype(t.dtype), device=t.device)
    buf.copy_(t)
    return plan.prescale_(buf)


def _reduce_one(member, plan):
    """One call's allreduce (after its control round): straight into the tensor where it can
    be, else through a wire copy. Its result: the tensor (in place) or a tensor of its own."""
    src = member.tensor.detach()
    if member.inplace and src.is_contiguous() and wire_dtype(src.dtype) == src.dtype \
            and plan.pre == 1.0:
        _fusion.allreduce_flat(src.view(-1), plan)
        _increment_version([src])  # as an in-place torch op would
        return member.tensor
    buf = _wire_copy(src, plan)
    _fusion.allreduce_flat(buf.view(-1), plan)
    if member.inplace:
        src.copy_(buf)
        return member.tensor
    return buf if buf.dtype == src.dtype else buf.to(src.dtype)


def allreduce_call(tensor, op, average, name, pre, post, inplace, async_, layout=None,
                   process_set=None):
    """layout: what else every rank's call must agree on (DistributedOptimizer: the model)."""
    what = call_name("allreduce", name)
    try:
        resolved = resolve_op(op, average)
    except ValueError:
        resolved = None  # the plan below reports it, on every rank
    if resolved == Adasum:
        return _adasum.call(tensor, name, pre, post, inplace, async_, process_set)

    def plan(st):
        check_name(name)
        code = check_tensor(tensor, what)
        if inplace:
            check_writable(tensor, what)
        p = ReducePlan(resolved or resolve_op(op, average), tensor.dtype, pre, post,
                       st.ctx.size, what)
        desc = describe(ALLREDUCE, code, CORE_OPS.index(p.core), shape=tensor.shape, name=name,
                        layout=layout, tensor=tensor)
        return p, _fusion.Member(what, p, desc, tensor, inplace)

    def job(st, planned):
        p, me = planned
        if async_ and not tensor.is_cuda:
            return _fusion.fused_job(st, me, p, what, _reduce_one)
        _control.agree(st, me.desc, what)
        return _reduce_one(me, p)

    # (dispatch.issue shows no GPU call to the calls ahead of it: they are never fused)
    return _dispatch.issue(what, plan, job, async_, tensor, process_set=process_set,
                           tag=lambda planned: planned[1])


def recorded(*tensors):
    """Whether autograd must record this call (grad mode on, a tensor requiring grad): only
    then does it go through its autograd Function, whose apply() costs ~50 us a call on the
    2-core VM; else the call runs as the Function's forward would, with the same result."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def check_differentiable(op, what):
    if op not in (Average, Sum):
        raise MlfabricError(f"the gradient of {what} with op {op} is not defined; only Average "
                            "and Sum are differentiable")


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, average, name, pre, post, process_set):
        out = allreduce_call(tensor, op, average, name, pre, post, False, False,
                             process_set=process_set)
        ctx.op, ctx.pre, ctx.post = resolve_op(op, average), pre, post
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx, grad):
        check_differentiable(ctx.op, "allreduce")
        grad = allreduce_call(grad, ctx.op, None, None, ctx.pre, ctx.post, False, False,
                              process_set=ctx.process_set)
        return grad, None, None, None, None, None, None


def checked_compression(what, compression, process_set=None):
    """compression, or its TypeError raised on every rank (through a rejected call)."""
    try:
        return _check_compression(compression)
    except TypeError as exc:
        reject_call(process_set, what, False)
        raise exc


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Reduce tensor over all ranks (default: Average) and return the result; tensor is left
    as it is. Differentiable. op: Average, Sum, Min, Max, Product (average=True/False is the
    deprecated spelling of Average/Sum). prescale_factor multiplies the input and
    postscale_factor the result (integer tensors too: see the module docstring for the
    arithmetic). compression: Compression.none or
    Compression.fp16 (see mlfabric.torch.compression for its tolerance). name: an optional
    label; when every rank gives one they must match (a check that ranks issue calls in the
    same order). process_set: the ranks taking part (default every rank; process_sets.py);
    every collective of mlfabric.torch takes it."""
    compression = checked_compression(call_name("allreduce", name), compression, process_set)
    if not isinstance(tensor, torch.Tensor):  # reported on every rank
        return allreduce_call(tensor, op, average, name, 1.0, 1.0, False, False,
                              process_set=process_set)
    compressed, cctx = compression.compress(tensor)
    if recorded(compressed):
        out = _AllreduceFn.apply(compressed, op, average, name, prescale_factor,
                                 postscale_factor, process_set)
    else:
        out = allreduce_call(compressed, op, average, name, prescale_factor, postscale_factor,
                             False, False, process_set=process_set)
    return compression.decompress(out, cctx)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None):
    """Non-blocking allreduce: returns a handle; synchronize(handle) returns the result."""
    return allreduce_call(tensor, op, average, name, prescale_factor, postscale_factor, False,
                          True, process_set=process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """In-place allreduce: tensor receives the result; returns tensor. Not differentiable."""
    return allreduce_call(tensor, op, average, name, prescale_factor, postscale_factor, True,
                          False, process_set=process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    """Non-blocking in-place allreduce: returns a handle; leave tensor alone until
    synchronize(handle), which returns it."""
    return allreduce_call(tensor, op, average, name, prescale_factor, postscale_factor, True,
                          True, process_set=process_set)


# --- grouped allreduce ----------------------------------------------------------------------------


def grouped_allreduce_call(tensors, op, average, name, pre, post, inplace, async_,
                           process_set=None):
    """One fused allreduce per dtype (in order of first appearance), each its own call. The
    tensors are copied into a staging buffer with one torch._foreach_copy_ (widened there if
    need be), reduced in place, and copied back with one more (in place forms) or cloned out."""
    what = call_name("grouped_allreduce", name)

    def plan(st):
        check_name(name)
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{what}: tensors must be a list of tensors, got "
                            f"{type(tensors).__name__}")
        if not tensors:
            raise ValueError(f"{what}: needs at least one tensor")
        resolved = resolve_op(op, average)
        sig, ptrs = scan_tensors(tensors, what)
        if inplace and ptrs is None:  # (addresses: every tensor is contiguous, so writable)
            for i, t in enumerate(tensors):
                check_writable(t, what, f"tensors[{i}]")
        # Every group's descriptor carries the whole list's dtypes and shapes, hashed once
        # (Python's hash of a tuple of ints is the same in every process), so ranks whose lists
        # differ fail at the first group instead of issuing different numbers of calls. The
        # hash is kept with the groups: a tuple does not cache its own.
        # (a group on a GPU is kept apart: its staging buffer is on that GPU)
        key = sig if tensors[0].is_cpu else (tensors[0].device, sig)
        known = st.layouts.get(key)
        if known is None:
            if len(st.layouts) >= _fusion.LAYOUTS_KEPT:
                st.layouts.clear()
            known = st.layouts[key] = (_fusion.group_layout(*_meta.decode(sig)), zlib.crc32(sig))
        groups, layout = known
        planned = []
        for g, group in enumerate(groups):
            p = ReducePlan(resolved, DTYPES[group.code], pre, post, st.ctx.size, what)
            planned.append((group, p, describe(
                ALLREDUCE, group.code, CORE_OPS.index(p.core), shape=(group.total,),
                name=None if name is None else f"{name}.{g}", layout=(g, layout),
                tensor=tensors[0])))
        return planned, ptrs

    def job(st, planned_ptrs):
        planned, all_ptrs = planned_ptrs
        outs = list(tensors) if inplace else [None] * len(tensors)
        for group, p, desc in planned:
            members = group.members
            srcs = tensors if members is None else [tensors[i] for i in members]
            ptrs = all_ptrs if members is None or all_ptrs is None else all_ptrs[members]
            table = _control.agree(st, desc, what)
            flat, views = _fusion.staged(st, group, everyone(table), tensors[0].device)
            dtype = DTYPES[group.code]
            # torch copies instead when the wire dtype is wider, a tensor is not contiguous,
            # or they are on a GPU (ptrs is None then)
            if flat.dtype != dtype:
                ptrs = None
            if ptrs is not None:
                _C.gather(flat.data_ptr(), ptrs, group.nbytes)
            else:
                with torch.no_grad():  # the staging buffer must not join srcs' graph
                    torch._foreach_copy_(views, srcs)
            p.prescale_(flat)
            _fusion.allreduce_flat(flat, p)
            if inplace:
                if ptrs is not None:
                    _C.scatter(flat.data_ptr(), ptrs, group.nbytes)
                    # as an in-place torch op would: autograd must see these were written
                    _increment_version(srcs)
                else:
                    with torch.no_grad():  # srcs may require grad
                        torch._foreach_copy_(srcs, views)
                continue
            results = _fusion.clone_all(views) if flat.dtype == dtype else [v.to(dtype)
                                                                            for v in views]
            if members is None:
                return results
            for i, out in zip(members, results):
                outs[i] = out
        return outs

    return _dispatch.issue(what, plan, job, async_, tensors[0] if isinstance(tensors, (list, tuple))
                           and tensors else None, tensors, process_set)


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, average, name, pre, post, process_set, *tensors):
        outs = grouped_allreduce_call(list(tensors), op, average, name, pre, post, False, False,
                                      process_set)
        ctx.op, ctx.pre, ctx.post = resolve_op(op, average), pre, post
        ctx.process_set = process_set
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        check_differentiable(ctx.op, "grouped_allreduce")
        reduced = grouped_allreduce_call(list(grads), ctx.op, None, None, ctx.pre, ctx.post,
                                         False, False, ctx.process_set)
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """allreduce of a list of tensors, fused into one buffer per dtype; returns a list.
    Differentiable."""
    compression = checked_compression(call_name("grouped_allreduce", name), compression,
                                      process_set)
    if not (isinstance(tensors, (list, tuple)) and tensors
            and all(isinstance(t, torch.Tensor) for t in tensors)):  # reported on every rank
        return grouped_allreduce_call(tensors, op, average, name, 1.0, 1.0, False, False,
                                      process_set)
    pairs = [(t, None) for t in tensors] if compression is Compression.none else \
        [compression.compress(t) for t in tensors]
    sent = [c for c, _ in pairs]
    if recorded(*sent):
        outs = _GroupedAllreduceFn.apply(op, average, name, prescale_factor, postscale_factor,
                                         process_set, *sent)
    else:
        outs = grouped_allreduce_call(sent, op, average, name, prescale_factor, postscale_factor,
                                      False, False, process_set)
    if compression is Compression.none:
        return list(outs)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None):
    return grouped_allreduce_call(tensors, op, average, name, prescale_factor, postscale_factor,
                                  False, True, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    return grouped_allreduce_call(tensors, op, average, name, prescale_factor, postscale_factor,
                                  True, False, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None):
    return grouped_allreduce_call(tensors, op, average, name, prescale_factor, postscale_factor,
                                  True, True, process_set)


# --- allgather ------------------------------------------------------------------------------------

def _gather_plan(table):
    """(rows of each rank, the rows every rank sends, row length): the same on every rank.
    Every rank sends max_rows rows (padded): mlfabric's allgather moves equal blocks."""
    rows = table[:, ROWS].copy()
    rows[table[:, STATE] != ACTIVE] = 0
    active = np.flatnonzero(table[:, STATE] == ACTIVE)
    return rows, int(rows.max()), int(table[active[0], ROW_LEN])


def allgather_call(tensor, name, async_, with_rows=False, process_set=None):
    what = call_name("allgather", name)

    def plan(st):
        check_name(name)
        code = check_tensor(tensor, what)
        return describe(ALLGATHER, code, shape=tensor.shape, name=name, tensor=tensor)

    def job(st, desc):
        table = _control.agree(st, desc, what)
        src = tensor.detach()
        shape = tuple(src.shape) or (1,)
        wire = wire_dtype(src.dtype)
        out, rows = gather(table, src.reshape(shape[0], math.prod(shape[1:])).to(wire))
        out = _own(out, (out.shape[0], *shape[1:])) if wire == src.dtype else \
            out.view(out.shape[0], *shape[1:]).to(src.dtype)
        return (out, rows) if with_rows else out

    return _dispatch.issue(what, plan, job, async_, tensor, process_set=process_set)


def _own(t, shape):
    """t's elements (a contiguous tensor no one else uses) as a tensor of shape that is not a
    view: a caller may then modify it in place even as the output of a custom autograd
    Function, which torch refuses for views (Horovod's outputs are fresh tensors too)."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape)


def gather(table, mine):
    """(every active rank's rows of mine, a (rows, row length) tensor of the wire dtype, in rank
    order; the rows of each rank), after the control round that gave table. Joined ranks give
    no rows (_take_part pads for them as for anyone: every rank sends max_rows rows)."""
    rows, max_rows, row_len = _gather_plan(table)
    total = int(rows.sum())
    if not (max_rows and row_len):
        return torch.empty((total, row_len), dtype=mine.dtype, device=mine.device), rows
    mine = mine.contiguous()
    if (rows == max_rows).all():
        out = torch.empty((total, row_len), dtype=mine.dtype, device=mine.device) \
            if mine.is_cuda else None  # on the CPU the core allocates it (its direct path)
        return _coll.allgather(mine, out=out), rows
    block = torch.zeros((max_rows, row_len), dtype=mine.dtype, device=mine.device)
    block[:mine.shape[0]] = mine
    got = _coll.allgather(block)
    out = torch.empty((total, row_len), dtype=mine.dtype, device=mine.device)
    torch.cat([got[r * max_rows:r * max_rows + int(k)] for r, k in enumerate(rows)], out=out)
    return out, rows


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        out, rows = allgather_call(tensor, name, False, True, process_set)
        me = _dispatch.state(process_set).ctx.rank
        ctx.offset, ctx.rows, ctx.shape = int(rows[:me].sum()), int(rows[me]), tensor.shape
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce_call(grad, Average, None, None, 1.0, 1.0, False, False,
                                 process_set=ctx.process_set)
        return reduced.narrow(0, ctx.offset, ctx.rows).reshape(ctx.shape), None, None


def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's tensor along dimension 0, in rank order; the first dimension may
    differ between ranks, the others must agree (a 0-d tensor counts as shape (1,)).
    Differentiable."""
    if not isinstance(tensor, torch.Tensor) or not recorded(tensor):  # (a bad one: reported
        return allgather_call(tensor, name, False, process_set=process_set)  # on every rank)
    return _AllgatherFn.apply(tensor, name, process_set)


def allgather_async(tensor, name=None, process_set=None):
    return allgather_call(tensor, name, True, process_set=process_set)


# --- reducescatter --------------------------------------------------------------------------------

def _reducescatter_call(tensor, op, average, name, pre, post, async_, process_set=None):
    what = call_name("reducescatter", name)

    def plan(st):
        code = check_rows(tensor, name, what)
        p = ReducePlan(resolve_op(op, average), tensor.dtype, pre, post, st.ctx.size, what)
        return p, describe(REDUCESCATTER, code, CORE_OPS.index(p.core), shape=tensor.shape,
                           name=name, tensor=tensor)

    def job(st, planned):
        p, desc = planned
        _control.agree(st, desc, what)
        src = tensor.detach()
        n, rows = st.ctx.size, src.shape[0]
        mine = _coll.split_rows(rows, n)[st.ctx.rank]
        if not src.numel():
            return src.new_empty((mine, *src.shape[1:]))
        # the core's reduce_scatter leaves its input alone: a copy only to widen or prescale
        sent = src.contiguous() if wire_dtype(src.dtype) == src.dtype and p.pre == 1.0 else \
            _wire_copy(src, p)
        out = _own(_coll.reduce_scatter(sent.view(rows, -1), op=p.core), (mine, *src.shape[1:]))
        p.postscale_(out)
        return out if out.dtype == src.dtype else out.to(src.dtype)

    return _dispatch.issue(what, plan, job, async_, tensor, process_set=process_set)


# reducescatter's gradient conventions (the grad keyword): "horovod", Horovod's (the default),
# size() times the local derivative; "local", the derivative itself.
REDUCESCATTER_GRADS = ("horovod", "local")


def checked_grad(what, grad, process_set=None):
    """grad (a reducescatter's gradient convention), or its ValueError raised on every rank
    (through a rejected call)."""
    if not (isinstance(grad, str) and grad in REDUCESCATTER_GRADS):
        reject_call(process_set, what, False)
        raise ValueError(f"{what}: grad must be one of {', '.join(map(repr, REDUCESCATTER_GRADS))}"
                         f", got {grad!r:.40}")
    return grad


def reducescatter_grad_scale(op, pre, post, size, grad):
    """What the allgather of a reducescatter's output gradients is multiplied by to give its
    input's gradient. Each rank's input rows r went into rank r's output times pre * post
    (/ size for Average): that factor gives the derivative of the ranks' summed loss with
    respect to this rank's input (grad="local"). Horovod's convention (grad="horovod") is size
    times it, pre * post (* size for Sum), so that the average over the ranks that
    DistributedOptimizer takes of the gradients after it gives that derivative."""
    scale = float(pre) * float(post)
    if grad == "local":
        return scale / size if op == Average else scale
    return scale * size if op == Sum else scale


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, average, name, pre, post, process_set, grad):
        out = _reducescatter_call(tensor, op, average, name, pre, post, False,
                                  process_set)  # checks first
        ctx.op, ctx.process_set = resolve_op(op, average), process_set
        ctx.scale = reducescatter_grad_scale(ctx.op, pre, post,
                                             _dispatch.state(process_set).ctx.size, grad)
        return out

    @staticmethod
    def backward(ctx, grad):
        check_differentiable(ctx.op, "reducescatter")
        back = allgather_call(grad.contiguous(), None, False, process_set=ctx.process_set)
        return ((back.mul_(ctx.scale) if ctx.scale != 1.0 else back), None, None, None, None,
                None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0, *, grad="horovod"):
    """Reduce tensor over all ranks (default: Average) and return this rank's block of rows of
    the result: dimension 0 split in rank order, the first shape[0] % size() ranks one row more
    (as Horovod, whose argument order this keeps). Every rank passes the same shape. The
    factors and compression as in allreduce (integer tensors scale as the module docstring
    says).

    Differentiable (Average, Sum). grad (keyword only) picks the input's gradient:
    ``"horovod"`` (the default, Horovod's) is the allgather of the output gradients times
    prescale_factor * postscale_factor, and times size() for op Sum; ``"local"`` is size()
    times smaller, the exact derivative of the ranks' summed loss with respect to this rank's
    input (for Average: the allgather times the factors / size()). Horovod's is meant for
    gradients averaged over the ranks afterwards (DistributedOptimizer), which brings them back
    to that derivative; "local" for gradients used as they are."""
    what = call_name("reducescatter", name)
    compression = checked_compression(what, compression, process_set)
    grad = checked_grad(what, grad, process_set)
    if not isinstance(tensor, torch.Tensor):  # reported on every rank
        return _reducescatter_call(tensor, op, None, name, 1.0, 1.0, False, process_set)
    compressed, cctx = compression.compress(tensor)
    if recorded(compressed):
        out = _ReducescatterFn.apply(compressed, op, None, name, prescale_factor,
                                     postscale_factor, process_set, grad)
    else:
        out = _reducescatter_call(compressed, op, None, name, prescale_factor, postscale_factor,
                                  False, process_set)
    return compression.decompress(out, cctx)


def reducescatter_async(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Non-blocking reducescatter: synchronize(handle) returns this rank's rows."""
    return _reducescatter_call(tensor, op, None, name, prescale_factor, postscale_factor, True,
                               process_set)


# --- broadcast ------------------------------------------------------------------------------------

def _broadcast_call(tensor, root_rank, name, inplace, async_, process_set=None):
    what = call_name("broadcast", name)

    def plan(st):
        check_name(name)
        code = check_tensor(tensor, what)
        if inplace:
            check_writable(tensor, what)
        return describe(BROADCAST, code, root=st.root(root_rank, what), shape=tensor.shape,
                        name=name, tensor=tensor)

    def job(st, desc):
        _control.agree(st, desc, what)
        src, root = tensor.detach(), int(desc[ROOT])
        if inplace and src.is_contiguous() and wire_dtype(src.dtype) == src.dtype:
            if src.numel():
                _coll.broadcast(src.view(-1), root=root)
                _increment_version([src])  # as an in-place torch op would (as allreduce_)
            return tensor
        buf = torch.empty(src.shape, dtype=wire_dtype(src.dtype), device=src.device)
        buf.copy_(src)
        if buf.numel():
            _coll.broadcast(buf.view(-1), root=root)
        if inplace:
            src.copy_(buf)
            return tensor
        return buf if buf.dtype == src.dtype else buf.to(src.dtype)

    return _dispatch.issue(what, plan, job, async_, tensor, process_set=process_set)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast_call(tensor, root_rank, name, False, False, process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce_call(grad, Average, None, None, 1.0, 1.0, False, False,
                                 process_set=ctx.process_set)
        if _dispatch.state().ctx.rank != ctx.root_rank:  # both global ranks
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=None):
    """root_rank's tensor, on every rank (tensor itself is left as it is). Differentiable.
    root_rank is a global rank, also with a process_set (as in Horovod)."""
    if not isinstance(tensor, torch.Tensor) or not recorded(tensor):  # (a bad one: reported
        return _broadcast_call(tensor, root_rank, name, False, False, process_set)  # everywhere)
    return _BroadcastFn.apply(tensor, root_rank, name, process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    return _broadcast_call(tensor, root_rank, name, False, True, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """In-place broadcast: tensor receives root_rank's values; returns tensor."""
    return _broadcast_call(tensor, root_rank, name, True, False, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    return _broadcast_call(tensor, root_rank, name, True, True, process_set)


def grouped_broadcast_call(tensors, root_rank, name, process_set=None):
    """In-place broadcast of a list of tensors, fused into buffers of MLFABRIC_FUSION_THRESHOLD
    bytes (one call each)."""
    what = call_name("broadcast", name)

    def plan(st):
        root = st.root(root_rank, what)
        for i, t in enumerate(tensors):
            check_tensor(t, what, f"tensors[{i}]")
            check_writable(t, what, f"tensors[{i}]")
        # the whole list's, as grouped (hashed once: each fused buffer's descriptor carries it)
        signature = stable_hash(tuple((str(t.dtype), tuple(t.shape)) for t in tensors))
        planned = []
        for b, members in enumerate(fuse(tensors, fusion_threshold())):
            dtype = tensors[members[0]].dtype
            total = sum(tensors[i].numel() for i in members)
            planned.append((members, describe(BROADCAST, DTYPE_CODE[dtype], root=root,
                                              shape=(total,), name=f"{name}.{b}",
                                              layout=(b, signature), tensor=tensors[members[0]])))
        return planned

    def job(st, planned):
        for members, desc in planned:
            _control.agree(st, desc, what)
            srcs = [tensors[i].detach() for i in members]
            flat = torch.cat([s.reshape(-1).to(wire_dtype(s.dtype)) for s in srcs])
            root = int(desc[ROOT])
            if flat.numel():
                _coll.broadcast(flat, root=root)
            if st.ctx.rank != root:
                off = 0
                for s in srcs:
                    s.copy_(flat[off:off + s.numel()].view(s.shape))
                    off += s.numel()
        return tensors

    cuda = next((t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda), None)
    return _dispatch.issue(what, plan, job, False, cuda, tensors, process_set)


# --- alltoall -------------------------------------------------------------------------------------

def _row_shape(d):
    """The row shape alltoall moves: the tensor's own when the descriptor holds every dimension
    (so the result needs no reshaping), else flattened. The same on every rank."""
    nd = int(d[NDIM])
    if nd <= MAX_DIMS:
        return tuple(int(v) for v in d[DIMS + 1:DIMS + nd])
    return (int(d[ROW_LEN]),)


def _alltoall_call(tensor, splits, name, async_, process_set=None):
    what = call_name("alltoall", name)

    def plan(st):
        code = check_rows(tensor, name, what)
        sends = _coll._alltoall_splits(splits, tensor.shape[0], st.ctx.size)
        return sends, describe(ALLTOALL, code, shape=tensor.shape, name=name, tensor=tensor)

    def job(st, planned):
        sends, desc = planned
        _control.agree(st, desc, what)
        src = tensor.detach()
        x = src.reshape(src.shape[0], *_row_shape(desc)).to(wire_dtype(src.dtype))
        out, received = _coll.alltoall(x, sends)
        if out.dim() != src.dim():
            out = out.reshape(out.shape[0], *src.shape[1:]).clone()
        out = out if out.dtype == src.dtype else out.to(src.dtype)
        return out, torch.from_numpy(received.astype(np.int32))

    return _dispatch.issue(what, plan, job, async_, tensor, process_set=process_set)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _alltoall_call(tensor, splits, name, False, process_set)
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = _alltoall_call(grad, ctx.received, None, False, ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send splits[j] rows of tensor (dimension 0, in order) to rank j and receive every rank's
    rows for this one, concatenated in rank order. splits: None (shape[0] / size rows to each
    rank) or size integers (a list or tensor). Returns the received tensor and, when splits was
    given, also the rows received from each rank (int32 tensor), like Horovod. Differentiable."""
    if not isinstance(tensor, torch.Tensor):  # reported on every rank
        return _alltoall_call(tensor, splits, name, False, process_set)
    if recorded(tensor):
        out, received = _AlltoallFn.apply(tensor, splits, name, process_set)
    else:
        out, received = _alltoall_call(tensor, splits, name, False, process_set)
    return out if splits is None else (out, received)


def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """Non-blocking alltoall: synchronize(handle) returns (output, received_splits)."""
    return _alltoall_call(tensor, splits, name, True, process_set)


# --- barrier and join -----------------------------------------------------------------------------

def barrier(process_set=None):
    """Return once every rank (of process_set) has called barrier() (joined ranks take part on
    their own)."""
    def job(st, desc):
        _control.agree(st, desc, "barrier")
        _coll.barrier()

    return _dispatch.issue("barrier", lambda st: describe(BARRIER), job, False,
                           process_set=process_set)


def join(device=-1, all_calls=False):
    """Declare that this rank has no more data: until every rank has joined, it takes part in the
    others' collectives (see the module docstring for what it contributes), then returns the rank
    that joined last (of several joining in the same round, the highest). In the others' GPU
    calls a joined rank takes part on GPU `device` if >= 0, else on its NCCL communicator's GPU,
    else on the current one (as of this call). all_calls (mlfabric's): also take part in the
    others' allgathers, alltoalls and broadcasts, which are otherwise an error while a rank is
    joined, as in Horovod."""
    def plan(st):
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise TypeError(f"join: device must be a GPU index (or -1), got {device!r}")
        if not isinstance(all_calls, bool):
            raise TypeError(f"join: all_calls must be True or False, got {all_calls!r}")
        gpu = int(device) if device >= 0 else None
        if gpu is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            gpu = torch.cuda.current_device()   # taken here: the job runs on another thread
        return gpu, all_calls

    return _dispatch.issue("join", plan, _joined_loop, False)


def _joined_loop(st, planned):
    gpu, all_calls = planned
    desc = np.zeros(W, np.int64)
    desc[STATE] = JOINED
    desc[JOINED_AT] = st.rounds + 1
    desc[_control.JOINED_ANY] = all_calls
    while True:
        table = control_round(st, desc)
        states = table[:, STATE]
        if (states == JOINED).all():
            at = table[:, JOINED_AT]
            return int(np.flatnonzero(at == at.max()).max())
        if disagreement(table, "join") is not None:
            continue  # the active ranks raise; nothing moves
        _take_part(table, gpu)


def _take_part(table, gpu):
    """A joined rank's part in the call the active ranks described."""
    d = table[np.flatnonzero(table[:, STATE] == ACTIVE)[0]]
    kind, wire = int(d[KIND]), wire_dtype(DTYPES[int(d[DTYPE])])
    device = _joined_device(gpu) if d[DEVICE] else torch.device("cpu")
    numel = int(d[ROWS]) * int(d[ROW_LEN])
    if kind == ALLREDUCE:
        core = CORE_OPS[int(d[OP])]
        if numel:
            buf = _identity(core, wire, numel, device)
            _coll.allreduce(buf, op=core, out=buf)
    elif kind == ALLGATHER:  # (ALLGATHER, BROADCAST, ALLTOALL: joined with all_calls=True)
        rows, max_rows, row_len = _gather_plan(table)
        if max_rows and row_len:
            _coll.allgather(torch.zeros((max_rows, row_len), dtype=wire, device=device))
    elif kind == BROADCAST:
        if numel:
            _coll.broadcast(torch.empty(numel, dtype=wire, device=device), root=int(d[ROOT]))
    elif kind == REDUCESCATTER:
        core = CORE_OPS[int(d[OP])]
        if numel:  # its rows of the result are dropped
            _coll.reduce_scatter(_identity(core, wire, numel, device).view(int(d[ROWS]), -1),
                                 op=core)
    elif kind == ALLTOALL:
        _coll.alltoall(torch.empty((0, *_row_shape(d)), dtype=wire, device=device),
                       np.zeros(table.shape[0], np.int64))
    else:
        _coll.barrier()


def _identity(core, wire, n, device):
    """n elements that leave a reduction unchanged: what a joined rank contributes."""
    if core in ("sum", "avg"):
        return torch.zeros(n, dtype=wire, device=device)
    if core == "prod":
        return torch.ones(n, dtype=wire, device=device)
    if wire.is_floating_point:
        value = float("inf") if core == "min" else float("-inf")
    else:
        info = torch.iinfo(wire)
        value = info.max if core == "min" else info.min
    return torch.full((n,), value, dtype=wire, device=device)


def _joined_device(gpu):
    """The GPU a joined rank takes part on (see join())."""
    comm = _dispatch.state().ctx.nccl
    if gpu is None:
        gpu = comm.device if comm is not None else torch.cuda.current_device()
    return torch.device("cuda", gpu)
