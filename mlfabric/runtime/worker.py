"""A worker rank's daemon side: its pushed updates until the plan sends or drops them, its model
requests (get), and its aggregator and distributor duties (paper §4: aggregators are co-hosted
with workers). Everything here runs on the daemon thread; the training thread only enqueues.

Servers are named by their logical id (the rank they started on); `server_rank` maps one to the
rank serving it now (its promoted replica's after a failover, recovery.py).

Data-plane keys: ('u', id, version, destination) an update to its next hop (the destination is
the server or replica its aggregate goes to); ('a', key, ids, version) an aggregate's sum;
('m', request, version) a model reply; ('d', version, forwards) a model to relay to other
workers (and to keep, when this worker asked for it too).
"""
import numpy as np

from .. import kernels
from .ledger import DROP_WORKER_FAILED


class Assignment:
    """Sum `members` (update ids, in order) as they arrive, then send the sum to `dst` no earlier
    than `not_before` (job time) at `rate` bytes/s. `key` names the aggregate at its destination."""
    __slots__ = ("key", "dst", "members", "not_before", "rate", "version")

    def __init__(self, key, dst, members, not_before, rate, version):
        self.key, self.dst, self.members = key, dst, tuple(members)
        self.not_before, self.rate, self.version = not_before, rate, version


class WorkerRole:
    def __init__(self, rt):
        self.rt = rt
        self.server_rank = {s: s for s in rt.roles.server_ranks}
        self.outbox = {}         # id -> [server, payload, version] until its last planned send
        self.ready = []          # (id, server, nbytes, version, norm, sent at) not yet reported
        self.gets = {}           # request id -> (Future, server, clock)
        self.next_get = 0
        # (update id, the aggregate's destination) -> payload that came before its Assignment, and
        # -> the Assignment waiting for it (one update may pass here for a server and a replica)
        self.stash = {}
        self.assigned = {}
        self.pending_aggs = []   # Assignments with members still to come
        self.plan_latency = []   # seconds from the scheduler's send to our receipt (control plane)

    # --- from the training thread ----------------------------------------------------------------
    def on_request(self, req):
        kind = req[0]
        rt = self.rt
        if kind == "push":
            _, uid, server, payload, version, norm = req
            rt.ledger.pushed.add(uid)
            if rt.config.sched_mode is None:  # vanilla async: straight to the server, unplanned
                rt.dp.send(self.server_rank[server], ("u", uid, version, server), payload)
            else:
                self.outbox[uid] = [server, payload, version]
                self.ready.append((uid, server, payload.nbytes, version, norm, rt.now()))
        elif kind == "get":
            _, fut, server, clock = req
            self._get(fut, server, clock)
        elif kind == "finish":
            self.flush()
            rt.channel.send(0, "done", len(rt.ledger.pushed))

    def _get(self, fut, server, clock):
        rid = self.next_get
        self.next_get += 1
        self.gets[rid] = (fut, server, clock)
        self.rt.channel.send(self.server_rank[server], "get", (rid, clock))

    def _answer(self, rid, data, version):
        got = self.gets.pop(rid, None)  # None: a request re-sent after a failure, answered twice
        if got is not None:
            got[0].set((data, version))

    def flush(self):
        if self.ready:
            self.rt.channel.send(0, "ready", self.ready)
            self.ready = []

    # --- from the scheduler ------------------------------------------------------------------------
    def on_ctrl(self, src, kind, body):
        rt = self.rt
        if kind == "send":
            sent_at, entries = body
            self.plan_latency.append(rt.now() - sent_at)
            for uid, hop, dst, not_before, rate, final in entries:
                _server, payload, version = self.outbox[uid]
                rt.dp.send(hop, ("u", uid, version, dst), payload, rate=rate,
                           not_before=rt.local(not_before))
                if final:
                    del self.outbox[uid]
        elif kind in ("drop", "release"):   # dropped, or no replica copy will be asked for
            for item in body:
                self.outbox.pop(item[0] if kind == "drop" else item, None)
        elif kind == "aggregate":
            for a in body:
                self.pending_aggs.append(a)
                for uid in a.members:
                    self.assigned[(uid, a.dst)] = a
                self._try_aggregate(a)
        else:
            raise RuntimeError("worker rank %d: unexpected control message %r from %d"
                               % (rt.rank, kind, src))

    # --- payloads ------------------------------------------------------------------------------------
    def on_data(self, msg):
        kind = msg.key[0]
        if kind == "m":
            self._answer(msg.key[1], msg.data, msg.key[2])
        elif kind == "d":  # we distribute this model version (§10.3)
            _, version, forwards = msg.key
            for w, rid, start, rate in forwards:
                if w == self.rt.rank:
                    self._answer(rid, msg.data, version)
                elif w not in self.rt.failed:
                    self.rt.dp.send(w, ("m", rid, version), msg.data, rate=rate,
                                    not_before=self.rt.local(start))
        elif kind == "u":  # we aggregate it for its destination (a server or a replica)
            member = (msg.key[1], msg.key[3])
            self.stash[member] = msg.data
            a = self.assigned.get(member)
            if a is not None:
                self._try_aggregate(a)
        else:
            raise RuntimeError("worker rank %d: unexpected payload %r" % (self.rt.rank, msg.key))

    def _try_aggregate(self, a):
        stash, members = self.stash, [(uid, a.dst) for uid in a.members]
        if not all(m in stash for m in members):
            return
        parts = [stash.pop(m) for m in members]
        for m in members:
            del self.assigned[m]
        self.pending_aggs.remove(a)
        rt = self.rt
        if not parts:  # failures took every member: the destination still expects the key
            total = np.empty(0, np.uint8)
        else:
            total = parts[0].copy() if len(parts) == 1 else kernels.reduce(parts)
        rt.ledger.aggregated.update(a.members)
        dst = a.dst if a.dst not in self.server_rank else self.server_rank[a.dst]
        rt.dp.send(dst, ("a", a.key, a.members, a.version), total, rate=a.rate,
                   not_before=rt.local(a.not_before))

    def tick(self, now):
        self.flush()

    # --- failures (recovery.py) ----------------------------------------------------------------------
    def peers_failed(self, ranks, lost):
        """Workers died: members they were to send are cut from our aggregates (and reported
        lost when the aggregate was for a server); requests are sent again, since a distributor
        that died may have been relaying our model."""
        dead = set(ranks)
        gone = []
        for a in list(self.pending_aggs):
            cut = [u for u in a.members if u >> 32 in dead and (u, a.dst) not in self.stash]
            if not cut:
                continue
            for u in cut:
                del self.assigned[(u, a.dst)]
            a.members = tuple(u for u in a.members if u not in cut)
            if a.dst in self.server_rank:
                gone += [(u, DROP_WORKER_FAILED) for u in cut]
            self._try_aggregate(a)
        if gone:
            self.rt.channel.send(0, "lost", gone)
        self._resend_gets(lambda server: True)

    def on_promote(self, server, rank, processed):
        """`server` is now served by `rank` (its replica): aggregates planned for the old server
        or for the replica are void (their members are dropped by the scheduler), requests go to
        the new rank."""
        old = {server, rank}
        for a in [a for a in self.pending_aggs if a.dst in old]:
            self.pending_aggs.remove(a)
            for uid in a.members:
                self.assigned.pop((uid, a.dst), None)
                self.stash.pop((uid, a.dst), None)
        self.server_rank[server] = rank
        self._resend_gets(lambda s: s == server)

    def _resend_gets(self, which):
        for rid, (fut, server, clock) in list(self.gets.items()):
            if which(server):
                del self.gets[rid]
                self._get(fut, server, clock)

    def stopped(self, error):
        for fut, *_ in self.gets.values():
            fut.fail(error)
        self.gets.clear()


def check_update(update, shape, dtype, server):
    """The clear error at the pushing worker: nothing is sent when the update does not fit."""
    if not isinstance(update, np.ndarray):
        raise TypeError("push(%d, update): update must be a numpy array, got %s"
                        % (server, type(update).__name__))
    if update.dtype != dtype or update.shape != tuple(shape):
        raise ValueError("push(%d, update): the server's model is %s %s but the update is %s %s; "
                         "nothing was sent" % (server, np.dtype(dtype).name, tuple(shape),
                                               update.dtype.name, update.shape))
