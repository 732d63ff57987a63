"""A worker rank's daemon side: its pushed updates until the plan sends or drops them, its model
requests (get), and its aggregator and distributor duties (paper §4: aggregators are co-hosted
with workers). Everything here runs on the daemon thread; the training thread only enqueues.

Data-plane keys: ('u', id, version, destination) an update to its next hop (the destination is
the server or replica its aggregate goes to); ('a', key, ids, version) an
aggregate's sum; ('m', request, version) a model reply; ('d', version, forwards) a model to relay to other
workers (and to keep, when this worker asked for it too).
"""
import numpy as np

from .. import kernels


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
        self.outbox = {}         # id -> [server, payload, version] until its last planned send
        self.ready = []          # (id, server, nbytes, version, norm, sent at) not yet reported
        self.gets = {}           # request id -> (Future, server)
        self.next_get = 0
        # (update id, the aggregate's destination) -> payload that came before its Assignment, and
        # -> the Assignment waiting for it (one update may pass here for a server and a replica)
        self.stash = {}
        self.assigned = {}
        self.pending_aggs = []   # Assignments with members still to come
        self.finishing = False
        self.plan_latency = []   # seconds from the scheduler's send to our receipt (control plane)

    # --- from the training thread ----------------------------------------------------------------
    def on_request(self, req):
        kind = req[0]
        rt = self.rt
        if kind == "push":
            _, uid, server, payload, version, norm = req
            rt.ledger.pushed.add(uid)
            if rt.config.sched_mode is None:  # vanilla async: straight to the server, unplanned
                rt.dp.send(server, ("u", uid, version, server), payload)
            else:
                self.outbox[uid] = [server, payload, version]
                self.ready.append((uid, server, payload.nbytes, version, norm, rt.now()))
        elif kind == "get":
            _, fut, server, clock = req
            rid = self.next_get
            self.next_get += 1
            self.gets[rid] = (fut, server)
            rt.channel.send(server, "get", (rid, clock))
        elif kind == "finish":
            self.flush()
            rt.channel.send(0, "done", len(rt.ledger.pushed))
            self.finishing = True

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
        elif kind == "drop":
            for uid, _reason in body:
                self.outbox.pop(uid, None)
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
            fut, _server = self.gets.pop(msg.key[1])
            fut.set((msg.data, msg.key[2]))
        elif kind == "d":  # we distribute this model version (§10.3)
            _, version, forwards = msg.key
            for w, rid, start, rate in forwards:
                if w == self.rt.rank:
                    fut, _server = self.gets.pop(rid)
                    fut.set((msg.data, version))
                else:
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
        total = parts[0].copy() if len(parts) == 1 else kernels.reduce(parts)
        self.rt.ledger.aggregated.update(a.members)
        self.rt.dp.send(a.dst, ("a", a.key, a.members, a.version), total, rate=a.rate,
                        not_before=self.rt.local(a.not_before))

    def tick(self, now):
        self.flush()

    def stopped(self, error):
        for fut, _ in self.gets.values():
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
