"""grouped_allgather and grouped_reducescatter (Horovod >= 0.27's names and semantics): a list of
tensors in one call, each tensor's result what the single-tensor call gives it, fused into one
collective per dtype (in order of first appearance), so a list of many small tensors costs a few
collectives instead of one per tensor.

Owns how a list travels fused (the control round is control.py's; join, devices and dtypes
work as in ops.py):

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

from .. import _C
from ..comm import collectives as _coll
from . import tensor_meta as _meta
from .arguments import (Average, CORE_OPS, DTYPES, DTYPE_CODE, ReducePlan, check_name, resolve_op,
                        scan_tensors, wire_dtype)
from .compression import Compression
from .control import (ACTIVE, ALLGATHER, REDUCESCATTER, ROW_HASH, STATE, agree, call_name,
                      control_round, describe, disagreement, mismatched, rank_groups)
from .dispatch import issue, state
from .fusion import LAYOUTS_KEPT, clone_all, group_layout
from .ops import (check_differentiable, checked_compression, checked_grad, gather,
                  grouped_allreduce_call, recorded, reducescatter_grad_scale)


def _check_list(tensors, what):
    """(dtype codes, shapes with 0-d as (1,), data addresses as arguments.scan_tensors gives
    them: a uint64 array, or None) of a grouped call's list, after checking it."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what}: tensors must be a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what}: needs at least one tensor")
    sig, ptrs = scan_tensors(tensors, what)
    codes, shapes = _meta.decode(sig)
    return codes, tuple(s or (1,) for s in shapes), ptrs


def _list_desc(kind, code, op, shape, name, codes, shapes, tensor, rows=True):
    """A descriptor whose row hash, and shape hash, cover the whole list (dtypes, and shapes:
    after the first dimension where rows may differ between ranks, whole where they may not).
    The shape hash is what a rank that knows nothing of lists compares (a joined rank, or one
    making a single-tensor call): lists that differ must differ there too."""
    # Python's hash of a tuple of ints is the same in every process (and cheaper than
    # control.stable_hash's crc32 of its repr, which a list of 100 shapes makes long)
    sig = hash((codes, tuple(s[1:] if rows else s for s in shapes)))
    desc = describe(kind, code, op, shape=shape, name=name, layout=sig, tensor=tensor)
    desc[ROW_HASH] = sig
    return desc


def _agree_list(st, desc, what, rows=True):
    """control.agree, naming lists that differ (rather than the shape of a row of the first
    round's tensor, which the user never passed). rows: as _list_desc's."""
    table = control_round(st, desc, what)
    states = table[:, STATE]
    active = np.flatnonzero(states == ACTIVE)
    if (states >= 0).all() and active.size and \
            (table[active, ROW_HASH] != table[active[0], ROW_HASH]).any():
        groups = rank_groups(table, active, lambda d: int(d[ROW_HASH]))
        raise mismatched(st, what, (
            f"{what}: the ranks' lists differ (their length, dtypes, or shapes"
            f"{' after the first dimension' if rows else ''}; ranks grouped by list: "
            f"{' | '.join(map(str, groups))})"))
    msg = disagreement(table, what)
    if msg is not None:
        raise mismatched(st, what, msg)
    return table


# --- grouped allgather ----------------------------------------------------------------------------

def _grouped_allgather_call(tensors, name, async_, with_rows=False, process_set=None):
    what = call_name("grouped_allgather", name)

    def plan(st):
        check_name(name)
        codes, shapes, ptrs = _check_list(tensors, what)
        # the rows travel through host memory whatever the device (tensor=None): no NCCL
        # launch and device sync for 8 bytes a tensor, and its waits stay bounded
        return codes, shapes, ptrs, _list_desc(ALLGATHER, DTYPE_CODE[torch.int64], 0,
                                               (1, len(tensors)), name, codes, shapes, None)

    def job(st, planned):
        codes, shapes, ptrs, desc = planned
        table = _agree_list(st, desc, what)
        mine = torch.tensor([[s[0] for s in shapes]], dtype=torch.int64)
        rows = np.zeros((st.ctx.size, len(tensors)), np.int64)  # each rank's rows of each
        rows[table[:, STATE] == ACTIVE] = gather(table, mine)[0].numpy()
        outs = [None] * len(tensors)
        for g, group in enumerate(group_layout(codes, shapes)):
            members = group.members or list(range(len(tensors)))
            dtype = DTYPES[group.code]
            wire = wire_dtype(dtype)
            lens = np.array([math.prod(shapes[i][1:]) for i in members], np.int64)
            direct = ptrs is not None and wire == dtype  # CPU, contiguous, not widened
            if direct:  # packed by C++ from the tensors' addresses: no torch op a tensor
                flat = torch.empty(group.total, dtype=dtype)
                _C.gather(flat.data_ptr(), ptrs[members], group.nbytes)
            else:
                flat = torch.cat([tensors[i].detach().reshape(-1).to(wire) for i in members])
            gdesc = describe(ALLGATHER, group.code, shape=(flat.numel(),),
                             name=None if name is None else f"{name}.{g}", tensor=tensors[0])
            got = gather(agree(st, gdesc, what), flat.view(-1, 1))[0].view(-1)
            # got: each rank's members back to back, in rank order (a joined rank's are empty)
            elems = rows[:, members] * lens  # (rank, member): elements of each piece
            totals = rows[:, members].sum(0).tolist()
            # each output its own tensor, not a view (see _own in ops.py)
            gathered = [got.new_empty((totals[j], *shapes[i][1:]))
                        for j, i in enumerate(members)]
            if direct:
                _unpack(got, gathered, elems, wire.itemsize)
            else:
                pieces = got.split(elems.ravel().tolist())
                for j, out in enumerate(gathered):
                    torch.cat(pieces[j::len(members)], out=out.view(-1))
            for i, out in zip(members, gathered):
                outs[i] = out if wire == dtype else out.to(dtype)
        return (outs, rows) if with_rows else outs

    return issue(what, plan, job, async_, _first(tensors), tensors, process_set)


def _unpack(got, outs, elems, itemsize):
    """Copy the pieces of got (rank-major: elems[r, j] elements of member j from rank r) into
    outs (member j's from every rank, in rank order) in one C++ call."""
    at = (np.cumsum(elems.ravel()) - elems.ravel()).reshape(elems.shape)  # offsets in got
    within = np.cumsum(elems, axis=0) - elems  # offsets in each output
    dsts = _addresses(outs) + (within * itemsize).astype(np.uint64)
    srcs = np.uint64(got.data_ptr()) + (at * itemsize).astype(np.uint64)
    # member-major, so each output's pieces are written one after the other
    _C.copy_pieces(np.ascontiguousarray(dsts.T).ravel(), np.ascontiguousarray(srcs.T).ravel(),
                   np.ascontiguousarray((elems * itemsize).astype(np.uint64).T).ravel())


def _addresses(tensors):
    """The data addresses of (contiguous CPU) tensors, a uint64 array for the C++ copies."""
    return np.array(list(map(torch.Tensor.data_ptr, tensors)), np.uint64)


def _first(tensors):
    return tensors[0] if isinstance(tensors, (list, tuple)) and tensors and \
        isinstance(tensors[0], torch.Tensor) else None


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        outs, rows = _grouped_allgather_call(list(tensors), name, False, True, process_set)
        me = state(process_set).ctx.rank
        ctx.offsets, ctx.rows = rows[:me].sum(0).tolist(), rows[me].tolist()
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # as allgather's: this rank's rows of the averaged gradient (of the floating tensors:
        # the others have none; every rank's list has the same dtypes)
        floating = [i for i, g in enumerate(grads) if g.dtype.is_floating_point]
        back = [None] * len(grads)
        if floating:
            reduced = grouped_allreduce_call([grads[i].contiguous() for i in floating], Average,
                                             None, None, 1.0, 1.0, False, False,
                                             ctx.process_set)
            for i, r in zip(floating, reduced):
                back[i] = r.narrow(0, ctx.offsets[i], ctx.rows[i]).reshape(ctx.shapes[i])
        return (None, None, *back)


def grouped_allgather(tensors, name=None, process_set=None):
    """allgather of each tensor of a list (a list back), fused into one allgather per dtype.
    Ranks pass lists of the same length, dtypes and shapes after the first dimension; the first
    may differ by rank and by tensor. Differentiable."""
    if _first(tensors) is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        # the error, on every rank
        return _grouped_allgather_call(tensors, name, False, process_set=process_set)
    if recorded(*tensors):
        return list(_GroupedAllgatherFn.apply(name, process_set, *tensors))
    return _grouped_allgather_call(list(tensors), name, False, process_set=process_set)


def grouped_allgather_async(tensors, name=None, process_set=None):
    """Non-blocking grouped_allgather: synchronize(handle) returns the list."""
    return _grouped_allgather_call(tensors, name, True, process_set=process_set)


# --- grouped reducescatter ------------------------------------------------------------------------

def _grouped_reducescatter_call(tensors, op, name, pre, post, async_, process_set=None):
    what = call_name("grouped_reducescatter", name)

    def plan(st):
        check_name(name)
        codes, shapes, ptrs = _check_list(tensors, what)
        for i, t in enumerate(tensors):
            if t.dim() == 0:
                raise ValueError(f"{what}: tensors[{i}] has no dimension to split; each needs "
                                 "at least one")
        resolved = resolve_op(op, None)
        # kept per list of dtypes and shapes (a training loop scatters the same list each step)
        key = (codes, shapes, tensors[0].device)
        known = st.grouped_layouts.get(key)
        if known is None:
            if len(st.grouped_layouts) >= LAYOUTS_KEPT:
                st.grouped_layouts.clear()
            known = st.grouped_layouts[key] = [
                _ScatterGroup(group, shapes, st.ctx.size, st.ctx.rank, tensors[0].device)
                for group in group_layout(codes, shapes)]
        return ptrs, [(group, p, _list_desc(
            REDUCESCATTER, group.code, CORE_OPS.index(p.core), (st.ctx.size, group.width),
            None if name is None else f"{name}.{g}", codes, shapes, tensors[0], rows=False))
            for g, group in enumerate(known)
            for p in [ReducePlan(resolved, DTYPES[group.code], pre, post, st.ctx.size, what)]]

    def job(st, planned):
        ptrs, groups = planned
        outs = [None] * len(tensors)
        for group, p, desc in groups:
            _agree_list(st, desc, what, rows=False)
            dtype = DTYPES[group.code]
            wire = wire_dtype(dtype)
            direct = ptrs is not None and wire == dtype
            if direct:
                # CPU, contiguous, not widened: C++ copies each rank's rows of each member (and
                # the padding, from zeros) straight into the rank-major buffer, from their
                # addresses: no Python tensor a member (at 100 small tensors those cost more than
                # the copies, the garbage collector's visits included)
                buf = torch.empty((st.ctx.size, group.width), dtype=wire)
                srcs = np.where(group.piece_member < 0, np.uint64(group.zeros(wire)),
                                ptrs[group.members][group.piece_member] + group.piece_offset)
                _C.gather(buf.data_ptr(), srcs, group.piece_bytes)
            else:
                # the members back to back and one zero (the padding's source), gathered
                # rank-major in one index_select
                flat = torch.cat([tensors[i].detach().reshape(-1).to(wire)
                                  for i in group.members]
                                 + [torch.zeros(1, dtype=wire, device=tensors[0].device)])
                buf = flat[group.order()].view(st.ctx.size, group.width)
            p.prescale_(buf)
            got = _coll.reduce_scatter(buf, op=p.core).view(-1) if group.width \
                else buf[st.ctx.rank]
            p.postscale_(got)
            if direct:  # each output its own tensor (see _own in ops.py), filled by one C++ call
                mine = [got.new_empty(shape) for shape in group.mine]
                _C.scatter(got.data_ptr(), _addresses(mine), group.mine_bytes)
            else:
                views = [piece.view(shape) for piece, shape in
                         zip(got[:sum(group.mine_lens)].split(group.mine_lens), group.mine)]
                mine = clone_all(views) if wire == dtype else [v.to(dtype) for v in views]
            for i, out in zip(group.members, mine):
                outs[i] = out
        return outs

    return issue(what, plan, job, async_, _first(tensors), tensors, process_set)


class _ScatterGroup:
    """The tensors of one dtype in a grouped reducescatter's list and how they travel: each
    member's rows split as reducescatter splits them, rank r's rows of every member in row r of
    a (size, width) buffer, zero-padded. piece_member / piece_offset / piece_bytes: that
    buffer's contents in order, as member j (-1 for padding), the byte offset in it, and their
    lengths (uint64 arrays, for the C++ gather); mine / mine_bytes: this rank's block of each
    member, its shape and bytes; order(): for each place in the buffer, the index of its element
    in the members laid back to back, the index one past them a zero (for torch's
    index_select)."""
    __slots__ = ("code", "members", "width", "mine", "mine_lens", "mine_bytes", "piece_member",
                 "piece_offset", "piece_bytes", "blocks", "starts", "device", "_order",
                 "_zeros")

    def __init__(self, group, shapes, n, me, device):
        self.code, self.device = group.code, device
        self.members = list(group.members or range(len(shapes)))
        rows = [_coll.split_rows(shapes[i][0], n) for i in self.members]
        lens = [math.prod(shapes[i][1:]) for i in self.members]
        self.blocks = [[rs[r] * k for rs, k in zip(rows, lens)] for r in range(n)]  # elements
        self.width = max(sum(b) for b in self.blocks)
        self.starts = np.cumsum([0] + [shapes[i][0] * k for i, k in zip(self.members, lens)])
        size = DTYPES[group.code].itemsize
        member, offset, nbytes, done = [], [], [], [0] * len(self.members)
        for b in self.blocks:
            for j, k in enumerate(b):
                member.append(j)
                offset.append(done[j] * size)
                nbytes.append(k * size)
                done[j] += k
            member.append(-1)
            offset.append(0)
            nbytes.append((self.width - sum(b)) * size)
        self.piece_member = np.array(member, np.int64)
        self.piece_offset = np.array(offset, np.uint64)
        self.piece_bytes = np.array(nbytes, np.uint64)
        self.mine = [(rs[me], *shapes[i][1:]) for rs, i in zip(rows, self.members)]
        self.mine_lens = self.blocks[me]
        self.mine_bytes = np.array(self.mine_lens, np.uint64) * np.uint64(size)
        self._order = self._zeros = None

    def zeros(self, wire):
        """The address of width zeros (the padding's source), kept."""
        if self._zeros is None:
            self._zeros = torch.zeros(max(self.width, 1), dtype=wire)
        return self._zeros.data_ptr()

    def order(self):
        if self._order is None:
            pad, order, done = int(self.starts[-1]), [], [0] * len(self.members)
            for b in self.blocks:
                for j, k in enumerate(b):
                    order.append(torch.arange(k) + int(self.starts[j]) + done[j])
                    done[j] += k
                order.append(torch.full((self.width - sum(b),), pad))
            self._order = torch.cat(order).to(self.device)
        return self._order


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, pre, post, process_set, grad, *tensors):
        outs = _grouped_reducescatter_call(list(tensors), op, name, pre, post, False,
                                           process_set)
        ctx.op, ctx.process_set = resolve_op(op, None), process_set
        ctx.scale = reducescatter_grad_scale(ctx.op, pre, post, state(process_set).ctx.size,
                                             grad)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # as reducescatter's: the allgather of the outputs' gradients, scaled (see there)
        check_differentiable(ctx.op, "grouped_reducescatter")
        back = _grouped_allgather_call([g.contiguous() for g in grads], None, False,
                                       process_set=ctx.process_set)
        if ctx.scale != 1.0:
            back = [b.mul_(ctx.scale) for b in back]
        return (None, None, None, None, None, None, *back)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=None, prescale_factor=1.0, postscale_factor=1.0, *,
                          grad="horovod"):
    """reducescatter of each tensor of a list (a list back: this rank's block of rows of each
    reduction), fused into one reduce_scatter per dtype. Every rank passes the same list of
    dtypes and shapes. Differentiable (Average, Sum); factors, compression and grad (the
    gradient convention: Horovod's by default, or "local") as reducescatter's."""
    what = call_name("grouped_reducescatter", name)
    compression = checked_compression(what, compression, process_set)
    grad = checked_grad(what, grad, process_set)
    if _first(tensors) is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return _grouped_reducescatter_call(tensors, op, name, 1.0, 1.0, False, process_set)
    pairs = [compression.compress(t) for t in tensors]
    sent = [c for c, _ in pairs]
    if recorded(*sent):
        outs = _GroupedReducescatterFn.apply(op, name, prescale_factor, postscale_factor,
                                             process_set, grad, *sent)
    else:
        outs = _grouped_reducescatter_call(sent, op, name, prescale_factor, postscale_factor,
                                           False, process_set)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=None,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Non-blocking grouped_reducescatter: synchronize(handle) returns the list."""
    return _grouped_reducescatter_call(tensors, op, name, prescale_factor, postscale_factor,
                                       True, process_set)
