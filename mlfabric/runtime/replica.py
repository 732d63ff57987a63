"""A replica rank's daemon side (paper §5.3): a copy of one server's model that applies the same
updates in the server's order, from copies the workers send on the replica's own schedule (through
the replica's aggregators), so it never costs the server's link anything. It reports its progress
to its server, whose commits wait for it (gate.py), and to the scheduler. When its server dies it
is promoted: it becomes that server (recovery.py).

The divergence is bounded both ways. The server's lead (what a failure would lose) by the gate;
the replica's lead (its copies can arrive before the server's own updates) here: the replica
applies a commit only if afterwards the updates it has and the server has not sum to at most
Div_max in norm (the server reports its version). Holding back while the server is itself
waiting for the replica (it reports the count it needs) would deadlock both, so the replica then
goes ahead up to that count; that cannot take its lead past Div_max, because the scheduler caps
every commit, server's and replica's, at Div_max in summed norm (aggregation.py, norm_cap). Only a
single update heavier than Div_max (or Div_max = 0) opens a wider gap, for one commit: one of the
two sides must apply it first.
"""
from collections import deque
from math import inf

from .server import ApplyInOrder, ServerRole, default_apply


class ReplicaRole:
    def __init__(self, rt, server, on_update=None):
        self.rt = rt
        self.server = server
        self.model = None           # arrives from the server at start ('init')
        self.on_update = on_update
        self.apply_fn = on_update or default_apply(rt.config.gamma)
        self.order = ApplyInOrder()
        self.count = 0              # updates applied (or skipped: see peers_failed)
        self.skipped = 0
        self.reported = 0
        # (ids, count after, job time, 0): the last applied_log_max commits, as the server's
        self.applied_log = deque(maxlen=rt.config.applied_log_max)
        self.div_max = min((rt.infos[w]["div_max"] for w in rt.roles.worker_ranks), default=inf)
        self.server_count, self.server_need = 0, 0
        self.prefix = [0.0]         # prefix[p]: sum of the norms of the first p updates applied

    def on_data(self, msg):
        key = msg.key
        if key[0] == "init":
            self.model = msg.data
        elif key[0] == "u":
            self.order.arrive(key[:2], (key[1],), msg.data)
        elif key[0] == "a":
            self.order.arrive(key[:2], key[2], msg.data)
        else:
            raise RuntimeError("replica rank %d: unexpected payload %r" % (self.rt.rank, key))
        self._apply_due()

    def on_ctrl(self, src, kind, body):
        if kind == "expect":
            self.order.add_plan(body)
            if self.rt.failed:  # planned before the scheduler knew of a death
                self.peers_failed(sorted(self.rt.failed), [])
            self._apply_due()
        elif kind == "server-count":
            self.server_count, self.server_need = body
            self._apply_due()
        else:
            raise RuntimeError("replica rank %d: unexpected control message %r from %d"
                               % (self.rt.rank, kind, src))

    def on_request(self, req):
        pass

    def _apply_due(self):
        if self.model is None:
            return
        rt = self.rt
        for ids, norms, data, _ in self.order.due(self._within_bound, values="norms"):
            if ids:
                self.apply_fn(self.model, data, ids)
            for n in norms:
                self.prefix.append(self.prefix[-1] + n)
            self.count += len(ids)
            rt.ledger.replicated.update(ids)
            self.applied_log.append((ids, self.count, rt.now(), 0))

    def _within_bound(self, norms):
        """May the next commit, whose updates have these norms, be applied now?"""
        if self.count < self.server_need:  # the server waits for us: no further than it needs
            return True
        p, c = self.server_count, self.count
        lead = self.prefix[c] - self.prefix[p] if p < c else 0.0
        lead += sum(n for k, n in enumerate(norms, c + 1) if k > p)
        return lead <= self.div_max

    def tick(self, now):
        if self.count != self.reported:
            self.reported = self.count
            self.rt.channel.send(self.server, "replicated", self.count)
            self.rt.channel.send(0, "replicated", self.count)

    def peers_failed(self, ranks, lost):
        """A worker or replica aggregator died: the copies it was to send never come. They are
        skipped (counted, so the server's gate does not wait forever), which leaves this replica
        short of updates its server may have applied; if the server dies later, the scheduler
        drops exactly those (it compares with the ids this replica applied)."""
        for r in ranks:
            for _ in self.order.forget(r):
                self.count += 1
                self.skipped += 1
        self._apply_due()

    def on_promote(self, server, rank, processed):
        """Become the server `server` (ours died): our model, our count as its version. Replica
        traffic still in flight is ignored from now on (ServerRole.on_data)."""
        if server != self.server:
            return None
        rt = self.rt
        if self.model is None:
            raise RuntimeError("replica rank %d: promoted before it had its initial model"
                               % rt.rank)
        rt.ledger.applied |= rt.ledger.replicated   # applied in the model that goes on
        role = ServerRole(rt, self.model, self.on_update, None,
                          version=len(rt.ledger.replicated),
                          logical=server, replica=None, processed=processed)
        role.applied_log = self.applied_log
        rt.channel.send(0, "promoted", (server, sorted(rt.ledger.replicated)))
        return role

    def stopped(self, error):
        pass
