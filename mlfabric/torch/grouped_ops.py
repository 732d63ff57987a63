"""grouped_allgather and grouped_reducescatter (Horovod >= 0.27's names and semantics): a list of
tensors in one call, each tensor's result what the single-tensor call gives it, fused into one
collective per dtype (in order of first appearance), so a list of many small tensors costs a few
collectives instead of one per tensor.

Owns how a list travels fused; the control round, join, devices and dtypes are ops.py's:
- allgather: ranks may hold different numbers of rows of each tensor, so a first round gathers
  every rank's rows of every tensor (an int64 allgather of a (1, len(list)) tensor, described
  and checked like any allgather, with the whole list's dtypes and row shapes in its descriptor:
  ranks whose lists differ fail there, on every rank). Then each dtype's tensors travel
  flattened back to back, as one allgather of a 1-D tensor, and are cut apart by those rows.
- reducescatter: every rank splits each tensor's rows the same way (ops.reducescatter's split),
  so the list is packed rank-major: row r of an (size, M) buffer holds rank r's rows of every
  tensor, zero-padded to the longest such block M; one reduce_scatter gives each rank its row.
Both are standard calls on the wire, so a joined rank takes part without knowing of groups.
"""
import math

import numpy as np
import torch

from .. import collectives as _coll
from ..errors import MismatchError
from .compression import Compression
from .ops import (_ACTIVE, _ALLGATHER, _CORE_OPS, _DTYPE_CODE, _DTYPES, _REDUCESCATTER,
                  _ROW_HASH, _STATE, Average, _agree, _check_differentiable, _check_name,
                  _compression, _control, _desc, _disagreement, _gather, _groups, _hash, _issue,
                  _layout, _own, _ReducePlan, _resolve_op, _scan, _state, _what, _wire)
from .ops import _grouped_call as _grouped_allreduce_call


def _check_list(tensors, what):
    """(dtype codes, shapes with 0-d as (1,)) of a grouped call's list, after checking it."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what}: tensors must be a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what}: needs at least one tensor")
    (codes, shapes), _ = _scan(tensors, what)
    return codes, tuple(tuple(int(d) for d in s) or (1,) for s in shapes)


def _list_desc(kind, code, op, shape, name, codes, shapes, tensor, rows=True):
    """A descriptor whose row hash, and shape hash, cover the whole list (dtypes, and shapes:
    after the first dimension where rows may differ between ranks, whole where they may not).
    The shape hash is what a rank that knows nothing of lists compares (a joined rank, or one
    making a single-tensor call): lists that differ must differ there too."""
    sig = (codes, tuple(s[1:] if rows else s for s in shapes))
    desc = _desc(kind, code, op, shape=shape, name=name, layout=sig, tensor=tensor)
    desc[_ROW_HASH] = _hash(sig)
    return desc


def _agree_list(st, desc, what, rows=True):
    """ops._agree, naming lists that differ (rather than the shape of a row of the first
    round's tensor, which the user never passed). rows: as _list_desc's."""
    table = _control(st, desc)
    states = table[:, _STATE]
    active = np.flatnonzero(states == _ACTIVE)
    if (states >= 0).all() and active.size and \
            (table[active, _ROW_HASH] != table[active[0], _ROW_HASH]).any():
        groups = _groups(table, active, lambda d: int(d[_ROW_HASH]))
        raise MismatchError(
            f"{what}: the ranks' lists differ (their length, dtypes, or shapes"
            f"{' after the first dimension' if rows else ''}; ranks grouped by list: "
            f"{' | '.join(map(str, groups))})")
    msg = _disagreement(table, what)
    if msg is not None:
        raise MismatchError(msg)
    return table


# --- grouped allgather ----------------------------------------------------------------------------

def _grouped_allgather_call(tensors, name, async_, with_rows=False):
    what = _what("grouped_allgather", name)

    def plan(st):
        _check_name(name)
        codes, shapes = _check_list(tensors, what)
        # the rows travel through host memory whatever the device (tensor=None): no NCCL
        # launch and device sync for 8 bytes a tensor, and its waits stay bounded
        return codes, shapes, _list_desc(_ALLGATHER, _DTYPE_CODE[torch.int64], 0,
                                         (1, len(tensors)), name, codes, shapes, None)

    def job(st, planned):
        codes, shapes, desc = planned
        table = _agree_list(st, desc, what)
        mine = torch.tensor([[s[0] for s in shapes]], dtype=torch.int64)
        rows = np.zeros((st.ctx.size, len(tensors)), np.int64)  # each rank's rows of each
        rows[table[:, _STATE] == _ACTIVE] = _gather(table, mine)[0].numpy()
        per_rank, totals = rows.tolist(), rows.sum(0).tolist()  # Python ints: cheaper in loops
        outs = [None] * len(tensors)
        for g, group in enumerate(_layout((codes, shapes))):
            members = group.members or range(len(tensors))
            dtype = _DTYPES[group.code]
            wire = _wire(dtype)
            lens = [math.prod(shapes[i][1:]) for i in members]
            flat = torch.cat([tensors[i].detach().reshape(-1).to(wire) for i in members])
            gdesc = _desc(_ALLGATHER, group.code, shape=(flat.numel(),),
                          name=None if name is None else f"{name}.{g}", tensor=tensors[0])
            got = _gather(_agree(st, gdesc, what), flat.view(-1, 1))[0].view(-1)
            # got: each rank's members back to back, in rank order (a joined rank's are empty)
            pieces = got.split([of[i] * n for of in per_rank for i, n in zip(members, lens)])
            for j, i in enumerate(members):
                # each output its own tensor, not a view (see ops._own)
                out = got.new_empty((totals[i], *shapes[i][1:]))
                torch.cat(pieces[j::len(members)], out=out.view(-1))
                outs[i] = out if wire == dtype else out.to(dtype)
        return (outs, rows) if with_rows else outs

    return _issue(what, plan, job, async_, _first(tensors), tensors)


def _first(tensors):
    return tensors[0] if isinstance(tensors, (list, tuple)) and tensors and \
        isinstance(tensors[0], torch.Tensor) else None


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *tensors):
        outs, rows = _grouped_allgather_call(list(tensors), name, False, with_rows=True)
        me = _state().ctx.rank
        ctx.offsets, ctx.rows = rows[:me].sum(0).tolist(), rows[me].tolist()
        ctx.shapes = [t.shape for t in tensors]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # as allgather's: this rank's rows of the averaged gradient (of the floating tensors:
        # the others have none; every rank's list has the same dtypes)
        floating = [i for i, g in enumerate(grads) if g.dtype.is_floating_point]
        back = [None] * len(grads)
        if floating:
            reduced = _grouped_allreduce_call([grads[i].contiguous() for i in floating], Average,
                                              None, None, 1.0, 1.0, False, False)
            for i, r in zip(floating, reduced):
                back[i] = r.narrow(0, ctx.offsets[i], ctx.rows[i]).reshape(ctx.shapes[i])
        return (None, *back)


def grouped_allgather(tensors, name=None):
    """allgather of each tensor of a list (a list back), fused into one allgather per dtype.
    Ranks pass lists of the same length, dtypes and shapes after the first dimension; the first
    may differ by rank and by tensor. Differentiable."""
    if _first(tensors) is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return _grouped_allgather_call(tensors, name, False)  # the error, on every rank
    return list(_GroupedAllgatherFn.apply(name, *tensors))


def grouped_allgather_async(tensors, name=None):
    """Non-blocking grouped_allgather: synchronize(handle) returns the list."""
    return _grouped_allgather_call(tensors, name, True)


# --- grouped reducescatter ------------------------------------------------------------------------

def _grouped_reducescatter_call(tensors, op, name, pre, post, async_):
    what = _what("grouped_reducescatter", name)

    def plan(st):
        _check_name(name)
        codes, shapes = _check_list(tensors, what)
        for i, t in enumerate(tensors):
            if t.dim() == 0:
                raise ValueError(f"{what}: tensors[{i}] has no dimension to split; each needs "
                                 "at least one")
        n, resolved = st.ctx.size, _resolve_op(op, None)
        planned = []
        for g, group in enumerate(_layout((codes, shapes))):
            members = list(group.members or range(len(tensors)))
            p = _ReducePlan(resolved, _DTYPES[group.code], pre, post, n, what)
            # blocks[r][j]: elements of member j that go to rank r
            blocks = [[k * math.prod(shapes[i][1:]) for i in members
                       for k in [_coll.split_rows(shapes[i][0], n)[r]]] for r in range(n)]
            width = max(sum(b) for b in blocks)
            planned.append((members, p, blocks, width, _list_desc(
                _REDUCESCATTER, group.code, _CORE_OPS.index(p.core), (n, width),
                None if name is None else f"{name}.{g}", codes, shapes, tensors[0], rows=False)))
        return shapes, planned

    def job(st, planned):
        shapes, groups = planned
        me = st.ctx.rank
        outs = [None] * len(tensors)
        for members, p, blocks, width, desc in groups:
            _agree_list(st, desc, what, rows=False)
            dtype = tensors[members[0]].dtype
            wire = _wire(dtype)
            flats = [tensors[i].detach().reshape(-1).to(wire) for i in members]
            # rank-major: rank r's rows of every member, then zeros up to width; one cat
            parts, starts = [], [0] * len(members)
            pad = flats[0].new_zeros(width)
            for b in blocks:
                for j, k in enumerate(b):
                    parts.append(flats[j][starts[j]:starts[j] + k])
                    starts[j] += k
                parts.append(pad[:width - sum(b)])
            buf = torch.cat(parts).view(len(blocks), width)
            if p.pre != 1.0:
                buf.mul_(p.pre)
            got = _coll.reduce_scatter(buf, op=p.core).view(-1) if width else buf[me]
            if p.after != 1.0:
                got.mul_(p.after)
            for i, piece in zip(members, got[:sum(blocks[me])].split(blocks[me])):
                shape = (_coll.split_rows(shapes[i][0], len(blocks))[me], *shapes[i][1:])
                # each output its own tensor, not a view (see ops._own)
                outs[i] = _own(piece, shape) if wire == dtype else piece.view(shape).to(dtype)
        return outs

    return _issue(what, plan, job, async_, _first(tensors), tensors)


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, pre, post, *tensors):
        outs = _grouped_reducescatter_call(list(tensors), op, name, pre, post, False)
        ctx.op = _resolve_op(op, None)
        ctx.scale = float(pre) * float(post) / (_state().ctx.size if ctx.op == Average else 1)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # as reducescatter's: the allgather of the outputs' gradients, scaled as the forward
        _check_differentiable(ctx.op, "grouped_reducescatter")
        back = _grouped_allgather_call([g.contiguous() for g in grads], None, False)
        if ctx.scale != 1.0:
            back = [b.mul_(ctx.scale) for b in back]
        return (None, None, None, None, *back)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          prescale_factor=1.0, postscale_factor=1.0):
    """reducescatter of each tensor of a list (a list back: this rank's block of rows of each
    reduction), fused into one reduce_scatter per dtype. Every rank passes the same list of
    dtypes and shapes. Differentiable (Average, Sum); factors and compression as reducescatter."""
    what = _what("grouped_reducescatter", name)
    compression = _compression(what, compression)
    if _first(tensors) is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return _grouped_reducescatter_call(tensors, op, name, 1.0, 1.0, False)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatterFn.apply(op, name, prescale_factor, postscale_factor,
                                         *[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def grouped_reducescatter_async(tensors, name=None, op=Average, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Non-blocking grouped_reducescatter: synchronize(handle) returns the list."""
    return _grouped_reducescatter_call(tensors, op, name, prescale_factor, postscale_factor,
                                       True)
