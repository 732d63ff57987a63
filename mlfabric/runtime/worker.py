"""A worker rank's daemon side: its pushed updates until the plan sends or drops them, its model
requests (get), and its aggregator and distributor duties (paper §4: aggregators are co-hosted
with workers). Everything here runs on the daemon thread; the training thread only enqueues.

Servers are named by their logical id (the rank they started on); `server_rank` maps one to the
rank serving it now (its promoted replica's after a failover, recovery.py).

Allreduce (Table 1's AllReduce, §6) is push then get through one worker: call k's root is drawn
from the seed (the same on every worker); the others push their contributions to it on a sync plan
of the scheduler's (aggregators being the other workers), the root sums them with its own, and the
result reaches everyone through a distribution tree (§10.3).

Data-plane keys: ('u', id, version, destination) an update to its next hop (the destination is
the server, replica or ('ar', call, root) its aggregate goes to); ('a', key, ids, version) an
aggregate's sum; ('m', request, version) a model reply; ('A', call) an allreduce result;
('d', forwards) a payload to relay to other workers under their keys (and to keep, when one of
them is this worker).
"""
import collections

import numpy as np

from .. import kernels
from ..errors import MismatchError
from .ledger import DROP_WORKER_FAILED
from .server import send_distribution


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
        self.allreduces = {}     # call -> Future of this worker's allreduce
        self.root_of = {}        # call -> [sum, contributions in, expected] where we are root
        # (id, reason) of our updates the scheduler dropped, until the training thread takes
        # them (ps.dropped()): a deque, since two threads touch it (append / popleft are atomic)
        self.dropped = collections.deque()

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
        elif kind == "allreduce":
            _, fut, k, root, payload, workers = req
            self.allreduces[k] = fut
            if root == rt.rank:
                self._root_add(k, (rt.rank,), payload, workers)
            else:
                uid = (rt.rank << 32) | (1 << 31) | k  # bit 31: not a parameter-server update
                self.outbox[uid] = [("ar", k, root), payload, k]
                self.ready.append((uid, ("ar", k, root), payload.nbytes, k, float("inf"),
                                   rt.now()))
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

    # --- from the scheduler -----------------------------------------------------------------------
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
            if kind == "drop":
                self.dropped.extend(body)
        elif kind == "distribute":   # we are an allreduce root: send the result out
            tag, direct, relays = body
            send_distribution(rt, self.root_of.pop(tag)[0], direct, relays)
        elif kind == "aggregate":
            for a in body:
                self.pending_aggs.append(a)
                for uid in a.members:
                    self.assigned[(uid, a.dst)] = a
                self._try_aggregate(a)
            if rt.failed:  # planned before the scheduler knew of a death
                self.peers_failed(sorted(rt.failed), [], resend=False)
        else:
            raise RuntimeError("worker rank %d: unexpected control message %r from %d"
                               % (rt.rank, kind, src))

    # --- payloads ---------------------------------------------------------------------------------
    def on_data(self, msg):
        kind = msg.key[0]
        if kind == "m":
            self._answer(msg.key[1], msg.data, msg.key[2])
        elif kind == "d":  # we relay this payload (§10.3)
            for w, key, start, rate in msg.key[1]:
                if w == self.rt.rank:
                    self.on_data(type(msg)(msg.src, key, msg.data, msg.arrived))
                elif w not in self.rt.failed:
                    self.rt.dp.send(w, key, msg.data, rate=rate, not_before=self.rt.local(start))
        elif kind == "A":
            self.allreduces.pop(msg.key[1]).set(msg.data)
        elif kind == "u" and isinstance(msg.key[3], tuple) and msg.key[3][2] == self.rt.rank:
            self._root_add(msg.key[3][1], (msg.key[1],), msg.data)   # our allreduce call
        elif kind == "a" and msg.key[1][0] == "ar":
            self._root_add(msg.key[1][1], msg.key[2], msg.data)
        elif kind == "u":  # we aggregate it for its destination (a server, replica or root)
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
        if not isinstance(a.dst, tuple):  # allreduce contributions are not PS updates
            rt.ledger.aggregated.update(a.members)
        dst = (a.dst[2] if isinstance(a.dst, tuple) else
               self.server_rank[a.dst] if a.dst in self.server_rank else a.dst)
        rt.dp.send(dst, ("a", a.key, a.members, a.version), total, rate=a.rate,
                   not_before=rt.local(a.not_before))

    def _root_add(self, k, ids, data, workers=None):
        """Allreduce call k, at its root: sum what comes (our own first or not); when every
        worker's contribution is in, ask the scheduler to distribute the result."""
        got = self.root_of.get(k)
        if got is None:
            got = self.root_of[k] = [None, 0, None]
        if workers is not None:
            got[2] = workers
        if got[0] is None:
            got[0] = np.array(data, copy=True)
        else:
            if data.shape != got[0].shape or data.dtype != got[0].dtype:
                raise MismatchError(
                    "allreduce call %d: workers disagree: %s %s (from ids %s) vs %s %s at the "
                    "root (rank %d); every worker must pass the same shape and dtype"
                    % (k, data.dtype, data.shape, [hex(u) for u in ids], got[0].dtype,
                       got[0].shape, self.rt.rank))
            kernels.axpy_(got[0].reshape(-1), 1.0, data.reshape(-1))
        got[1] += len(ids)
        if got[2] is not None and got[1] == len(got[2]):
            result = got[0]
            self.allreduces.pop(k).set(result.copy())
            others = [w for w in got[2] if w != self.rt.rank and w not in self.rt.failed]
            if others:
                self.rt.channel.send(0, "pulls", (k, result.nbytes,
                                                  [(w, ("A", k)) for w in others]))
            else:
                del self.root_of[k]

    def tick(self, now):
        self.flush()

    def poll_s(self):
        """Alert while an answer is due (a plan for our updates, a model, an allreduce)."""
        return 0.0005 if (self.outbox or self.gets or self.allreduces) else 0.002

    # --- failures (recovery.py) -------------------------------------------------------------------
    def peers_failed(self, ranks, lost, resend=True):
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
        if resend:
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
        for fut in self.allreduces.values():
            fut.fail(error)
        self.gets.clear()
        self.allreduces.clear()


def check_update(update, shape, dtype, server):
    """The clear error at the pushing worker: nothing is sent when the update does not fit."""
    if not isinstance(update, np.ndarray):
        raise TypeError("push(%d, update): update must be a numpy array, got %s"
                        % (server, type(update).__name__))
    if update.dtype != dtype or update.shape != tuple(shape):
        raise ValueError("push(%d, update): the server's model is %s %s but the update is %s %s; "
                         "nothing was sent" % (server, np.dtype(dtype).name, tuple(shape),
                                               update.dtype.name, update.shape))
