"""The scheduler's plans for payloads that go from one rank to many, or many to one outside the
parameter-server batches: pull batches answered through distribution trees (paper §10.3), and
Table 1's AllReduce (§6), a sync batch to a root worker followed by a distribution of the sum.
Mixed into SchedulerRole (scheduler.py); latency-critical, so planned when asked, not at a tick.
"""
import time
from math import inf

from .._core import config as _config
from ..sched import Update, distribute, schedule
from ..sched.distribution import SLOW_EGRESS, under_share
from .control import deliver
from .lowering import lower, rate_of
from .messages import SendUpdate, SumUpdates
from .server import GATE_SHARE

# a get is parked (_admit) at most this share of MLFABRIC_TIMEOUT, the bound on a worker's wait
PARK_MAX_SHARE = 0.25


class SchedulerPulls:
    def _distribute(self, src, tag, nbytes, requests):
        """Plan the delivery of one payload (a model version; an allreduce result) from rank `src`
        to `requests` [(worker, the key it receives it under)] at once (a pull batch is
        latency-critical: it is not held for the next update batch). The plan goes back to `src`
        as (tag, direct sends, relays through distributors, the ranks among those src sends to
        whose downlink paces the send)."""
        rt = self.rt
        t = rt.now()
        t_start = time.perf_counter()
        requests = list(dict((w, key) for w, key in requests if w not in rt.failed).items())
        requests, deferred = self._admit(src, tag, requests)
        if not nbytes:  # nothing to move: a tree cannot help
            rt.channel.send(src, "distribute", (tag, [(w, key, t, None) for w, key in requests],
                                                [], [], deferred))
            return
        hosts, idx = [src], {src: 0}
        for h in self.aggregators + [w for w, _ in requests]:
            if h not in idx:
                idx[h] = len(hosts)
                hosts.append(h)
        key_of = dict(requests)
        # an allreduce's result (from a root worker) is waited for by every worker: its last
        # delivery is what counts; a server's model by each requester for its own copy
        objective = "makespan" if src in self.workers else rt.config.pull_objective
        dist, _ = distribute([idx[w] for w, _ in requests], self.view.network(hosts, t), 0,
                             float(nbytes), distributors=[idx[a] for a in self.aggregators],
                             start=t, seed=rt.config.seed * 1000003 + self.batches,
                             cut_through=rt.config.cut_through, objective=objective)
        for tr in dist.transfers():
            self.view.book(hosts[tr.src], hosts[tr.dst], tr.segments)
        direct = [(hosts[tr.dst], key_of[hosts[tr.dst]], tr.start, rate_of(tr))
                  for tr in dist.direct]
        # unreachable on the view (no capacity left, ever): sent directly all the same, the
        # real network decides
        direct += [(hosts[h], key_of[hosts[h]], t, None) for h in dist.unserved]
        # what each distributor forwards, to whom, under which key: a worker that relays further
        # (a cut-through pipeline) is sent ('d', its own forwards), nested
        relay_of = {id(d.inbound): d for d in dist.distributors}

        def forwards(d):
            out = {tr.dst: tr for tr in d.outbound}
            fw = []
            for w in d.workers:
                tr = out.get(w)
                nested = relay_of.get(id(tr)) if tr is not None else None
                key = ("d", forwards(nested)) if nested is not None else key_of[hosts[w]]
                fw.append((hosts[w], key, tr.start if tr else t, rate_of(tr)))
            return fw
        relays = [(hosts[d.host], d.inbound.start, rate_of(d.inbound), forwards(d))
                  for d in dist.distributors if d.inbound.src == 0]
        # the receivers of src's own sends whose downlink paces them (server.gating): a
        # reported ingress under GATE_SHARE of src's reported egress
        out = self.view.reported(src, t)
        paced = [h for h, *_ in direct + relays
                 if under_share(self.view.reported(self.view.hosts + h, t), out, GATE_SHARE)]
        rt.channel.send(src, "distribute", (tag, direct, relays, paced, deferred))
        self.plan_time.append(time.perf_counter() - t_start)

    def _admit(self, src, version, requests):
        """mlfabric-A's admission of a pull batch: the requests served now, and those deferred
        to a later batch of the server. Not in the paper, which answers every request of a batch
        and drops at the worker the updates that come back too stale (§5.1). Here a model is
        handed out only while the update computed from it can still meet tau_max: between the
        model's version and that update go the updates planned but not applied (in flight),
        those reported but not yet planned, and those being computed from models handed out
        before (held: each held worker's next update); the batch's own requesters take the
        positions left, first come first served, and at least one is always served. Why:
        answered whole, a batch hands one version to many workers at once, they push together,
        and once tau_max updates of theirs and their predecessors' are planned the rest are
        dropped; the dropped ask again together, so the convoy persists (30 workers, C1-N1: half
        of all updates dropped, a fifth of all planned at a lag of exactly tau_max). Deferred, a
        requester waits at the server and is then answered a fresher version: the wait is not
        part of its update's delay.

        Slow links (as the monitor reports them: an uplink under SLOW_EGRESS of the server's
        ingress, a downlink under that share of its egress) are not held. A requester whose
        uplink is slow is parked while a worker with a fast one pushes: its update would be
        dropped for the slow link at its batch (sched.scheduler.slow_links), so the model would
        only take server and relay egress from workers whose updates count. Parked, it waits at
        the server and asks again after t_lag (the monitor's next report of its link); once no
        fast worker pushes (they finished, or every uplink is slow), or it has been parked for
        PARK_MAX_SHARE of MLFABRIC_TIMEOUT, it is served. A requester whose downlink only is
        slow is served at once and not held: the model takes it ten transfer times to come (N3),
        and held all that while it would keep a position from a worker that turns one into an
        applied update in a fraction of that time. (30 workers under N3, where half of each
        direction run at a tenth, one run of C1-N3 and C3-N3 each: slow links held, mlfabric-A
        applied 13 updates/s; admission off, 12-16; slow links served at once, 15-17; slow
        uplinks parked, 15-16 with a model fetch of 0.25 s instead of 0.65-0.76, and 31% of the
        pushes dropped instead of 57-62%; over 3 runs of Table 2 parked, 16-19/s in C1-N3 and
        C3-N3, RR-Sync 16-17.)

        Returns (served, deferred), deferred as (worker, key, parked)."""
        s = next((s for s, r in self.rank_of.items() if r == src), None)
        if (s is None or self.mode != "async" or self.tau_max == inf
                or not self.rt.config.pull_admission):
            return requests, []
        t = self.rt.now()
        hosts = self.view.hosts
        ingress = self.view.reported(hosts + src, t)    # the server's
        egress = self.view.reported(src, t)
        held = self.held[s]
        for w, _ in requests:           # asking again: done with the model it held
            held.pop(w, None)
        for w in [w for w in held if w in self.rt.failed or w in self.done]:
            del held[w]
        ahead = self.v_init[s] - self.applied_of[s] + len(self.pending[s]) + len(held)
        n = max(1, int(self.tau_max - ahead))
        # a slow uplink's update is dropped at the next batch if a worker with a fast one
        # pushes (sched.scheduler.slow_links): park its model until its link is fast again
        park = (self.rt.config.slow_drop and any(
            not under_share(self.view.reported(p, t), ingress, SLOW_EGRESS)
            for p in self._pushing_peers(s, t)))
        # a get parked this long is served all the same: a worker whose uplink stays slow
        # still fetches now and then, and its wait never nears MLFABRIC_TIMEOUT
        park_max = _config.timeout_s() * PARK_MAX_SHARE
        parked = self.parked_since[s]
        served, deferred = [], []
        for w, key in requests:
            slow_up = under_share(self.view.reported(w, t), ingress, SLOW_EGRESS)
            if park and slow_up and t - parked.setdefault(w, t) < park_max:
                deferred.append((w, key, True))
                self.parked_pulls += 1
                continue
            since = parked.pop(w, None)
            if since is not None:
                self.parked_longest = max(self.parked_longest, t - since)
            if slow_up or under_share(self.view.reported(hosts + w, t), egress, SLOW_EGRESS):
                served.append((w, key))
            elif n > 0:
                served.append((w, key))
                held[w] = version
                n -= 1
            else:
                deferred.append((w, key, False))
                self.deferred_pulls += 1
        return served, deferred

    # --- allreduce through push/get (§6) ------------------------------------------------------
    def _allreduce_ready(self, call, update):
        """Collect the contributions to allreduce call (k, root); when every other live worker's
        is in, plan them as one sync batch to the root, aggregators being the other workers."""
        got = self.allreduce_pending.setdefault(call, [])
        got.append(update)
        if len(got) < len(self.workers) - 1:
            return
        del self.allreduce_pending[call]
        _, k, root = call
        t = self.rt.now()
        t_start = time.perf_counter()
        hosts, idx = [root], {root: 0}
        for h in self.workers:
            if h not in idx:
                idx[h] = len(hosts)
                hosts.append(h)
        ups = [Update(u.id, idx[u.worker], u.size, k, t) for u in got]
        plan, _ = schedule(ups, self.view.network(hosts, t), 0,
                           aggregators=[idx[w] for w in self.aggregators if w != root],
                           start=t, seed=self.rt.config.seed * 1000003 + self.batches,
                           mode="sync", cut_through=self.rt.config.cut_through)
        self.batches += 1
        for tr in plan.transfers():
            self.view.book(hosts[tr.src], hosts[tr.dst], tr.segments)
        parts = lower(plan, hosts, {u.id: u for u in got}, call, ("ar", k), sync=True,
                      commits=False)
        deliver(self.rt, parts, kinds=(SumUpdates, SendUpdate))   # the root sums what comes
        self.plan_time.append(time.perf_counter() - t_start)

