"""A server rank's daemon side (and, with its own plan, the replica's: replica.py): the model, the
order in which updates are applied, and the answers to model requests.

Scheduled asynchronous modes (mlfabric-A, SSP) apply in the plan's order: the scheduler sends the
server each batch's commits in order ('expect'), and a payload that arrives before its predecessor
waits (paper §3.1.1: order is enforced by the network; this only covers a late payload). With a
replica, each commit also waits until the replica has applied enough (gate.py). Vanilla async
applies whatever arrives, as it arrives. mlfabric-S sums an iteration's updates in whatever order
they come and takes one step when all live workers' updates are in (§6).

The version is the number of updates applied (async modes: an aggregate of m updates counts m, so
every member keeps its delay) or of iterations (sync). Every applied update's delay is recorded for
the accounting, in the scheduler's convention (mlfabric.sched.plan, paper Fig. 1; the simulator's
too): tau = the version it takes the model to - the version it was computed from, so a lone
worker's update has delay 1 and tau_max bounds exactly what the scheduler planned.
"""
import time
from collections import Counter, deque
from math import inf

import numpy as np

from .. import kernels
from ..errors import MlfabricError
from .ledger import DROP_AGGREGATOR_FAILED, DROP_STREAM_VOIDED, DROP_WORKER_FAILED
from .messages import DropUpdate, uid_text


def _pick(entry, values, ids):
    """values (one per id `entry` plans) of the ids that came, in their order; a payload
    carrying an id its commit does not plan is an error naming the commit."""
    of = dict(zip(entry.ids, values))
    extra = [u for u in ids if u not in of]
    if extra:
        raise MlfabricError("plan message `%s`: its payload carries update(s) %s, which it does "
                            "not plan" % (entry, ", ".join(uid_text(u) for u in extra)))
    return tuple(of[u] for u in ids)


def default_apply(gamma):
    """The built-in update rule: w += u (updates arrive already scaled by -eta, eq. 1), with server
    momentum gamma (eq. 2) when asked."""
    if not gamma:
        def apply(model, update, ids):
            kernels.axpy_(model, 1.0, update)
        return apply
    prev = {}

    def apply_momentum(model, update, ids):
        last = prev.get("w")
        step = update.copy()
        if last is not None:
            kernels.axpy_(step, gamma, model - last)
        prev["w"] = model.copy()
        kernels.axpy_(model, 1.0, step)
    return apply_momentum


class ApplyInOrder:
    """The commits of a plan applied strictly in order, each once its payload is in and the
    replica has applied as many updates as the commit's gate asks (paper §5.3; gate.py). The wait
    is enforced by the replica's progress reports, so a network slower than planned can cost time
    but never break the divergence bound."""

    def __init__(self):
        self.expect = deque()    # ExpectCommit records (messages.py), in order
        self.arrived = {}        # arrival key -> (ids, payload)
        self.replica_count = 0   # updates the replica has reported applied

    def add_plan(self, commits):
        self.expect.extend(commits)

    def arrive(self, key, ids, data):
        self.arrived[key] = (ids, data)

    def due(self, may=None, values="versions"):
        """Pop and yield (ids, their values, payload, replica count waited for) while the next
        commit may be applied. The values are a field of the commit, one per planned id:
        versions by default, norms in a replica's plan; `may(norms)`, if given, must agree too.
        The ids are the payload's own: an aggregate whose aggregator lost a member to a failure
        carries fewer than planned."""
        while (self.expect and self.expect[0].key in self.arrived
               and self.replica_count >= self.expect[0].need):
            entry = self.expect[0]
            ids = self.arrived[entry.key][0]
            if may is not None and not may(_pick(entry, entry.norms, ids)):
                return
            self.expect.popleft()
            data = self.arrived.pop(entry.key)[1]
            yield ids, _pick(entry, getattr(entry, values), ids), data, entry.need

    def replica_need(self):
        """The replica count the next commit waits for when only the replica holds it (its
        payload is in), else 0."""
        if (self.expect and self.expect[0].key in self.arrived
                and self.replica_count < self.expect[0].need):
            return self.expect[0].need
        return 0

    def forget(self, dead):
        """Commits that can never arrive because rank `dead` died: a direct update it was to send,
        or an aggregate it was to send. Removed; returns [(id, reason)]."""
        lost, keep = [], deque()
        for entry in self.expect:
            if entry.via == dead and entry.key not in self.arrived:
                why = DROP_WORKER_FAILED if entry.key[0] == "u" else DROP_AGGREGATOR_FAILED
                lost.extend((u, why) for u in entry.ids)
            else:
                keep.append(entry)
        self.expect = keep
        return lost


class ServerRole:
    def __init__(self, rt, model, on_update=None, on_request=None, *, version=0, logical=None,
                 replica="auto", processed=None):
        self.rt = rt
        cfg = rt.config
        self.model = model
        self.version = version
        self.logical = rt.rank if logical is None else logical  # the server id workers use
        self.apply_fn = on_update or default_apply(cfg.gamma)
        self.request_fn = on_request
        self.mode = cfg.mode
        self.workers = [w for w in rt.roles.worker_ranks if w not in rt.failed]
        self.order = ApplyInOrder()
        self.processed = {w: 0 for w in self.workers}  # applied or dropped, per worker (SSP)
        self.processed.update({w: n for w, n in (processed or {}).items() if w in self.processed})
        self.gets = []               # (worker, request id, clock) waiting for their condition
        self.asked = {}              # worker -> job time its (one) get came (profile)
        self.planning = {}           # worker -> its get, of the pull batch being planned
        self.distribution = cfg.distribution and cfg.sched_mode is not None
        self.snapshots = {}          # version -> the model copy a pull batch is planned for
        self.pulls = []              # requests due, waiting for the models still leaving
        self.parked = []             # requests the admission parked (slow uplink), and until when
        self.parked_until = 0.0
        self.leaving = {}            # rank -> model sends to it in flight (0: a batch is planned)
        self.planning_since = 0.0    # when the batch being planned went to the scheduler
        # (ids, version after, job time, replica count waited for): the order, for audits and
        # tests; the last cfg.applied_log_max commits only, so a long job does not grow it
        self.applied_log = deque(maxlen=cfg.applied_log_max)
        self.unreported = []         # ids applied since the last 'applied' report
        self.iteration = None        # sync: [sum, members] of the open iteration
        self.planned_iterations = set()  # sync: iterations whose updates are all planned
        self.sync_seen = set()       # sync: arrival keys seen (they may precede their plan)
        self.checkpointed = version  # version of the last checkpoint written
        self.checkpoint_s = 0.0      # seconds spent writing them
        if replica == "auto":
            replica = rt.roles.replica_of(rt.rank)
        self.replica = replica
        self.told_replica = None     # (version, replica count needed) last sent to the replica
        if replica is not None:      # the replica starts from the same model
            rt.dp.send(replica, ("init", 0), model.copy())
        else:
            self.order.replica_count = inf

    # --- payloads ---------------------------------------------------------------------------------
    def on_data(self, msg):
        key = msg.key
        if key[0] == "u":
            if key[3] != self.logical:
                return  # a copy for the replica this rank was before its promotion
            ids, versions = (key[1],), (key[2],)
        elif key[0] == "a":
            if "r" in key[1]:
                return  # a replica aggregate planned before this rank's promotion
            ids, versions = key[2], (key[3],) * len(key[2])
        else:
            raise RuntimeError("server rank %d: unexpected payload %r" % (self.rt.rank, key))
        if self.mode == "mlfabric-S":
            self._arrived_sync(key[:2])
            self._sum_iteration(ids, msg.data)
        elif self.mode == "async":
            self._apply(ids, versions, msg.data)
        else:
            self.order.arrive(key[:2], ids, msg.data)
            self._apply_due()
        self._answer_gets()

    def on_voided(self, src, key, why):
        """A streamed aggregate came void (a member's sender died while the sum was streaming
        out): it arrives empty, so the order and the sync iteration go on, and its members are
        dropped with their reason (the live ones too: their bytes were summed with the dead
        one's)."""
        if key[0] != "a" or "r" in key[1]:
            raise RuntimeError("server rank %d: unexpected void payload %r" % (self.rt.rank, key))
        ids = key[2]
        self.rt.channel.send(0, "lost", [DropUpdate(u, DROP_STREAM_VOIDED) for u in ids])
        for uid in ids:
            if uid >> 32 in self.processed:
                self.processed[uid >> 32] += 1
        if self.mode == "mlfabric-S":
            self._arrived_sync(key[:2])
            self._close_iteration()
        else:
            self.order.arrive(key[:2], (), None)
            self._apply_due()
        self._answer_gets()

    def _apply_due(self):
        for ids, versions, data, needed in self.order.due():
            self._apply(ids, versions, data, needed)

    def _apply(self, ids, versions, data, needed=0):
        rt = self.rt
        if ids:  # an aggregate can come empty when failures took all its members
            self.apply_fn(self.model, data, ids)
        for p, v in enumerate(versions):
            rt.ledger.delays[self.version + p + 1 - v] += 1
        self.version += len(ids)
        self._record(ids, needed)

    def _sum_iteration(self, ids, data):
        if ids:
            if self.iteration is None:
                self.iteration = [data.astype(self.model.dtype, copy=True), list(ids)]
            else:
                kernels.axpy_(self.iteration[0], 1.0, data)
                self.iteration[1].extend(ids)
        self._close_iteration()

    def _arrived_sync(self, key):
        """Sync mode uses the plan only to know what is still to come (so a failure can be told
        from a late payload): an arrival settles its entry, whichever came first."""
        self.sync_seen.add(key)
        self.order.expect = deque(e for e in self.order.expect if e.key != key)

    def _close_iteration(self):
        """Take the step once the scheduler has planned every live worker's update of the open
        iteration and none of them is still to come (arrived, or lost to a failure)."""
        if self.version not in self.planned_iterations or self.order.expect:
            return
        self.planned_iterations.discard(self.version)
        members = ()
        if self.iteration is not None:
            total, members = self.iteration[0], tuple(self.iteration[1])
            self.iteration = None
            self.apply_fn(self.model, total, members)
        self.version += 1
        self._record(members)

    def _checkpoint(self):
        """Every checkpoint_every updates (or iterations), the model and version to disk."""
        from . import checkpoint
        cfg = self.rt.config
        if self.version // cfg.checkpoint_every > self.checkpointed // cfg.checkpoint_every:
            t0 = time.perf_counter()
            checkpoint.save(cfg.checkpoint_dir, self.logical, self.model, self.version)
            self.checkpoint_s += time.perf_counter() - t0
            self.checkpointed = self.version

    def _record(self, ids, needed=0):
        rt = self.rt
        if rt.config.checkpoint_every:
            self._checkpoint()
        rt.ledger.applied.update(ids)
        self.unreported.extend(ids)
        self.applied_log.append((ids, self.version, rt.now(), needed))
        for uid in ids:
            w = uid >> 32
            if w in self.processed:
                self.processed[w] += 1

    # --- control ----------------------------------------------------------------------------------
    def on_ctrl(self, src, kind, body):
        if kind == "expect":
            if self.mode == "mlfabric-S":
                self.order.add_plan(e for e in body if e.key not in self.sync_seen)
            else:
                self.order.add_plan(body)
            if self.rt.failed:  # planned before the scheduler knew: from the dead, nothing comes
                self.peers_failed(sorted(self.rt.failed), [])
            elif self.mode == "mlfabric-S":
                self._close_iteration()
            else:
                self._apply_due()
        elif kind == "iteration":     # sync: every update of this iteration is planned
            self.planned_iterations.add(body)
            self._close_iteration()
        elif kind == "replicated":
            self.order.replica_count = body
            self._apply_due()
        elif kind == "replica-gone":
            self.order.replica_count = inf
            self.replica = None
            self._apply_due()
        elif kind == "dropped":
            for d in body:
                if d.id >> 32 in self.processed:
                    self.processed[d.id >> 32] += 1
        elif kind == "get":  # a worker has one get at a time: a re-sent one supersedes
            rid, clock = body
            self.gets = [g for g in self.gets if g[0] != src] + [(src, rid, clock)]
            self.asked[src] = self.rt.now()
        elif kind == "distribute":
            self._distribute(*body)
        elif kind == "done":  # a worker finished: the SSP gate no longer waits for it
            self.processed.pop(src, None)
        else:
            raise RuntimeError("server rank %d: unexpected control message %r from %d"
                               % (self.rt.rank, kind, src))
        self._answer_gets()

    def on_request(self, req):
        pass

    def on_promote(self, server, rank, processed):
        pass  # another server's replica was promoted: nothing changes here

    def peers_failed(self, ranks, lost):
        """Workers (or aggregators) died: what they were to send is dropped and reported; a
        sync iteration completes without them; the SSP gate stops waiting for them."""
        rt = self.rt
        gone = []
        for r in ranks:
            gone += self.order.forget(r)
            if r in self.processed:
                del self.processed[r]
            if r in self.workers:
                self.workers.remove(r)
            self.gets = [g for g in self.gets if g[0] != r]
            self.pulls = [g for g in self.pulls if g[0] != r]
            self.parked = [g for g in self.parked if g[0] != r]
            self.asked.pop(r, None)
            self.leaving.pop(r, None)  # their sends were dropped (DataPlane.forget_peer)
            if r == self.replica:
                self.order.replica_count = inf
                self.replica = None
        if gone:
            rt.channel.send(0, "lost", [DropUpdate(u, why) for u, why in gone])
        if self.mode == "mlfabric-S":
            self._close_iteration()
        self._apply_due()
        self._answer_gets()

    def _answer_gets(self):
        """Move the requests whose condition holds to the pull queue, and serve it."""
        if self.gets:
            due, keep = [], []
            for g in self.gets:
                (due if self._may_answer(g[2]) else keep).append(g)
            self.gets = keep
            self.pulls.extend(due)
        self._serve_pulls()

    def _serve_pulls(self):
        """Pull batching (§10.3): while models are still leaving, requests wait (not on a send
        paced by its receiver's slow link: gating); when the last has left, everything waiting
        is answered with the model as it is then, through the scheduler as one distribution
        batch (distributors relay it, so the server's egress is not the bottleneck). Without a
        scheduler, each is sent directly and every send holds the next batch. Simultaneous
        requests (the end of a sync iteration) form a batch at once; asynchronous ones batch
        themselves exactly when the server's egress is the bottleneck.

        A lone request goes through the scheduler too: its plan says whether the receiver's link
        paces the send (30 workers under N3: a tenth of the rate, 0.8 s for an 80 ms model),
        and a direct send to such a receiver would hold every other get for that long (a wait
        of 0.73 s at p90 for a fetch where the transfer takes 80 ms)."""
        if not self.pulls or self.leaving:
            return
        due, self.pulls = self.pulls, []
        now = self.rt.now()
        model = np.array(self.request_fn(self.model, self.version) if self.request_fn
                         else self.model, copy=True)
        if not self.distribution:
            self._served((w for w, _, _ in due), now)
            for w, rid, _ in due:
                self._leaves(w)
                self.rt.dp.send(w, ("m", rid, self.version), model,
                                on_done=lambda w=w: self._left(w))
            return
        self.leaving[0] = 1  # the scheduler is planning the batch
        self.planning = {w: (w, rid, clock) for w, rid, clock in due}
        self.snapshots[self.version] = model
        self.planning_since = now
        self.rt.channel.send(0, "pulls", (self.version, model.nbytes,
                                          [(w, ("m", rid, self.version)) for w, rid, _ in due]))

    def _leaves(self, rank):
        self.leaving[rank] = self.leaving.get(rank, 0) + 1

    def _left(self, rank):
        """A model send to `rank` is done (or `rank` died: all of them are)."""
        n = self.leaving.pop(rank, 0) - 1
        if n > 0:
            self.leaving[rank] = n
        self._serve_pulls()

    def _served(self, ranks, at):
        """Profile the server-side wait of the gets of `ranks`, answered by the pull batch
        taken at `at` (a get sent back by the admission waits on to a later one)."""
        self.rt.ledger.pull_wait.extend(at - self.asked.pop(w, at) for w in ranks)

    def _distribute(self, version, direct, relays, paced, deferred):
        """The scheduler's plan for the pull batch of `version`: send it; the requests it
        deferred (scheduler pulls.py _admit) wait, first in line, for the next batch, and those
        it parked (a slow uplink) are asked again together t_lag after the last parking."""
        del self.leaving[0]
        now = self.rt.now()
        self.rt.ledger.pull_plan.append(now - self.planning_since)
        back = {w: park for w, _, park in deferred}
        self.pulls[:0] = [g for w, g in self.planning.items()
                          if back.get(w) is False and w not in self.rt.failed]
        parked = [g for w, g in self.planning.items() if back.get(w) and w not in self.rt.failed]
        if parked:  # asked again once the monitor has reported the links anew
            self.parked += parked
            self.parked_until = now + self.rt.config.t_lag
        self._served((w for w in self.planning if w not in back), self.planning_since)
        self.planning = {}
        gated = gating([x[0] for x in direct + relays], paced)  # sends that hold the next batch
        for rank, n in gated.items():
            for _ in range(n):
                self._leaves(rank)

        def left(rank):
            if gated.get(rank):
                gated[rank] -= 1
                self._left(rank)
        send_distribution(self.rt, self.snapshots.pop(version), direct, relays, left)
        self._serve_pulls()

    def _may_answer(self, clock):
        """sync: the worker's next iteration is done; SSP: the slowest worker still training is
        at most `slack` updates behind the asking worker's clock; otherwise always."""
        if self.mode == "mlfabric-S":
            return self.version >= clock
        if self.mode == "ssp":
            return min(self.processed.values(), default=clock) >= clock - self.rt.config.slack
        return True

    def tick(self, now):
        if self.parked and self.rt.now() >= self.parked_until:
            self.pulls[:0], self.parked = self.parked, []
            self._serve_pulls()
        if self.unreported:
            self.rt.channel.send(0, "applied", self.unreported)
            self.unreported = []
        if self.replica is not None and self.replica not in self.rt.failed:
            state = (self.version, self.order.replica_need())
            if state != self.told_replica:  # the replica bounds its own lead with it
                self.told_replica = state
                self.rt.channel.send(self.replica, "server-count", state)

    def stopped(self, error):
        pass


# A send whose receiver's downlink is under this share of the server's uplink is paced by the
# receiver (see gating).
GATE_SHARE = 0.5


def gating(ranks, paced):
    """Of a pull batch's sends (the rank each goes to, once per send), how many to each rank hold
    the next batch (Server._serve_pulls), as a Counter: all but those to the ranks in `paced`,
    whose downlink the scheduler sees under GATE_SHARE of the server's uplink (pulls.py). Such a
    send is paced by its receiver's slow link (N3: a tenth of the rate, 0.8 s for an 80 ms
    model), which leaves the server's egress mostly free; holding every other get behind it
    would age the models they are answered with. The scheduler's view still books its bytes, so
    the next batch's plan shares the link with it. A send planned slow because the server's
    uplink is booked is not paced by its receiver: it holds."""
    paced = set(paced)
    return Counter(rank for rank in ranks if rank not in paced)


def send_distribution(rt, payload, direct, relays, left=None):
    """Send a planned distribution (pulls.py): the payload straight to the direct group under
    each one's key, and to each distributor with what it forwards to whom. left(rank), if given,
    is called as each send is done."""
    def done(rank):
        return None if left is None else (lambda: left(rank))
    for w, key, start, rate in direct:
        rt.dp.send(w, key, payload, rate=rate, not_before=rt.local(start), on_done=done(w))
    for d, start, rate, forwards in relays:
        rt.dp.send(d, ("d", forwards), payload, rate=rate, not_before=rt.local(start),
                   on_done=done(d))
