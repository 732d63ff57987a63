"""mlfabric's policies: every 100 ms the scheduler plans the batch of ready updates with
mlfabric.sched.schedule (ordering Alg. 2, aggregation Alg. 3; §5.1-5.2, §6) — the function the
runtime calls — on the monitor's lagged view (mlfabric.sched.view), then replicates with
mlfabric.sched.replication.replicate (§5.3) when a replica is configured. The plan is then executed
on the true network (truth.py): its transfers, in the plan's order and hops, through Network.send,
each starting no earlier than planned (an aggregate no earlier than its last member's true arrival),
and the server applies in the plan's order: a commit happens at max(true arrival, previous commit).
A stale view therefore costs real time but never breaks the order, so delays stay <= tau_max.

Policies: 'mlfabric' (async, tau_max, drops, aggregation over k aggregators), 'mlfabric-ssp'
(stale synchronous with slack K: ordering without deadlines, a worker computing its update i waits
until every worker has i - K updates processed), 'mlfabric-sync' (a barrier per iteration, mode
'sync': the model version counts iterations, so every applied update has delay 1).

Choices where the paper is silent:
- A worker learns at planning time that its update was dropped, and pulls then; otherwise its push
  has left it when the update reaches its first hop (the server or an aggregator).
- Model pulls are planned by the scheduler one at a time, when requested, as a direct server ->
  worker transfer on its view and booked like any planned transfer, so every policy pays the same
  per-pull cost at the server's egress. With distribution=True the pulls of a batch are instead
  answered with one version through distribution trees (§10.3, mlfabric.sched.distribute), with the
  server's aggregator machines as distributors.
- The replica's copies leave the worker's daemon on the replica's schedule; the worker does not wait
  for them. Updates still punted when the run ends stay unreplicated (reported as the final lag).
"""
import time
from dataclasses import replace
from math import ceil, inf

from mlfabric.sched import Update, distribute, schedule
from mlfabric.sched._records import fast_constructor

from .accounts import Gate
from .config import SCHEDULED
from mlfabric.sched.view import SchedulerView
from .run import Run
from .truth import TrueNetwork

try:
    from mlfabric.sched import replication as _replication
except ImportError:  # a tree without §5.3: fine unless a replica is asked for
    _replication = None

_PRUNE_EVERY = 1.0  # simulated seconds between prunes of past breakpoints

_update = fast_constructor(Update)  # a million updates: see mlfabric.sched._records


class ScheduledRun(Run):
    def __init__(self, cfg, policy, progress=False):
        if policy not in SCHEDULED:
            raise ValueError("not a scheduled policy: %r (known: %s)"
                             % (policy, ", ".join(SCHEDULED)))
        self.policy = policy
        super().__init__(cfg, progress)
        self.mode = SCHEDULED[policy]
        self.sync = self.mode == "sync"
        self.truth = TrueNetwork(self.nic, cfg.hosts, cfg.fixed_hosts, cfg.base_rate)
        self.view = SchedulerView(self.truth, cfg.t_lag)
        self.server = cfg.server
        self.aggs, self.raggs = cfg.aggregator_hosts()
        self.tau_max = cfg.tau_max if self.mode == "async" else inf
        self.gate = None
        if self.mode != "async":
            self.gate = Gate(self.W, 0 if self.sync else cfg.slack, self._release)
        self.queue = []
        self.pulls = []            # pull requests waiting for the next batch (distribution)
        self.distribution = cfg.distribution
        self.tick_at = None
        self.batches = 0
        self.v_init = 0            # async/ssp: updates applied by earlier plans; sync: iterations
        self.last_commit = 0.0     # the server's last commit, executed
        self.planned_last = 0.0    # ... and as the scheduler planned it
        # with momentum (eq. 2) an aggregate of several updates carries two weighted sums so the
        # server ends exactly where the members applied one by one would (divergence.py); a sync
        # iteration is one step, so plain sums do
        self.momentum = cfg.gamma > 0 and not self.sync
        self.iter_left = self.W    # sync: updates of the open iteration not yet planned
        self.iter_last = None      # sync: last applied update of the open iteration
        self.step_end = set()      # sync: updates that close a server step
        self.last_prune = 0.0
        self._fixed_hosts, self._fixed_idx = [], {}  # the server and its aggregators, numbered
        for h in [self.server, *self.aggs]:
            if h not in self._fixed_idx:
                self._fixed_idx[h] = len(self._fixed_hosts)
                self._fixed_hosts.append(h)
        self._agg_idx = [self._fixed_idx[a] for a in self.aggs]
        self.rstate = None
        self.replica_lag = None
        if cfg.replica:
            if _replication is None:
                raise RuntimeError("a replica needs mlfabric.sched.replication (paper §5.3), "
                                   "which is not available in this tree")
            self.rstate = _replication.ReplicaState()

    # --- workers --------------------------------------------------------------------------------
    def ready(self, t, w, i):
        uid = self.log.uid(w, i)
        self.log.push(uid, self.wver[w], t)
        self.queue.append(uid)
        self._want_tick(t)

    def _want_tick(self, t):
        """Make sure the scheduler runs at the next batch boundary (every `batch` seconds)."""
        if self.tick_at is None:
            b = self.cfg.batch
            tk = ceil(t / b) * b
            if tk < t:
                tk += b
            self.tick_at = tk
            self.engine.at(tk, self._tick)

    def _pushed(self, t, w):
        self.next_it[w] += 1
        i = self.next_it[w]
        if i == self.N:
            return
        if self.gate is not None and not self.gate.allows(i):
            self.gate.wait(w, i)
            return
        self._pull(t, w)

    def _release(self, w, t):
        self._pull(t, w)

    def _processed(self, t, uid):
        self.gate.done(self.log.worker(uid), t)

    def _pull(self, t, w):
        """Plan the model transfer on the scheduler's view, book it, execute it for real (with
        distribution trees: queue the request for the next batch)."""
        if self.distribution:
            self.pulls.append(w)
            self._want_tick(t)
            return
        h, s = self.host[w], self.server
        view = self.view
        end, segs = view.t_en((s, self.truth.hosts + h), t, self.size, t)
        view.book(s, h, segs)
        got = self.truth.send_end(s, h, self.size, segs[0].t0 if segs else end)
        self.server_out_bytes += self.size
        self.wver[w] = self.versions.at(t)
        self.start_compute(got, w)

    # --- batches --------------------------------------------------------------------------------
    def _tick(self, t):
        self.tick_at = None
        ids, self.queue = self.queue, []
        pulls, self.pulls = self.pulls, []
        if t - self.last_prune >= _PRUNE_EVERY:
            self.truth.prune(t)
            self.view.prune(t)
            self.last_prune = t
        self.tick_time = 0.0
        if ids:
            self._batch(t, ids)
        if pulls:
            self._distribute(t, pulls)
        self.sched_times.append(self.tick_time)
        self.batches += 1

    def _batch(self, t, ids):
        cfg, log = self.cfg, self.log
        # the batch's hosts: the server and its aggregators first (the same every batch), then
        # the replica's, then the workers' machines in the order their updates are listed
        hosts, idx = list(self._fixed_hosts), dict(self._fixed_idx)
        state = self.rstate
        hostof, N = self.host, self.N
        if state is not None:
            for h in [cfg.replica_host, *self.raggs,
                      *(hostof[log.worker(u.id)] for u in state.punted)]:
                if h not in idx:
                    idx[h] = len(hosts)
                    hosts.append(h)
        ups = []
        size, version, ready, norm = self.size, log.version, log.ready, self.compute.norm
        for uid in ids:
            w, i = divmod(uid, N)
            h = hostof[w]
            x = idx.get(h)
            if x is None:
                x = idx[h] = len(hosts)
                hosts.append(h)
            ups.append(_update(uid, x, size, version[uid], ready[uid], norm(w, i)))
        net = self.view.network(hosts, t)
        iteration_end = self.sync and self.iter_left == len(ids)
        seed = cfg.seed * 1000003 + self.batches
        t0 = time.perf_counter()
        plan, net = schedule(ups, net, idx[self.server], aggregators=self._agg_idx,
                             tau_max=self.tau_max, v_init=self.v_init, start=t, seed=seed,
                             mode=self.mode, momentum=self.momentum, after=self.planned_last)
        if state is not None:
            state = replace(state, punted=[replace(u, worker=idx[self.host[log.worker(u.id)]])
                                           for u in state.punted])
            plan, net, self.rstate = _replication.replicate(
                plan, net, idx[cfg.replica_host], [idx[a] for a in self.raggs], state,
                div_max=cfg.div_max, gamma=cfg.gamma, seed=seed, sync=self.sync,
                iteration_end=iteration_end)
        self.tick_time += time.perf_counter() - t0
        if plan.commits:
            self.planned_last = plan.commits[-1].time
        self._execute(t, plan, hosts, iteration_end)

    def _distribute(self, t, workers):
        """One batch of pull requests answered with one model version through distribution trees
        (§10.3, mlfabric.sched.distribution), planned on the view, executed on the true network.
        Workers on one machine that ask in the same batch share its delivery."""
        hosts, idx = [self.server], {self.server: 0}
        req = []
        for h in list(self.aggs) + [self.host[w] for w in workers]:
            if h not in idx:
                idx[h] = len(hosts)
                hosts.append(h)
        for w in workers:
            if idx[self.host[w]] not in req:
                req.append(idx[self.host[w]])
        net = self.view.network(hosts, t)
        version = self.versions.at(t)
        t0 = time.perf_counter()
        dist, _ = distribute(req, net, 0, self.size, distributors=[idx[a] for a in self.aggs],
                             start=t, seed=self.cfg.seed * 1000003 + self.batches, version=version)
        self.tick_time += time.perf_counter() - t0
        if dist.unserved:
            raise RuntimeError("model distribution left hosts %r unserved" % (dist.unserved,))
        got = {}
        for d in dist.distributors:
            arrived = self._send(d.inbound, hosts, d.inbound.start)
            self.server_out_bytes += d.inbound.size
            if d.host in d.workers:
                got[d.host] = arrived
            for x in d.outbound:
                got[x.dst] = self._send(x, hosts, max(x.start, arrived))
        for x in dist.direct:
            got[x.dst] = self._send(x, hosts, x.start)
            self.server_out_bytes += x.size
        for w in workers:
            self.wver[w] = version
            self.start_compute(got[idx[self.host[w]]], w)

    def _send(self, tr, hosts, start):
        """Book a planned transfer and execute it on the true network; its true end."""
        src, dst = hosts[tr.src], hosts[tr.dst]
        self.view.book(src, dst, tr.segments)
        return self.truth.send_end(src, dst, tr.size, start)

    def _execute(self, t, plan, hosts, iteration_end):
        """Run the plan on the true network, in the order it was reserved: the server's transfers,
        the replica's frozen ones, and last the server transfer replication delayed (it was
        re-reserved after the replica's, §5.3); then apply, drop and tell the workers."""
        log, engine = self.log, self.engine
        send = self._send
        rp = plan.replica
        delayed = rp.delayed if rp is not None else None
        first_hop, ends = {}, []
        for tr in plan.direct:
            if tr is delayed:
                ends.append(None)
                continue
            e = send(tr, hosts, tr.start)
            first_hop[tr.ids[0]] = e
            ends.append(e)
        held = None  # (index in ends, start no earlier than) of the delayed aggregate
        for a in plan.aggregates:
            last = t
            for x in a.inbound:
                e = send(x, hosts, x.start)
                first_hop[x.ids[0]] = e
                if e > last:  # max(last, e), keeping the first of equals
                    last = e
            tr = a.transfer
            if tr is delayed:
                held = (len(ends), last)
                ends.append(None)
            else:
                ends.append(send(tr, hosts, max(tr.start, last)))
        self.server_bytes += plan.server_bytes
        if rp is not None:
            self._send_replica(t, rp, hosts)
        if delayed is not None:
            k, last = held if held is not None else (len(ends) - 1, t)
            ends[k] = send(delayed, hosts, max(delayed.start, last))
            if held is None:
                first_hop[delayed.ids[0]] = ends[k]
        pos = {uid: p for p, uid in enumerate(plan.order, 1)}
        n_direct = len(plan.direct)
        for k, (c, e) in enumerate(zip(plan.commits, ends)):
            ct = max(e, self.last_commit)
            self.last_commit = ct
            for uid in c.ids:
                tau = 1 if self.sync else self.v_init + pos[uid] - log.version[uid]
                log.apply(uid, tau, ct, aggregated=k >= n_direct)
                if self.gate is not None:
                    engine.at(ct, self._processed, uid)
            if not self.sync:
                self.versions.add(ct, len(c.ids))
        for uid, why in plan.dropped.items():
            log.drop(uid, why, t)
            if self.gate is not None:
                engine.at(t, self._processed, uid)
            first_hop[uid] = t
        for uid in plan.updates:
            engine.at(first_hop[uid], self._pushed, log.worker(uid))
        if self.sync:
            if plan.order:
                self.iter_last = plan.order[-1]
            self.iter_left -= len(plan.updates)
            if self.iter_left == 0:
                self.versions.add(max(self.last_commit, t), 1)
                self.v_init += 1
                self.iter_left = self.W
                if self.iter_last is not None:
                    self.step_end.add(self.iter_last)
                self.iter_last = None
        else:
            self.v_init += len(plan.order)
        if rp is not None:
            self._replica_models(plan, rp, iteration_end)

    def _send_replica(self, t, rp, hosts):
        """The replica's frozen transfers: direct copies, then each aggregate after its inbound."""
        for tr in rp.direct:
            self._send(tr, hosts, tr.start)
            self.replica_bytes += tr.size
        for a in rp.aggregates:
            last = t
            for x in a.inbound:
                last = max(last, self._send(x, hosts, x.start))
            self._send(a.transfer, hosts, max(a.transfer.start, last))
            self.replica_bytes += a.transfer.size

    def _replica_models(self, plan, rp, iteration_end):
        """Divergence where the scheduler bounds it: the server after this batch, the replica after
        its frozen commits (exactly, with vectors)."""
        self.replica_lag = self.rstate.lag
        m = self.models
        if m is not None:
            for uid in plan.order:
                m.apply_server(uid, ends_step=not self.sync)
            if self.sync and iteration_end:
                m.end_server_step()
            for uid in rp.applied:
                m.apply_replica(uid, ends_step=not self.sync or uid in self.step_end)
        if rp.enforced:
            self.note_divergence(rp.divergence)
            if not rp.bound_met:
                self.bound_unmet += 1
