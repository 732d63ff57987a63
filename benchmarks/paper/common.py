"""What the paper-reproduction benchmarks (benchmarks/paper/) share: the scale-down, the paper's
published numbers, the workloads as run_job update functions, the traced job (the model over
time, recorded on the workers and evaluated offline after the job), time to a target, and the
JSON record every script writes.

Scale-down (BENCHMARKS.md, "Parameter-server training on the runtime"): 8 MPI ranks on one machine
(rank 0 schedules, rank 1 serves, 6 workers) stand for the paper's 30 workers; NIC pacing at
50 MB/s stands for 10 Gbps; payloads are sized so one transfer takes what the paper's takes
(ResNet-50's 100 MB -> 4 MB = 80 ms). Emulated seconds are paper seconds. The learning workloads
are small (an MLP classifier, LDA on a synthetic corpus), so their parameters are carried
at the head of a zero-padded payload of the paper's transfer size: the network sees the paper's
bytes, the optimiser the real model.

Importing this module does not start MPI; the functions that run jobs import it when called.
"""
import math
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the scripts' parser and entry: common.parser, common.run_main
from mlfabric.bench.script import parser, run_main  # noqa: E402,F401

RESULTS = os.path.join(ROOT, "benchmarks", "results", "paper")

BASE_RATE = 50e6            # bytes/s standing for the paper's 10 Gbps
LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None  # scripts import us first
PAPER_GBPS = 10.0

# --- the paper's numbers (§7), the rows REPRODUCTION.md sets ours beside -------------------------
# Table 2: speedup in time to 74% top-1 (ResNet-50, ImageNet) of MLfabric-A over RR-Sync
PAPER_TABLE2 = {"C1-N1": 1.74, "C1-N2": 1.23, "C1-N3": 1.42,
                "C2-N1": 2.96, "C2-N2": 2.0, "C2-N3": 2.32,
                "C3-N1": 1.90, "C3-N2": 1.33, "C3-N3": 1.42}
# §2 (measured in §7's cluster): a synchronous iteration took 8x as long when 10% of the workers
# took 4x longer and 10% of the NIC directions ran at 5 Gbps (C2 with N1's link rates) as without
PAPER_SYNC_SLOWDOWN = ("C2-N1", 8.0)
# Fig. 7 (c, d): LDA on NYTimes, C1-N1, iterations and seconds to log-likelihood -7.94
PAPER_LDA = {"rr-sync": (145, 182.0), "mlfabric-A-30": (188, 139.0),
             "mlfabric-A-60": (239, 169.0), "async": (300, 1080.0)}
# §7.2: MLfabric-S vs RR-Sync (5 epochs, ResNet-50): RR-Sync 1.2-2x faster everywhere except
# C2-N1, where MLfabric-S is 16% faster; vs Tr-Sync under C2-N2, per-iteration communication
# time 18.42% lower (ResNet-50), 21.7% (ResNet-152: 3.05 s -> 2.38 s)
PAPER_SYNC = {"rr_over_s_range": (1.2, 2.0), "C2-N1_s_faster_than_rr": 0.16,
              "C2-N2_s_vs_tr_comm_reduction_resnet50": 0.1842,
              "C2-N2_s_vs_tr_comm_reduction_resnet152": 0.217}
# Fig. 9: the replica-traffic saving from aggregation plateaus at 5.6x (30 workers)
PAPER_FIG9_PLATEAU = 5.6
# §7.4: scheduler ms per batch; < 5 ms for the 30-worker runs (batches of < 10 updates)
PAPER_SCHED_MS = {10: 5.0, 30: 5.0, 100: 30.0, 500: 440.0, 1000: 1460.0}


def result_path(name):
    return os.path.join(RESULTS, name)


def relpath(path):
    """A path as the repo sees it (for commands and citations)."""
    try:
        return os.path.relpath(os.path.abspath(path), ROOT)
    except ValueError:
        return path


# --- the JSON every script writes ----------------------------------------------------------------

def command_line(script, argv, ranks=None):
    """The exact command that reproduces a run (relative to the repo root); argv None: this
    process's own arguments."""
    cmd = "python benchmarks/paper/%s %s" % (script, " ".join(sys.argv[1:] if argv is None
                                                             else argv))
    return ("mpirun --oversubscribe -n %d %s" % (ranks, cmd) if ranks else cmd).strip()


_GIT_AT_START = []   # the git state as the run began (begin(); a run takes minutes)


def base_meta(script, argv, ranks=None, **params):
    """command, git state, CPU and the run's parameters. The git state comes from
    mlfabric.bench.harness (the benchmarks' shared driver), as begin() read it when the run
    started - the code that ran, not what the tree held by the time the JSON is written - or
    now for scripts that do not call begin()."""
    from mlfabric.bench.harness import git_state
    from mlfabric.bench.kernels import cpu_name
    git = _GIT_AT_START[0] if _GIT_AT_START else git_state()
    return {"command": command_line(script, argv, ranks), "script": "benchmarks/paper/" + script,
            "git": git, "cpu": cpu_name(), "machine": platform.machine(),
            "python": platform.python_version(), "base_rate": BASE_RATE,
            # the machine is shared: how busy it was when the run began (1, 5, 15 min)
            "load_average": LOAD_AT_START,
            "base_rate_stands_for_gbps": PAPER_GBPS, **params}


def write_json(path, doc):
    import json

    from mlfabric.bench.harness import jsonable
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(jsonable(doc), f, indent=1)


def read_json(path):
    import json
    with open(path) as f:
        return json.load(f)


# --- time to a target ----------------------------------------------------------------------------

def first_at_or_above(points, target):
    """The first point (by time) whose value is at or above `target`, or None. points: dicts with
    't' and 'value' (any order)."""
    for p in sorted(points, key=lambda p: p["t"]):
        if p["value"] >= target:
            return p
    return None


def speedup(t_ref, t_new):
    """t_ref / t_new: > 1 means the new mode reached the target sooner."""
    if t_ref is None or t_new is None or t_new <= 0:
        return None
    return t_ref / t_new


# --- workloads: run_job update functions over a padded payload -----------------------------------

def pad_elements(payload_bytes, itemsize, params):
    """Elements of the payload: the paper's transfer size, never fewer than the model's."""
    return max(int(params), int(round(payload_bytes / itemsize)))


class ClassifierTask:
    """Table 2's workload, the stand-in for ResNet-50 on ImageNet: an MLP (9,610 parameters), each
    worker SGD on its own shard with minibatches of `batch`. Data: "synthetic" (default), seeded
    Gaussian blobs - 12,000 samples, 64 features, 10 classes, separation 2.5, whose test accuracy
    rises smoothly to ~78% (2,400 test samples); or "digits", the 8x8 digits, whose 359 test
    images make the curve jitter by +-1% near its plateau, so that the first crossing of a target
    there is mostly noise. Like the paper's Table 2 runs ("we start with a pre-trained model",
    §7.1), every job starts from a model pre-trained by `pretrain` synchronous iterations,
    computed on rank 0 and broadcast. The learning rate is per update: RR-Sync sums the workers'
    updates and the parameter server applies each, so both move the model alike per update."""

    metric = "test accuracy"
    dtype = np.float32
    DATASETS = ("synthetic", "digits")

    def __init__(self, comm, workers, payload_bytes=4e6, lr=0.08, batch=32, pretrain=12,
                 pretrain_lr=None, seed=0, model="mlp", dataset="synthetic",
                 start_accuracy=None, max_pretrain=150):
        if dataset not in self.DATASETS:
            raise ValueError("dataset must be one of %s, got %r" % (self.DATASETS, dataset))
        self.workers, self.lr, self.batch, self.seed, self.model = workers, lr, batch, seed, model
        self.pretrain = pretrain
        self.pretrain_lr = lr if pretrain_lr is None else pretrain_lr
        self.dataset = dataset
        # rank 0 makes the data and pre-trains; the others get arrays (on 2 cores, scikit-learn
        # and torch imported by 8 processes at once cost seconds)
        shared = None
        if comm.rank == 0:
            from mlfabric.workloads import digits, synthetic_classification
            self.Xtr, self.ytr, self.Xte, self.yte = (
                digits(seed) if dataset == "digits" else
                synthetic_classification(12000, 64, 10, seed=seed, separation=2.5))
            self._eval = self._classifier(0, lr)
            if start_accuracy is None:
                start, _ = self.sync_curve(self._eval.model0(), pretrain, self.pretrain_lr)
            else:
                start, pretrain = self.pretrain_to(start_accuracy, max_pretrain)
            shared = (self.Xtr, self.ytr, self.Xte, self.yte, start, pretrain)
        idle_barrier(comm)
        (self.Xtr, self.ytr, self.Xte, self.yte, self.start,
         self.pretrain) = comm.bcast(shared, root=0)
        # Every rank imports torch now, with one compute thread (as torchrun), not inside the
        # first timed job: the workers' first update would otherwise pay seconds of import on a
        # busy machine (30 ranks: 20 s), charged to whichever mode happened to run first.
        from mlfabric.bench.impls import limit_threads
        limit_threads()
        import torch  # noqa: F401  (the import is the point)
        self.params = self.start.size
        self.size = pad_elements(payload_bytes, 4, self.params)

    def _classifier(self, w, lr):
        from mlfabric.workloads import Classifier, shard
        X, y = shard(self.Xtr, self.ytr, w, self.workers)
        return Classifier(self.model, X, y, classes=10, batch_size=self.batch, lr=lr,
                          seed=self.seed)

    def sync_curve(self, start, iterations, lr):
        """What RR-Sync computes, in one process: model += the sum of every worker's update, for
        `iterations` iterations from `start`; returns (final params, [metric after each])."""
        clfs = [self._classifier(w, lr) for w in range(self.workers)]
        m, curve = start.copy(), []
        for _ in range(iterations):
            m = m + sum(c.step(m) for c in clfs)
            curve.append(self.evaluate(m))
        return m, curve

    def pretrain_to(self, accuracy, max_iterations):
        """(model, iterations): synchronous iterations from the initial model until the test
        accuracy is at least `accuracy` - the same start for any number of workers (30 workers'
        summed steps are larger, so fewer iterations get there). ValueError if it never does."""
        clfs = [self._classifier(w, self.pretrain_lr) for w in range(self.workers)]
        m = self._eval.model0()
        for i in range(max_iterations + 1):
            if self.evaluate(m) >= accuracy:
                return m, i
            m = m + sum(c.step(m) for c in clfs)
        raise ValueError("synchronous pre-training does not reach accuracy %.3f within %d "
                         "iterations" % (accuracy, max_iterations))

    def model0(self, comm):
        m = np.zeros(self.size, self.dtype)
        m[:self.params] = self.start
        return m

    def job_update_fn(self, worker_index, drops=False):
        """A fresh update function for one job: each worker's minibatch order restarts. A
        dropped gradient is not re-sent (drops is unused): its worker's next one replaces it."""
        clfs = {}

        def update(rank, i, model):
            w = worker_index(rank)
            if w not in clfs:
                clfs[w] = self._classifier(w, self.lr)
            u = np.zeros(self.size, self.dtype)
            u[:self.params] = clfs[w].step(np.asarray(model[:self.params]))
            return u
        return update

    def evaluate(self, params):
        return self._eval.accuracy(np.asarray(params, self.dtype), self.Xte, self.yte)

    def describe(self):
        return {"workload": "MLP classifier", "dataset": self.dataset, "params": self.params,
                "payload_elements": self.size,
                "payload_bytes": self.size * 4, "lr": self.lr, "batch": self.batch,
                "pretrain_iterations": self.pretrain, "pretrain_lr": self.pretrain_lr,
                "train_samples": len(self.Xtr), "test_samples": len(self.Xte),
                "seed": self.seed, "metric": self.metric}


class LdaTask:
    """Fig. 7's workload: LDA by collapsed Gibbs sampling (mlfabric.workloads.lda) on a corpus
    drawn from LDA's generative model; each worker sweeps its documents once per iteration and
    pushes the word-topic count delta (float64). Metric: per-token log-likelihood of held-out
    documents (the paper's -7.94 on NYTimes is of this kind)."""

    metric = "held-out log-likelihood per token"
    dtype = np.float64

    def __init__(self, workers, payload_bytes=2.8e6, docs=1200, test_docs=150, doc_len=60,
                 vocab=1000, topics=20, seed=0, resend_dropped=True):
        from mlfabric.workloads.lda import LdaConfig, generate_corpus
        self.workers, self.seed = workers, seed
        self.resend_dropped = resend_dropped
        corpus, _ = generate_corpus(docs + test_docs, vocab, topics, doc_len, seed=seed)
        self.train, self.test = corpus[:docs], corpus[docs:]
        self.config = LdaConfig(vocab, topics)
        self.params = self.config.size
        self.size = pad_elements(payload_bytes, 8, self.params)
        self.shape = dict(docs=docs, test_docs=test_docs, doc_len=doc_len, vocab=vocab,
                          topics=topics)

    def _worker(self, w):
        from mlfabric.workloads.lda import LdaWorker
        n = len(self.train)
        return LdaWorker(self.train[w * n // self.workers:(w + 1) * n // self.workers],
                         self.config, seed=(self.seed, w))

    def sync_curve(self, iterations):
        """RR-Sync's model sequence in one process (model += every worker's delta)."""
        ws = [self._worker(w) for w in range(self.workers)]
        m, curve = self.config.zeros(), []
        for _ in range(iterations):
            m = m + sum(x.sweep(m) for x in ws)
            curve.append(self.evaluate(m))
        return m, curve

    def model0(self, comm):
        return np.zeros(self.size, self.dtype)

    def job_update_fn(self, worker_index, drops=False):
        """A worker's sweep delta, plus the deltas of its earlier updates the scheduler dropped
        (mlfabric.ps.dropped()): LDA's counts are state, not gradients, so a dropped delta must
        reach the server later, or the model's counts stop matching the topic assignments. The
        ids are (rank << 32) | i: one push per iteration to the one server. drops: the job's mode
        may drop updates (a parameter-server job, which registered this worker)."""
        lda, sent = {}, {}

        def update(rank, i, model):
            w = worker_index(rank)
            if w not in lda:
                lda[w] = self._worker(w)
            u = np.zeros(self.size, self.dtype)
            u[:self.params] = lda[w].sweep(np.asarray(model[:self.params]))
            if drops and self.resend_dropped:
                from mlfabric import ps
                for uid, _ in ps.dropped():
                    u[:self.params] += sent.pop(uid & 0xFFFFFFFF)
                sent[i] = u[:self.params].copy()
                for old in [k for k in sent if k < i - 64]:   # long applied: forget
                    del sent[old]
            return u
        return update

    def evaluate(self, params):
        from mlfabric.workloads.lda import log_likelihood
        return log_likelihood(np.asarray(params, np.float64), self.test, self.config)

    def describe(self):
        return {"workload": "LDA (collapsed Gibbs)", **self.shape, "params": self.params,
                "payload_elements": self.size, "payload_bytes": self.size * 8,
                "seed": self.seed, "metric": self.metric}


# --- the traced job ------------------------------------------------------------------------------

def traced_job(comm, mode, task, *, iterations, compute_s, emulation, tau_max=math.inf,
               batch_interval=0.1, t_lag=0.2, seed=0, every=1, duration_s=None,
               pull_objective=None, slow_drop=None, pull_admission=None):
    """Run one job of `mode` (mlfabric.ps.driver.run_job, the loop every mode shares) on every
    rank with `task`'s updates, recording the model each worker computes from. Returns, on rank
    0, the job's record with 'points' [{t, value, worker, iteration}] (the model evaluated
    offline); None on the other ranks.

    Why the workers' models: in a parameter-server mode a worker's model is the server's model
    of the moment it was fetched, and in RR-Sync every worker holds the model after each
    iteration, so one rule serves every mode. t is seconds from the job's start (a barrier just
    before run_job) to the moment the worker held that model: run_job sleeps the emulated
    compute time between fetching the model and calling the update function, so that sleep
    (the same seeded trace) is taken off the time of the call."""
    from mlfabric.ps.driver import run_job
    from mlfabric.runtime.core import PS_MODES
    from mlfabric.runtime.roles import Roles
    roles = Roles(comm.size)
    workers = len(roles.worker_ranks)
    ctrace = emulation.compute_trace(workers, compute_s) if compute_s else None
    # only the scheduled parameter-server modes drop updates (and report them to the worker)
    inner = task.job_update_fn(roles.worker_index, drops=mode in ("mlfabric-A", "ssp",
                                                                  "mlfabric-S"))
    records = []

    def update_fn(rank, i, model):
        if i % every == 0:
            w = roles.worker_index(rank)
            held = time.monotonic() - t0 - (ctrace.time(w, i) if ctrace else 0.0)
            records.append((held, w, i, np.array(model[:task.params], copy=True)))
        return inner(rank, i, model)

    settings = dict(size=task.size, iterations=iterations, compute_s=compute_s,
                    dtype=task.dtype, emulation=emulation, batch_interval=batch_interval,
                    t_lag=t_lag,
                    seed=seed, update_fn=update_fn, model0=task.model0(comm))
    if mode in PS_MODES:   # every commit: the applied ids and drops are read off the log
        settings["applied_log_max"] = None
    if mode == "mlfabric-A":  # the one mode it bounds (the runtime refuses it elsewhere)
        settings["tau_max"] = tau_max
    if duration_s is not None:     # an asynchronous job: workers run for a time (run_job)
        settings["duration_s"] = duration_s
    if pull_objective is not None:  # the runtime's pull trees (mlfabric.ps.init)
        settings["pull_objective"] = pull_objective
    if slow_drop is not None:       # mlfabric-A's slow-link drop (mlfabric.ps.init)
        settings["slow_drop"] = slow_drop
    if pull_admission is not None:  # mlfabric-A's pull admission (mlfabric.ps.init)
        settings["pull_admission"] = pull_admission
    idle_barrier(comm)   # rank 0 may still be evaluating the last job's models
    t0 = time.monotonic()
    res = run_job(mode, **settings)
    end = time.monotonic() - t0
    mine = {"role": res.role, "rank": comm.rank, "iter_times": list(res.iter_times), "end": end,
            # server: (updates in the commit, job time of the commit)
            "commits": [(len(e[0]), e[2]) for e in res.applied_log],
            "applied_ids": [int(u) for e in res.applied_log for u in e[0]], "records": records}
    parts = comm.gather(mine, root=0)
    comm.Barrier()
    if comm.rank != 0:
        return None
    # the emulated compute of the steady iterations (1..): what an iteration spends that is not
    # communication (or waiting for it)
    compute = [ctrace.time(w, i) if ctrace else 0.0
               for w in range(workers) for i in range(1, iterations)]
    rec = _job_record(mode, task, parts, res.summary, settings, emulation, tau_max)
    rec["compute_s_mean"] = sum(compute) / len(compute) if compute else 0.0
    if rec["iteration_s"]:
        rec["wait_s_per_iteration"] = rec["iteration_s"]["mean"] - rec["compute_s_mean"]
    return rec


def _job_record(mode, task, parts, summary, settings, emulation, tau_max):
    from benchmarks.ps_modes import stats, summary_record
    workers = [p for p in parts if p["role"] == "worker"]
    commits = sorted((c for p in parts if p["role"] == "server" for c in p["commits"]),
                     key=lambda c: c[1])
    points, seen = [], {}
    for p in workers:
        for t, w, i, params in p["records"]:
            # workers of a PS job often fetch the same version: evaluate each model once
            key = params.tobytes()
            if key not in seen:
                seen[key] = task.evaluate(params)
            points.append({"t": t, "value": seen[key], "worker": w, "iteration": i})
    points.sort(key=lambda p: p["t"])
    steady = [t for p in workers for t in p["iter_times"][1:]]
    # which updates never reached the server, as (worker rank, iteration): push ids are
    # (rank << 32) | n, and with one server a worker's n-th push is its iteration n
    dropped = []
    if mode not in ("rr-sync", "tr-sync"):   # allreduce jobs have no server (it sits out)
        applied = {u for p in parts for u in p["applied_ids"]}
        dropped = [(p["rank"], i) for p in sorted(workers, key=lambda p: p["rank"])
                   for i in range(len(p["iter_times"])) if (p["rank"] << 32) | i not in applied]
    return {"mode": mode, "tau_max": tau_max if mode == "mlfabric-A" else None,
            "workers": len(workers), "iterations": settings["iterations"],
            "duration_s": settings.get("duration_s"),
            # per worker (rank order): a job run for a time gives fast workers more
            "worker_iterations": [len(p["iter_times"]) for p in
                                  sorted(workers, key=lambda p: p["rank"])],
            "compute_s": settings["compute_s"],
            "batch_interval": settings["batch_interval"], "t_lag": settings["t_lag"],
            "emulation": {"compute": emulation.compute, "network": emulation.network,
                          "base_rate": emulation.base_rate, "period": emulation.period,
                          "seed": emulation.seed},
            "job_s": max(p["end"] for p in parts),
            "summary": summary_record(summary), "iteration_s": stats(steady),
            "server_commits": commits, "dropped_updates": dropped,
            "models_evaluated": len(seen), "points": points}


def fetch_times(job):
    """A parameter-server job's model fetches, seconds each: from the end of a worker's compute
    for iteration i-1 (its push returns at once) to its holding the model of iteration i; also
    the update function's few milliseconds."""
    from mlfabric.emulate.presets import ComputeTrace
    em = job["emulation"]
    trace = ComputeTrace(em["compute"], job["workers"], job["compute_s"], em["seed"])
    held = {(p["worker"], p["iteration"]): p["t"] for p in job["points"]}
    return [t - held[(w, i - 1)] - trace.time(w, i - 1) for (w, i), t in held.items()
            if (w, i - 1) in held]


def updates_applied_by(job, t):
    """Updates the job had applied by time t: a PS mode's server commits (job time, which starts
    within milliseconds of the traced job's clock), RR-Sync's completed iterations x workers."""
    if job["mode"] in ("rr-sync", "tr-sync"):
        done = [p["iteration"] for p in job["points"] if p["t"] <= t]
        return (max(done) if done else 0) * job["workers"]
    return sum(n for n, tc in job["server_commits"] if tc <= t)


def held_at_or_above(points, target, window, step=0.01):
    """The first time at which the model held, averaged over the trailing `window` seconds, is
    at or above `target`: {t, value (the average), iteration (of the newest point)}, or None.
    The model held at time t is the newest point's (a step function from the first point on);
    the window is clipped to that history. Why average: a noisy metric near its plateau is
    touched by chance long before it is held, and the first touch favours whichever mode
    produces more models (30 asynchronous workers fetch ~50 models for each one RR-Sync makes).
    Averaging over time, not over models, weighs every mode's trajectory alike."""
    pts = sorted(points, key=lambda p: p["t"])
    if not pts:
        return None
    t = np.array([p["t"] for p in pts])
    v = np.array([p["value"] for p in pts], np.float64)
    grid = np.arange(t[0], t[-1] + step / 2, step)
    held = v[np.searchsorted(t, grid, side="right") - 1]
    k = max(1, int(round(window / step)))
    csum = np.concatenate(([0.0], np.cumsum(held)))
    n = np.minimum(np.arange(1, len(grid) + 1), k)
    avg = (csum[1:] - csum[np.arange(1, len(grid) + 1) - n]) / n
    hit = np.flatnonzero(avg >= target)
    if not len(hit):
        return None
    i = hit[0]
    newest = pts[np.searchsorted(t, grid[i], side="right") - 1]
    return {"t": float(grid[i]), "value": float(avg[i]), "iteration": newest["iteration"]}


def reached_at(points, target, window):
    """The point at which `target` counts as reached: first touched (window 0) or held."""
    return (held_at_or_above(points, target, window) if window > 0
            else first_at_or_above(points, target))


def target_summary(job, target, window=0.0):
    """Time, worker iterations and applied updates when the job's model first reached target:
    first touched (window 0), or held on average over a trailing window (held_at_or_above)."""
    hit = reached_at(job["points"], target, window)
    touch = first_at_or_above(job["points"], target)
    best = max((p["value"] for p in job["points"]), default=None)
    out = {"target": target, "window_s": window, "reached": hit is not None, "best": best,
           "t": hit["t"] if hit else None, "iteration": hit["iteration"] if hit else None,
           "updates_applied": updates_applied_by(job, hit["t"]) if hit else None,
           "first_touch_t": touch["t"] if touch else None, "job_s": job["job_s"]}
    s = job["summary"]
    span = (job["server_commits"][-1][1] - job["server_commits"][0][1]
            if len(job["server_commits"]) > 1 else None)
    # how fast each mode moves the model: updates applied per second of the job
    out["applied_per_s"] = (s["applied"] / job["job_s"]) if job["job_s"] > 0 else None
    out["commit_span_s"] = span
    return out


def ring_ideal(emulation, workers, compute_s, payload_bytes, iterations):
    """RR-Sync's times on an infinitely fast CPU, under the job's emulated stragglers and NIC
    rates: [end of iteration 1, 2, ...] in job seconds. Iteration i takes the slowest worker's
    emulated compute, then the ring: 2(N-1) steps, each moving payload/N bytes over every link
    w -> w+1 at once, so a step lasts as long as the slowest link (the lower of w's egress and
    w+1's ingress rate, at the step's start). What the measured RR-Sync spends beyond this is
    the CPU's (8 to 32 processes on 2 cores): comparing mlfabric-A with this as well as with
    the measured run tells whether a direction depends on that overhead."""
    from mlfabric.emulate.presets import NicTrace
    ctrace = emulation.compute_trace(workers, compute_s)
    nic = NicTrace(emulation.network, 2 * workers, emulation.base_rate, emulation.period,
                   emulation.seed)
    piece = payload_bytes / workers
    slowest = {}   # rate period -> the ring's slowest link then

    def ring_rate(t):
        k = nic.period_index(t)
        if k not in slowest:
            rates = nic.period_rates(k)
            slowest[k] = min(min(rates[w], rates[workers + (w + 1) % workers])
                             for w in range(workers))
        return slowest[k]
    t, out = 0.0, []
    for i in range(iterations):
        t += max(ctrace.time(w, i) for w in range(workers))
        for _ in range(2 * (workers - 1)):
            t += piece / ring_rate(t)
        out.append(t)
    return out


def idle_barrier(comm, poll_s=0.005):
    """A barrier whose waiters sleep: Open MPI's blocking calls poll, and with 8 to 32
    processes on 2 cores the waiters would take the CPU from the one rank with work to do (rank
    0 evaluating models: 10x slower at 32 ranks)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def emulation(preset, seed, base_rate=BASE_RATE, period=5.0):
    """The paper's straggler preset 'C?-N?' as an Emulation; period: seconds between NIC rate
    changes (the paper's T = 5 s)."""
    from mlfabric.emulate import Emulation
    compute, network = preset.upper().split("-")
    return Emulation(compute, network, base_rate=base_rate, period=period, seed=seed)


def host(comm):
    from mlfabric.bench.report import host_info
    return host_info(comm)


def log(comm, text):
    if comm.rank == 0:
        print(text, file=sys.stderr, flush=True)


def begin(parse_args, argv):
    """The opening of every MPI paper script's main(): (comm, args, workers, host, t_start),
    workers being the worker ranks of the default roles (one scheduler, one server)."""
    from mpi4py import MPI

    from mlfabric.runtime.roles import Roles
    comm = MPI.COMM_WORLD
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if comm.rank == 0:   # (rank 0 writes the JSON)
        from mlfabric.bench.harness import git_state
        _GIT_AT_START[:] = [git_state()]
    return comm, args, len(Roles(comm.size).worker_ranks), host(comm), time.monotonic()


def plot_curves(ax, jobs, target, label_of, xkey="t"):
    """A metric-over-time (or over iterations) curve per job, the target as a line."""
    for job in jobs:
        pts = sorted(job["points"], key=lambda p: p[xkey])
        ax.plot([p[xkey] for p in pts], [p["value"] for p in pts], ".", ms=2, alpha=0.5,
                label=label_of(job))
    ax.axhline(target, color="k", lw=0.8, ls="--")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
