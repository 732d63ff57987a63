"""The control round: in front of every call each rank contributes a small descriptor of it (kind,
dtype, op, root, shape, name, device; describe()) to an allgather, and from the table every rank
decides the same thing: go ahead, or raise MismatchError naming the ranks and what each passed
(disagreement()), so every rank fails together, before any data moves. Owns the descriptor's
layout (the word indices, states and kinds below; the fusion words are fusion.py's to fill), the
round itself (control_round, agree, exchange), the mismatch reports, a call's name in messages
(call_name), and a rank's part in a round as 'rejected' (reject: its arguments were bad). A rank
inside join() contributes 'joined' and learns from the others' descriptors which call to take
part in (ops.join); allgather, alltoall and broadcast beside it are an error, as in Horovod,
unless it joined with JOINED_ANY set. Where the ranks' descriptors name different calls and
some are async, or a rank has calls set aside, control_round hands over to reorder.resolve,
which finds the call every rank has issued (the ranks' async calls may come in different
orders, as Horovod's, matched by name, may).
"""
import math
import sys
import zlib

import numpy as np

from ..comm import collectives as _coll
from ..errors import MismatchError, MlfabricError, PeerTimeoutError
from . import timeline as _timeline
from .arguments import CORE_OPS, dtype_name

# --- a call's descriptor: int64 words ---------------------------------------------------------

(STATE, JOINED_AT, KIND, DTYPE, OP, ROOT, ROWS, ROW_LEN, NDIM, SHAPE_HASH, ROW_HASH,
 NAME_HASH) = range(12)
DIMS, MAX_DIMS = 12, 8  # words 12..19: the first dimensions, for messages
DEVICE = 20  # 0: the tensors are on the CPU, 1: on a GPU (they move over NCCL)
# Written by control_round (reorder.py): 1 when this rank may set its call aside (an async call
# of CPU tensors, in its first round); how many calls this rank has set aside.
MOBILE, ASIDE_N = 21, 22
# An async allreduce's offer to fuse the like calls queued behind it (see fusion.fused_job): how
# many (FUSE_N), and a hash of their descriptors after the first 1, 2, 4, ... 128 of them.
FUSE_N, FUSE_LEVELS = 23, 8
FUSE_H = 24  # words 24..31
W = 32  # int64 words per descriptor
# In a JOINED descriptor, word OP: 1 when the joined rank also takes part in allgathers,
# alltoalls and broadcasts (join(all_calls=True)); 0, as in Horovod: those are an error while a
# rank is joined (it has no rows to give, and Horovod's joined ranks take part in reductions and
# barriers only).
JOINED_ANY = OP
# equal when all agree
SAME = [KIND, DTYPE, OP, ROOT, ROW_LEN, ROW_HASH, NAME_HASH, DEVICE]
ACTIVE, JOINED, REJECTED = 1, 0, -1
KINDS = ("barrier", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
         "process set")
BARRIER, ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, PROCESS_SET = range(7)
SET_CALLS = ("add_process_set", "remove_process_set")  # op of a PROCESS_SET descriptor


def stable_hash(value):
    """A hash of value that is the same in every process (its repr's crc32)."""
    return zlib.crc32(repr(value).encode())


_DESCS = {}  # describe's arguments -> the descriptor: a training loop repeats the same calls


def describe(kind, dtype=0, op=0, root=0, shape=(), name=None, layout=None, tensor=None):
    """This rank's descriptor of a call (a new array: callers may amend it). shape: the
    tensor's (0-d counts as (1,)); layout: what else must agree (the member shapes of a grouped
    allreduce); tensor: one of the call's tensors, for its device."""
    device = 1 if tensor is not None and tensor.is_cuda else 0
    key = (kind, dtype, op, root, tuple(shape), name, layout, device)
    try:
        d = _DESCS.get(key)
    except TypeError:  # an unhashable name or layout: described afresh (and checked by plan)
        key, d = None, None
    if d is None:
        d = _new_desc(kind, dtype, op, root, shape, name, layout, device)
        if key is not None and len(_DESCS) < 4096:
            _DESCS[key] = d
    return d.copy()


def _new_desc(kind, dtype, op, root, shape, name, layout, device):
    shape = tuple(int(s) for s in shape) or (1,)
    d = np.zeros(W, np.int64)
    d[STATE], d[KIND], d[DTYPE], d[OP], d[ROOT] = ACTIVE, kind, dtype, op, root
    d[ROWS] = shape[0]
    d[ROW_LEN] = math.prod(shape[1:])
    d[NDIM] = len(shape)
    d[SHAPE_HASH] = stable_hash(shape if layout is None else (shape, layout))
    d[ROW_HASH] = stable_hash(shape[1:])
    d[NAME_HASH] = -1 if name is None else stable_hash(name)
    k = min(len(shape), MAX_DIMS)
    d[DIMS:DIMS + k] = shape[:k]
    d[DEVICE] = device
    return d


def shape_of(d, rows=True):
    nd = int(d[NDIM])
    dims = tuple(int(v) for v in d[DIMS:DIMS + min(nd, MAX_DIMS)])
    dims += ("...",) if nd > MAX_DIMS else ()
    return dims if rows else dims[1:]


def rank_groups(table, ranks, key):
    """Lists of ranks that agree on key(descriptor), in order of first appearance."""
    groups = {}
    for r in ranks:
        groups.setdefault(key(table[r]), []).append(int(r))
    return list(groups.values())


def disagreement(table, what):
    """The error every rank raises for this control round, or None (the same on every rank:
    it depends on the table alone)."""
    # The usual case: every rank active and describing the same call, word for word.
    raw = table.tobytes()
    if table[0, STATE] == ACTIVE and raw == raw[:len(raw) // len(table)] * len(table):
        return None
    states = table[:, STATE]
    # Then at numpy speed: the same call, its rows differing where they may (allgather).
    if (states == ACTIVE).all() and (table[:, SAME] == table[0, SAME]).all() and (
            table[0, KIND] in (ALLGATHER, ALLTOALL)
            or (table[:, SHAPE_HASH] == table[0, SHAPE_HASH]).all()):
        return None
    bad = np.flatnonzero(states == REJECTED)
    if bad.size:
        return (f"{what}: rank(s) {bad.tolist()} rejected their arguments (see the error on those "
                "ranks); nothing was exchanged")
    active = np.flatnonzero(states == ACTIVE)
    if not active.size:
        return None
    kinds = rank_groups(table, active, lambda d: int(d[KIND]))
    if len(kinds) == 1 and (table[active, NAME_HASH] != -1).all():
        names = rank_groups(table, active, lambda d: int(d[NAME_HASH]))
        if len(names) > 1:
            return (f"{what}: the ranks' tensor names differ (ranks grouped by name: "
                    f"{' | '.join(map(str, names))}): they issued different calls at this point. "
                    "mlfabric runs a call once every rank has issued it: async calls of CPU "
                    "tensors may be issued in different orders, other calls (blocking ones, "
                    "and the async call that synchronize() waits for) must come in the same "
                    "order on every rank")
    checks = [("call", lambda d: int(d[KIND]), lambda d: KINDS[int(d[KIND])]),
              ("device", lambda d: int(d[DEVICE]), lambda d: ("cpu", "cuda")[int(d[DEVICE])]),
              ("dtype", lambda d: int(d[DTYPE]), lambda d: dtype_name(int(d[DTYPE])))]
    kind = int(table[active[0], KIND])
    if kind == PROCESS_SET:
        joined = np.flatnonzero(states == JOINED)
        if joined.size:
            return (f"{what}: rank(s) {joined.tolist()} are inside join(); every rank adds or "
                    "removes a process set, outside join()")
        checks.append(("call", lambda d: int(d[OP]), lambda d: SET_CALLS[int(d[OP])]))
        checks.append(("the process set's ranks", lambda d: int(d[SHAPE_HASH]),
                       lambda d: str(list(shape_of(d)))))
    if kind in (ALLREDUCE, REDUCESCATTER):
        checks.append(("op", lambda d: int(d[OP]), lambda d: CORE_OPS[int(d[OP])]))
    if kind == BROADCAST:
        checks.append(("root", lambda d: int(d[ROOT]), lambda d: str(int(d[ROOT]))))
    if kind in (ALLREDUCE, BROADCAST, REDUCESCATTER):
        checks.append(("shape", lambda d: int(d[SHAPE_HASH]), lambda d: str(shape_of(d))))
    elif kind in (ALLGATHER, ALLTOALL):
        checks.append(("shape of a row (the dimensions after the first)",
                       lambda d: int(d[ROW_HASH]), lambda d: str(shape_of(d, rows=False))))
    for field, key, show in checks:
        groups = rank_groups(table, active, key)
        if len(groups) > 1:
            shown = [show(table[g[0]]) for g in groups]
            if field == "shape" and len(set(shown)) == 1:  # the hash covers the layout too
                return (f"{what}: the ranks issued different calls of the same shape {shown[0]} "
                        f"(ranks grouped by call: {' | '.join(map(str, groups))}): a grouped "
                        "call's list, a DistributedOptimizer's bucket (or one built otherwise: "
                        "another model, groups or backward_passes_per_step) or a SyncBatchNorm "
                        "layer on some, another call on the others")
            parts = "; ".join(f"{v} on rank(s) {g}" for v, g in zip(shown, groups))
            return f"{what}: ranks disagree on {field}: {parts}"
    joined = np.flatnonzero(states == JOINED)
    if joined.size and kind in (ALLGATHER, BROADCAST, ALLTOALL) and \
            not table[joined, JOINED_ANY].all():
        return (f"{what}: rank(s) {joined.tolist()} have joined (are inside join()); as in "
                f"Horovod, {'an' if kind == ALLGATHER or kind == ALLTOALL else 'a'} "
                f"{KINDS[kind]} is not supported while a rank is joined (joined ranks take part "
                "in allreduces, reducescatters and barriers only); nothing was exchanged")
    if kind == BROADCAST:
        root = int(table[active[0], ROOT])
        if states[root] != ACTIVE:
            return f"{what}: the root rank {root} has joined; a joined rank cannot broadcast"
    return None


def control_round(st, desc, what=None):
    """The control round: every rank's descriptor, as a table. what: the call, named in the
    PeerTimeoutError of a round that times out.

    Where the descriptors differ and some rank has an async call it may set aside, or calls set
    aside before, the ranks look further (reorder.resolve): this may run this rank's calls set
    aside first, set this call aside (reorder.SetAside, for the dispatcher), or retry; the table
    then returned describes the call every rank runs next, which on this rank is this one."""
    table = st.preagreed
    if table is not None:  # a call set aside, run now: its round already took place
        st.preagreed = None
        return table
    cur = st.current
    while True:
        desc[MOBILE] = cur is not None and cur.mobile and len(st.aside) < _reorder.MAX_ASIDE
        desc[ASIDE_N] = len(st.aside)
        table = exchange(st, desc, what).reshape(st.ctx.size, W)
        raw = table.tobytes()
        if raw == raw[:len(raw) // len(table)] * len(table):
            aside = bool(table[0, ASIDE_N])
            if not aside:
                break  # the usual case: one call on every rank, word for word
        else:
            aside = bool(table[:, ASIDE_N].any())
            if not aside and not table[:, MOBILE].any():
                break  # no call that may wait: agree() finds what differs
        msg = disagreement(table, what or "the call")
        st.verdict = (table, msg)  # (agree's, without computing it again)
        if (table[:, STATE] == REJECTED).any():
            break
        # Where a rank has calls set aside, the oldest calls every rank has issued go first
        # (two unnamed calls alike are told apart by their order alone). Else only different
        # calls (kind or name) wait: one call whose arguments differ fails at once.
        waits = _different_calls(table)
        if not aside and (msg is None or not waits):
            break
        table = _reorder.resolve(st, desc, table, msg, what or "the call", waits)
        if table is not None:
            break
    if cur is not None:
        cur.mobile = False  # a call's later rounds (a grouped call's) cannot set it aside
    return table


def _different_calls(table):
    """Whether the active ranks describe different calls (kind or name): only then may a rank
    set its call aside (two calls of one kind and name whose arguments differ are one call,
    mismatched, as in Horovod)."""
    states = table[:, STATE]
    ids = table[states == ACTIVE][:, [KIND, NAME_HASH]]
    return len(ids) > 0 and bool((ids != ids[0]).any())


def exchange(st, words, what=None):
    """Every rank's words (the same number on each), concatenated: one allgather, counted in
    st.rounds."""
    timing = _timeline.negotiating()
    try:
        got = _coll.allgather(words)
    except PeerTimeoutError as exc:
        if what is None:
            raise
        # its own words name the engine's allgather, not the call. After a mismatch the
        # ranks' calls may no longer line up (a call some rank issued once more, e.g. an async
        # one queued behind the call that failed): a round no peer joins times out, and its
        # cause is that earlier error, which may have gone unseen (an async call's, until
        # synchronize())
        after = "" if st.mismatch is None else (
            f" (this rank's earlier call {st.mismatch[0]} failed with MismatchError: "
            f"{st.mismatch[1][:300]}; after a mismatch the ranks' calls may no longer line up, "
            "so the peers may never issue this one)")
        aside = "" if not st.aside else (
            " (this rank's async calls still waiting for the others to issue them: "
            f"{', '.join(c.what for c in st.aside)})")
        raise PeerTimeoutError(f"{what}: in the control round (the ranks agreeing on the call): "
                               f"{exc}{after}{aside}") from exc
    finally:
        if timing is not None:  # a round that failed (a dead peer) is the one to see
            timing[1].append((timing[0], _timeline.now_us()))
    st.rounds += 1
    st.mismatch = None  # the ranks' calls line up again (the caller records a new mismatch)
    return got


def mismatched(st, what, msg):
    """The MismatchError every rank of st raises for call `what`, recorded for control_round."""
    st.mismatch = (what, msg)
    err = MismatchError(msg)
    err._mlf_peers_told = st  # every rank of st raises it (elastic.run reads the mark)
    return err


def agree(st, desc, what):
    """Control round of an active rank: the table, or the MismatchError every rank raises."""
    table = control_round(st, desc, what)
    known = st.verdict
    msg = known[1] if known is not None and known[0] is table else disagreement(table, what)
    if msg is not None:
        raise mismatched(st, what, msg)
    return table


def everyone(table):
    """Whether every rank takes part in the call this table agreed on (none has joined)."""
    return JOINED not in table[:, STATE].tolist()


class CallName(str):
    """A call's name in messages, knowing whether the caller named it (named: a name passed,
    not an InternalName): the dispatcher checks that no named call is issued twice while in
    flight (reorder.py)."""


class InternalName(str):
    """A name mlfabric gives its own calls (a DistributedOptimizer's buckets: two optimizers
    of one model name theirs alike): not checked for calls of the same name in flight."""


def call_name(kind, name):
    out = CallName(f"{kind} '{name}'" if name is not None else kind)
    out.named = name is not None and not isinstance(name, InternalName)
    return out


def reject(st, what, async_):
    """Take part in the control round of the call `what` as 'rejected' (the peers raise a
    MismatchError naming this rank). Called while handling the error this rank raises next,
    which is marked with the state whose ranks have heard of it (elastic.run reads the mark)."""
    told = sys.exc_info()[1]
    if told is not None:
        try:
            told._mlf_peers_told = st
        except AttributeError:  # an exception type without a __dict__
            pass
    desc = np.zeros(W, np.int64)
    desc[STATE] = REJECTED

    def job():
        try:
            control_round(st, desc)
        except MlfabricError:
            pass  # the peers' view of this call; this rank's own error is the one to raise

    if async_:
        st.submit(what, job)
    else:
        st.run(what, job)


from . import reorder as _reorder  # noqa: E402  (it reads this module's words and checks)
