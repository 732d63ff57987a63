"""Pipeline-parallel training measured (issue 6): mlfabric.pipeline's executor on real MPI ranks,
against the thesis's formulas, its simulator, pure data parallelism and torch.distributed.pipelining.
One experiment per subcommand:

  bubbles    synthetic compute (each piece's forward sleeps t_f, its backward t_b): the measured
             bubble of GPipe, PipeDream-Flush and interleaved 1F1B against (p-1)/m, (p-1)/(vm)
             and simulate(); the steady-state idle of PipeDream 1F1B and 2BW; the peak stashed
             activations and weight versions the executor counted, against Table 7.1 and
             validate(); Gantt PNGs of one measured run and of its simulation
  partition  a conv body with a large fully connected head under an emulated slow link: profile
             (profile_layers), partition (§2.4.1) at the link's bandwidth, run the partitioner's
             configuration (PipeDream 1F1B; 1F1B-RR when it replicates a stage) and pure data
             parallelism (mlfabric.allreduce of the gradients); predicted and measured throughput
  torch      the same model, schedule (GPipe; 1F1B, which torch runs in PipeDream-Flush's order)
             and microbatches in mlfabric and in torch.distributed.pipelining on gloo: throughput
             ratio, for the synthetic model and for a real one
  overhead   (one rank) the executor against a plain PyTorch loop on the same real model and
             microbatches, no communication: the executor's own cost per step

    mpirun -n 4 python benchmarks/pipeline.py bubbles|partition|torch [options] --out FILE.json
    mpirun -n 1 python benchmarks/pipeline.py overhead [options] --out FILE.json

How things are measured, and why:
- Compute intervals are logged by the model pieces themselves (a forward that sleeps, a custom
  autograd Function whose backward sleeps), so the executor needs no hook and an interval is the
  work, not the wait for its input. A rank's log lines up with its action list (each F and B runs
  its piece once, in list order; the optimizer logs S). Timestamps are time.perf_counter
  (CLOCK_MONOTONIC, shared by the processes of one host; ranks on several hosts are aligned at a
  barrier). Rank 0 gathers them into a validate.Timeline, so the measured bubble is simulate()'s
  own bubble_fraction (§4.2.2: idle time within the makespan over compute time) and steady_idle,
  evaluated on measured instead of simulated times.
- The time from a pass's input being ready to the pass starting is split into "local" (the rank's
  previous pass ended last: the executor's own cost per action) and "remote" (the input from
  another rank came last: send, transfer, the receiver waking up). They are what a measured
  bubble has beyond the simulated one.
- Emulated slow link (partition): the sender sleeps bytes / B for every activation and input
  gradient it sends between stages, and a gradient allreduce of W bytes over r replicas sleeps
  2 (r - 1) / r x W / B (a ring) before the real allreduce: data parallelism and the pipeline's
  replicated stages alike. Sleeping on the sender does not overlap with compute, for either.

Rank 0 prints tables and writes the JSON: {"meta": {command, host, git state, parameters},
"runs": [...], "results": {..., "targets": {name: {target, value, met}}}} and, for bubbles, PNGs
beside it. Exit status 0 when the experiment ran (a missed target is reported, not an error), 2
for a bad command line; an exception on any rank aborts the whole job.
"""
import argparse
import datetime
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mlfabric._core import dtypes as _dtypes  # noqa: E402
from mlfabric.bench import harness  # noqa: E402
from mlfabric.bench.report import host_info  # noqa: E402
from mlfabric.bench.script import int_list  # noqa: E402
from mlfabric.comm import algorithms  # noqa: E402
from mlfabric.pipeline import schedules as sch  # noqa: E402
from mlfabric.pipeline.validate import Timeline, simulate  # noqa: E402

nn = torch.nn
now = time.perf_counter
MS = 1e3
SCHEDULES = ("gpipe", "flush", "interleaved", "1f1b", "2bw")


# --- instrumented compute ----------------------------------------------------------------------

class _SleepInBackward(torch.autograd.Function):
    """Identity forward; the backward sleeps `seconds` (a synthetic backward) and logs it."""

    @staticmethod
    def forward(ctx, x, seconds, log):
        ctx.seconds, ctx.log = seconds, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        t0 = now()
        time.sleep(ctx.seconds)
        ctx.log.append(("B", t0, now()))
        return grad, None, None


class SleepPiece(nn.Module):
    """A model piece of synthetic compute: forward sleeps t_f, backward t_b (seconds), each logged
    as (kind, start, end). Sleeping needs no core, so 4 ranks on 2 cores still compute in
    parallel. One scalar weight, so that every piece has a backward and an optimizer step."""

    def __init__(self, t_f, t_b, log):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.t_f, self.t_b, self.log = t_f, t_b, log

    def forward(self, x):
        t0 = now()
        time.sleep(self.t_f)
        self.log.append(("F", t0, now()))
        return _SleepInBackward.apply(x * self.scale, self.t_b, self.log)


class _PaceBackward(torch.autograd.Function):
    """Identity forward; the backward sleeps grad bytes / B: sending the input gradient back to
    the previous stage over the emulated link."""

    @staticmethod
    def forward(ctx, x, bandwidth):
        ctx.bandwidth = bandwidth
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(grad.numel() * grad.element_size() / ctx.bandwidth)
        return grad, None


class PaceSend(nn.Module):
    """Last layer of a stage that sends its output on: sleeps output bytes / B."""

    def __init__(self, bandwidth):
        super().__init__()
        self.bandwidth = bandwidth

    def forward(self, x):
        time.sleep(x.numel() * x.element_size() / self.bandwidth)
        return x


class PaceGradient(nn.Module):
    """First layer of a stage that receives its input: its backward paces the input gradient."""

    def __init__(self, bandwidth):
        super().__init__()
        self.bandwidth = bandwidth

    def forward(self, x):
        return _PaceBackward.apply(x, self.bandwidth) if x.requires_grad else x


class ClockedSGD:
    """Plain SGD (p -= lr * grad) that logs ("S", t, t) at each step (the schedule's S actions)
    and, given the communicator of a stage's replicas, first averages the gradients over them: a
    paced sleep of 2 (r-1)/r x bytes / B (the emulated ring), then the real allreduce
    (mlfabric's MPI algorithms on that communicator, as the executor's flush does). The
    executor now averages a replicated stage's gradients itself before every step (1F1B-RR
    too), so this allreduce re-averages equal gradients: it is kept because the time the
    replicas wait for each other is measured here (sync_s). Not a
    torch.optim.Optimizer: building one imports torch._dynamo, seconds per process, which the
    smoke tests cannot afford 4 times over on 2 cores; the executor needs step and zero_grad."""

    def __init__(self, params, log, lr=0.0, replicas=None, bandwidth=None):
        self.params = list(params)
        self.lr, self._log, self._replicas, self._bandwidth = lr, log, replicas, bandwidth
        self.paced_s = self.sync_s = 0.0  # paced sleep, real allreduce (waiting included)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        t = now()
        self._log.append(("S", t, t))
        if self._replicas is not None and self._replicas.Get_size() > 1:
            r = self._replicas.Get_size()
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in self.params])
            pace = 2.0 * (r - 1) / r * flat.numel() * flat.element_size() / self._bandwidth
            time.sleep(pace)
            self.paced_s += pace
            t0 = now()
            algorithms.allreduce(self._replicas, flat.numpy(), _dtypes.DTYPE_CODES["float32"],
                                 "sum")
            self.sync_s += now() - t0
            flat /= r
            off = 0
            for p in self.params:
                p.grad = flat[off:off + p.numel()].view_as(p).clone()
                off += p.numel()
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)


def conv_layers(channels, image, hidden, seed, classes=10):
    """The conv body + fully connected head model, as layers for the profiler and partitioner:
    weights mostly in the head (Linear(2c (image/4)^2, hidden) dominates), activations mostly in
    the body (c x image^2 per sample after the first conv)."""
    torch.manual_seed(seed)
    c = channels
    feat = 2 * c * (image // 4) ** 2
    return [nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Flatten(), nn.Linear(feat, hidden), nn.ReLU()),
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
            nn.Linear(hidden, classes)]


HEAD_FIRST = 4  # conv_layers: layers 0-3 are the conv body, 4.. the fully connected head


def conv_data(n, b, image, seed, classes=10):
    """n seeded microbatches of b images (3 x image x image) and their labels."""
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(b, 3, image, image, generator=g) for _ in range(n)]
    ys = [torch.randint(0, classes, (b,), generator=g) for _ in range(n)]
    return xs, ys


def nbytes(params):
    return sum(p.numel() * p.element_size() for p in params)


def mse(out, target):
    return ((out - target) ** 2).mean()


# --- timelines from logs -----------------------------------------------------------------------

def clock_offsets(comm):
    """Per rank, what to subtract from its perf_counter to get rank 0's: 0 on one host (one
    CLOCK_MONOTONIC); on several, the difference of readings taken right after a barrier."""
    hosts = comm.allgather(socket.gethostname())
    if len(set(hosts)) == 1:
        return 0.0
    comm.Barrier()
    t = now()
    t0 = comm.bcast(t if comm.rank == 0 else None, root=0)
    return t - t0


def measured_timeline(schedule, logs, t_f, t_b, stats):
    """A validate.Timeline (in ms, 0 at the first pass's start) from every rank's log of
    (kind, start s, end s), which must follow that rank's action list kind by kind."""
    zero = min(t0 for log in logs.values() for _, t0, _ in log)
    rows = {}
    for r, log in logs.items():
        acts = schedule.actions[r]
        if [a.kind for a in acts] != [k for k, _, _ in log]:
            raise RuntimeError("rank %d logged %d passes (%s...) for its %d actions (%s...): the "
                               "model pieces did not run once per action"
                               % (r, len(log), "".join(k for k, _, _ in log[:12]), len(acts),
                                  "".join(a.kind for a in acts[:12])))
        rows[r] = [(a, (t0 - zero) * MS, (t1 - zero) * MS) for a, (_, t0, t1) in zip(acts, log)]
    makespan = max(e for row in rows.values() for _, _, e in row)
    p = schedule.p
    return Timeline(schedule, rows, makespan, (t_f * MS,) * p, (t_b * MS,) * p, 0.0, stats)


def start_gaps(tl):
    """(local, remote) lists of ms from a pass's input being ready to its start (module doc)."""
    sched = tl.schedule
    last = sched.pieces - 1
    end = {}
    for r, row in tl.rows.items():
        for a, _, e in row:
            if a.kind != "S":
                end[(a.kind, sched.vstage(a), a.microbatch)] = (r, e)
    local, remote = [], []
    for r, row in tl.rows.items():
        prev = None
        for a, s, e in row:
            if a.kind == "S":
                continue
            q, k = sched.vstage(a), a.microbatch
            dep = None
            if a.kind == "F" and q > 0:
                dep = end[("F", q - 1, k)]
            elif a.kind == "B" and q < last:
                dep = end[("B", q + 1, k)]
            if dep is not None and dep[0] != r and (prev is None or dep[1] >= prev):
                remote.append(s - dep[1])
            elif prev is not None:
                local.append(s - prev)
            prev = e
    return local, remote


def summary(xs):
    """n, mean, median, p90, max of a sample (None for an empty one)."""
    return harness.stats(xs, with_min=False)


# --- bubbles (targets 1 and 2) -------------------------------------------------------------------

def bubble_configs(args, p):
    """(name, m, v, batches) per run: GPipe and Flush at every m, interleaved at every m that p
    divides, 1F1B over --steady inputs, 2BW with m = p over --steady microbatches."""
    out = []
    for name in args.schedules:
        if name in ("gpipe", "flush"):
            out += [(name, m, 1, 1) for m in args.m]
        elif name == "interleaved":
            out += [(name, m, args.chunks, 1) for m in args.m if m % p == 0]
        elif name == "1f1b":
            out.append((name, args.steady, 1, 1))
        else:
            out.append((name, p, 1, max(1, args.steady // p)))
    return out


def make_bubble_schedule(name, p, m, v, batches):
    if name == "gpipe":
        return sch.gpipe(p, m)
    if name == "flush":
        return sch.flush(p, m)
    if name == "interleaved":
        return sch.interleaved(p, m, v)
    if name == "1f1b":
        return sch.one_f_one_b(p, m)
    return sch.two_bw(p, m, batches)


def label(name, m, v, batches):
    if name == "interleaved":
        return "interleaved m=%d v=%d" % (m, v)
    if name == "2bw":
        return "2bw m=%d x %d batches" % (m, batches)
    if name == "1f1b":
        return "1f1b %d inputs" % m
    return "%s m=%d" % (name, m)


def thesis_memory(name, p, m, s):
    """Table 7.1 / the digest, stage s: (stashed activations, weight versions), as text."""
    return {"gpipe": (str(m), "1"), "flush": (str(min(p - s, m)), "1"),
            "interleaved": ("(validate)", "1"), "1f1b": (str(p - s), "<= %d" % p),
            "2bw": (str(p - s), "2")}[name]


def memory_ok(name, p, m, s, stash, versions, pred_stash, pred_versions):
    if (stash, versions) != (pred_stash, pred_versions):
        return False
    if name == "gpipe":
        return stash == m and versions == 1
    if name == "flush":
        return stash == min(p - s, m) and versions == 1
    if name == "interleaved":
        return versions == 1
    if name == "1f1b":
        return stash == p - s and versions <= p
    return stash == p - s and versions <= 2


def bubble_formula(name, p, m, v, batches):
    return (p - 1) / (v * m * (batches if name == "2bw" else 1))


def exp_bubbles(comm, args, runs):
    p = comm.size
    from mlfabric.pipeline.executor import PipelineExecutor
    t_f, t_b = args.t_f_ms / MS, args.t_b_ms / MS
    offset = clock_offsets(comm)
    configs = bubble_configs(args, p)
    executors = {}
    x = [torch.zeros(1, 4) for _ in range(max(args.steady, max(args.m)) * 2)]
    for rep in range(args.repeats):
        for cfg in configs:
            name, m, v, batches = cfg
            if cfg not in executors:
                sched = make_bubble_schedule(name, p, m, v, batches)
                log = []
                pieces = [SleepPiece(t_f / v, t_b / v, log) for _ in range(v)]
                params = [prm for pc in pieces for prm in pc.parameters()]
                ex = PipelineExecutor(sched, pieces, mse, ClockedSGD(params, log), comm)
                # warm-up run with 1 ms passes: the first run of an executor pays one-time costs
                # (autograd's and functional_call's first calls, allocations) that are no bubble
                for pc in pieces:
                    pc.t_f, pc.t_b = 1e-3 / v, 2e-3 / v
                ex.run(x[:sched.microbatches], x[:sched.microbatches])
                for pc in pieces:
                    pc.t_f, pc.t_b = t_f / v, t_b / v
                messages = []
                time_messages(ex, messages)
                executors[cfg] = (sched, ex, log, messages)
            sched, ex, log, messages = executors[cfg]
            n = sched.microbatches
            log.clear()
            messages.clear()
            comm.Barrier()
            t0 = now()
            ex.run(x[:n], x[:n])
            wall = now() - t0
            logs = comm.gather([(k, a - offset, b - offset) for k, a, b in log], root=0)
            msgs = comm.gather([m[:4] + tuple(t - offset for t in m[4:]) for m in messages],
                               root=0)
            peaks = comm.gather((ex.peak_stash, ex.peak_versions), root=0)
            if comm.rank == 0:
                runs.append(bubble_record(args, cfg, rep, sched, ex.stats, dict(enumerate(logs)),
                                          msgs, peaks, wall, t_f, t_b))
                if not args.quiet:
                    r = runs[-1]
                    print("[rep %d] %-24s bubble %.4f (sim %.4f) steady idle %s  %.2f s"
                          % (rep, r["label"], r["bubble"], r["sim_bubble"],
                             "-" if r["steady_idle"] is None else "%.4f" % r["steady_idle"],
                             wall), file=sys.stderr, flush=True)
    if comm.rank != 0:
        return None
    return bubble_results(args, p, configs, runs)


def time_messages(ex, log):
    """Log when this rank's executor posts each tensor and when each receive is asked for and
    done, by wrapping the instance's _send and _receive (the executor has no public hook for
    this; the wrappers change nothing else): ("send", kind, piece, microbatch, t) and
    ("send", kind, piece, microbatch, t_posted, t_called) and ("recv", kind, piece, microbatch,
    t_called, t_done)."""
    send, receive = ex._send, ex._receive

    def timed_send(kind, q, k, *rest):
        t0 = now()
        out = send(kind, q, k, *rest)
        log.append(("send", kind, q, k, now(), t0))
        return out

    def timed_receive(kind, q, k, *rest):
        t0 = now()
        out = receive(kind, q, k, *rest)
        log.append(("recv", kind, q, k, t0, now()))
        return out
    ex._send, ex._receive = timed_send, timed_receive


def hop_times(tl, msgs, zero):
    """Where the time of each message between ranks goes (ms): `tail` from the producing pass's
    compute end to the send being posted (autograd's rest, gradient accumulation, header);
    `delivery` from max(posted, receive asked for) to the receive done (transfer and the
    waiting rank noticing: its wait loop spins, yields, then naps up to 1 ms); `head` from the
    receive done to the consuming pass's compute start; `wait` the receive's whole wait;
    `send_call` the time inside the executor's _send."""
    sched = tl.schedule
    span = {}
    for row in tl.rows.values():
        for a, s, e in row:
            if a.kind != "S":
                span[(a.kind, sched.vstage(a), a.microbatch)] = (s, e)
    posted = {m[1:4]: m[4] for ms in msgs for m in ms if m[0] == "send"}
    out = {"tail": [], "delivery": [], "head": [], "wait": [], "send_call": [],
           "tail_F": [], "tail_B": []}
    for ms in msgs:
        for m in ms:
            if m[0] != "recv" or m[1:4] not in posted:
                continue  # a tensor a rank kept for itself
            kind, q, k = m[1:4]
            made = span[("F", q, k)] if kind == 0 else span[("B", q + 1, k)]
            used = span[("F", q + 1, k)] if kind == 0 else span[("B", q, k)]
            post, called, done = ((t - zero) * MS for t in (posted[m[1:4]], m[4], m[5]))
            out["tail"].append(post - made[1])
            out["tail_F" if kind == 0 else "tail_B"].append(post - made[1])
            out["delivery"].append(done - max(post, called))
            out["head"].append(used[0] - done)
            out["wait"].append(done - called)
    out["send_call"] = [(m[4] - m[5]) * MS for ms in msgs for m in ms if m[0] == "send"]
    return {k: summary(v) for k, v in out.items()}


def bubble_record(args, cfg, rep, sched, stats, logs, msgs, peaks, wall, t_f, t_b):
    name, m, v, batches = cfg
    tl = measured_timeline(sched, logs, t_f, t_b, stats)
    zero = min(t0 for log in logs.values() for _, t0, _ in log)
    sim = simulate(sched, t_f * MS, t_b * MS)
    local, remote = start_gaps(tl)
    busy = sum(tl.busy(r) for r in tl.rows)
    replay = replay_with_overheads(sched, tl, local, remote, busy)
    rec = {"label": label(*cfg), "schedule": name, "p": sched.p, "m": m, "v": v,
           "batches": batches, "microbatches": sched.microbatches, "repeat": rep,
           "wall_s": wall, "makespan_ms": tl.makespan, "compute_ms": busy,
           "nominal_compute_ms": sched.p * sched.microbatches * (t_f + t_b) * MS,
           "bubble": tl.bubble_fraction, "idle": tl.idle_fraction,
           "steady_idle": tl.steady_idle, "steady_window_ms": tl.steady_window,
           "sim_makespan_ms": sim.makespan, "sim_bubble": sim.bubble_fraction,
           "sim_steady_idle": sim.steady_idle, "formula_bubble": bubble_formula(*cfg_p(cfg, sched)),
           "gap_local_ms": summary(local), "gap_remote_ms": summary(remote),
           "replay": replay, "hops_ms": hop_times(tl, msgs, zero),
           "peak_stash": [pk[0] for pk in peaks], "peak_versions": [pk[1] for pk in peaks],
           "validate_peak_stash": [stats.rank_peak_stash[r] for r in range(sched.ranks)],
           "validate_peak_versions": [stats.rank_peak_versions[r] for r in range(sched.ranks)]}
    if rep == 0:
        rec["rows_ms"] = {r: [(a.label(sched.v > 1), round(s, 3), round(e, 3)) for a, s, e in row]
                          for r, row in tl.rows.items()}
        rec["_timeline"], rec["_sim"] = tl, sim
    return rec


def replay_with_overheads(sched, tl, local, remote, busy):
    """The simulator again, with what this run measured: each pass as long as its kind's mean
    measured compute plus the mean local gap (the executor's cost per action), and t_comm = the
    mean remote gap minus the local one (what a hop adds). If its bubble matches the measured
    one, those overheads are the whole story of the difference from the formula."""
    v = sched.v
    f = [e - s for row in tl.rows.values() for a, s, e in row if a.kind == "F"]
    b = [e - s for row in tl.rows.values() for a, s, e in row if a.kind == "B"]
    o_l = statistics.fmean(local) if local else 0.0
    o_r = statistics.fmean(remote) if remote else o_l
    sim = simulate(sched, v * (statistics.fmean(f) + o_l), v * (statistics.fmean(b) + o_l),
                   max(0.0, o_r - o_l))
    return {"t_f_ms": v * statistics.fmean(f), "t_b_ms": v * statistics.fmean(b),
            "local_ms": o_l, "hop_ms": max(0.0, o_r - o_l), "makespan_ms": sim.makespan,
            "bubble": (sched.ranks * sim.makespan - busy) / busy}


def cfg_p(cfg, sched):
    name, m, v, batches = cfg
    return name, sched.p, m, v, batches


def bubble_results(args, p, configs, runs):
    out = {"configs": [], "targets": {}}
    print("\nbubbles: p = %d ranks, synthetic compute t_f = %g ms, t_b = %g ms (sleep), %d "
          "repeats (medians); bubble = idle within the makespan / compute (thesis §4.2.2); "
          "replay = simulate() with the run's measured compute and gaps; local / remote = mean "
          "ms from a pass's input being ready to its start" % (p, args.t_f_ms, args.t_b_ms,
                                                               args.repeats))
    print("%-24s %8s %8s %8s %8s %8s %9s %9s %9s %9s" % (
        "schedule", "formula", "sim", "measured", "rel.err", "replay", "st.idle", "sim st.i",
        "local ms", "remote ms"))
    for cfg in configs:
        name, m, v, batches = cfg
        rs = [r for r in runs if r["label"] == label(*cfg)]
        med = statistics.median(r["bubble"] for r in rs)
        f = rs[0]["formula_bubble"]
        st = [r["steady_idle"] for r in rs if r["steady_idle"] is not None]
        st_med = statistics.median(st) if st else None
        loc = statistics.fmean(r["gap_local_ms"]["mean"] for r in rs if r["gap_local_ms"])
        rem = statistics.fmean(r["gap_remote_ms"]["mean"] for r in rs if r["gap_remote_ms"])
        row = {"label": label(*cfg), "schedule": name, "m": m, "v": v, "batches": batches,
               "formula_bubble": f, "sim_bubble": rs[0]["sim_bubble"], "bubble_median": med,
               "bubble_per_repeat": [r["bubble"] for r in rs], "relative_error": (med - f) / f,
               "steady_idle_median": st_med,
               "steady_idle_per_repeat": [r["steady_idle"] for r in rs],
               "sim_steady_idle": rs[0]["sim_steady_idle"],
               "makespan_ms_median": statistics.median(r["makespan_ms"] for r in rs),
               "sim_makespan_ms": rs[0]["sim_makespan_ms"],
               "gap_local_ms_mean": loc, "gap_remote_ms_mean": rem,
               "replay_bubble_median": statistics.median(r["replay"]["bubble"] for r in rs)}
        out["configs"].append(row)
        print("%-24s %8.4f %8.4f %8.4f %+7.1f%% %8.4f %9s %9s %9.2f %9.2f" % (
            row["label"], f, row["sim_bubble"], med, 100 * row["relative_error"],
            row["replay_bubble_median"],
            "-" if st_med is None else "%.4f" % st_med,
            "-" if row["sim_steady_idle"] is None else "%.4f" % row["sim_steady_idle"], loc, rem))
        if name in ("gpipe", "flush", "interleaved"):
            out["targets"]["bubble %s" % row["label"]] = {
                "target": "measured bubble within 10%% (relative) of %s = %.4f"
                          % ("(p-1)/(vm)" if name == "interleaved" else "(p-1)/m", f),
                "value": med, "relative_error": row["relative_error"],
                "met": abs(row["relative_error"]) <= 0.10}
        else:
            out["targets"]["steady idle %s" % row["label"]] = {
                "target": "steady-state idle < 5%", "value": st_med,
                "met": st_med is not None and st_med < 0.05}

    print("\nwhere a message between ranks spends its time (ms; mean over messages, median over "
          "repeats): tail = producing pass's end -> send posted, delivery = posted (or receive "
          "asked, if later) -> received, head = received -> consuming pass's start")
    print("%-24s %9s %9s %9s %9s %9s %9s" % ("schedule", "tail", "delivery", "head",
                                             "deliv.p90", "deliv.max", "msgs"))
    for cfg, row in zip(configs, out["configs"]):
        rs = [r for r in runs if r["label"] == label(*cfg)]
        hop = {k: statistics.median(r["hops_ms"][k]["mean"] for r in rs)
               for k in ("tail", "delivery", "head")}
        hop["delivery_p90"] = statistics.median(r["hops_ms"]["delivery"]["p90"] for r in rs)
        hop["delivery_max"] = max(r["hops_ms"]["delivery"]["max"] for r in rs)
        row["hops_ms"] = hop
        print("%-24s %9.3f %9.3f %9.3f %9.3f %9.3f %9d" % (
            row["label"], hop["tail"], hop["delivery"], hop["head"], hop["delivery_p90"],
            hop["delivery_max"], rs[0]["hops_ms"]["delivery"]["n"]))

    print("\npeak stashed activations / weight versions per stage, measured by the executor "
          "(validate's count; Table 7.1)")
    print("%-24s %-6s %10s %10s %14s %10s %10s %14s %5s" % (
        "schedule", "stage", "stash", "validate", "Table 7.1", "versions", "validate",
        "Table 7.1", "ok"))
    mem = []
    for cfg in configs:
        name, m, v, batches = cfg
        r = next(x for x in runs if x["label"] == label(*cfg))
        ok_all = True
        for s in range(p):
            th = thesis_memory(name, p, m, s)
            ok = memory_ok(name, p, m, s, r["peak_stash"][s], r["peak_versions"][s],
                           r["validate_peak_stash"][s], r["validate_peak_versions"][s])
            ok_all &= ok
            mem.append({"label": r["label"], "stage": s, "stash": r["peak_stash"][s],
                        "validate_stash": r["validate_peak_stash"][s], "thesis_stash": th[0],
                        "versions": r["peak_versions"][s],
                        "validate_versions": r["validate_peak_versions"][s],
                        "thesis_versions": th[1], "ok": ok})
            print("%-24s %-6d %10d %10d %14s %10d %10d %14s %5s" % (
                r["label"] if s == 0 else "", s, r["peak_stash"][s], r["validate_peak_stash"][s],
                th[0], r["peak_versions"][s], r["validate_peak_versions"][s], th[1],
                "yes" if ok else "NO"))
        out["targets"]["memory %s" % r["label"]] = {
            "target": "peak stash and weight versions per stage = validate's and Table 7.1's",
            "value": {"stash": r["peak_stash"], "versions": r["peak_versions"]}, "met": ok_all}
    out["memory"] = mem
    return out


def write_gantts(args, runs, base):
    """PNG Gantt charts (measured and simulated) and the text chart of the --gantt run."""
    from mlfabric.pipeline.timeline import gantt, plot
    if args.gantt == "none":
        return []
    name, _, rest = args.gantt.partition("/")
    want = [r for r in runs if r["schedule"] == name and "_timeline" in r
            and (not rest or r["m"] == int(rest))]
    if not want:
        print("(no run matches --gantt %s: no chart)" % args.gantt)
        return []
    r = want[0]
    tag = r["label"].replace(" ", "-").replace("=", "").replace("x-", "x")
    paths = []
    for kind, tl in (("measured", r["_timeline"]), ("simulated", r["_sim"])):
        path = "%s-gantt-%s-%s.png" % (base, tag, kind)
        plot(tl, path)
        paths.append(path)
    print("\nmeasured run of %s (times in ms; one column = %g ms):" % (r["label"], args.t_f_ms))
    print(gantt(r["_timeline"], unit=args.t_f_ms / r["v"]))
    print("plots: %s" % ", ".join(paths))
    return paths


# --- partition (target 3) ------------------------------------------------------------------------

def paced_pieces(pieces, bandwidth):
    """Each piece wrapped with the emulated link: pace the input gradient it sends back (all but
    the first) and the activation it sends on (all but the last)."""
    out = []
    for q, piece in enumerate(pieces):
        mods = ([PaceGradient(bandwidth)] if q > 0 else []) + [piece] + \
            ([PaceSend(bandwidth)] if q + 1 < len(pieces) else [])
        out.append(nn.Sequential(*mods))
    return out


def profile_on_rank0(comm, layers, sample, repeats):
    """profile_layers on rank 0 while the other ranks wait without spinning (an MPI barrier
    would busy-poll and take cores from the profile), broadcast. The profile is one process's:
    on a host with fewer cores than ranks the runs compute slower than it says."""
    from mlfabric.pipeline.profile import profile_layers
    profiles = profile_layers(layers, sample, repeats=repeats, warmup=1) if comm.rank == 0 \
        else None
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)
    return comm.bcast(profiles, root=0)


def paced_model_time(profiles, stages, bandwidth):
    """Seconds per input of a configuration as the emulation runs it (no overlap of compute and
    the paced link): per stage, (compute + activation out + gradient back + the replicas' ring
    allreduce) / replicas; the slowest stage sets the pace."""
    worst = 0.0
    for i, st in enumerate(stages):
        comp = sum(pr.time_s for pr in profiles[st.first_layer:st.last_layer + 1])
        w = sum(pr.weight_bytes for pr in profiles[st.first_layer:st.last_layer + 1])
        send = profiles[st.last_layer].activation_bytes / bandwidth if i + 1 < len(stages) else 0
        back = profiles[st.first_layer - 1].activation_bytes / bandwidth if i > 0 else 0
        r = st.replicas
        sync = 2.0 * (r - 1) / r * w / bandwidth if r > 1 else 0.0
        worst = max(worst, (comp + send + back + sync) / r)
    return worst


def run_pipeline(comm, args, part, data):
    """One warm-up and --rounds timed runs of the partitioner's configuration: PipeDream 1F1B
    (1F1B-RR with the partition's replicas) over --inputs microbatches. Yields per round
    (seconds, completion times at the last stage)."""
    from mlfabric.pipeline.executor import PipelineExecutor
    from mlfabric.pipeline.stage import split_layers, stage_modules
    reps = tuple(st.replicas for st in part.stages)
    sched = sch.one_f_one_b(len(reps), args.inputs, replicas=reps)
    pieces = split_layers(conv_layers(args.channels, args.image, args.hidden, args.seed),
                          len(reps), partition=part)
    mine = stage_modules(paced_pieces(pieces, args.bandwidth), sched, comm.rank)
    pl = sched.placement[comm.rank]
    replicas = comm.Split(pl.stage, pl.replica)
    log = []
    params = [prm for m in mine for prm in m.parameters()]
    opt = ClockedSGD(params, log, lr=args.lr, replicas=replicas, bandwidth=args.bandwidth)
    ex = PipelineExecutor(sched, mine, nn.CrossEntropyLoss(), opt, comm)
    xs, ys = data
    last = pl.stage == len(reps) - 1

    def once():
        log.clear()
        opt.paced_s = opt.sync_s = 0.0
        comm.Barrier()
        t0 = now()
        ex.run(xs, ys)
        comm.Barrier()
        t = now() - t0
        done = comm.gather([b - t0 for k, b, _ in log if k == "S"] if last else [], root=0)
        sync = comm.gather({"stage": pl.stage, "replica": pl.replica, "paced_s": opt.paced_s,
                            "allreduce_s": opt.sync_s}, root=0)
        return t, sorted(x for d in (done or []) for x in d), sync

    once()  # warm-up: first-touch allocations, the allreduce engine's setup
    return sched, once, replicas


def steady_rate(done, per_item):
    """Items per second between the first and last quarter of completion times (fill and drain
    left out)."""
    n = len(done)
    if n < 4:
        return None
    i0, i1 = n // 4, n - 1 - n // 4
    return (i1 - i0) * per_item / (done[i1] - done[i0]) if done[i1] > done[i0] else None


def run_data_parallel(comm, args, data):
    """Pure data parallelism: the whole model on every rank, one microbatch per rank per
    iteration, gradients averaged by mlfabric.allreduce after the paced sleep of the ring
    (2 (d-1)/d x bytes / B). Returns a function timing --iterations iterations."""
    import mlfabric
    mlfabric.init(comm)
    model = nn.Sequential(*conv_layers(args.channels, args.image, args.hidden, args.seed))
    params = list(model.parameters())
    opt = ClockedSGD(params, [], lr=args.lr)  # the pipeline's SGD, without replicas
    loss_fn = nn.CrossEntropyLoss()
    d = comm.size
    wbytes = nbytes(params)
    pace = 2.0 * (d - 1) / d * wbytes / args.bandwidth
    xs, ys = data
    state = {"it": 0}

    def iteration():
        i = (state["it"] * d + comm.rank) % len(xs)
        state["it"] += 1
        t0 = now()
        loss = loss_fn(model(xs[i]), ys[i])
        opt.zero_grad()
        loss.backward()
        t1 = now()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        time.sleep(pace)
        arr = flat.numpy()
        mlfabric.allreduce(arr, out=arr)
        flat /= d
        off = 0
        for p in params:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        opt.step()
        return t1 - t0, now() - t1

    def timed():
        comm.Barrier()
        t0 = now()
        split = [iteration() for _ in range(args.iterations)]
        comm.Barrier()
        return now() - t0, split

    for _ in range(args.warmup):
        iteration()
    return timed, wbytes, pace


def exp_partition(comm, args, runs):
    from mlfabric.pipeline.partition import Stage, Topology, partition, pipeline_time
    torch.set_num_threads(args.threads)
    d, b = comm.size, args.microbatch
    layers = conv_layers(args.channels, args.image, args.hidden, args.seed)
    sample = conv_data(1, b, args.image, args.seed + 7)[0][0]
    profiles = profile_on_rank0(comm, layers, sample, args.profile_repeats)
    topo = Topology([(d, args.bandwidth)])
    part = comm.bcast(partition(profiles, topo) if comm.rank == 0 else None, root=0)
    n_layers = len(profiles)
    dp_stages = [Stage(0, n_layers - 1, d)]
    pred = {"pipeline": {"partitioner_model_s_per_input": part.predicted_time_per_sample,
                         "paced_model_s_per_input": paced_model_time(profiles, part.stages,
                                                                     args.bandwidth)},
            "data parallel": {"partitioner_model_s_per_input": pipeline_time(profiles, dp_stages,
                                                                             args.bandwidth),
                              "paced_model_s_per_input": paced_model_time(profiles, dp_stages,
                                                                          args.bandwidth)}}
    for v in pred.values():
        v["partitioner_model_samples_s"] = b / v["partitioner_model_s_per_input"]
        v["paced_model_samples_s"] = b / v["paced_model_s_per_input"]

    data = conv_data(args.inputs, b, args.image, args.seed)
    sched, pipe_once, _ = run_pipeline(comm, args, part, data)
    dp_timed, wbytes, dp_pace = run_data_parallel(comm, args, data)
    for rnd in range(args.rounds):
        order = ("data parallel", "pipeline") if rnd % 2 == 0 else ("pipeline", "data parallel")
        for what in order:
            if what == "pipeline":
                wall, done, sync = pipe_once()
                rec = {"config": what, "round": rnd, "wall_s": wall, "inputs": args.inputs,
                       "samples_s": args.inputs * b / wall,
                       "steady_samples_s": steady_rate(done, b) if comm.rank == 0 else None,
                       "completions_s": done, "replica_sync": sync}
            else:
                wall, split = dp_timed()
                splits = comm.gather(split, root=0)
                rec = {"config": what, "round": rnd, "wall_s": wall,
                       "iterations": args.iterations,
                       "samples_s": args.iterations * d * b / wall}
                if comm.rank == 0:
                    comp = [c for s in splits for c, _ in s]
                    comm_t = [c for s in splits for _, c in s]
                    rec.update(compute_s=summary(comp), allreduce_s=summary(comm_t),
                               steady_samples_s=d * b / statistics.median(
                                   [sum(x) for s in splits for x in s]))
            if comm.rank == 0:
                runs.append(rec)
                if not args.quiet:
                    print("[round %d] %-13s %8.1f samples/s (steady %s)  %.2f s"
                          % (rnd, what, rec["samples_s"],
                             "-" if rec.get("steady_samples_s") is None
                             else "%.1f" % rec["steady_samples_s"], wall),
                          file=sys.stderr, flush=True)
    if comm.rank != 0:
        return None
    return partition_results(args, profiles, part, pred, runs, wbytes, dp_pace, sched)


def partition_results(args, profiles, part, pred, runs, wbytes, dp_pace, sched):
    b, d = args.microbatch, sum(st.replicas for st in part.stages)
    print("\npartition: conv body + FC head, %d ranks, microbatch %d images %dx%d, emulated link "
          "B = %.3g bytes/s" % (d, b, args.image, args.image, args.bandwidth))
    print("profile (profile_layers on rank 0 alone, %d thread(s)):" % args.threads)
    print("  %-26s %10s %14s %14s" % ("layer", "T_l (ms)", "a_l (bytes)", "w_l (bytes)"))
    for pr in profiles:
        print("  %-26s %10.2f %14d %14d" % (pr.name, pr.time_s * MS, pr.activation_bytes,
                                             pr.weight_bytes))
    stages = [(st.first_layer, st.last_layer, st.replicas) for st in part.stages]
    print("partitioner: stages (first, last layer, replicas) %s, NOAM %d; schedule %s"
          % (stages, part.noam, sched.header()))
    print("data parallelism: %d bytes of weights (%.0f%% in the fully connected head); ring "
          "allreduce paced 2(d-1)/d x W / B = %.3f s per iteration"
          % (wbytes, 100 * sum(pr.weight_bytes for pr in profiles[HEAD_FIRST:]) / wbytes, dp_pace))
    res = {"bandwidth": args.bandwidth, "weight_bytes": wbytes,
           "head_weight_bytes": sum(pr.weight_bytes for pr in profiles[HEAD_FIRST:]),
           "dp_allreduce_paced_s": dp_pace,
           "profiles": [{"name": pr.name, "time_s": pr.time_s,
                         "activation_bytes": pr.activation_bytes,
                         "weight_bytes": pr.weight_bytes} for pr in profiles],
           "partition": {"stages": stages, "noam": part.noam,
                         "predicted_time_per_input_s": part.predicted_time_per_sample},
           "schedule": sched.header(), "predicted": pred, "measured": {}}
    print("\n%-14s %14s %14s %14s %14s" % ("config", "pred (model)", "pred (paced)",
                                           "measured", "meas. steady"))
    for what in ("pipeline", "data parallel"):
        rs = [r for r in runs if r["config"] == what]
        med = statistics.median(r["samples_s"] for r in rs)
        st = [r["steady_samples_s"] for r in rs if r.get("steady_samples_s")]
        res["measured"][what] = {"samples_s_median": med,
                                 "samples_s_per_round": [r["samples_s"] for r in rs],
                                 "steady_samples_s_median": statistics.median(st) if st else None}
        p = pred[what]
        print("%-14s %14.1f %14.1f %14.1f %14s   samples/s (per round: %s)" % (
            what, p["partitioner_model_samples_s"], p["paced_model_samples_s"], med,
            "%.1f" % statistics.median(st) if st else "-",
            " ".join("%.1f" % r["samples_s"] for r in rs)))
    # the replicas of a stage average gradients at every step: time in that allreduce is mostly
    # waiting for the replica whose backward comes last (the next stage runs them in order)
    sync = [s for r in runs if r["config"] == "pipeline" for s in r["replica_sync"]
            if stages[s["stage"]][2] > 1]
    if sync:
        walls = {r["round"]: r["wall_s"] for r in runs if r["config"] == "pipeline"}
        n_rounds = len(walls)
        res["replica_sync_fraction"] = {
            "allreduce": sum(s["allreduce_s"] for s in sync) / (len(sync) / n_rounds)
            / sum(walls.values()),
            "paced": sum(s["paced_s"] for s in sync) / (len(sync) / n_rounds)
            / sum(walls.values())}
        print("replicated stages: %.0f%% of the run in the gradient allreduce among replicas "
              "(mostly waiting for each other), %.0f%% in its paced sleep"
              % (100 * res["replica_sync_fraction"]["allreduce"],
                 100 * res["replica_sync_fraction"]["paced"]))
    m = res["measured"]
    ratio = m["pipeline"]["samples_s_median"] / m["data parallel"]["samples_s_median"]
    res["ratio_measured"] = ratio
    res["ratio_predicted_model"] = (pred["pipeline"]["partitioner_model_samples_s"]
                                    / pred["data parallel"]["partitioner_model_samples_s"])
    res["ratio_predicted_paced"] = (pred["pipeline"]["paced_model_samples_s"]
                                    / pred["data parallel"]["paced_model_samples_s"])
    print("pipeline / data parallel: measured %.2fx, predicted %.2fx (partitioner's model), "
          "%.2fx (paced model)" % (ratio, res["ratio_predicted_model"],
                                   res["ratio_predicted_paced"]))
    pure_dp = len(stages) == 1
    res["targets"] = {"partitioner beats data parallelism": {
        "target": "the partitioner's configuration has higher measured throughput than pure "
                  "data parallelism under the emulated link",
        "value": ratio, "met": ratio > 1.0 and not pure_dp}}
    return res


# --- torch.distributed.pipelining (target 4) -----------------------------------------------------

def balanced_boundaries(times, p):
    """First layer of pieces 1..p-1 of the contiguous split of `times` minimising the largest
    piece sum (ties to the earliest cut): the 2BW planner's balanced split."""
    from mlfabric.pipeline.partition import _balanced_split
    return [first for first, _ in _balanced_split(list(times), p)[1:]]


def init_gloo(comm):
    import torch.distributed as dist
    hosts = comm.allgather(socket.gethostname())
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size,
                            timeout=datetime.timedelta(seconds=120))
    return dist


def exp_torch(comm, args, runs):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from mlfabric.pipeline.executor import PipelineExecutor
    from mlfabric.pipeline.stage import split_layers
    torch.set_num_threads(args.threads)
    dist = init_gloo(comm)
    p, m, b, rank = comm.size, args.m, args.microbatch, comm.rank
    models = {}
    if "synthetic" in args.models:
        g = torch.Generator().manual_seed(args.seed)
        batch = (torch.randn(m * b, 16, generator=g), torch.randn(m * b, 16, generator=g))

        def synthetic():
            return SleepPiece(args.t_f_ms / MS, args.t_b_ms / MS, [])
        models["synthetic"] = (synthetic, mse, batch, None)
    if "real" in args.models:
        layers = conv_layers(args.channels, args.image, args.hidden, args.seed)
        sample = conv_data(1, b, args.image, args.seed + 7)[0][0]
        profiles = profile_on_rank0(comm, layers, sample, 3)
        bounds = balanced_boundaries([pr.time_s for pr in profiles], p)
        xs, ys = conv_data(m, b, args.image, args.seed)
        batch = (torch.cat(xs), torch.cat(ys))

        def real():
            return split_layers(conv_layers(args.channels, args.image, args.hidden, args.seed),
                                p, boundaries=bounds)[rank]
        models["real"] = (real, nn.CrossEntropyLoss(), batch, bounds)

    results = {"targets": {}, "cases": []}
    for mname, (build, loss_fn, (x, y), bounds) in models.items():
        xs, ys = list(torch.tensor_split(x, m)), list(torch.tensor_split(y, m))
        for sname in args.schedules:
            # mlfabric
            piece_a = build()
            opt_a = torch.optim.SGD(piece_a.parameters(), lr=args.lr)
            sched = (sch.gpipe if sname == "gpipe" else sch.flush)(p, m)
            ex = PipelineExecutor(sched, [piece_a], loss_fn, opt_a, comm)
            # torch
            piece_b = build()
            opt_b = torch.optim.SGD(piece_b.parameters(), lr=args.lr)
            stage = PipelineStage(piece_b, rank, p, torch.device("cpu"))
            tsched = (ScheduleGPipe if sname == "gpipe" else Schedule1F1B)(stage, m,
                                                                            loss_fn=loss_fn)

            def step_mlfabric():
                losses = ex.run(xs, ys)
                return statistics.fmean(losses.values()) if losses else None

            def step_torch():
                losses = []
                if rank == 0:
                    tsched.step(x)
                elif rank == p - 1:
                    tsched.step(target=y, losses=losses)
                else:
                    tsched.step()
                opt_b.step()
                opt_b.zero_grad()
                return statistics.fmean(float(v.detach()) for v in losses) if losses else None

            steps = {"mlfabric": step_mlfabric, "torch": step_torch}
            # same model check: one step each from the same weights on the same microbatches
            w0 = [prm.detach().clone() for prm in piece_a.parameters()]
            first = {k: f() for k, f in steps.items()}
            diff = max((float((pa - pb).detach().abs().max()) for pa, pb in
                        zip(piece_a.parameters(), piece_b.parameters())), default=0.0)
            moved = max((float((pa.detach() - w).abs().max()) for pa, w in
                         zip(piece_a.parameters(), w0)), default=0.0)
            diff = comm.allreduce(diff, op=MPI.MAX)
            moved = comm.allreduce(moved, op=MPI.MAX)
            loss_a = comm.bcast(first["mlfabric"] if rank == p - 1 else None, root=p - 1)
            loss_b = comm.bcast(first["torch"] if rank == p - 1 else None, root=p - 1)
            per = {"mlfabric": [], "torch": []}
            for rnd in range(args.rounds):
                order = ("mlfabric", "torch") if rnd % 2 == 0 else ("torch", "mlfabric")
                for fw in order:
                    comm.Barrier()
                    t0 = now()
                    for _ in range(args.steps):
                        steps[fw]()
                    comm.Barrier()
                    per[fw].append(args.steps * m * b / (now() - t0))
            if rank == 0:
                case = {"model": mname, "schedule": sname, "torch_schedule":
                        "ScheduleGPipe" if sname == "gpipe" else "Schedule1F1B",
                        "mlfabric_schedule": sched.name, "p": p, "m": m, "microbatch": b,
                        "boundaries": bounds, "first_step_loss": {"mlfabric": loss_a,
                                                                  "torch": loss_b},
                        "max_abs_weight_diff_after_first_step": diff,
                        "max_abs_weight_change_first_step": moved,
                        "samples_s_per_round": per,
                        "samples_s_median": {k: statistics.median(v) for k, v in per.items()}}
                ratios = [a / t for a, t in zip(per["mlfabric"], per["torch"])]
                case["ratio_per_round"] = ratios
                case["ratio_median"] = statistics.median(ratios)
                if mname == "synthetic":
                    ideal = (m + p - 1) * (args.t_f_ms + args.t_b_ms) / MS
                    case["ideal_samples_s"] = m * b / ideal
                    case["efficiency"] = {k: v / case["ideal_samples_s"]
                                          for k, v in case["samples_s_median"].items()}
                results["cases"].append(case)
                runs.append(case)
                if not args.quiet:
                    print("%-9s %-6s mlfabric %.2f torch %.2f samples/s: %.2fx (after one "
                          "step the weights moved by %.2g and differ by %.2g)"
                          % (mname, sname, case["samples_s_median"]["mlfabric"],
                             case["samples_s_median"]["torch"], case["ratio_median"], moved,
                             diff),
                          file=sys.stderr, flush=True)
    comm.Barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    print("\ntorch: mlfabric.pipeline vs torch.distributed.pipelining (gloo), %d ranks, m = %d "
          "microbatches of %d, %d steps x %d alternating rounds, %d thread(s) per rank"
          % (p, m, b, args.steps, args.rounds, args.threads))
    print("%-10s %-7s %14s %14s %8s %20s %14s" % ("model", "sched", "mlfabric s/s", "torch s/s",
                                                 "ratio", "per round", "weight diff"))
    for c in results["cases"]:
        print("%-10s %-7s %14.2f %14.2f %7.2fx %20s %14.2g" % (
            c["model"], c["schedule"], c["samples_s_median"]["mlfabric"],
            c["samples_s_median"]["torch"], c["ratio_median"],
            " ".join("%.2f" % r for r in c["ratio_per_round"]),
            c["max_abs_weight_diff_after_first_step"]))
        if "efficiency" in c:
            print("%-18s ideal %.2f samples/s ((m+p-1)(t_f+t_b) per step): mlfabric %.1f%%, "
                  "torch %.1f%% of it" % ("", c["ideal_samples_s"],
                                          100 * c["efficiency"]["mlfabric"],
                                          100 * c["efficiency"]["torch"]))
        results["targets"]["%s %s" % (c["model"], c["schedule"])] = {
            "target": "throughput ratio mlfabric / torch.distributed.pipelining, same model, "
                      "schedule and microbatches (reported)",
            "value": c["ratio_median"], "met": None}
    return results


def exp_overhead(comm, args, runs):
    """The executor's own cost, without communication: PipelineExecutor(flush(1, m)) on one
    rank against a plain PyTorch loop (forward, loss / m, backward per microbatch, then the
    step), alternating, the torch subcommand's real model and microbatches. (One rank: the
    executor reads MPI_TAG_UB from its communicator, which only COMM_WORLD and its duplicates
    carry, so it cannot run on a 1-rank sub-communicator of a larger job.)"""
    from mlfabric.pipeline.executor import PipelineExecutor
    torch.set_num_threads(args.threads)
    m, b = args.m, args.microbatch
    xs, ys = conv_data(m, b, args.image, args.seed)
    loss_fn = nn.CrossEntropyLoss()
    model_a = nn.Sequential(*conv_layers(args.channels, args.image, args.hidden, args.seed))
    opt_a = torch.optim.SGD(model_a.parameters(), lr=args.lr)
    ex = PipelineExecutor(sch.flush(1, m), [model_a], loss_fn, opt_a, comm)
    model_b = nn.Sequential(*conv_layers(args.channels, args.image, args.hidden, args.seed))
    opt_b = torch.optim.SGD(model_b.parameters(), lr=args.lr)

    def plain():
        for xb, yb in zip(xs, ys):
            (loss_fn(model_b(xb), yb) / m).backward()
        opt_b.step()
        opt_b.zero_grad()

    fns = {"mlfabric_ms": lambda: ex.run(xs, ys), "plain_ms": plain}
    times = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for r in range(args.steps):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = now()
            fns[k]()
            times[k].append((now() - t0) * MS)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["per_step_ms"] = times
    out["ratio"] = out["plain_ms"] / out["mlfabric_ms"]
    runs.append(dict(out))
    print("\noverhead: one process, no communication, conv model, m = %d microbatches of %d: the "
          "executor (flush, p = 1) %.1f ms per step, a plain PyTorch loop %.1f ms: speed ratio "
          "%.3f (%d alternating steps each)" % (m, b, out["mlfabric_ms"], out["plain_ms"],
                                                out["ratio"], len(times["plain_ms"])))
    out["targets"] = {"executor vs plain loop": {
        "target": "speed of the executor relative to a plain loop on one process (reported)",
        "value": out["ratio"], "met": None}}
    return out


# --- driver -------------------------------------------------------------------------------------

def name_list(known):
    def parse(text):
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in known]
        if bad or not out:
            raise argparse.ArgumentTypeError("choose among %s, got %r" % (", ".join(known), text))
        return out
    return parse


def options(p):
    sub = p.add_subparsers(dest="experiment", required=True)
    common = argparse.ArgumentParser(add_help=False)
    harness.add_out(common, "write the JSON here (bubbles: and the Gantt PNGs beside it)",
                    metavar="FILE.json")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--quiet", "-q", action="store_true", help="no progress lines")

    b = sub.add_parser("bubbles", parents=[common], help="targets 1 and 2 (synthetic compute)")
    b.add_argument("--t-f-ms", type=float, default=20.0, help="forward per microbatch per stage")
    b.add_argument("--t-b-ms", type=float, default=None, help="backward (default 2 t_f)")
    b.add_argument("--m", type=int_list, default=[4, 8, 16], help="microbatches per batch")
    b.add_argument("--chunks", type=int, default=2, help="v of the interleaved schedule")
    b.add_argument("--steady", type=int, default=24,
                   help="microbatches of the 1F1B and 2BW runs (2BW: m = p, batches = this / p)")
    b.add_argument("--schedules", type=name_list(SCHEDULES), default=list(SCHEDULES))
    b.add_argument("--repeats", type=int, default=3, help="runs of each schedule (round robin)")
    b.add_argument("--gantt", default="flush/8",
                   help="NAME[/M]: the run drawn as a Gantt chart ('none': no chart)")

    q = sub.add_parser("partition", parents=[common], help="target 3 (partitioner vs DP)")
    q.add_argument("--bandwidth", type=float, default=50e6, help="emulated link, bytes/s")
    q.add_argument("--microbatch", type=int, default=16, help="images per microbatch (b)")
    q.add_argument("--image", type=int, default=32, help="image side (a multiple of 4)")
    q.add_argument("--channels", type=int, default=32, help="channels of the first convs")
    q.add_argument("--hidden", type=int, default=1024, help="width of the FC head")
    q.add_argument("--inputs", type=int, default=24, help="microbatches per pipeline run")
    q.add_argument("--iterations", type=int, default=6, help="data-parallel iterations per run")
    harness.add_warmup(q, 1, "untimed data-parallel iterations", type=int)
    q.add_argument("--rounds", type=int, default=2, help="alternating rounds of both configs")
    q.add_argument("--profile-repeats", type=int, default=5)
    q.add_argument("--lr", type=float, default=0.01)
    q.add_argument("--threads", type=int, default=1, help="torch threads per rank")

    t = sub.add_parser("torch", parents=[common], help="target 4 (torch.distributed.pipelining)")
    t.add_argument("--m", type=int, default=8, help="microbatches per step")
    t.add_argument("--microbatch", type=int, default=8, help="samples per microbatch")
    t.add_argument("--t-f-ms", type=float, default=20.0, help="synthetic model: forward")
    t.add_argument("--t-b-ms", type=float, default=None, help="synthetic model: backward (2 t_f)")
    t.add_argument("--models", type=name_list(("synthetic", "real")),
                   default=["synthetic", "real"])
    t.add_argument("--schedules", type=name_list(("gpipe", "1f1b")), default=["gpipe", "1f1b"])
    t.add_argument("--steps", type=int, default=3, help="timed steps per framework per round")
    t.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    t.add_argument("--image", type=int, default=32)
    t.add_argument("--channels", type=int, default=32)
    t.add_argument("--hidden", type=int, default=1024)
    t.add_argument("--lr", type=float, default=0.01)
    t.add_argument("--threads", type=int, default=1, help="torch threads per rank")

    o = sub.add_parser("overhead", parents=[common],
                       help="the executor vs a plain PyTorch loop on one rank (mpirun -n 1)")
    o.add_argument("--m", type=int, default=8, help="microbatches per step")
    o.add_argument("--microbatch", type=int, default=8, help="samples per microbatch")
    o.add_argument("--steps", type=int, default=10, help="timed steps of each (alternating)")
    o.add_argument("--image", type=int, default=32)
    o.add_argument("--channels", type=int, default=32)
    o.add_argument("--hidden", type=int, default=1024)
    o.add_argument("--lr", type=float, default=0.01)
    o.add_argument("--threads", type=int, default=1, help="torch threads")


def check(p, args):
    if getattr(args, "t_b_ms", 0) is None:
        args.t_b_ms = 2 * args.t_f_ms
    size = MPI.COMM_WORLD.size
    if args.experiment == "bubbles":
        if args.t_f_ms <= 0 or args.t_b_ms <= 0 or args.repeats < 1 or args.chunks < 1 \
                or args.steady < size:
            p.error("need --t-f-ms, --t-b-ms > 0, --repeats >= 1, --chunks >= 1, --steady >= "
                    "the ranks (%d)" % size)
        if "interleaved" in args.schedules and not any(m % size == 0 for m in args.m):
            p.error("interleaved needs an --m that the ranks (%d) divide, got %s"
                    % (size, args.m))
    elif args.experiment == "partition":
        if args.image % 4 or min(args.microbatch, args.image, args.channels, args.hidden,
                                 args.iterations, args.rounds, args.threads) < 1 \
                or args.inputs < size or args.bandwidth <= 0:
            p.error("need --image a multiple of 4, positive sizes, --inputs >= the ranks (%d), "
                    "--bandwidth > 0" % size)
    elif args.experiment == "overhead":
        if size != 1 or min(args.m, args.microbatch, args.steps, args.threads) < 1 \
                or args.image % 4:
            p.error("overhead runs on one rank (mpirun -n 1), with positive sizes and --image a "
                    "multiple of 4")
    else:
        if size < 2 or min(args.m, args.microbatch, args.steps, args.rounds,
                           args.threads) < 1 or args.m < size:
            p.error("need >= 2 ranks and --m >= the ranks (%d), positive sizes" % size)
        if args.t_f_ms <= 0 or args.t_b_ms <= 0 or args.image % 4:
            p.error("need --t-f-ms, --t-b-ms > 0 and --image a multiple of 4")


EXPERIMENTS = {"bubbles": exp_bubbles, "partition": exp_partition, "torch": exp_torch,
               "overhead": exp_overhead}

COMPUTE = {"bubbles": "sleep-based: a rank computes by sleeping, so it needs no core and %d ranks "
                      "run in parallel on any number of cores",
           "partition": "real: %d ranks share the host's cores (with fewer cores than ranks the "
                        "compute is time-sliced, in both configurations)",
           "torch": "synthetic (sleep) and real; the real model's %d ranks share the host's cores",
           "overhead": "real, %d rank"}


def run(comm, args):
    host = host_info(comm)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    runs = []
    results = EXPERIMENTS[args.experiment](comm, args, runs)
    if comm.rank != 0:
        return None
    pngs = []
    if args.out and args.experiment == "bubbles":
        pngs = write_gantts(args, runs, os.path.splitext(args.out)[0])
    targets = results.get("targets", {})
    print("\ntargets:")
    for k, v in targets.items():
        met = {True: "met", False: "MISSED", None: "reported"}[v["met"]]
        val = v["value"]
        print("  %-40s %-8s %s" % (k, met, ("%.4g" % val) if isinstance(val, float) else val))
    if args.out:
        meta = {"command": harness.command_line(),
                "experiment": args.experiment, "ranks": comm.size,
                "parameters": {k: v for k, v in vars(args).items() if k not in ("out", "quiet")},
                "compute": COMPUTE[args.experiment] % comm.size,
                "clock": "time.perf_counter (CLOCK_MONOTONIC), one clock per host",
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                "total_wall_s": time.monotonic() - t0, "pngs": pngs, **host}
        return {"meta": meta, "runs": runs, "results": results}
    return None


ENTRY = harness.Entry("pipeline", __doc__, options, run, check, prog="benchmarks/pipeline.py")

if __name__ == "__main__":
    harness.main(ENTRY)
