"""The scheduler rank (paper §4-§6): collects the daemons' ready updates, and every batch interval
plans each server's batch with mlfabric.sched.schedule on the monitor's view of the network, books
the plan's transfers in that view, and sends every daemon its part: the workers what to send where
and when (or that an update is dropped), the aggregators what to sum, the server the commits in
order. It also decides when the job is over (every worker done, every pushed update applied or
dropped) and gathers everyone's accounts into the job's summary.

Times are job time (seconds since the job's t0, on the scheduler's clock; daemons convert).
"""
import time
from dataclasses import replace
from math import inf

from ..sched import ReplicaState, Update, distribute, replicate, schedule
from ..sched.view import SchedulerView
from .ledger import summarize
from .monitor import UNPACED, ReportedCapacities
from .worker import Assignment


class SchedulerRole:
    def __init__(self, rt):
        self.rt = rt
        cfg = rt.config
        roles = rt.roles
        self.mode = cfg.sched_mode      # None: vanilla async (nothing to plan)
        self.workers = roles.worker_ranks
        self.servers = roles.server_ranks
        infos = [rt.infos[w] for w in self.workers]
        self.tau_max = infos[0]["tau_max"] if infos else inf
        self.div_max = infos[0]["div_max"] if infos else inf
        k = len(self.workers) if cfg.aggregators is None else min(cfg.aggregators,
                                                                   len(self.workers))
        self.aggregators = self.workers[:k]
        # the replica's own aggregators (k' of §5.3): the same machines, taken from the other end,
        # so a replica copy and a server-bound update of one batch seldom meet at one daemon
        self.replica_aggregators = self.workers[::-1][:k]
        self.replica = {s: roles.replica_of(s) for s in self.servers}
        self.rstate = {s: ReplicaState() for s in self.servers if self.replica[s] is not None}
        self.replica_planned = {s: 0 for s in self.servers}  # replica commits planned so far
        self.replicated = {s: 0 for s in self.servers}       # ... and reported done
        base = cfg.emulation.base_rate
        self.caps = ReportedCapacities(rt.size, UNPACED if base is None else base)
        self.view = SchedulerView(self.caps, 0.0)
        self.pending = {s: [] for s in self.servers}   # Update (hosts are ranks) per server
        self.v_init = {s: 0 for s in self.servers}
        self.after = {s: 0.0 for s in self.servers}
        self.next_batch = rt.now() + cfg.batch_interval
        self.batches = 0
        self.ready_latency = []   # seconds from a worker's report to our receipt
        self.plan_time = []       # seconds spent planning one batch (schedule + booking + sending)
        self.pushed = 0           # ready updates reported (scheduled modes)
        self.resolved = 0         # applied (reported by servers) + dropped
        self.done = {}            # worker -> its pushed count, once it has finished
        self.ledgers = {}
        self.stopping = False
        self.next_flush = 0.0
        self.iteration_ready = {}  # sync: (server, iteration) -> updates reported ready

    def on_request(self, req):
        if req[0] == "finish":
            self.want_finish = True

    def on_ctrl(self, src, kind, body):
        rt = self.rt
        if kind == "ready":
            now = rt.now()
            for uid, server, nbytes, version, norm, sent in body:
                self.ready_latency.append(now - sent)
                self.pending[server].append(Update(uid, src, float(nbytes), version, now, norm))
                if self.mode == "sync":
                    key = (server, version)
                    n = self.iteration_ready[key] = self.iteration_ready.get(key, 0) + 1
                    if n == len(self.workers):
                        # the iteration's last update: nothing else can join its batch, and the
                        # server waits for it, so it is planned now rather than at the next tick
                        del self.iteration_ready[key]
                        self._plan(server, now)
            self.pushed += len(body)
        elif kind == "pulls":
            self._distribute(src, *body)
        elif kind == "report":
            self.caps.update(src, *body)
        elif kind == "applied":
            self.resolved += len(body)
        elif kind == "replicated":
            self.replicated[rt.roles.server_of(src)] = body
        elif kind == "done":
            self.done[src] = body
        elif kind == "ledger":
            self.ledgers[src] = body
        else:
            raise RuntimeError("scheduler: unexpected control message %r from rank %d"
                               % (kind, src))

    def tick(self, now_mono):
        rt = self.rt
        t = rt.now()
        if self.mode is not None and t >= self.next_batch:
            self.next_batch = t + rt.config.batch_interval
            for s in self.servers:
                if self.pending[s]:
                    self._plan(s, t)
            if self.batches % 10 == 0:
                self.view.prune(t)
        if not self.stopping and len(self.done) == len(self.workers):
            pushed = sum(self.done.values())
            if self.resolved == pushed and all(not p for p in self.pending.values()):
                if not self._replicas_caught_up(t):
                    return
                self.stopping = True
                for r in range(1, rt.size):
                    rt.channel.send(r, "stop")
                self.ledgers[0] = rt.ledger
        if self.stopping and len(self.ledgers) == rt.size:
            self._summarize()

    def _replicas_caught_up(self, t):
        """Every replica has applied what its server applied; punted copies are planned now,
        with Div_max = 0 (a full catch-up)."""
        ok = True
        for s, state in self.rstate.items():
            if state.punted and t >= self.next_flush:
                self._plan(s, t, flush=True)
                self.next_flush = t + self.rt.config.batch_interval
            if state.punted or self.replicated[s] < self.replica_planned[s]:
                ok = False
        return ok

    def wake_in(self, now_mono):
        return max(0.0, self.next_batch - self.rt.now()) if self.mode is not None else 0.01

    # --- one batch ---------------------------------------------------------------------------------
    def _plan(self, server, t, flush=False):
        rt, cfg = self.rt, self.rt.config
        t_start = time.perf_counter()
        updates, self.pending[server] = self.pending[server], []
        state = self.rstate.get(server)
        replica = self.replica[server]
        hosts, idx = [server], {server: 0}
        extra = [] if state is None else [replica, *self.replica_aggregators,
                                           *(u.id >> 32 for u in state.punted)]
        for h in self.aggregators + extra + [u.worker for u in updates]:
            if h not in idx:
                idx[h] = len(hosts)
                hosts.append(h)
        ups = [Update(u.id, idx[u.worker], u.size, u.version, t, u.norm) for u in updates]
        if self.mode == "sync":
            self.v_init[server] = max(self.v_init[server], max(u.version for u in ups))
        seed = cfg.seed * 1000003 + self.batches
        plan, net = schedule(ups, self.view.network(hosts, t), 0,
                             aggregators=[idx[a] for a in self.aggregators], tau_max=self.tau_max,
                             v_init=self.v_init[server], start=t, seed=seed, mode=self.mode,
                             after=self.after[server])
        if state is not None:
            state = replace(state, punted=[replace(u, worker=idx[u.id >> 32])
                                           for u in state.punted])
            by_punted = {u.id: u for u in state.punted}
            plan, net, self.rstate[server] = replicate(
                plan, net, idx[replica], [idx[a] for a in self.replica_aggregators], state,
                div_max=0.0 if flush else self.div_max, gamma=cfg.gamma, seed=seed,
                sync=False, iteration_end=True)
        self.batches += 1
        if plan.commits:
            self.after[server] = plan.commits[-1].time
        if self.mode != "sync":
            self.v_init[server] += len(plan.order)
        by_id = {u.id: u for u in updates}
        if state is not None:
            for uid, u in by_punted.items():
                by_id.setdefault(uid, Update(uid, uid >> 32, u.size, u.version, u.ready, u.norm))
        final = state is None   # with a replica, the worker keeps the update for its copy
        sends = {}      # worker rank -> [(id, hop, destination, not_before, rate, final)]
        aggs = {}       # aggregator rank -> [Assignment]
        expect = []
        for tr in plan.transfers():
            self.view.book(hosts[tr.src], hosts[tr.dst], tr.segments)
        for tr in plan.direct:
            uid = tr.ids[0]
            sends.setdefault(by_id[uid].worker, []).append(
                (uid, server, server, tr.start, _rate(tr), final))
            expect.append((("u", uid), (uid,), (by_id[uid].version,), 0))
        for k, a in enumerate(plan.aggregates):
            for tr in a.inbound:
                uid = tr.ids[0]
                sends.setdefault(by_id[uid].worker, []).append(
                    (uid, hosts[a.aggregator], server, tr.start, _rate(tr), final))
            key = (self.batches, k)
            version = by_id[a.members[0]].version if self.mode == "sync" else None
            aggs.setdefault(hosts[a.aggregator], []).append(Assignment(
                key, server, a.members, a.transfer.start, _rate(a.transfer), version))
            expect.append((("a", key), tuple(a.members),
                           tuple(by_id[u].version for u in a.members), 0))
        if state is not None:
            self._replica_parts(server, plan.replica, hosts, by_id, sends, aggs, expect)
        if self.mode != "sync":
            rt.channel.send(server, "expect", expect)
        for rank, entries in aggs.items():
            rt.channel.send(rank, "aggregate", entries)
        sent = rt.now()
        for rank, entries in sends.items():
            rt.channel.send(rank, "send", (sent, entries))
        if plan.dropped:
            drops = {}
            for uid, why in plan.dropped.items():
                rt.ledger.dropped[uid] = why
                drops.setdefault(by_id[uid].worker, []).append((uid, why))
            for rank, entries in drops.items():
                rt.channel.send(rank, "drop", entries)
            rt.channel.send(server, "dropped", list(plan.dropped))
            self.resolved += len(plan.dropped)
        self.plan_time.append(time.perf_counter() - t_start)

    def _replica_parts(self, server, rp, hosts, by_id, sends, aggs, expect):
        """The replica's frozen transfers as plan parts: copies from workers (the update's last
        send: the worker may then free it), its aggregators' sums, its commits in order; and the
        server's last commit of the batch waits until the replica has applied them (§5.3)."""
        rt = self.rt
        replica = self.replica[server]
        keys = {}
        for tr in rp.direct:
            uid = tr.ids[0]
            sends.setdefault(uid >> 32, []).append(
                (uid, replica, replica, tr.start, _rate(tr), True))
            keys[(uid,)] = ("u", uid)
        for k, a in enumerate(rp.aggregates):
            for tr in a.inbound:
                uid = tr.ids[0]
                sends.setdefault(uid >> 32, []).append(
                    (uid, hosts[a.aggregator], replica, tr.start, _rate(tr), True))
            key = (self.batches, "r", k)
            aggs.setdefault(hosts[a.aggregator], []).append(Assignment(
                key, replica, a.members, a.transfer.start, _rate(a.transfer), None))
            keys[tuple(a.members)] = ("a", key)
        commits = [(keys[tuple(c.ids)], tuple(c.ids), (None,) * len(c.ids), 0)
                   for c in rp.commits]
        self.replica_planned[server] += len(rp.applied)
        if commits:
            rt.channel.send(replica, "expect", commits)
        if expect:
            last = expect[-1]
            expect[-1] = (last[0], last[1], last[2], self.replica_planned[server])

    # --- model distribution (§10.3) ------------------------------------------------------------------
    def _distribute(self, server, version, nbytes, requests):
        """Plan one model version's delivery to `requests` [(worker, request id)] at once (a pull
        batch is latency-critical: it is not held for the next update batch)."""
        rt = self.rt
        t = rt.now()
        t_start = time.perf_counter()
        hosts, idx = [server], {server: 0}
        for h in self.aggregators + [w for w, _ in requests]:
            if h not in idx:
                idx[h] = len(hosts)
                hosts.append(h)
        rid = dict(requests)
        dist, _ = distribute([idx[w] for w, _ in requests], self.view.network(hosts, t), 0,
                             float(nbytes), distributors=[idx[a] for a in self.aggregators],
                             start=t, seed=rt.config.seed * 1000003 + self.batches,
                             version=version)
        for tr in dist.transfers():
            self.view.book(hosts[tr.src], hosts[tr.dst], tr.segments)
        direct = [(hosts[tr.dst], rid[hosts[tr.dst]], tr.start, _rate(tr)) for tr in dist.direct]
        # unreachable on the view (no capacity left, ever): sent directly all the same, the
        # real network decides
        direct += [(hosts[h], rid[hosts[h]], t, None) for h in dist.unserved]
        relays = []
        for d in dist.distributors:
            out = {hosts[tr.dst]: tr for tr in d.outbound}
            forwards = [(hosts[w], rid[hosts[w]], out[hosts[w]].start if hosts[w] in out else t,
                         _rate(out[hosts[w]]) if hosts[w] in out else None) for w in d.workers]
            relays.append((hosts[d.host], d.inbound.start, _rate(d.inbound), forwards))
        rt.channel.send(server, "distribute", (version, direct, relays))
        self.plan_time.append(time.perf_counter() - t_start)

    # --- the end -------------------------------------------------------------------------------------
    def _summarize(self):
        rt = self.rt
        ledgers = [self.ledgers.get(r) for r in range(rt.size)]
        summary = summarize(ledgers, rt.roles.server_ranks, rt.roles.replica_ranks)
        summary.control = {"ready_latency": self.ready_latency, "plan_time": self.plan_time,
                           "batches": self.batches}
        for r in range(1, rt.size):
            rt.channel.send(r, "summary", summary)
        rt.summary.set(summary)
        rt.daemon.stop = True

    def stopped(self, error):
        pass


def _rate(tr):
    """The planned average rate of a transfer (bytes/s); None for an empty one."""
    d = tr.end - tr.start
    return tr.size / d if d > 0 and tr.size > 0 else None
