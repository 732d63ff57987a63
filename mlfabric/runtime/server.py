"""A server rank's daemon side (and, with its own plan, the replica's: replica.py): the model, the
order in which updates are applied, and the answers to model requests.

Scheduled asynchronous modes (mlfabric-A, SSP) apply in the plan's order: the scheduler sends the
server each batch's commits in order ('expect'), and a payload that arrives before its predecessor
waits (paper §3.1.1: order is enforced by the network; this only covers a late payload). Vanilla
async applies whatever arrives, as it arrives. mlfabric-S sums an iteration's updates in whatever
order they come and takes one step when all workers' updates are in (§6).

The version is the number of updates applied (async modes: an aggregate of m updates counts m, so
every member keeps its delay) or of iterations (sync). Every applied update's delay
tau = version before it - the version it was computed from is recorded for the accounting.
"""
from collections import deque

import numpy as np

from .. import kernels


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
    """The commits of a plan applied strictly in order, each once its payload is in and, for a
    batch's last commit when a replica exists, once the replica has applied as many updates as the
    plan gave it by then (paper §5.3: the server's last transfer waits for the replica; here the
    wait is enforced by the replica's progress reports, so a network slower than planned can cost
    time but never break the divergence bound)."""

    def __init__(self):
        self.expect = deque()    # (arrival key, ids, versions, replica count needed) in order
        self.arrived = {}        # arrival key -> payload
        self.replica_count = 0   # updates the replica has reported applied

    def add_plan(self, commits):
        self.expect.extend(commits)

    def arrive(self, key, data):
        self.arrived[key] = data

    def due(self):
        """Pop and yield (ids, versions, payload, replica count waited for) while the next
        commit may be applied."""
        while (self.expect and self.expect[0][0] in self.arrived
               and self.replica_count >= self.expect[0][3]):
            key, ids, versions, needed = self.expect.popleft()
            yield ids, versions, self.arrived.pop(key), needed


class ServerRole:
    def __init__(self, rt, model, on_update=None, on_request=None):
        self.rt = rt
        cfg = rt.config
        self.model = model
        self.version = 0
        self.apply_fn = on_update or default_apply(cfg.gamma)
        self.request_fn = on_request
        self.mode = cfg.mode
        self.workers = list(rt.roles.worker_ranks)
        self.order = ApplyInOrder()
        self.processed = {w: 0 for w in self.workers}  # applied or dropped, per worker (SSP)
        self.gets = []               # (worker, request id, clock) waiting for their condition
        self.distribution = cfg.distribution and cfg.sched_mode is not None
        self.snapshots = {}          # version -> [model copy, sends left] while distributed
        # (ids, version after, job time, replica count waited for: > 0 at a batch's end with a
        # replica): the order, for audits and tests
        self.applied_log = []
        self.unreported = []         # ids applied since the last 'applied' report
        self.iteration = None        # sync: [sum, members] of the open iteration
        replica = rt.roles.replica_of(rt.rank)
        if replica is not None:      # the replica starts from the same model
            rt.dp.send(replica, ("init", 0), model.copy())

    # --- payloads ----------------------------------------------------------------------------------
    def on_data(self, msg):
        key = msg.key
        if key[0] == "u":
            ids, versions = (key[1],), (key[2],)
        elif key[0] == "a":
            ids, versions = key[2], (key[3],) * len(key[2])
        else:
            raise RuntimeError("server rank %d: unexpected payload %r" % (self.rt.rank, key))
        self.rt.ledger.bytes_in += msg.data.nbytes
        if self.mode == "mlfabric-S":
            self._sum_iteration(ids, msg.data)
        elif self.mode == "async":
            self._apply(ids, versions, msg.data)
        else:
            self.order.arrive(key[:2], msg.data)
            for ids, versions, data, needed in self.order.due():
                self._apply(ids, versions, data, needed)
        self._answer_gets()

    def _apply(self, ids, versions, data, needed=0):
        rt = self.rt
        self.apply_fn(self.model, data, ids)
        for p, (uid, v) in enumerate(zip(ids, versions)):
            rt.ledger.delays.append((uid, self.version + p - v))
        self.version += len(ids)
        self._record(ids, needed)

    def _sum_iteration(self, ids, data):
        if self.iteration is None:
            self.iteration = [data.astype(self.model.dtype, copy=True), list(ids)]
        else:
            kernels.axpy_(self.iteration[0], 1.0, data)
            self.iteration[1].extend(ids)
        if len(self.iteration[1]) == len(self.workers):
            total, members = self.iteration
            self.iteration = None
            self.apply_fn(self.model, total, tuple(members))
            self.version += 1
            self._record(tuple(members))

    def _record(self, ids, needed=0):
        rt = self.rt
        rt.ledger.applied.update(ids)
        self.unreported.extend(ids)
        self.applied_log.append((ids, self.version, rt.now(), needed))
        for uid in ids:
            self.processed[uid >> 32] += 1

    # --- control ---------------------------------------------------------------------------------------
    def on_ctrl(self, src, kind, body):
        if kind == "expect":
            self.order.add_plan(body)
            for ids, versions, data, needed in self.order.due():
                self._apply(ids, versions, data, needed)
        elif kind == "replicated":
            self.order.replica_count = body
            for ids, versions, data, needed in self.order.due():
                self._apply(ids, versions, data, needed)
        elif kind == "dropped":
            for uid in body:
                self.processed[uid >> 32] += 1
        elif kind == "get":
            rid, clock = body
            self.gets.append((src, rid, clock))
        elif kind == "distribute":
            self._distribute(*body)
        else:
            raise RuntimeError("server rank %d: unexpected control message %r from %d"
                               % (self.rt.rank, kind, src))
        self._answer_gets()

    def _answer_gets(self):
        """Answer the requests whose condition holds. Two or more at once go through the
        scheduler as one distribution batch (§10.3: distributors relay the model so the server's
        egress is not the bottleneck); a single one is answered directly."""
        if not self.gets:
            return
        due, keep = [], []
        for g in self.gets:
            (due if self._may_answer(g[2]) else keep).append(g)
        self.gets = keep
        if not due:
            return
        model = np.array(self.request_fn(self.model, self.version) if self.request_fn
                         else self.model, copy=True)
        if len(due) == 1 or not self.distribution:
            for w, rid, _ in due:
                self.rt.dp.send(w, ("m", rid, self.version), model)
            return
        self.snapshots[self.version] = [model, 0]
        self.rt.channel.send(0, "pulls", (self.version, model.nbytes,
                                          [(w, rid) for w, rid, _ in due]))

    def _distribute(self, version, direct, relays):
        """Send a planned distribution: the model straight to the direct group, and to each
        distributor with the list of workers it forwards to."""
        snap = self.snapshots[version]
        model, dp, local = snap[0], self.rt.dp, self.rt.local

        def sent():
            snap[1] -= 1
            if snap[1] == 0:
                del self.snapshots[version]
        snap[1] = len(direct) + len(relays)
        for w, rid, start, rate in direct:
            dp.send(w, ("m", rid, version), model, rate=rate, not_before=local(start),
                    on_done=sent)
        for d, start, rate, forwards in relays:
            dp.send(d, ("d", version, forwards), model, rate=rate, not_before=local(start),
                    on_done=sent)

    def _may_answer(self, clock):
        """sync: the worker's next iteration is done; SSP: the slowest worker is at most `slack`
        updates behind the asking worker's clock; otherwise always."""
        if self.mode == "mlfabric-S":
            return self.version >= clock
        if self.mode == "ssp":
            return min(self.processed.values()) >= clock - self.rt.config.slack
        return True

    def tick(self, now):
        if self.unreported:
            self.rt.channel.send(0, "applied", self.unreported)
            self.unreported = []

    def stopped(self, error):
        pass
