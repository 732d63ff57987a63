"""Tensor fusion: the calls whose tensors travel together in one buffer. Owns the fusion of queued
async allreduces of CPU tensors (fused_job: one control round and one allreduce for a run of like
calls), the staging buffers that fused and grouped calls copy their tensors into (staging,
staged, group_layout: shared memory where the ranks share a host), the allreduce of a flat
buffer with its scaling (allreduce_flat), the fusion threshold (MLFABRIC_FUSION_THRESHOLD) and
fuse(), the bucket plan of DistributedOptimizer and broadcast_parameters.
"""
import bisect
import copy
import math
import zlib

import numpy as np
import torch
from torch.autograd.graph import increment_version as _increment_version

from .. import _C
from .._core import config as _config
from ..comm import collectives as _coll
from ..comm import shared as _shared
from ..errors import MlfabricError
from . import control as _control
from . import tensor_meta as _meta
from .arguments import DTYPES, wire_dtype
from .control import ACTIVE, FUSE_H, FUSE_LEVELS, FUSE_N, STATE, W


def allreduce_flat(flat, plan):
    """flat (as it travels) reduced in place over the ranks, then scaled as plan says
    (arguments.ReducePlan: Horovod's arithmetic, integer tensors included)."""
    if flat.numel():
        _coll.allreduce(flat, op=plan.core, out=flat)
        plan.postscale_(flat)


# --- tensor fusion of queued async allreduces --------------------------------------------------
# Horovod fuses the allreduces that are ready at the same time into one buffer. Here an async
# allreduce of a CPU tensor that starts while like calls (the same dtype, op and scaling) are
# queued behind it does their work too: one control round and one allreduce for them all, where
# each call would cost both (100 async calls of 1 KiB: ~120 us each on the 2-core VM). Ranks may
# have queued different numbers of them by then, so each offers in its descriptor how many it has
# (FUSE_N) and a running hash of their descriptors after 1, 2, 4, ... of them (FUSE_H). From
# the table every rank picks the same number: the largest power of 2 that every rank has queued
# and whose hashes all agree (64-bit: crc32 and adler32). The calls fused are then those every
# rank would have described next, word for word, so fusion changes how the data moves, never what
# is checked: calls that would not agree are left queued, to fail in their own round. A rank whose
# offers the others keep refusing (ranks naming their calls differently) offers less often.
_REFUSED_PAUSE = 16  # calls run unfused (no offer to hash) after an offer every rank could take


class Member:
    """One allreduce call's tensor and descriptor: what _reduce_members moves, and for an async
    call of a CPU tensor what it shows the call running ahead of it (its Executor tag). key and
    nbytes are read only where fusion asks (a blocking call never does)."""
    __slots__ = ("what", "plan", "desc", "tensor", "inplace")

    def __init__(self, what, plan, desc, tensor, inplace):
        self.what, self.plan, self.desc, self.tensor = what, plan, desc, tensor
        self.inplace = inplace

    @property
    def key(self):
        """What calls fused into one allreduce share: dtype, core op and scaling."""
        p = self.plan
        return (self.tensor.dtype, p.core, p.pre, p.after)

    @property
    def nbytes(self):
        """Bytes as it travels."""
        return self.tensor.numel() * wire_dtype(self.tensor.dtype).itemsize


def _followers(st, head):
    """The fusible calls queued right behind head, within the fusion threshold, up to the first
    that reads or writes memory an earlier one of the run writes in place (fused, it would see
    that call's input, not its result)."""
    budget = _fusion_budget() - head.nbytes
    key = head.key
    written = ([], [])
    _writes(written, head)
    out = []
    for tag in st.queue.queued(1 << (FUSE_LEVELS - 1)):
        budget -= tag.nbytes
        if budget < 0 or tag.key != key or _writes(written, tag):
            break
        out.append(tag)
    return out


def _writes(written, tag):
    """Whether tag's tensor overlaps memory in `written` (the byte spans [first, end) written in
    place by earlier members: disjoint, so kept sorted as (firsts, ends) and searched by
    bisection); then records its own span if it is written in place. Addresses alone decide:
    the tensors of queued calls are alive, so spans of distinct storages never overlap."""
    t = tag.tensor
    if not t.numel():
        return False
    lo = t.data_ptr()
    if t.is_contiguous():
        hi = lo + t.numel() * t.element_size()
    else:
        hi = lo + (1 + sum((k - 1) * s for k, s in zip(t.shape, t.stride()))) * t.element_size()
    firsts, ends = written
    i = bisect.bisect_right(firsts, lo)
    if (i and ends[i - 1] > lo) or (i < len(firsts) and firsts[i] < hi):
        return True
    if tag.inplace:
        firsts.insert(i, lo)
        ends.insert(i, hi)
    return False


def _fusion_budget():
    try:
        return fusion_threshold()
    except MlfabricError:
        return 0  # a bad setting: no fusion here (DistributedOptimizer reports it)


def _offer(desc, followers):
    """Write the fusion words of desc: len(followers) and their prefix hashes."""
    desc[FUSE_N] = len(followers)
    a, b = 0, 1
    for i, tag in enumerate(followers, 1):
        data = tag.desc.tobytes()
        a, b = zlib.crc32(data, a), zlib.adler32(data, b)
        if i & (i - 1) == 0:  # a power of 2
            desc[FUSE_H + i.bit_length() - 1] = (a << 31) ^ b


def _fused_count(table):
    """How many queued calls every rank fuses behind this one (from the table alone)."""
    rows = table.tolist()  # (a few ranks' 30 words: cheaper as lists than as numpy ops)
    n = min(row[FUSE_N] for row in rows)
    if n <= 0 or any(row[STATE] != ACTIVE for row in rows):
        return 0  # a joined rank takes part in one call at a time
    first = rows[0]
    for level in range(n.bit_length() - 1, -1, -1):
        h = FUSE_H + level
        if all(row[h] == first[h] for row in rows):
            return 1 << level
    return 0


def fused_job(st, head, plan, what, alone):
    """An async allreduce's job: its control round, offering the like calls queued behind it;
    then one allreduce for it and those that every rank fuses. Their handles finish here.
    alone(head, plan): the call's allreduce when nothing is fused (its result)."""
    desc = head.desc
    followers = []
    if st.fusion_pause:
        st.fusion_pause -= 1
    else:
        try:
            followers = _followers(st, head)
            if followers:
                _offer(desc, followers)
        except Exception:  # noqa: BLE001 - a queued tensor that cannot be read: offer nothing
            # (this call's round must still happen: the peers are in it)
            followers = []
            desc[FUSE_N:W] = 0
    table = _control.agree(st, desc, what)
    taken = st.queue.take(_fused_count(table)) if followers else []
    if not taken:
        if followers and table[:, FUSE_N].min() > 0:
            st.fusion_pause = _REFUSED_PAUSE  # every rank offered; their calls differ
        return alone(head, plan)
    members = [head] + followers[:len(taken)]
    try:
        results = _reduce_members(st, members, plan)
    except BaseException as exc:
        st.queue.finish(taken, errors=[_own_copy(exc, f"{m.what}, fused with {what}")
                                       for m in members[1:]])
        raise
    st.queue.finish(taken, results[1:])
    return results[0]


def _own_copy(exc, what):
    """exc for another handle, whose call is `what`: a copy caused by it, its message led by
    that call's name (one exception object raised by many synchronize() calls would grow its
    traceback at each)."""
    try:
        err = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied: itself
        return exc
    if len(err.args) == 1 and isinstance(err.args[0], str):
        err.args = (f"{what}: {err.args[0]}",)
    err.__cause__ = exc
    return err


def _addresses(tensors):
    """The data addresses of these CPU tensors (a uint64 array, read in one native call where it
    can be: tensor_meta.py), or None if one is not contiguous."""
    got = _meta.scan(tensors)
    if got is not None:
        return got[1]
    if all(map(torch.Tensor.is_contiguous, tensors)):
        return np.array(list(map(torch.Tensor.data_ptr, tensors)), dtype=np.uint64)
    return None


def _reduce_members(st, members, plan):
    """Allreduce the tensors of these fused calls (after the control round, which every rank
    passed as active): each call's result. They travel as one wire buffer: dense tensors of a
    dtype that travels as it is are copied into the staging buffer (shared memory where the
    ranks share a host: the allreduce then reads it in place) and, when every call is in
    place, back, by address, in one native call each way (~0.1 us a tensor, where torch's
    copies cost ~1 us)."""
    tensors = [m.tensor for m in members]
    dtype = tensors[0].dtype  # (one per run: the members' key)
    sizes = list(map(torch.Tensor.numel, tensors))
    ptrs = _addresses(tensors) if wire_dtype(dtype) == dtype else None
    if ptrs is not None:
        total = sum(sizes)
        flat = _staging(st, dtype, total, True, tensors[0].device)[:total]
        nbytes = np.array(sizes, dtype=np.uint64) * np.uint64(dtype.itemsize)
        _C.gather(flat.data_ptr(), ptrs, nbytes)
    else:
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to(wire_dtype(dtype))
    plan.prescale_(flat)
    allreduce_flat(flat, plan)
    if ptrs is not None and all(m.inplace for m in members):
        _C.scatter(flat.data_ptr(), ptrs, nbytes)
        _increment_version(tensors)  # as an in-place torch op would
        return tensors
    results = []
    for m, piece in zip(members, flat.split(sizes)):
        piece = piece.view(m.tensor.shape)
        if m.inplace:
            m.tensor.detach().copy_(piece)
            results.append(m.tensor)
        elif piece.dtype != dtype:
            results.append(piece.to(dtype))
        else:  # a result of its own, not a view of the (reused) fused buffer
            results.append(piece.clone())
    return results


# Grouped allreduces stage through one reusable flat buffer per wire dtype (a fresh buffer would
# cost page faults on every call) of up to this many bytes; larger calls get a buffer of their own.
# When every rank is on one host and takes part, the buffer is in shared memory (collectively
# allocated, at the same offset everywhere), so the allreduce reads the peers' staging buffers in
# place instead of copying through the engine's segment: the tensors are copied once in and once
# out, as one tensor of the same size would be. Shared staging grows by doubling and is freed at
# finalize (at most about twice STAGING_MAX per dtype).
STAGING_MAX = 64 << 20
LAYOUTS_KEPT = 64  # lists of dtypes and shapes whose grouping (and staging views) are kept


class _Group:
    """The tensors of one dtype in a grouped allreduce's list, and their place in the staging
    buffer: kept per list of dtypes and shapes, since a training loop reduces the same list
    every step."""
    __slots__ = ("code", "members", "shapes", "total", "nbytes", "staged")

    def __init__(self, code, members, shapes):
        self.code, self.members, self.shapes = code, members, shapes
        self.total = sum(math.prod(s) for s in shapes)
        size = DTYPES[code].itemsize
        # of each tensor, for _C.gather / scatter (a uint64 array: nothing to convert per call)
        self.nbytes = np.array([math.prod(s) * size for s in shapes], dtype=np.uint64)
        self.staged = None  # (staging buffer, its first `total` elements, views shaped as shapes)


def group_layout(codes, shapes):
    """The groups of a list of these dtype codes and shapes: one per dtype, in order of first
    appearance."""
    if codes.count(codes[0]) == len(codes):
        return [_Group(codes[0], None, shapes)]
    members = {}
    for i, c in enumerate(codes):
        members.setdefault(c, []).append(i)
    return [_Group(c, m, tuple(shapes[i] for i in m)) for c, m in members.items()]


def _staging(st, wire, total, everyone, device):
    """A buffer of at least `total` elements of dtype `wire` on `device` to stage a fused call's
    data in (the one kept for the next call, unless it is over STAGING_MAX). Staging runs
    inside calls, one at a time, after the control round: `everyone` (every rank takes part,
    none joined) means every rank makes this same call now, so a shared buffer may be
    allocated (a collective). A GPU buffer is only touched on mlfabric's stream there, one call
    after another: reuse is ordered."""
    nbytes = total * wire.itemsize
    shared = everyone and device.type == "cpu" and st.ctx.shm is not None and \
        nbytes <= STAGING_MAX
    pool = st.shared_staging if shared else st.staging
    key = wire if device.type == "cpu" else (wire, device)
    buf = pool.get(key)
    if buf is None or buf.numel() < total:
        if shared:
            grown = max(total, 2 * buf.numel() if buf is not None else 0)
            buf = _shared.shared_empty(min(grown, STAGING_MAX // wire.itemsize), wire)
        else:
            buf = torch.empty(total, dtype=wire, device=device)
        if nbytes <= STAGING_MAX:  # else used for this call only
            pool[key] = buf
    return buf


def staged(st, group, everyone, device):
    """(flat, views) for group in the staging buffer of its wire dtype (_staging): views shaped
    like the group's tensors, back to back at the start of flat; kept in the group while that
    buffer is the one staging uses."""
    buf = _staging(st, wire_dtype(DTYPES[group.code]), group.total, everyone, device)
    if group.staged is not None and group.staged[0] is buf:
        return group.staged[1], group.staged[2]
    flat = buf[:group.total]
    views = [v.view(s) for v, s in zip(flat.split([math.prod(s) for s in group.shapes]),
                                       group.shapes)]
    if group.total * buf.element_size() <= STAGING_MAX:
        group.staged = (buf, flat, views)
    return flat, views


def clone_all(tensors):
    """Independent copies of tensors, in one call where this torch has one."""
    clone = getattr(torch, "_foreach_clone", None)
    return list(clone(tensors)) if clone is not None else [t.clone() for t in tensors]


def fusion_threshold():
    """MLFABRIC_FUSION_THRESHOLD: the most bytes fused into one buffer (DistributedOptimizer's
    gradient buckets after the first, broadcast_parameters, queued async allreduces); default
    4 MiB; 0 turns fusion off.
    Every rank must use the same value. A bucket waits for all its gradients, so smaller buckets
    overlap more of backward; each costs a control round and an allreduce call, which with
    buckets in shared memory (zero-copy) is cheap enough that 4 MiB beat DDP's 25 MiB (the
    previous default) on every step measured (BENCHMARKS.md, DistributedOptimizer)."""
    return _config.fusion_threshold()  # (init() checks that every rank reads the same)


def fuse(tensors, threshold, first=None):
    """Indices of tensors grouped into buffers: one device and dtype per buffer, at most
    threshold bytes (a larger tensor gets a buffer of its own), in the order given; first
    (default threshold) caps the first buffer of each instead (DDP's small first bucket).
    Deterministic: the same tensors give the same buffers on every rank."""
    first = threshold if first is None else first
    buckets, current, filled, cap = [], {}, {}, {}
    for i, t in enumerate(tensors):
        # one device and dtype per buffer (an optimizer's state can mix CUDA tensors with CPU
        # scalars: Adam's step counts)
        kind, nbytes = (t.device, t.dtype), t.numel() * t.element_size()
        members = current.get(kind)
        if members is None or (members and filled[kind] + nbytes > cap[kind]):
            cap[kind] = first if members is None else threshold
            members = current[kind] = []
            filled[kind] = 0
            buckets.append(members)
        members.append(i)
        filled[kind] += nbytes
    return buckets
