"""Process sets, as Horovod's (>= 0.23): collectives among a subset of the ranks.

    even = hvd.add_process_set([0, 2])       # every rank calls it, with the same ranks
    if even.included():
        hvd.allreduce(t, process_set=even)   # only ranks 0 and 2 take part
    hvd.remove_process_set(even)             # every rank, again

Owns ProcessSet, global_process_set, add_process_set / remove_process_set and the sets passed to
init(process_sets=[...]). A registered set has, on each of its ranks, a context of its own
(mlfabric.comm.context.Context on a communicator split from mlfabric's: its own shared-memory
transport, queue, and NCCL communicator when GPU tensors move) and an dispatch.State running its
calls in it, so its collectives and control rounds stay among its ranks, in their own order:
calls on different sets are independent, as in Horovod. Every collective of mlfabric.torch and
DistributedOptimizer take process_set=; root_rank stays a global rank (Horovod's rule), and
results come in the set's rank order (its ranks sorted).

Adding and removing are collective over every rank, ordered with the global calls, and checked:
ranks that pass different sets fail together with a MismatchError naming what each passed.
join() is over every rank (as Horovod's, which takes no process set): a joined rank takes part
in the global calls only, so its set's calls wait for it (at most MLFABRIC_TIMEOUT seconds).
"""
import numpy as np
from mpi4py import MPI

from ..comm import context as _context
from . import control, dispatch


class ProcessSet:
    """A set of global ranks that run collectives together. Build it from a list of ranks,
    then register it: init(process_sets=[...]) or add_process_set(). size(), rank() and
    included() answer once it is registered (None before)."""

    def __init__(self, ranks):
        if isinstance(ranks, MPI.Comm):
            raise TypeError("ProcessSet(comm): mlfabric builds process sets from a list of "
                            "global ranks; pass the communicator's ranks as a list")
        try:
            listed = [r for r in ranks]
        except TypeError:
            raise TypeError(f"ProcessSet needs a list of ranks, got {type(ranks).__name__}") \
                from None
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in listed):
            raise TypeError(f"ProcessSet needs integer ranks, got {listed!r}")
        self.ranks = sorted(int(r) for r in listed)
        self.process_set_id = None

    def _registered(self):
        """The registered ranks, or None (not registered in this initialisation)."""
        if self.process_set_id is None or not _context.initialized():
            return None
        st = dispatch.state()
        if self.process_set_id == 0:
            return list(range(st.ctx.size))
        entry = st.sets.get(self.process_set_id)
        return list(entry[0]) if entry is not None and list(entry[0]) == self.ranks else None

    def size(self):
        """Number of ranks in the set, or None while it is not registered."""
        ranks = self._registered()
        return None if ranks is None else len(ranks)

    def rank(self):
        """This rank's place in the set (the rank its results are ordered by; -1 when it is not
        in the set), or None while the set is not registered. Collectives still name roots by
        their global rank, hvd.rank()."""
        ranks = self._registered()
        if ranks is None:
            return None
        me = dispatch.state().ctx.rank
        return ranks.index(me) if me in ranks else -1

    def included(self):
        """Whether this rank is in the set, or None while it is not registered."""
        ranks = self._registered()
        return None if ranks is None else dispatch.state().ctx.rank in ranks

    def __repr__(self):
        ranks = "all" if self.process_set_id == 0 else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0  # every rank; ranks filled in at init()


def on_init(process_sets):
    """init()'s part: the global set's ranks, then the sets passed to init (None, "dynamic" (as
    Horovod's flag: sets may be added later, always allowed here) or a list)."""
    global_process_set.ranks = list(range(dispatch.state().ctx.size))
    if process_sets is None or process_sets == "dynamic":
        return
    if not isinstance(process_sets, (list, tuple)):
        raise TypeError("init(process_sets=...) takes a list of ProcessSet (or of rank lists), "
                        f"or 'dynamic'; got {type(process_sets).__name__}")
    for ps in process_sets:
        add_process_set(ps)


def add_process_set(process_set):
    """Register process_set (a ProcessSet or a list of ranks) and return it. Collective: every
    rank calls it with the same ranks, in the same order relative to its other calls."""
    try:
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        what, bad = f"add_process_set({ps.ranks})", None
    except TypeError as exc:  # raised in plan(), so that the peers hear of it
        what, bad = f"add_process_set({process_set!r:.60})", exc

    def plan(st):
        if bad is not None:
            raise bad
        n = st.ctx.size
        if not ps.ranks:
            raise ValueError(f"{what}: a process set needs at least one rank")
        if len(set(ps.ranks)) != len(ps.ranks) or not 0 <= ps.ranks[0] <= ps.ranks[-1] < n:
            raise ValueError(f"{what}: ranks must be distinct ranks in [0, {n})")
        if ps._registered() is not None:
            raise ValueError(f"{what}: this ProcessSet is already registered (id "
                             f"{ps.process_set_id})")
        return _set_desc(0, ps.ranks)

    def job(st, desc):
        control.agree(st, desc, what)
        member = st.ctx.rank in ps.ranks
        sub = st.ctx.comm.Split(0 if member else MPI.UNDEFINED, key=st.ctx.rank)
        state = None
        if member:
            try:
                state = dispatch.State(_context.sub_context(sub), parent=st,
                                       ranks=tuple(ps.ranks))
            except BaseException:
                sub.Free()
                raise
        set_id = next(st.set_ids)
        st.sets[set_id] = (tuple(ps.ranks), state)
        ps.process_set_id = set_id
        return ps

    return dispatch.issue(what, plan, job, False)


def remove_process_set(process_set):
    """Unregister process_set and free what it holds; True when it was registered (the global
    set is never removed: False). Collective: every rank calls it, after the set's calls."""
    if isinstance(process_set, ProcessSet) and process_set.process_set_id == 0:
        return False
    what = f"remove_process_set({getattr(process_set, 'ranks', process_set)!r:.60})"

    def plan(st):
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"remove_process_set needs a ProcessSet, got "
                            f"{type(process_set).__name__}")
        if process_set._registered() is None:
            raise ValueError(f"{what}: not registered in this initialisation")
        return _set_desc(1, process_set.ranks)

    def job(st, desc):
        control.agree(st, desc, what)
        _, state = st.sets.pop(process_set.process_set_id)
        process_set.process_set_id = None
        if state is not None:
            state.close()
        return True

    return dispatch.issue(what, plan, job, False)


def _set_desc(call, ranks):
    """The control-round descriptor of add (call 0) / remove (1) of the set of ranks: their
    hash to compare, the first of them (in place of a shape's dimensions) for messages."""
    desc = control.describe(control.PROCESS_SET, op=call)
    desc[control.SHAPE_HASH] = control.stable_hash(tuple(ranks))
    desc[control.NDIM] = len(ranks)
    k = min(len(ranks), control.MAX_DIMS)
    desc[control.DIMS:control.DIMS + k] = ranks[:k]
    return desc


def process_set_by_id(process_set_id):
    """The registered set with this id (0: global_process_set)."""
    if process_set_id == 0:
        return global_process_set
    entry = dispatch.state().sets.get(process_set_id)
    if entry is None:
        raise ValueError(f"no process set with id {process_set_id} is registered")
    ps = ProcessSet(entry[0])
    ps.process_set_id = process_set_id
    return ps


def process_sets():
    """Every registered set, global_process_set first."""
    return [global_process_set] + [process_set_by_id(i) for i in sorted(dispatch.state().sets)]


__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "process_set_by_id", "process_sets"]
