"""A replica rank's daemon side (paper §5.3): a copy of one server's model that applies the same
updates in the server's order, from copies the workers send on the replica's own schedule (through
the replica's aggregators), so it never costs the server's link anything. It reports its progress
to its server, whose batch-ending commits wait for it (server.ApplyInOrder), and to the scheduler.
On the server's failure it is promoted (mlfabric.ps.recovery).
"""
from .server import ApplyInOrder, default_apply


class ReplicaRole:
    def __init__(self, rt, server, on_update=None):
        self.rt = rt
        self.server = server
        self.model = None           # arrives from the server at start ('init')
        self.apply_fn = on_update or default_apply(rt.config.gamma)
        self.order = ApplyInOrder()
        self.count = 0              # updates applied
        self.reported = 0
        self.early = []             # payloads that came before the initial model
        self.applied_log = []       # (ids, count after, job time)

    def on_data(self, msg):
        key = msg.key
        if key[0] == "init":
            self.model = msg.data
        elif key[0] in ("u", "a"):
            self.order.arrive(key[:2], msg.data)
        else:
            raise RuntimeError("replica rank %d: unexpected payload %r" % (self.rt.rank, key))
        self._apply_due()

    def on_ctrl(self, src, kind, body):
        if kind == "expect":
            self.order.add_plan(body)
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
        for ids, _versions, data, _ in self.order.due():
            self.apply_fn(self.model, data, ids)
            self.count += len(ids)
            rt.ledger.replicated.update(ids)
            self.applied_log.append((ids, self.count, rt.now(), 0))

    def tick(self, now):
        if self.count != self.reported:
            self.reported = self.count
            self.rt.channel.send(self.server, "replicated", self.count)
            self.rt.channel.send(0, "replicated", self.count)

    def stopped(self, error):
        pass
