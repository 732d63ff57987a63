"""PipeDream's partitioner, the layer profiler and PipeDream-2BW's planner (single process):
the dynamic program against enumeration on one level (seeded and hypothesis profiles) and on two
levels (an independent recursive enumeration of the thesis's hierarchical model), the Fig. 2.7
example, the regimes that must give pure data parallelism or a pipeline, the planner's memory
limit and recomputation choice against hand-computed costs, and exact byte counts from torch."""
import functools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.pipeline.partition import (Stage, Topology, brute_force, linear_profile_fn,
                                         partition, pipeline_time, plan_2bw)
from mlfabric.pipeline.profile import LayerProfile, profile_layers, synthetic_profile

TIMES = (0.0, 0.5, 1.0, 2.0, 3.0, 5.5)
BYTES = (0.0, 0.2, 0.5, 1.0, 3.0, 4.0)


def random_profile(rng, n):
    return synthetic_profile([rng.choice(TIMES) for _ in range(n)],
                             [rng.choice(BYTES) for _ in range(n)],
                             [rng.choice(BYTES) for _ in range(n)])


def check_shape(part, n_layers, workers):
    """Stages cover the layers in order, contiguously, and use exactly `workers` workers."""
    assert part.stages[0].first_layer == 0 and part.stages[-1].last_layer == n_layers - 1
    for a, b in zip(part.stages, part.stages[1:]):
        assert b.first_layer == a.last_layer + 1
    assert all(s.first_layer <= s.last_layer and s.replicas >= 1 for s in part.stages)
    assert part.workers == workers
    assert part.noam == math.ceil(workers / part.stages[0].replicas)


def check_against_brute_force(profiles, workers, bw):
    dp = partition(profiles, Topology([(workers, bw)]))
    bf = brute_force(profiles, workers, bw)
    check_shape(dp, len(profiles), workers)
    assert dp.predicted_time_per_sample == pytest.approx(bf.predicted_time_per_sample, rel=1e-12,
                                                         abs=1e-15)
    # the stages it reports really have the time it predicts
    assert pipeline_time(profiles, dp.stages, bw) == pytest.approx(dp.predicted_time_per_sample,
                                                                   rel=1e-12, abs=1e-15)


# --- one level: the program equals enumeration ----------------------------------------------------

def test_partition_equals_brute_force_seeded():
    rng = random.Random(6)
    for _ in range(400):
        check_against_brute_force(random_profile(rng, rng.randint(1, 6)), rng.randint(1, 4),
                                  rng.choice((0.25, 1.0, 4.0)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10), st.floats(0, 10)),
                min_size=1, max_size=6),
       st.integers(1, 4), st.floats(0.1, 10))
def test_partition_equals_brute_force_hypothesis(layers, workers, bw):
    profiles = synthetic_profile(*zip(*layers))
    check_against_brute_force(profiles, workers, bw)


def test_fig_2_7_two_one_split():
    # Stage totals 6 (2 + 4) and 3 (1 + 2) on three workers; layer 2's weights are too large to
    # replicate it, so PipeDream replicates the first stage twice: max stage time 6/2 = 3.
    profiles = synthetic_profile([6.0, 3.0], activation_bytes=1.0, weight_bytes=[1.0, 1e6])
    part = partition(profiles, Topology([(3, 1.0)]))
    assert part.stages == [Stage(0, 0, 2), Stage(1, 1, 1)]
    assert part.predicted_time_per_sample == 3.0
    assert part.predicted_throughput == pytest.approx(1 / 3)
    assert part.noam == 2  # ceil(3 workers / 2 input-stage replicas)
    assert brute_force(profiles, 3, 1.0).stages == part.stages


def test_compact_weights_large_activations_give_data_parallelism():
    # ResNet-like: small weights, large activations: every cut costs more than the all-reduce.
    profiles = synthetic_profile([1.0, 2.0, 1.5, 1.0, 0.5], activation_bytes=1e9, weight_bytes=1e3)
    for workers in (1, 2, 3, 5, 8):
        part = partition(profiles, Topology([(workers, 1e9)]))
        assert part.stages == [Stage(0, 4, workers)]
        assert part.noam == 1
        assert part.predicted_time_per_sample == pytest.approx(6.0 / workers)


def test_large_weights_slow_link_give_pipeline():
    # VGG/GNMT-like: the all-reduce of large weights on a slow link dwarfs compute; activations
    # are small, so a straight pipeline (one worker per stage) wins.
    profiles = synthetic_profile([1.0, 1.0, 1.0, 1.0], activation_bytes=1e3, weight_bytes=1e9)
    part = partition(profiles, Topology([(4, 1e6)]))
    assert part.stages == [Stage(k, k, 1) for k in range(4)]
    assert part.noam == 4
    assert part.predicted_time_per_sample == pytest.approx(1.0)
    # three workers for four equal layers: the best straight pipeline has a stage of two layers
    part = partition(profiles, Topology([(3, 1e6)]))
    assert [s.replicas for s in part.stages] == [1, 1, 1]
    assert part.predicted_time_per_sample == pytest.approx(2.0)


def test_one_layer_is_replicated():
    profiles = synthetic_profile([4.0], 1.0, 1.0)
    part = partition(profiles, Topology([(3, 1.0)]))
    assert part.stages == [Stage(0, 0, 3)]
    assert part.predicted_time_per_sample == pytest.approx(max(4.0, 2 * 2 * 1.0) / 3)


# --- two levels -----------------------------------------------------------------------------------

def hierarchical_brute_force(profiles, levels):
    """The thesis's hierarchical model by plain enumeration at every level: a level-k stage
    i..j on r components costs max(best(k-1, i..j), 2 (r-1) sum w / B_k) / r."""
    t = [p.time_s for p in profiles]
    a = [p.activation_bytes for p in profiles]
    w = [p.weight_bytes for p in profiles]

    def compositions(total, parts):
        if parts == 1:
            yield (total,)
            return
        for first in range(1, total - parts + 2):
            for rest in compositions(total - first, parts - 1):
                yield (first,) + rest

    @functools.lru_cache(maxsize=None)
    def best(k, i, j, m):
        if k == 0:
            return sum(t[i:j + 1])
        m_k, bw = levels[k - 1]
        m_below = levels[k - 2][0] if k >= 2 else 1
        n = j - i + 1
        result = math.inf
        for q in range(1, min(n, m) + 1):
            for sizes in compositions(n, q):
                firsts = [i + sum(sizes[:x]) for x in range(q)]
                for reps in compositions(m, q):
                    worst = 0.0
                    for x, (f, s, r) in enumerate(zip(firsts, sizes, reps)):
                        last = f + s - 1
                        stage = max(best(k - 1, f, last, m_below),
                                    2 * (r - 1) * sum(w[f:last + 1]) / bw) / r
                        worst = max(worst, stage)
                        if x + 1 < q:
                            worst = max(worst, 2 * a[last] / bw)
                    result = min(result, worst)
        return result

    return best(len(levels), 0, len(profiles) - 1, levels[-1][0])


def test_two_level_equals_hierarchical_brute_force():
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(1, 5)
        profiles = random_profile(rng, n)
        levels = rng.choice([[(2, 8.0), (2, 1.0)], [(3, 8.0), (2, 0.5)], [(2, 4.0), (3, 1.0)],
                             [(1, 8.0), (3, 1.0)], [(2, 2.0), (1, 1.0), (2, 0.5)]])
        part = partition(profiles, Topology(levels))
        check_shape(part, n, math.prod(m for m, _ in levels))
        assert part.predicted_time_per_sample == pytest.approx(
            hierarchical_brute_force(profiles, levels), rel=1e-12, abs=1e-15)


def test_two_level_no_worse_than_flat_data_parallelism():
    # Flat pure data parallelism over the slow link is a point of the hierarchical search
    # (all-reduce inside servers at B_1 >= B_2, then across them), so it can never be better.
    rng = random.Random(8)
    for _ in range(100):
        profiles = random_profile(rng, rng.randint(1, 6))
        m1, m2 = rng.randint(1, 3), rng.randint(1, 3)
        b2 = rng.choice((0.25, 1.0))
        two = partition(profiles, Topology([(m1, b2 * rng.choice((1, 4, 100))), (m2, b2)]))
        dp = pipeline_time(profiles, [Stage(0, len(profiles) - 1, m1 * m2)], b2)
        assert two.predicted_time_per_sample <= dp * (1 + 1e-12)


def test_two_level_uses_fast_links_for_the_allreduce():
    # Two servers of four workers: NVLink inside (300 GB/s), 1.25 GB/s between. Four equal layers
    # of 1 GB weights and 1 MB outputs, 1 s each. The single-level answers: the whole cluster at
    # the slow link (each layer on 2 workers: max(1 s, 2 * 1 GB / 1.25 GB/s) / 2 = 0.8 s), or one
    # server at the fast link (1 s). The hierarchy puts two layers on each server, replicated over
    # its four workers: max(2 s, 2 * 3 * 2 GB / 300 GB/s) / 4 = 0.5 s (one layer on 2 workers ties
    # at 0.5 s; the tie goes to fewer stages).
    profiles = synthetic_profile([1.0] * 4, activation_bytes=1e6, weight_bytes=1e9)
    two = partition(profiles, Topology([(4, 300e9), (2, 1.25e9)]))
    flat_slow = partition(profiles, Topology([(8, 1.25e9)]))
    one_server = partition(profiles, Topology([(4, 300e9)]))
    check_shape(two, 4, 8)
    assert flat_slow.predicted_time_per_sample == pytest.approx(0.8)
    assert one_server.predicted_time_per_sample == pytest.approx(1.0)
    assert two.predicted_time_per_sample == pytest.approx(0.5)
    assert two.stages == [Stage(0, 1, 4), Stage(2, 3, 4)]


def test_large_tables_are_fast():
    rng = random.Random(9)
    profiles = synthetic_profile([rng.random() for _ in range(40)], 1e6, 1e7)
    part = partition(profiles, Topology([(8, 300e9), (4, 12.5e9)]))
    check_shape(part, 40, 32)


# --- bad input ------------------------------------------------------------------------------------

def test_bad_input_is_rejected():
    good = synthetic_profile([1.0, 2.0], 1.0, 1.0)
    with pytest.raises(ValueError, match="empty"):
        partition([], Topology([(2, 1.0)]))
    with pytest.raises(ValueError, match="empty"):
        brute_force([], 2, 1.0)
    with pytest.raises(ValueError, match="workers"):
        brute_force(good, 0, 1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        brute_force(good, 2, 0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        Topology([(2, -1.0)])
    with pytest.raises(ValueError, match="integer >= 1"):
        Topology([(0, 1.0)])
    with pytest.raises(ValueError, match="at least one level"):
        Topology([])
    with pytest.raises(ValueError, match="time_s"):
        partition([LayerProfile("x", -1.0, 0, 0)], Topology([(1, 1.0)]))
    with pytest.raises(ValueError, match="weight_bytes"):
        partition([LayerProfile("x", 1.0, 0, math.nan)], Topology([(1, 1.0)]))
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        synthetic_profile([1.0, 2.0], [1, 2, 3], 0)


# --- PipeDream-2BW planner ------------------------------------------------------------------------

# Four equal layers: 1 s fwd+bwd per sample, 100-byte outputs per sample, 10-byte weights; inputs
# 100 bytes per sample. Memory per worker at b = 1 (hand-computed from the model in plan_2bw):
#   p=1, d=4: 1 version: 40 + 400 + 100                  = 540 (no recomputation for one stage)
#   p=2, d=2: 2 versions: no recompute 40 + 2*200 + 2*100 = 640, recompute 40 + 200 + 2*100 = 440
#   p=4, d=1: no recompute 20 + 4*100 + 4*100            = 820, recompute 20 + 100 + 4*100 = 520
PER_SAMPLE = synthetic_profile([1.0] * 4, activation_bytes=100.0, weight_bytes=10.0)


def plan(limit, **kw):
    kw.setdefault("input_bytes_per_sample", 100.0)
    return plan_2bw(PER_SAMPLE, 4, limit, 16, 1e3, **kw)


def test_2bw_memory_model_by_hand():
    table = {(c.d, c.p, c.b, c.recompute): c for c in plan(1e9).candidates}
    assert table[4, 1, 1, False].memory_bytes == 540
    assert table[2, 2, 1, False].memory_bytes == 640
    assert table[2, 2, 1, True].memory_bytes == 440
    assert table[1, 4, 1, False].memory_bytes == 820
    assert table[1, 4, 1, True].memory_bytes == 520
    assert (4, 1, 1, True) not in table
    # 2BW needs m >= p microbatches: batch 16 over d=1 gives b <= 4 for p=4
    assert max(b for (d, p, b, _) in table if p == 4) == 4
    # time for (d=2, p=2, b=1, recompute): compute 4/3 * 2 s, activations in/out 2*100/1e3 s,
    # all-reduce 2*(1/2)*20/1e3 s over m=8 microbatches
    c = table[2, 2, 1, True]
    assert c.m == 8 and c.stages == [(0, 1), (2, 3)]
    assert c.time_per_microbatch_s == pytest.approx(4 / 3 * 2 + 2 * 100 / 1e3)
    assert c.throughput == pytest.approx(2 * 1 / c.time_per_microbatch_s)


def test_2bw_respects_memory_limit_and_recomputes_only_when_needed():
    roomy = plan(1e9)
    assert not roomy.best.recompute
    for limit in (2000, 900, 700, 600, 550, 500, 450):
        res = plan(limit)
        assert res.best.fits and res.best.memory_bytes <= limit
        assert all(c.fits == (c.memory_bytes <= limit) for c in res.candidates)
        assert res.best.throughput == max(c.throughput for c in res.candidates if c.fits)
        if res.best.recompute:
            # recomputation only because nothing without it fits for this (d, p)
            assert not any(c.fits and not c.recompute and (c.d, c.p) == (res.best.d, res.best.p)
                           for c in res.candidates)
    # between 440 and 520 only (d=2, p=2, b=1) with recomputation fits
    tight = plan(500)
    assert (tight.best.d, tight.best.p, tight.best.b, tight.best.recompute) == (2, 2, 1, True)
    assert "<- best" in tight.table()


def test_2bw_impossible_limit_is_an_error():
    with pytest.raises(ValueError, match="no configuration fits the memory limit.*needs 440"):
        plan(439)
    with pytest.raises(ValueError, match="workers"):
        plan_2bw(PER_SAMPLE, 0, 1e9, 16, 1e3)
    with pytest.raises(ValueError, match="memory_limit"):
        plan_2bw(PER_SAMPLE, 4, 0, 16, 1e3)
    with pytest.raises(ValueError, match="bandwidth"):
        plan_2bw(PER_SAMPLE, 4, 1e9, 16, 0.0)


def test_2bw_allreduce_on_slow_link_prefers_pipelines():
    # Large weights on a slow link: even spread over m microbatches the all-reduce dominates
    # (d=4: 2 * 3/4 * 40 MB / 1 MB/s / 4 = 15 s per microbatch of 1 s compute), so fewer replicas
    # and deeper pipelines win (d=1, p=4: 1 s + 2 * 2 KB / 1 MB/s).
    heavy = synthetic_profile([1.0] * 4, activation_bytes=1e3, weight_bytes=1e7)
    res = plan_2bw(heavy, 4, 1e12, 16, 1e6)
    assert (res.best.d, res.best.p) == (1, 4)
    # the same model with a fast all-reduce and slow activation links: data parallelism wins
    res = plan_2bw(heavy, 4, 1e12, 16, 1e12, pp_bandwidth=1e3)
    assert (res.best.d, res.best.p) == (4, 1)


def test_2bw_larger_microbatches_can_pay_for_recomputation():
    # A fixed 1 s per layer per microbatch (kernel overheads) makes b = 2 much more efficient than
    # b = 1. Under 1000 bytes, b = 2 fits only with recomputation: (d=2, p=2) needs
    # 40 + 2*400 + 2*200 = 1240 without, 40 + 400 + 2*200 = 840 with; its 4/3 compute costs less
    # than b = 1's overheads (2 * 2 / (4/3 * 2.4) = 1.25 samples/s against 0.91 at b = 1).
    model = linear_profile_fn(synthetic_profile([0.1] * 4, 100.0, 10.0), fixed_time_s=1.0)
    res = plan_2bw(model, 4, 1000, 16, 1e9, input_bytes_per_sample=100.0,
                   microbatch_sizes=[1, 2, 4])
    best = res.best
    assert (best.d, best.p, best.b, best.recompute) == (2, 2, 2, True)
    assert best.memory_bytes == 840
    assert best.throughput == pytest.approx(1.25)
    assert max(c.throughput for c in res.candidates if c.fits and not c.recompute) == \
        pytest.approx(1 / 1.1)


# --- profiler -------------------------------------------------------------------------------------

def test_profile_layers_times_and_exact_bytes():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    prof = profile_layers(model, x, repeats=3, warmup=1)
    assert [p.name for p in prof] == ["0:Linear", "1:ReLU", "2:Linear"]
    assert all(p.time_s > 0 for p in prof)
    assert [p.activation_bytes for p in prof] == [5 * 16 * 4, 5 * 16 * 4, 5 * 4 * 4]
    assert [p.weight_bytes for p in prof] == [(8 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4]
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradients
    # a list of modules, float64, a parameter shared by two layers counted once
    lin = torch.nn.Linear(6, 6).double()
    prof = profile_layers([lin, torch.nn.Tanh(), lin], torch.randn(3, 6, dtype=torch.float64),
                          repeats=1, warmup=0)
    assert [p.weight_bytes for p in prof] == [(36 + 6) * 8, 0, 0]
    assert [p.activation_bytes for p in prof] == [3 * 6 * 8] * 3
    # the profile feeds the partitioner directly
    part = partition(prof, Topology([(2, 1e9)]))
    check_shape(part, 3, 2)


def test_profile_layers_bad_input():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="no layers"):
        profile_layers(torch.nn.Sequential(), torch.randn(2, 2))
    with pytest.raises(ValueError, match="torch.Tensor"):
        profile_layers([torch.nn.ReLU()], [1.0, 2.0])
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        profile_layers([lambda x: x], torch.randn(2, 2))
