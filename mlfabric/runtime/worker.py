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

Cut-through (Config.cut_through, the default): relays and aggregates do not wait for whole
payloads. At the header of a ('d', forwards) payload the forwards start, each chunk leaving once
it is in; an update for one of our aggregates is kept as its inbound Stream, and once every member
of an aggregate has at least begun to arrive the sum streams out (relay.StreamingSum). A stream
whose source fails on the way reaches its receiver void (dataplane.py): a voided model request is
asked again, a voided aggregate's members are dropped by the server with their reason.
"""
import collections

import numpy as np

from .. import kernels
from ..errors import MismatchError, MlfabricError
from .dataplane import Stream
from .ledger import DROP_AGGREGATOR_FAILED, DROP_WORKER_FAILED, profile
from .messages import DropUpdate, ReadyUpdate, handle_each, uid_text
from .relay import StreamingSum
from .server import send_distribution


class Assignment:
    """An aggregator's working state for one SumUpdates record (messages.py) it was sent: the
    members, ids and upstream still to come, which a failure may cut (peers_failed)."""
    __slots__ = ("key", "dst", "members", "not_before", "rate", "version", "ids", "via",
                 "upstream", "record")

    def __init__(self, record):
        self.record = record   # as the scheduler sent it (errors name it)
        self.key, self.dst, self.members = record.key, record.dst, tuple(record.members)
        self.not_before, self.rate, self.version = record.not_before, record.rate, record.version
        self.ids = tuple(record.ids)
        self.via, self.upstream = record.via, record.upstream

    def slots(self):
        """Its inputs as stash keys: (update id, destination) per member; (key, None) for the
        upstream sum."""
        out = [(uid, self.dst) for uid in self.members]
        if self.upstream is not None:
            out.append((self.upstream[0], None))
        return out


class WorkerRole:
    def __init__(self, rt):
        self.rt = rt
        self.server_rank = {s: s for s in rt.roles.server_ranks}
        self.outbox = {}         # id -> [server, payload, version] until its last planned send
        self.ready = []          # ReadyUpdate records not yet reported to the scheduler
        self.gets = {}           # request id -> (Future, server, clock, job time it was sent)
        self.next_get = 0
        # (update id, the aggregate's destination) -> payload that came before its Assignment (a
        # Stream while it is still coming, cut-through), and -> the Assignment waiting for it
        # (one update may pass here for a server and a replica)
        self.stash = {}
        self.assigned = {}
        # a pipeline's running sum that came (its stash slot) -> the ids it says it carries: fewer
        # than planned when a failure cut members upstream (reported lost there)
        self.carried = {}
        self.streamed = set()    # members a streaming sum took while they were still coming
        self.cut_through = rt.config.cut_through
        # A streaming sum voided by a member's failure drops its live members too; a replica,
        # sent its own copies of them, could not follow, so replicated jobs sum whole payloads.
        self.stream_sums = self.cut_through and not rt.config.replicas
        if self.cut_through:
            rt.dp.on_stream = self.on_stream
        self.pending_aggs = []   # Assignments with members still to come
        self.plan_latency = profile()  # s from the scheduler's send to our receipt (control)
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
                self.ready.append(ReadyUpdate(uid, server, payload.nbytes, version, norm,
                                              rt.now()))
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
                self.ready.append(ReadyUpdate(uid, ("ar", k, root), payload.nbytes, k,
                                              float("inf"), rt.now()))
        elif kind == "finish":
            self.flush()
            rt.channel.send(0, "done", len(rt.ledger.pushed))
            for r in sorted(set(self.server_rank.values())):  # SSP: stop waiting for it
                rt.channel.send(r, "done", None)

    def _get(self, fut, server, clock):
        rid = self.next_get
        self.next_get += 1
        self.gets[rid] = (fut, server, clock, self.rt.now())
        self.rt.channel.send(self.server_rank[server], "get", (rid, clock))

    def _answer(self, rid, data, version):
        got = self.gets.pop(rid, None)  # None: a request re-sent after a failure, answered twice
        if got is not None:
            got[0].set((data, version))
            self.rt.ledger.get_latency.append(self.rt.now() - got[3])

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
            handle_each("worker rank %d" % rt.rank, entries, self._send)
        elif kind == "drop":
            for d in body:
                self.outbox.pop(d.id, None)
            self.dropped.extend((d.id, d.reason) for d in body)
        elif kind == "release":   # no replica copy will be asked for
            for uid in body:
                self.outbox.pop(uid, None)
        elif kind == "distribute":   # we are an allreduce root: send the result out
            tag, direct, relays = body[:3]
            send_distribution(rt, self.root_of.pop(tag)[0], direct, relays)
        elif kind == "aggregate":
            handle_each("worker rank %d" % rt.rank, body, self._assigned)
            if rt.failed:  # planned before the scheduler knew of a death
                self.peers_failed(sorted(rt.failed), [], resend=False)
        else:
            raise RuntimeError("worker rank %d: unexpected control message %r from %d"
                               % (rt.rank, kind, src))

    def _send(self, m):
        """SendUpdate m: our update to its next hop, as planned."""
        held = self.outbox.get(m.id)
        if held is None:
            raise MlfabricError("worker rank %d: plan message `%s`: update %s is not waiting "
                                "here to be sent (never pushed, or already sent for good or "
                                "dropped)" % (self.rt.rank, m, uid_text(m.id)))
        rt = self.rt
        rt.dp.send(m.hop, ("u", m.id, held[2], m.dst), held[1], rate=m.rate,
                   not_before=rt.local(m.not_before))
        if m.final:
            del self.outbox[m.id]

    def _assigned(self, m):
        """SumUpdates m: sum its members as they come (some may be here already)."""
        a = Assignment(m)
        self.pending_aggs.append(a)
        for slot in a.slots():
            self.assigned[slot] = a
        self._try_aggregate(a)

    # --- payloads ---------------------------------------------------------------------------------
    def on_stream(self, src, key, stream):
        """At an inbound header (cut-through): start a relay's forwards now; keep an update for
        one of our aggregates as its Stream, and start the aggregate if it was the last member."""
        kind = key[0]
        if kind == "d":
            self.rt.ledger.relayed["forward"] += self._forward(key[1], stream.data,
                                                               stream.available)
        elif self.stream_sums and self._summed_here(key):
            self._take(key, stream)

    def _forward(self, forwards, data, available=None):
        """Pass `data` on to the other workers in `forwards`; returns how many."""
        rt, n = self.rt, 0
        for w, key, start, rate in forwards:
            if w != rt.rank and w not in rt.failed:
                rt.dp.send(w, key, data, rate=rate, not_before=rt.local(start),
                           available=available)
                n += 1
        return n

    def _for_our_allreduce(self, key):
        return isinstance(key[3], tuple) and key[3][2] == self.rt.rank

    def _summed_here(self, key):
        """An input of one of our aggregates: an update we aggregate for its destination, or a
        pipeline's running sum."""
        return ((key[0] == "u" and not self._for_our_allreduce(key))
                or (key[0] == "a" and key[1][0] == "up"))

    @staticmethod
    def _slot(key):
        return (key[1], key[3]) if key[0] == "u" else (key[1], None)

    def _take(self, key, data):
        """An input (whole, or a Stream) under data-plane `key` is here: stash it, and sum if its
        aggregate is ready."""
        slot = self._slot(key)
        self.stash[slot] = data
        if key[0] == "a":
            self.carried[slot] = key[2]
        a = self.assigned.get(slot)
        if a is not None:
            self._try_aggregate(a)

    def on_data(self, msg):
        kind = msg.key[0]
        if kind == "m":
            self._answer(msg.key[1], msg.data, msg.key[2])
        elif kind == "d":  # we relay this payload (§10.3)
            forwards = msg.key[1]
            if not self.cut_through:   # (cut-through: forwarded at its header, on_stream)
                self._forward(forwards, msg.data)
            for w, key, _, _ in forwards:
                if w == self.rt.rank:  # ours too: a copy while the forwards still read it
                    data = msg.data.copy() if len(forwards) > 1 else msg.data
                    self.on_data(type(msg)(msg.src, key, data, msg.arrived))
        elif kind == "A":
            self.allreduces.pop(msg.key[1]).set(msg.data)
        elif kind == "u" and self._for_our_allreduce(msg.key):
            self._root_add(msg.key[3][1], (msg.key[1],), msg.data)   # our allreduce call
        elif kind == "a" and msg.key[1][0] == "ar":
            self._root_add(msg.key[1][1], msg.key[2], msg.data)
        elif self._summed_here(msg.key):  # an update we aggregate (or a pipeline's sum)
            slot = self._slot(msg.key)
            if slot in self.streamed:  # its sum already took it as it came
                self.streamed.discard(slot)
                return
            self._take(msg.key, msg.data)
        else:
            raise RuntimeError("worker rank %d: unexpected payload %r" % (self.rt.rank, msg.key))

    def _try_aggregate(self, a):
        """Send aggregate `a` once every member is here (cut-through: once every member has at
        least begun to arrive; the sum then streams out as they come). An unexpected error
        names the plan message that asked for it."""
        members = a.slots()
        if all(m in self.stash for m in members):
            handle_each("worker rank %d" % self.rt.rank, [a.record],
                        lambda _: self._aggregate(a, members))

    def _aggregate(self, a, members):
        stash = self.stash
        parts = [stash.pop(m) for m in members]
        for m in members:
            del self.assigned[m]
        self.pending_aggs.remove(a)
        if a.upstream is not None:
            # members cut upstream (a failure) are lost there: our sum must not claim them, or
            # the server would count them applied with their values missing from the model
            carried = self.carried.pop((a.upstream[0], None), None)
            if carried is not None and len(carried) < len(a.upstream[1]):
                cut = set(a.upstream[1]).difference(carried)
                a.ids = tuple(u for u in a.ids if u not in cut)
        rt = self.rt
        available = None
        if not parts:  # failures took every member: the destination still expects the key
            total = np.empty(0, np.uint8)
        elif any(isinstance(p, Stream) for p in parts):
            self.streamed.update(m for m, p in zip(members, parts) if isinstance(p, Stream))
            available = StreamingSum(parts)
            rt.ledger.relayed["sum"] += 1
            total = available.total
        else:
            total = parts[0].copy() if len(parts) == 1 else kernels.reduce(parts)
        if not isinstance(a.dst, tuple):  # allreduce contributions are not PS updates
            rt.ledger.aggregated.update(a.members)
        dst = (a.via if a.via is not None else a.dst[2] if isinstance(a.dst, tuple) else
               self.server_rank[a.dst] if a.dst in self.server_rank else a.dst)
        rt.dp.send(dst, ("a", a.key, a.ids, a.version), total, rate=a.rate,
                   not_before=rt.local(a.not_before), available=available)

    def on_voided(self, src, key, why):
        """A streamed payload for us came void (its sender's source failed on the way): ask
        again for a voided model; an allreduce whose result or contribution was lost fails."""
        kind = key[0]
        if kind == "m":
            if key[1] in self.gets:
                self._ask_again(key[1])
        elif kind == "d":
            for w, inner, _, _ in key[1]:
                if w == self.rt.rank:
                    self.on_voided(src, inner, why)
        elif kind == "a" and key[1][0] == "up":
            pass  # a pipeline's running sum: ours, streaming on, carries the void to the end
        elif kind in ("A", "a"):
            call = key[1] if kind == "A" else key[1][1]
            raise MlfabricError("allreduce call %s: a %s from rank %d was lost (%s); the call "
                                "cannot complete" % (call, "result" if kind == "A" else
                                                     "contribution", src, why))
        else:
            raise RuntimeError("worker rank %d: unexpected void payload %r" % (self.rt.rank, key))

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

        def lost(slot):  # an input from the dead is lost unless whole here (a Stream is void)
            return not isinstance(self.stash.get(slot), np.ndarray)
        for a in list(self.pending_aggs):
            cut = [u for u in a.members if u >> 32 in dead and lost((u, a.dst))]
            up = a.upstream
            cut_up = up is not None and up[2] in dead and lost((up[0], None))
            if not cut and not cut_up:
                continue
            slots = [(u, a.dst) for u in cut] + ([(up[0], None)] if cut_up else [])
            for slot in slots:
                del self.assigned[slot]
                self.stash.pop(slot, None)
                self.carried.pop(slot, None)
            why = [(u, DROP_WORKER_FAILED) for u in cut]
            if cut_up:  # the pipeline's sum so far died with the aggregator before us
                why += [(u, DROP_AGGREGATOR_FAILED) for u in up[1]]
                a.upstream = None
            out = {u for u, _ in why}
            a.members = tuple(u for u in a.members if u not in out)
            a.ids = tuple(u for u in a.ids if u not in out)
            if a.dst in self.server_rank:
                gone += why
            self._try_aggregate(a)
        if gone:
            self.rt.channel.send(0, "lost", [DropUpdate(u, why) for u, why in gone])
        if resend:
            self._resend_gets(lambda server: True)

    def on_promote(self, server, rank, processed):
        """`server` is now served by `rank` (its replica): aggregates planned for the old server
        or for the replica are void (their members are dropped by the scheduler), requests go to
        the new rank."""
        old = {server, rank}
        for a in [a for a in self.pending_aggs if a.dst in old]:
            self.pending_aggs.remove(a)
            for slot in a.slots():
                self.assigned.pop(slot, None)
                self.stash.pop(slot, None)
                self.carried.pop(slot, None)
        self.server_rank[server] = rank
        self._resend_gets(lambda s: s == server)

    def _resend_gets(self, which):
        for rid, (_, server, _, _) in list(self.gets.items()):
            if which(server):
                self._ask_again(rid)

    def _ask_again(self, rid):
        """Request `rid` will not be answered (a failure on its way): ask anew, as a new one."""
        fut, server, clock, _ = self.gets.pop(rid)
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
