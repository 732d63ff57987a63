"""Where the layers go: PipeDream's partitioner (thesis §2.4.1) and PipeDream-2BW's planner
(thesis ch. 3, Alg. 1 and the closed-form cost model of §3.3.3).

`partition` solves the dynamic program of §2.4.1 level by level over a hierarchical topology::

    T^k(i->j, m) = (1/m) max{ A^{k-1}(i->j, m_{k-1}), 2(m-1) sum_{l=i..j} w_l / B_k }
    A^k(i->j, m) = min( T^k(i->j, m),
                        min_{i<=s<j} min_{1<=m'<m} max{ A^k(i->s, m-m'), 2 a_s / B_k,
                                                        T^k(s+1->j, m') } )
    A^0(i->j, 1) = sum_{l=i..j} T_l

and returns A^L(0->N-1, m_L) with the stages that reach it. `brute_force` enumerates every
contiguous split and replication of one level, to check the program against.

Where the thesis leaves a choice open, this is what we do, and why:

- The unsplit candidate T^k(i->j, m) is part of the min (the thesis's A^k only splits): without it
  a range can never be one stage replicated over all m workers, so pure data parallelism (the
  planner's answer for ResNet-50 in §2.5) would be unreachable.
- Every configuration uses exactly the m workers it is given, as in the thesis's recurrence.
- Ties go to the candidate with fewer stages (the unsplit one first), then to the first split
  point and the fewest workers for the last stage: fewer stages means fewer activation transfers
  and weight versions for the same modelled time, and a fixed order makes plans reproducible.
- The hierarchy restricts the search: a stage at level k takes whole level-(k-1) components (for
  example whole servers), as in the thesis. A flat topology at the slowest bandwidth can therefore
  reach splits (3 + 1 workers over 2 servers of 2) that the hierarchical program cannot.
- The result is flattened: a level-k stage replicated m' times, whose level-(k-1) pipeline has a
  stage with r workers, becomes a stage with r * m' workers. The stages list is in layer order and
  the workers add up to the topology's total.
"""
import math
from dataclasses import dataclass, field
from itertools import combinations
from numbers import Integral, Real

import numpy as np

from .profile import LayerProfile, check_profiles

_TIE = 1e-12  # relative margin a candidate must win by to replace a simpler one (float noise)


@dataclass(frozen=True)
class Topology:
    """Hierarchical topology, level 1 first: level k joins m_k components of level k-1 with links
    of bandwidth B_k bytes/s; level 0 is one worker. Example: 2 servers of 4 GPUs with NVLink
    inside and Ethernet between: Topology([(4, 300e9), (2, 12.5e9)])."""
    levels: tuple

    def __init__(self, levels):
        levels = tuple((m, b) for m, b in levels)
        if not levels:
            raise ValueError("a topology needs at least one level")
        for k, (m, b) in enumerate(levels, 1):
            if not isinstance(m, Integral) or m < 1:
                raise ValueError(f"level {k}: the number of components must be an integer >= 1, "
                                 f"got {m!r}")
            if not isinstance(b, Real) or not b > 0:
                raise ValueError(f"level {k}: bandwidth must be > 0 bytes/s, got {b!r}")
        object.__setattr__(self, "levels", levels)

    @property
    def workers(self):
        return math.prod(m for m, _ in self.levels)


@dataclass(frozen=True)
class Stage:
    first_layer: int  # inclusive, 0-based
    last_layer: int   # inclusive
    replicas: int     # workers running this stage (data parallelism within the stage)

    @property
    def layers(self):
        return range(self.first_layer, self.last_layer + 1)


@dataclass
class Partition:
    stages: list                        # Stage, in layer order
    noam: int                           # inputs in flight per input-stage replica (§2.4.2)
    predicted_time_per_sample: float    # A^L(0->N-1, m_L): seconds of the slowest stage per input
    predicted_throughput: float         # inputs per second: 1 / predicted_time_per_sample

    @property
    def workers(self):
        return sum(s.replicas for s in self.stages)


def _make_partition(stages, time_per_sample):
    workers = sum(s.replicas for s in stages)
    noam = -(-workers // stages[0].replicas)  # ceil(#workers / #replicas of the input stage)
    time_per_sample = float(time_per_sample)
    thr = math.inf if time_per_sample == 0 else 1.0 / time_per_sample
    return Partition(stages, noam, time_per_sample, thr)


def _arrays(profiles):
    t = np.array([p.time_s for p in profiles], dtype=np.float64)
    a = np.array([p.activation_bytes for p in profiles], dtype=np.float64)
    w = np.array([p.weight_bytes for p in profiles], dtype=np.float64)
    return t, a, w


def _range_sums(x):
    """S[i, j] = sum x[i..j] for i <= j (upper triangle; the rest is unused)."""
    c = np.concatenate(([0.0], np.cumsum(x)))
    return c[None, 1:] - c[:-1, None]


def _solve_level(base, wsum, act_time, m_k, bandwidth):
    """One level of the program. base[i, j] = A^{k-1}(i->j, m_{k-1}); wsum[i, j] = sum of w over
    i..j; act_time[s] = 2 a_s / B_k. Returns (A, split_s, split_m) with A[i, j, m] = A^k(i->j, m)
    for m = 1..m_k, split_s = -1 where the range is one stage, else the last layer of the
    sub-pipeline and split_m the workers of the last stage."""
    n = base.shape[0]
    ms = np.arange(1, m_k + 1, dtype=np.float64)
    # T[i, j, m]: one stage i..j replicated over m components; index 0 unused.
    T = np.full((n, n, m_k + 1), np.inf)
    T[:, :, 1:] = np.maximum(base[:, :, None], 2.0 * (ms - 1.0) * wsum[:, :, None] / bandwidth) / ms
    A = T.copy()
    split_s = np.full((n, n, m_k + 1), -1, dtype=np.int64)
    split_m = np.zeros((n, n, m_k + 1), dtype=np.int64)
    for i in range(n):
        for j in range(i + 1, n):  # j ascending: A[i, s, :] for s < j is final when needed
            for m in range(2, m_k + 1):
                # rows: s = i..j-1; columns: m' = 1..m-1 (the sub-pipeline gets m - m')
                left = A[i, i:j, m - 1:0:-1]
                right = T[i + 1:j + 1, j, 1:m]
                cand = np.maximum(np.maximum(left, act_time[i:j, None]), right)
                k = int(np.argmin(cand))
                best = cand.flat[k]
                if best < A[i, j, m] * (1.0 - _TIE):
                    A[i, j, m] = best
                    split_s[i, j, m] = i + k // (m - 1)
                    split_m[i, j, m] = k % (m - 1) + 1
    return A, split_s, split_m


def partition(profiles, topology):
    """PipeDream's partitioning (§2.4.1) of `profiles` (LayerProfile per layer, in order) over
    `topology` (a Topology). Returns a Partition: stages in layer order with their workers, NOAM,
    the modelled time per input of the slowest stage (A^L) and the throughput it implies."""
    profiles = check_profiles(profiles)
    if not isinstance(topology, Topology):
        topology = Topology(topology)
    t, a, w = _arrays(profiles)
    wsum = _range_sums(w)
    base = _range_sums(t)  # A^0
    tables = []            # per level: (split_s, split_m, m_{k-1})
    m_prev = 1
    for m_k, bw in topology.levels:
        A, split_s, split_m = _solve_level(base, wsum, 2.0 * a / bw, m_k, bw)
        tables.append((split_s, split_m, m_prev))
        base = A[:, :, m_k]
        m_prev = m_k

    def stages_of(k, i, j, m, mult):
        """Flattened stages of A^k(i->j, m), each replica count multiplied by `mult`."""
        if k == 0:
            return [Stage(i, j, mult)]
        split_s, split_m, m_below = tables[k - 1]
        s = int(split_s[i, j, m])
        if s < 0:  # one stage, replicated over m level-(k-1) components
            return stages_of(k - 1, i, j, m_below, mult * m)
        mp = int(split_m[i, j, m])
        return stages_of(k, i, s, m - mp, mult) + stages_of(k - 1, s + 1, j, m_below, mult * mp)

    n = len(profiles)
    stages = stages_of(len(tables), 0, n - 1, topology.levels[-1][0], 1)
    return _make_partition(stages, base[0, n - 1])


def stage_time(profiles, first, last, replicas, bandwidth):
    """T^1 of one stage: (1/r) max{ sum T_l, 2 (r-1) sum w_l / B } (single level)."""
    comp = sum(p.time_s for p in profiles[first:last + 1])
    sync = 2.0 * (replicas - 1) * sum(p.weight_bytes for p in profiles[first:last + 1]) / bandwidth
    return max(comp, sync) / replicas


def pipeline_time(profiles, stages, bandwidth):
    """Modelled time per input of a single-level configuration: the slowest of its stages
    (stage_time) and of its activation transfers (2 a_s / B at each boundary)."""
    worst = 0.0
    for k, st in enumerate(stages):
        worst = max(worst, stage_time(profiles, st.first_layer, st.last_layer, st.replicas,
                                      bandwidth))
        if k + 1 < len(stages):
            worst = max(worst, 2.0 * profiles[st.last_layer].activation_bytes / bandwidth)
    return worst


def _compositions(total, parts):
    """Every way to write `total` as an ordered sum of `parts` positive integers."""
    for cuts in combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield [bounds[k + 1] - bounds[k] for k in range(parts)]


def brute_force(profiles, workers, bandwidth):
    """The optimum of one level by enumeration: every contiguous split of the layers into stages
    and every assignment of exactly `workers` workers to them (each at least one). Exponential:
    for checking `partition` on small cases. Ties go to fewer stages, then the first found."""
    profiles = check_profiles(profiles)
    if not isinstance(workers, Integral) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if not isinstance(bandwidth, Real) or not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    n = len(profiles)
    best, best_stages = math.inf, None
    for nstages in range(1, min(n, workers) + 1):
        for sizes in _compositions(n, nstages):
            firsts = np.cumsum([0] + sizes[:-1])
            for reps in _compositions(workers, nstages):
                stages = [Stage(int(f), int(f) + s - 1, r) for f, s, r in zip(firsts, sizes, reps)]
                v = pipeline_time(profiles, stages, bandwidth)
                if best_stages is None or v < best * (1.0 - _TIE):
                    best, best_stages = v, stages
    return _make_partition(best_stages, best)


# --- PipeDream-2BW's planner (ch. 3) --------------------------------------------------------------

@dataclass
class Candidate:
    d: int                    # data-parallel size (parallel pipelines)
    p: int                    # pipeline depth (stages)
    b: int                    # microbatch size per worker
    recompute: bool           # activation recomputation
    m: int                    # microbatches per pipeline per batch (= gradient accumulation)
    stages: list              # (first_layer, last_layer) per stage, each stage on d workers
    memory_bytes: float       # modelled peak bytes on the fullest worker
    time_per_microbatch_s: float  # t: one microbatch leaves each pipeline every t seconds
    throughput: float         # samples per second, all pipelines: d * b / t
    fits: bool                # memory_bytes <= the limit


@dataclass
class Plan2BW:
    best: Candidate
    candidates: list = field(default_factory=list)  # every configuration evaluated, fits or not

    def table(self):
        """The candidates as a text table, best throughput first."""
        head = f"{'d':>3} {'p':>3} {'b':>4} {'rc':>3} {'m':>4} {'memory':>12} {'t/mb (s)':>11} " \
               f"{'samples/s':>11}  fits"
        rows = [head]
        for c in sorted(self.candidates, key=lambda c: (not c.fits, -c.throughput)):
            mark = " <- best" if c is self.best else ""
            rows.append(f"{c.d:>3} {c.p:>3} {c.b:>4} {'y' if c.recompute else 'n':>3} {c.m:>4} "
                        f"{c.memory_bytes:>12.4g} {c.time_per_microbatch_s:>11.4g} "
                        f"{c.throughput:>11.4g}  {'yes' if c.fits else 'no'}{mark}")
        return "\n".join(rows)


def linear_profile_fn(per_sample, fixed_time_s=0.0):
    """A small cost model for plan_2bw: layer times b * T_l + fixed_time_s (the fixed part stands
    for per-kernel overheads, so larger microbatches run more efficiently) and activations b * a_l
    for a microbatch of b samples, from per-sample profiles."""
    per_sample = check_profiles(per_sample)

    def at(b):
        return [LayerProfile(p.name, b * p.time_s + fixed_time_s, b * p.activation_bytes,
                             p.weight_bytes) for p in per_sample]
    return at


def _balanced_split(times, p):
    """Contiguous split of `times` into p stages minimising the largest stage sum (first best);
    returns [(first, last)]. The 2BW planner gives every stage d workers, so only compute
    needs balancing."""
    n = len(times)
    c = np.concatenate(([0.0], np.cumsum(times)))
    # best[k][j]: the minimal largest sum splitting the first j layers into k stages
    best = np.full((p + 1, n + 1), np.inf)
    cut = np.zeros((p + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            for s in range(k - 1, j):
                v = max(best[k - 1][s], c[j] - c[s])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, s
    bounds, j = [], n
    for k in range(p, 0, -1):
        s = int(cut[k][j])
        bounds.append((s, j - 1))
        j = s
    return bounds[::-1]


def _bandwidth_fn(value, default, what):
    v = default if value is None else value
    if not callable(v):
        if not isinstance(v, Real) or not v > 0:
            raise ValueError(f"{what} must be > 0 bytes/s or a function, got {v!r}")
        return lambda _size: v

    def checked(size):
        bw = v(size)
        if not isinstance(bw, Real) or not bw > 0:
            raise ValueError(f"{what}({size}) must be > 0 bytes/s, got {bw!r}")
        return bw
    return checked


def plan_2bw(model, workers, memory_limit_bytes, batch_size, bandwidth, *, dp_bandwidth=None,
             pp_bandwidth=None, microbatch_sizes=None, input_bytes_per_sample=0.0,
             recompute_factor=4.0 / 3.0):
    """PipeDream-2BW's planner (thesis Alg. 1, §3.3): sweep every (d, p) with d * p = workers,
    every microbatch size b (those dividing batch_size / d, or `microbatch_sizes`) and
    recomputation off/on (off only when p = 1: one stage stashes nothing across microbatches, so
    recomputation would save no memory); drop configurations over the memory limit;
    return the highest modelled throughput (Plan2BW: the best and the whole table).

    `model` is either a function b -> [LayerProfile] (times and activation bytes for a microbatch
    of b samples, e.g. profile_layers at several b, or linear_profile_fn) or a list of per-sample
    LayerProfile, scaled linearly in b. `bandwidth` (bytes/s) is used for activations between
    stages and for the all-reduce between replicas unless `pp_bandwidth` (a number or a function of
    p) or `dp_bandwidth` (a number or a function of d, e.g. fast inside a server) say otherwise.
    `input_bytes_per_sample` is the size of one input sample (stage 0 stashes its inputs).

    The model, for a configuration (d, p, b, r) with m = batch_size / (d b) microbatches per
    pipeline (gradient accumulation; 2BW needs m >= p when p > 1, its minimum batch being b p):

    - Stages: the layers are split into p contiguous stages balancing compute (every stage has d
      replicas, the parallel pipelines of §3.2.3). For stage i: T_i(b) the sum of layer times,
      W_i the weight bytes, A_total_i(b) the sum of its layers' output bytes, A_in_i(b) the bytes
      of its input (the previous stage's output; the samples for stage 0), A_out_i(b) its output
      (0 for the last stage).
    - Memory (§3.3.3, Table 7.1), on the fullest worker (max over i), with v = 2 weight versions
      (1 when p = 1: without pipelining no microbatch overlaps an update)::

          without recomputation: v W_i + p A_total_i(b) + p A_in_i(b)
          with recomputation:    v W_i +   A_total_i(b) + p A_in_i(b)

      (p stashes: the first stage of 1F1B has p microbatches in flight; with recomputation only
      the stage inputs are stashed, one stage's activations are rebuilt at a time.)
    - Time per microbatch (§3.3.3, pipelined: 2BW has no flush; the slowest stage sets the pace)::

          t = max_i max{ c T_i(b) + 2 (A_in_i(b) [i > 0] + A_out_i(b)) / pp_bandwidth(p),
                         (2 (d-1)/d W_i / dp_bandwidth(d)) / m }

      with c = recompute_factor (4/3: the forward runs twice) under recomputation, else 1; the
      factor 2 counts activations forward and gradients backward; the all-reduce is a ring (each
      worker sends and receives (d-1)/d of W_i) done once per batch, so it is spread over the m
      microbatches and overlaps compute.
    - Throughput = d b / t samples per second.

    Ties (within 1e-9) go to no recomputation, then fewer stages, then the larger microbatch.
    Raises ValueError when no configuration fits `memory_limit_bytes`."""
    if not isinstance(workers, Integral) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if not isinstance(batch_size, Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not isinstance(memory_limit_bytes, Real) or not memory_limit_bytes > 0:
        raise ValueError(f"memory_limit_bytes must be > 0, got {memory_limit_bytes!r}")
    if not recompute_factor >= 1:
        raise ValueError(f"recompute_factor must be >= 1, got {recompute_factor!r}")
    if microbatch_sizes is not None and not all(isinstance(b, Integral) and b >= 1
                                                for b in microbatch_sizes):
        raise ValueError(f"microbatch_sizes must be integers >= 1, got {microbatch_sizes!r}")
    profile_at = linear_profile_fn(model) if not callable(model) else model
    pp_bw = _bandwidth_fn(pp_bandwidth, bandwidth, "pp_bandwidth")
    dp_bw = _bandwidth_fn(dp_bandwidth, bandwidth, "dp_bandwidth")

    cache = {}

    def profile(b):
        if b not in cache:
            cache[b] = check_profiles(profile_at(b))
        return cache[b]

    n_layers = len(profile(1))
    candidates = []
    for p in range(1, min(workers, n_layers) + 1):
        if workers % p:
            continue
        d = workers // p
        if batch_size % d:
            continue
        sizes = microbatch_sizes or range(batch_size // d, 0, -1)
        # one stage stashes nothing across microbatches: recomputation would only cost time
        for recompute in (False, True) if p > 1 else (False,):
            for b in sorted(sizes, reverse=True):
                if (batch_size // d) % b:
                    continue
                m = batch_size // (d * b)
                if p > 1 and m < p:
                    continue
                candidates.append(_evaluate(profile(b), d, p, b, m, recompute, recompute_factor,
                                            input_bytes_per_sample * b, pp_bw(p), dp_bw(d),
                                            memory_limit_bytes))
    if not candidates:
        raise ValueError(f"no configuration of {workers} workers divides batch_size {batch_size} "
                         f"into at least p microbatches of the sizes allowed")
    best = None
    # the preferred order for ties: no recomputation, fewer stages, larger microbatch
    for c in sorted(candidates, key=lambda c: (c.recompute, c.p, -c.b)):
        if c.fits and (best is None or c.throughput > best.throughput * (1.0 + 1e-9)):
            best = c
    if best is None:
        need = min(c.memory_bytes for c in candidates)
        raise ValueError(f"no configuration fits the memory limit of {memory_limit_bytes:.4g} "
                         f"bytes: the smallest needs {need:.4g} bytes per worker")
    return Plan2BW(best, candidates)


def _evaluate(profiles, d, p, b, m, recompute, c_extra, input_bytes, pp_bw, dp_bw, limit):
    """One row of the planner's table: memory and time of (d, p, b, recompute); see plan_2bw."""
    t, a, w = _arrays(profiles)
    bounds = _balanced_split(t, p)
    versions = 2 if p > 1 else 1
    mem, step = 0.0, 0.0
    for i, (f, l) in enumerate(bounds):
        a_in = input_bytes if i == 0 else a[f - 1]
        a_out = a[l] if i + 1 < p else 0.0
        a_total = a[f:l + 1].sum()
        w_i = w[f:l + 1].sum()
        stash = a_total if recompute else p * a_total
        mem = max(mem, versions * w_i + stash + p * a_in)
        comp = (c_extra if recompute else 1.0) * t[f:l + 1].sum()
        comm = 2.0 * ((a_in if i > 0 else 0.0) + a_out) / pp_bw if p > 1 else 0.0
        allreduce = 2.0 * (d - 1) / d * w_i / dp_bw
        step = max(step, comp + comm, allreduce / m)
    mem, step = float(mem), float(step)
    thr = math.inf if step == 0 else d * b / step
    return Candidate(d, p, b, recompute, m, bounds, mem, step, thr, mem <= limit)
