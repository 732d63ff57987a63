"""The scheduler rank (paper §4-§6): collects the daemons' ready updates, and every batch interval
plans each server's batch with mlfabric.sched.schedule on the monitor's view of the network, books
the plan's transfers in that view, and sends every daemon its part: the workers what to send where
and when (or that an update is dropped), the aggregators what to sum, the server the commits in
order. With a replica it also plans the replica's copies (mlfabric.sched.replicate) and the
server's divergence gate (gate.py). It answers pull batches with distribution trees (§10.3),
decides when the job is over (every live worker done, every pushed update applied or dropped) and
gathers everyone's accounts into the job's summary. Pull batches and allreduce calls are planned
in pulls.py, failures handled in recovery.py.

Servers are named by their logical id (the rank they started on); `rank_of` maps a logical server
to the rank that serves it now (its replica's, after a failover). Times are job time (seconds since
the job's t0, on the scheduler's clock; daemons convert).
"""
import logging
import time
from bisect import bisect_right
from collections import Counter
from dataclasses import replace
from math import inf

from .._core import config as _config
from ..errors import MlfabricError, PeerTimeoutError
from ..sched import ReplicaState, Update, replicate, schedule
from ..sched.view import SchedulerView
from .control import deliver
from .gate import DivergenceGate
from .idset import IdSet
from .ledger import profile, summarize
from .lowering import lower
from .messages import DropUpdate
from .monitor import UNPACED, ReportedCapacities
from .pulls import SchedulerPulls
from .recovery import SchedulerRecovery

_log = logging.getLogger("mlfabric.runtime")

PEER_WINDOW = 3   # batches: a worker that reported an update within them still pushes (slow drop)


class SchedulerRole(SchedulerRecovery, SchedulerPulls):
    def __init__(self, rt):
        self.rt = rt
        cfg = rt.config
        roles = rt.roles
        self.mode = cfg.sched_mode      # None: vanilla async (nothing to plan)
        self.workers = list(roles.worker_ranks)
        self.servers = list(roles.server_ranks)
        self.rank_of = {s: s for s in self.servers}
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
        self.gate = {s: DivergenceGate(self.div_max) for s in self.rstate}
        self.replica_planned = {s: 0 for s in self.servers}  # replica commits planned so far
        self.replicated = {s: 0 for s in self.servers}       # ... and reported done
        base = cfg.emulation.base_rate
        self.caps = ReportedCapacities(rt.size, UNPACED if base is None else base)
        self.view = SchedulerView(self.caps, 0.0)
        self.pending = {s: [] for s in self.servers}   # Update (hosts are ranks) per server
        # per server, each worker's last report of an update ready (job time): the workers that
        # push lately, whose paths the slow-link drop also compares with (sched.scheduler)
        self.pushed_at = {s: {} for s in self.servers}
        # ids planned for each server with a replica: at a failover, those the replica never
        # applied are dropped (recovery.py); a byte an id (IdSet), none without a replica
        self.planned = {s: IdSet() for s in self.servers}
        self.v_init = {s: rt.infos[s].get("version", 0) for s in self.servers}  # (resume)
        # The staleness budget, profiled (asynchronous modes): an update's lag when planned,
        # v_init - its version (the updates planned since the model it was computed from; over
        # tau_max it is dropped), and how many of those were planned but not yet applied then
        # (in flight: the model a worker fetches is behind v_init by that many)
        self.applied_of = dict(self.v_init)   # per server, as its 'applied' reports say
        self.lag_at_plan = Counter()
        self.in_flight_at_plan = profile()
        # ... and how long the planned stay in flight: per update, from its plan to the server's
        # report that it is applied, and how much later than its commit's planned arrival that
        # report came (the plan books the network as the view has it; a late commit holds the
        # ones behind it at the server's link, and every update in flight adds to each lag)
        self.planned_commit = {}    # id -> (job time planned, its commit's planned arrival)
        self.commit_latency = profile()
        self.commit_late = profile()
        # per server, the workers handed a model whose update from it is not yet planned:
        # worker -> the version (pulls.py _admit)
        self.held = {s: {} for s in self.servers}
        # per server, worker -> the job time its get was first parked (pulls.py _admit)
        self.parked_since = {s: {} for s in self.servers}
        self.deferred_pulls = 0     # requests that _admit sent back to wait for a later batch
        self.parked_pulls = 0       # ... of them, for a slow uplink (_admit)
        self.parked_longest = 0.0   # the longest a get stayed parked before it was served
        self.after = {s: 0.0 for s in self.servers}
        self.next_batch = rt.now() + cfg.batch_interval
        self.batches = 0
        self.ready_latency = profile()  # seconds from a worker's report to our receipt
        self.plan_time = profile()  # seconds planning one batch (schedule + booking + sending)
        self.ready_ids = IdSet()  # ids reported ready (scheduled modes)
        self.resolved = IdSet()   # ids applied (reported by servers) or dropped
        self.resolved_of = {w: 0 for w in self.workers}  # per worker, for the end condition
        self.done = {}            # worker -> its pushed count, once it has finished
        self.reported_of = {}     # worker -> its updates reported ready (sync: see _uneven)
        self.ledgers = {}
        self.stopping = False
        self.iteration_ready = {}  # sync: (server, iteration) -> updates reported ready
        # servers whose replica is being promoted (recovery.py) -> time.monotonic() it was asked
        self.promoting = {}
        self.allreduce_pending = {}  # ("ar", call, root) -> contributions reported ready
        self.failed_over = set()   # servers now served by their promoted replica
        self.failovers = []        # (server, new rank, updates in the promoted model, job time)
        self.last_alive = 0.0      # time.monotonic() of the last liveness round
        # the end's progress (_bounds): what the job has left to do, and since when it is so
        self.end_state, self.end_since = None, time.monotonic()

    def on_request(self, req):
        pass

    def on_data(self, msg):
        raise RuntimeError("scheduler: unexpected payload %r from rank %d" % (msg.key, msg.src))

    def on_ctrl(self, src, kind, body):
        rt = self.rt
        if kind == "ready":
            now = rt.now()
            for r in body:
                self.ready_latency.append(now - r.sent)
                server, version = r.server, r.version
                if isinstance(server, tuple):   # a contribution to allreduce call (k, root)
                    self._allreduce_ready(server, Update(r.id, src, float(r.size), version, now))
                    continue
                self.ready_ids.add(r.id)
                self.pending[server].append(Update(r.id, src, float(r.size), version, now,
                                                   r.norm))
                self.pushed_at[server][src] = now
                if self.mode == "sync":
                    self.reported_of[src] = self.reported_of.get(src, 0) + 1
                    key = (server, version)
                    n = self.iteration_ready[key] = self.iteration_ready.get(key, 0) + 1
                    if n == len(self.workers):
                        # the iteration's last update: nothing else can join its batch, and the
                        # server waits for it, so it is planned now rather than at the next tick
                        self._iteration_planned(server, version, now)
        elif kind == "pulls":   # (tag, bytes, [(worker, key it receives)]) from a server/root
            self._distribute(src, *body)
        elif kind == "report":
            self.caps.update(src, *body)
        elif kind == "applied":
            now = rt.now()
            for uid in body:
                planned = self.planned_commit.get(uid)
                if planned is not None:
                    self.commit_latency.append(now - planned[0])
                    self.commit_late.append(now - planned[1])
            self._resolve(body)
            s = next((s for s, r in self.rank_of.items() if r == src), None)
            if s is not None:
                self.applied_of[s] += len(body)
        elif kind == "lost":            # work a failure took, found by a daemon (recovery.py)
            self.lost(body)
        elif kind == "replicated":
            s = next((s for s, r in self.replica.items() if r == src), None)
            if s is not None:
                self.replicated[s] = body
        elif kind == "promoted":
            self.promoted(src, *body)
        elif kind == "done":
            self.done[src] = body
        elif kind == "ledger":
            self.ledgers[src] = body
        else:
            raise RuntimeError("scheduler: unexpected control message %r from rank %d"
                               % (kind, src))
        if self.mode == "sync" and kind in ("ready", "done") and self.done:
            self._uneven()

    def logical(self, rank):
        """The logical server a rank serves."""
        return next(s for s, r in self.rank_of.items() if r == rank)

    def _resolve(self, ids, reason=None):
        """ids are applied (reason None) or dropped for `reason`; each counts once."""
        for uid in ids:
            if reason is not None:
                self.rt.ledger.dropped[uid] = reason
            self.planned_commit.pop(uid, None)
            if uid not in self.resolved:
                self.resolved.add(uid)
                w = uid >> 32
                self.resolved_of[w] = self.resolved_of.get(w, 0) + 1

    def tick(self, now_mono):
        rt = self.rt
        t = rt.now()
        if self.mode is not None and t >= self.next_batch:
            self.next_batch = t + rt.config.batch_interval
            for s in self.servers:
                if s in self.promoting:
                    continue
                if self.pending[s]:
                    if not self._ingress_full(s, t):
                        self._plan(s, t)
                elif s in self.rstate and self.rstate[s].punted:
                    # nothing new for the server: catch the replica up in full, it costs the
                    # server nothing and the divergence gate may be holding the server back
                    self._plan(s, t, catch_up=True)
            if self.batches % 10 == 0:
                self.view.prune(t)
        if now_mono - self.last_alive >= rt.config.t_lag:
            self._liveness(now_mono)
            self._bounds(now_mono)
        if not self.stopping and self._finished():
            self.stopping = True
            for r in range(1, rt.size):
                rt.channel.send(r, "stop")
            self.ledgers[0] = rt.ledger
        if self.stopping and all(r in self.ledgers for r in range(rt.size) if r not in rt.failed):
            self._summarize()

    def _bounds(self, now_mono):
        """The job's end never waits unboundedly on a live job: liveness (_liveness) covers a
        rank that stops reporting; this covers ranks that report yet never send what the end
        waits for. A promotion the replica has not confirmed within MLFABRIC_TIMEOUT is an
        error; so is an end that makes no progress for MLFABRIC_TIMEOUT once every live worker
        is done (nothing new can come then: every planned transfer is bounded by the data
        plane's own timeout, so a wait that long means a message that will never come), naming
        what it waits for."""
        limit = _config.timeout_s()
        for s, since in self.promoting.items():
            if now_mono - since > limit:
                raise PeerTimeoutError(
                    "server %d died and its replica (rank %d) has not confirmed its promotion "
                    "within MLFABRIC_TIMEOUT=%g s: the job cannot go on"
                    % (s, self.replica[s], limit))
        if not (self.stopping or all(w in self.done for w in self.workers)):
            self.end_state, self.end_since = None, now_mono
            return
        state = (len(self.resolved), len(self.ready_ids), len(self.ledgers), len(self.rt.failed),
                 len(self.failovers), tuple(self.replicated.values()), self.stopping)
        if state != self.end_state:
            self.end_state, self.end_since = state, now_mono
        elif now_mono - self.end_since > limit:
            raise PeerTimeoutError(
                "the job's end made no progress for %.0f s (MLFABRIC_TIMEOUT=%g s) after every "
                "worker finished; waiting for: %s" % (now_mono - self.end_since, limit,
                                                       self.waiting_for()))

    def _uneven(self):
        """Sync: a worker that finished having pushed fewer updates than another pushed leaves
        that one's later iterations waiting for an update that never comes: an error at once,
        on every rank, rather than a wait until MLFABRIC_TIMEOUT."""
        most = max(self.reported_of.values(), default=0)
        short = sorted(w for w, n in self.done.items() if n < most and w not in self.rt.failed)
        if short:
            ahead = sorted(w for w, n in self.reported_of.items() if n == most)
            raise MlfabricError(
                "ps-sync: worker rank(s) %s finished after %s update(s) while rank(s) %s pushed "
                "%d: a synchronous iteration waits for every worker's update, so theirs would "
                "never complete. Every worker must take the same number of steps"
                % (short, sorted({self.done[w] for w in short}), ahead, most))

    def _liveness(self, now_mono):
        """Tell every rank the scheduler runs, and check that every live rank's daemon does:
        each reports every t_lag (the monitor), so one silent for MLFABRIC_TIMEOUT is stuck or
        died unnoticed, and the job stops with its name instead of waiting forever. (A job
        itself may last as long as it likes.)"""
        self.last_alive = now_mono
        rt = self.rt
        limit = _config.timeout_s()
        for r in range(1, rt.size):
            if r in rt.failed:
                continue
            rt.channel.send(r, "alive")
            silent = now_mono - rt.channel.heard[r]
            if silent > limit:
                # (not "rank ..." first: _fail takes such a text for one already broadcast)
                raise PeerTimeoutError(
                    "no word from rank %d (%s) for %.0f s (MLFABRIC_TIMEOUT=%g s; every daemon "
                    "reports to the scheduler every t_lag): it is stuck or died unnoticed"
                    % (r, rt.roles.role(r), silent, limit))

    def _finished(self):
        """Every live worker is done and every update it pushed is resolved; nothing is pending
        or being promoted; every replica has caught up with its server."""
        if any(w not in self.done for w in self.workers) or self.promoting:
            return False
        if any(self.resolved_of.get(w, 0) < self.done[w] for w in self.workers):
            return False
        if self.ready_ids - self.resolved or any(self.pending.values()):
            return False
        return all(not st.punted and self.replicated[s] >= self.replica_planned[s]
                   for s, st in self.rstate.items())

    def poll_s(self):
        return 0.0005

    def waiting_for(self):
        """Why the job has not ended yet, in words (for the timeout's error message)."""
        parts = []
        left = [w for w in self.workers if w not in self.done]
        if left:
            parts.append("workers %s have not finished" % left)
        short = {w: self.done[w] - self.resolved_of.get(w, 0) for w in self.workers
                 if w in self.done and self.resolved_of.get(w, 0) < self.done[w]}
        if short:
            parts.append("unresolved updates per worker %s" % short)
        unresolved = self.ready_ids - self.resolved
        if unresolved:
            parts.append("%d reported updates neither applied nor dropped" % len(unresolved))
        if any(self.pending.values()):
            parts.append("updates waiting to be planned")
        for s, st in self.rstate.items():
            if st.punted or self.replicated[s] < self.replica_planned[s]:
                parts.append("replica of server %d behind (%d punted, %d/%d applied)"
                             % (s, len(st.punted), self.replicated[s], self.replica_planned[s]))
        if self.promoting:
            parts.append("promoting replicas of %s" % sorted(self.promoting))
        if self.stopping:
            parts.append("ledgers from ranks %s" % sorted(
                set(range(self.rt.size)) - set(self.ledgers) - self.rt.failed))
        return "; ".join(parts) or "nothing"

    def wake_in(self, now_mono):
        return max(0.0, self.next_batch - self.rt.now()) if self.mode is not None else 0.01

    def _ingress_full(self, server, t):
        """Is the server's ingress booked full (as the view has it) from now until after the
        next tick? Then the batch is held for that tick: none of it could reach the server
        sooner, and held together more of it aggregates. (Not in the paper, which plans every
        batch; it matters when few workers push at once: a 100 ms batch of one update cannot
        aggregate, and the server link then takes one update at a time.) A link with no capacity
        ever again holds nothing: the plan drops what cannot arrive."""
        p = self.view.profile(self.view.hosts + self.rank_of[server], t)
        horizon = t + self.rt.config.batch_interval
        k = bisect_right(p.t, t) - 1
        if p.v[k] > 0:
            return False
        for j in range(k + 1, len(p.t)):
            if p.t[j] >= horizon:
                return True
            if p.v[j] > 0:
                return False
        return False

    # --- one batch --------------------------------------------------------------------------------
    def _iteration_planned(self, server, version, t):
        """Sync: every live worker's update of iteration `version` is in; plan what is pending
        and tell the server, which then steps once they have all arrived."""
        self.iteration_ready.pop((server, version), None)
        if self.pending[server]:
            self._plan(server, t)
        self.rt.channel.send(self.rank_of[server], "iteration", version)

    def _plan(self, server, t, catch_up=False):
        """Plan `server`'s pending updates (and its replica's copies); send the parts."""
        cfg = self.rt.config
        t_start = time.perf_counter()
        updates, self.pending[server] = self.pending[server], []
        held = self.held[server]
        for u in updates:   # planned or dropped now: no longer ahead of later models (pulls.py)
            if held.get(u.worker, inf) <= u.version:
                del held[u.worker]
        updates = self._drop_orphans(server, updates)
        srank = self.rank_of[server]
        state = self.rstate.get(server)
        replica = self.replica[server]
        hosts, idx = [srank], {srank: 0}
        extra = [] if state is None else [replica, *self.replica_aggregators,
                                           *(u.id >> 32 for u in state.punted)]
        peers = self._pushing_peers(server, t) if cfg.slow_drop and self.mode == "async" else []
        for h in self.aggregators + extra + [u.worker for u in updates] + peers:
            if h not in idx:
                idx[h] = len(hosts)
                hosts.append(h)
        ups = [Update(u.id, idx[u.worker], u.size, u.version, t, u.norm) for u in updates]
        if self.mode == "sync" and ups:
            self.v_init[server] = max(self.v_init[server], max(u.version for u in ups))
        elif ups:
            self.lag_at_plan.update(self.v_init[server] - u.version for u in ups)
            self.in_flight_at_plan.append(self.v_init[server] - self.applied_of[server])
        seed = cfg.seed * 1000003 + self.batches
        # with a replica, no commit on either side may weigh more than Div_max (aggregation.py)
        cap = self.div_max if state is not None else inf
        plan, net = schedule(ups, self.view.network(hosts, t), 0,
                             aggregators=[idx[a] for a in self.aggregators], tau_max=self.tau_max,
                             v_init=self.v_init[server], start=t, seed=seed, mode=self.mode,
                             after=self.after[server], norm_cap=cap,
                             # streaming sums only without a replica (worker.py)
                             cut_through=cfg.cut_through and state is None,
                             next_batch=t + cfg.batch_interval if cfg.slow_drop else None,
                             peers=[idx[p] for p in peers])
        by_id = {u.id: u for u in updates}
        if state is not None:
            state = replace(state, punted=[replace(u, worker=idx[u.id >> 32])
                                           for u in state.punted])
            for u in state.punted:
                by_id.setdefault(u.id, replace(u, worker=u.id >> 32))
            plan, net, self.rstate[server] = replicate(
                plan, net, idx[replica], [idx[a] for a in self.replica_aggregators], state,
                div_max=0.0 if catch_up else self.div_max, gamma=cfg.gamma, seed=seed,
                sync=False, iteration_end=True, norm_cap=cap)
        self.batches += 1
        for c in plan.commits:
            for uid in c.ids:
                self.planned_commit[uid] = (t, c.time)
        if plan.commits:
            self.after[server] = plan.commits[-1].time
        if self.mode != "sync":
            self.v_init[server] += len(plan.order)
        if self.replica[server] is not None:
            self.planned[server].update(plan.order)
        for tr in plan.transfers():
            self.view.book(hosts[tr.src], hosts[tr.dst], tr.segments)
        self._send_parts(server, plan, hosts, by_id, state is None)
        self.plan_time.append(time.perf_counter() - t_start)
        if _log.isEnabledFor(logging.DEBUG):  # one line per batch, at most every batch_interval
            _log.debug("plan %d for server %d: %d of %d updates ordered, %d commits, %d "
                       "transfers, %.2f ms%s", self.batches, server, len(plan.order),
                       len(updates), len(plan.commits), len(list(plan.transfers())),
                       1e3 * self.plan_time[-1], " (replica catch-up)" if catch_up else "")

    def _pushing_peers(self, server, t):
        """The live workers that reported an update for `server` within the last PEER_WINDOW
        batches: they push, so one of them sent at the next batch is a fair reference for the
        slow-link drop, and one that stops (finished, dead, a long straggle) leaves the set soon
        after, so a batch of slow senders is not dropped whole for long on its account."""
        window = PEER_WINDOW * self.rt.config.batch_interval
        return [w for w, at in self.pushed_at[server].items()
                if t - at <= window and w not in self.rt.failed and w not in self.done]

    def _send_parts(self, server, plan, hosts, by_id, final):
        """Each daemon's part of a plan (lowering.py), sent. `final`: no replica copy follows, so
        a worker frees its update after this send (with a replica it keeps it for the copy)."""
        srank = self.rank_of[server]
        parts = lower(plan, hosts, by_id, server, (self.batches,), final=final,
                      sync=self.mode == "sync", gate=self.gate.get(server),
                      replica=self.replica[server], replica_planned=self.replica_planned[server])
        if plan.replica is not None:
            self.replica_planned[server] += len(plan.replica.applied)
        for uid, why in plan.dropped.items():
            self._resolve((uid,), why)
        deliver(self.rt, parts, srank)

    def _drop(self, server, drops, tell_server=True):
        """Tell the workers and the server that these updates {id: (worker, reason)} are
        dropped, and record them."""
        per_worker = {}
        for uid, (w, why) in drops.items():
            self._resolve((uid,), why)
            per_worker.setdefault(w, []).append(DropUpdate(uid, why))
        for w, entries in per_worker.items():
            self.rt.channel.send(w, "drop", entries)
        if tell_server:
            self.rt.channel.send(self.rank_of[server], "dropped",
                                 [DropUpdate(uid, why) for uid, (_, why) in drops.items()])

    # --- the end ----------------------------------------------------------------------------------
    def _summarize(self):
        rt = self.rt
        ledgers = [self.ledgers.get(r) for r in range(rt.size)]
        summary = summarize(ledgers, rt.roles.server_ranks, rt.roles.replica_ranks,
                            dead=rt.failed, known=self.ready_ids)
        summary.control = {"ready_latency": list(self.ready_latency),
                           "plan_time": list(self.plan_time),
                           "plan_latency": [x for lg in ledgers if lg for x in lg.plan_latency],
                           "get_latency": [x for lg in ledgers if lg for x in lg.get_latency],
                           "pull_wait": [x for lg in ledgers if lg for x in lg.pull_wait],
                           "pull_plan": [x for lg in ledgers if lg for x in lg.pull_plan],
                           "achieved_rates": dict(self.caps.achieved),
                           "lag_at_plan": dict(self.lag_at_plan),
                           "in_flight_at_plan": list(self.in_flight_at_plan),
                           "commit_latency": list(self.commit_latency),
                           "commit_late": list(self.commit_late),
                           "deferred_pulls": self.deferred_pulls,
                           "parked_pulls": self.parked_pulls,
                           "parked_longest_s": self.parked_longest,
                           "batches": self.batches}
        summary.failovers = list(self.failovers)
        for r in range(1, rt.size):
            rt.channel.send(r, "summary", summary)
        rt.summary.set(summary)
        rt.daemon.stop = True

    def stopped(self, error):
        pass

