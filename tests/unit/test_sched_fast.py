"""The scheduler's fast path (mlfabric.sched.fast, csrc/sched_fast.cc) against the reference loops
(ordering.order_updates, aggregation.aggregate, scheduler.schedule): field by field and to the
bit, in fast and in plain mode, over hypothesis and seeded random instances (empty to 60 updates;
heterogeneous, time-varying and dead links; core links; ready times; equal sizes and rates that
tie; zero-byte updates; workers on the server's host and on their aggregator's), with and without
cut_through (aggregates relayed cut-through; the pipeline case, chosen or not). Also its input
checks, the benchmark's instances and table, and the floating-point fact that rules out a lazy
heap of stale t_en values."""
import dataclasses
import json
import math
import random
from math import inf

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.bench import __main__ as bench_entry
from mlfabric.bench import sched as bench
from mlfabric.sched import Network, Update, aggregation, fast, ordering, scheduler
from mlfabric.sched import network as network_module
from mlfabric.sched.network import Profile

PROPS = settings(max_examples=50, deadline=None)
native = pytest.mark.skipif(not fast.available(), reason="mlfabric._C has no sched_run")
RATES = (0.0, 1.0, 2.5, 3.3, 5.0, 10.0)  # the paper's NIC rates (any unit), and dead links


# --- comparing to the bit ------------------------------------------------------------------------

def bits(x):
    """x with every number as its exact float bits, containers, networks and dataclasses
    unpacked, dict order kept: equal bits() means equal to the bit (-0.0 is not 0.0)."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (int, float)):
        return float(x).hex()
    if isinstance(x, (list, tuple)):
        return tuple(bits(v) for v in x)
    if isinstance(x, dict):
        return tuple((bits(k), bits(v)) for k, v in x.items())
    if isinstance(x, Network):
        return ("Network", x.hosts, bits(sorted(x._core_paths.items())),
                tuple((bits(p.t), bits(p.v)) for p in x.links))
    if dataclasses.is_dataclass(x):
        return (type(x).__name__,) + tuple(bits(getattr(x, f.name))
                                           for f in dataclasses.fields(x))
    raise TypeError("cannot compare %r" % (x,))


def assert_same_fields(ref, got, skip=()):
    for f in dataclasses.fields(ref):
        if f.name not in skip:
            assert bits(getattr(got, f.name)) == bits(getattr(ref, f.name)), f.name


def reference(b):
    o = ordering.order_updates(b["updates"], b["network"], b["server"], v_init=b["v_init"],
                               tau_max=b["tau_max"], start=b["start"])
    g = aggregation.aggregate(o.order, {u.id: u for u in b["updates"]}, b["network"],
                              b["server"], b["aggs"], start=b["start"], agg_scale=b["agg_scale"],
                              cut_through=b.get("cut_through", False))
    return o, g


def check_against_reference(b):
    """schedule_fast, fast and plain, returns what the reference returns; the network passed in
    is left as it was. Fast mode may mark a case it stopped early as inf: such a case is never
    better than the chosen one."""
    before = bits(b["network"])
    ro, rg = reference(b)
    for plain in (False, True):
        fo, fg = fast.schedule_fast(**b, plain=plain)
        assert_same_fields(ro, fo)
        assert_same_fields(rg, fg, skip=("cases",))
        assert len(fg.cases) == len(rg.cases)
        for n, (r, f) in enumerate(zip(rg.cases, fg.cases)):
            if plain or f != inf:
                assert bits(f) == bits(r), ("case", n)
            else:
                assert r > rg.makespan or (r == rg.makespan and n > rg.n_direct), ("case", n)
    assert bits(b["network"]) == before


# --- instances -----------------------------------------------------------------------------------

@st.composite
def capacities(draw, dead_ok):
    """A link: a constant, or a trace of 1-4 steps (the last one positive unless dead_ok)."""
    times = [0.0] + sorted(draw(st.sets(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.5, 6.0]),
                                        max_size=3)))
    rates = [draw(st.sampled_from(RATES)) for _ in times]
    if rates[-1] == 0.0 and not dead_ok:
        rates[-1] = 10.0
    return rates[0] if len(times) == 1 and rates[0] > 0 else list(zip(times, rates))


@st.composite
def batches(draw, max_updates=24, cut_through=False):
    """Keyword arguments of fast.schedule_fast: server 0; workers anywhere, the server's host
    included (local transfers); aggregators on workers' hosts (local inbound transfers).
    cut_through=True: that flag set, and half the time a batch the pipeline case can take
    (two updates or more, workers off the server's host, every other host an aggregator)."""
    hosts = draw(st.integers(2, 7))
    dead_ok = draw(st.booleans())
    core, paths = [], {}
    if draw(st.booleans()):
        core = [draw(capacities(False)) for _ in range(draw(st.integers(1, 2)))]
        pairs = draw(st.lists(st.tuples(st.integers(0, hosts - 1), st.integers(0, hosts - 1))
                              .filter(lambda p: p[0] != p[1]), unique=True, max_size=6))
        paths = {p: draw(st.lists(st.integers(0, len(core) - 1), min_size=1, unique=True))
                 for p in pairs}
    network = Network([draw(capacities(dead_ok)) for _ in range(hosts)],
                      [draw(capacities(dead_ok)) for _ in range(hosts)], core, paths)
    chain = cut_through and draw(st.booleans())
    n = draw(st.integers(2 if chain else 0, max_updates))
    ids = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n, unique=True))
    v_init = 20
    updates = [Update(i, draw(st.integers(1 if chain else 0, hosts - 1)),
                      draw(st.sampled_from([0.0, 1.0, 1.0, 2.0, 2.5, 7.5])),
                      version=draw(st.integers(v_init - 12, v_init)),
                      ready=draw(st.sampled_from([0.0, 0.0, 0.3, 1.5])))
               for i in ids]
    aggs = (draw(st.permutations(range(1, hosts))) if chain else
            draw(st.lists(st.integers(1, hosts - 1), unique=True, max_size=4)))
    b = dict(updates=updates, network=network, server=0, aggs=aggs,
             tau_max=draw(st.sampled_from([inf, 0, 1, 3, 6, 12, 2.5])), v_init=v_init,
             start=draw(st.sampled_from([0.0, 0.0, 0.5])),
             agg_scale=draw(st.sampled_from([1.0, 2.0])))
    if cut_through:
        b["cut_through"] = True
    return b


def random_batch(rng, n, cut_through=False):
    """A seeded instance of n updates: like batches(), bigger, often on uniform links (ties).
    cut_through=True: that flag set, and half the time every other host an aggregator (so the
    pipeline case is possible when no worker is on the server's host)."""
    hosts = rng.randint(2, 12)

    def link(dead_ok):
        times = [0.0] + sorted(rng.sample([0.25, 0.5, 1.0, 2.0, 3.5, 6.0, 9.0],
                                          rng.randint(0, 3)))
        rates = [rng.choice(RATES) for _ in times]
        if rates[-1] == 0.0 and not (dead_ok and rng.random() < 0.3):
            rates[-1] = rng.choice(RATES[1:])
        return list(zip(times, rates))

    core, paths = [], {}
    if rng.random() < 0.3:
        core = [link(False) for _ in range(rng.randint(1, 2))]
        for _ in range(rng.randint(1, 6)):
            a, b = rng.randrange(hosts), rng.randrange(hosts)
            if a != b:
                paths[(a, b)] = rng.sample(range(len(core)), rng.randint(1, len(core)))
    if rng.random() < 0.4:
        rate = rng.choice(RATES[1:])
        network = Network([rate] * hosts, [rate] * hosts, core, paths)
    else:
        network = Network([link(True) for _ in range(hosts)], [link(True) for _ in range(hosts)],
                          core, paths)
    sizes = rng.choice([[1.0], [1.0, 2.0], [0.0, 1.0, 2.0, 5.0, 7.5, 0.3], [0.1, 0.7, 1.1, 3.3]])
    readies = rng.choice([[0.0], [0.0, 0.5, 1.5], [0.0, 0.1, 0.2, 0.7, 2.2]])
    v_init = 30
    updates = [Update(3 * i + rng.randint(0, 2),
                      rng.randrange(hosts) if rng.random() < 0.15 else rng.randint(1, hosts - 1),
                      rng.choice(sizes), version=rng.randint(v_init - 25, v_init),
                      ready=rng.choice(readies))
               for i in range(n)]
    rng.shuffle(updates)
    b = dict(updates=updates, network=network, server=0,
             aggs=rng.sample(range(1, hosts), rng.randint(0, min(6, hosts - 1))),
             tau_max=rng.choice([inf, 0, 2, 5, 12, 3.5, 20]), v_init=v_init,
             start=rng.choice([0.0, 0.0, 0.3]), agg_scale=rng.choice([1.0, 2.0]))
    if cut_through:
        b["cut_through"] = True
        if rng.random() < 0.5:
            b["aggs"] = rng.sample(range(1, hosts), hosts - 1)
    return b


# --- the fast path equals the reference ----------------------------------------------------------

def test_the_native_part_is_built():
    assert fast.available(), ("mlfabric._C lacks sched_run: rebuild with "
                              "`MLFABRIC_CUDA=0 python setup.py build_ext --inplace`")


@native
@PROPS
@given(batches())
def test_fast_and_plain_equal_the_reference(b):
    check_against_reference(b)


@native
@settings(max_examples=150, deadline=None)  # ~1 in 20 takes the pipeline, ~1 in 10 rejects it
@given(batches(cut_through=True))
def test_fast_and_plain_equal_the_reference_cut_through(b):
    check_against_reference(b)


@native
@pytest.mark.parametrize("cut_through", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_seeded_batches_up_to_60_updates_equal_the_reference(seed, cut_through):
    rng = random.Random(seed)
    for n in (0, 1, 2, 3, 7, 13, 29, 60):
        check_against_reference(random_batch(rng, n, cut_through))


@native
@pytest.mark.parametrize("cut_through", [False, True])
@pytest.mark.parametrize("n, rates", [(0, "N1"), (1, "N1"), (7, "N2"), (41, "N3"), (60, "N1")])
def test_benchmark_batches_equal_the_reference(n, rates, cut_through):
    kw = bench.instance(n, seed=n, rates=rates)
    aggs = aggregation.group_order(kw["aggregators"], kw["seed"])
    check_against_reference(dict(updates=kw["updates"], network=kw["network"], server=0,
                                 aggs=aggs, tau_max=kw["tau_max"], v_init=kw["v_init"],
                                 start=0.0, agg_scale=1.0, cut_through=cut_through))


def _pipeline_batch(hosts, rates, agg_scale=1.0, aggs=None, sizes=None):
    """One update per host 1..hosts-1, all ready at 0, to server 0; every worker an aggregator
    unless `aggs` says otherwise."""
    sizes = sizes or [10.0] * (hosts - 1)
    ups = [Update(i, i + 1, sizes[i], version=0) for i in range(hosts - 1)]
    return dict(updates=ups, network=Network(rates[0], rates[1]), server=0,
                aggs=list(range(hosts - 1, 0, -1)) if aggs is None else aggs, tau_max=inf,
                v_init=0, start=0.0, agg_scale=agg_scale, cut_through=True)


@native
@pytest.mark.parametrize("agg_scale", [1.0, 2.0])
def test_cut_through_pipeline_chosen_equals_the_reference(agg_scale):
    b = _pipeline_batch(7, ([10.0] * 7, [10.0] * 7), agg_scale)
    g = reference(b)[1]
    assert g.n_direct == 0 and len(g.aggregates) == 1 and g.makespan == g.pipeline
    assert len(g.aggregates[0].levels()) == 5
    check_against_reference(b)


@native
def test_cut_through_pipeline_not_chosen_equals_the_reference():
    # a slow egress in the chain holds the whole pipeline to its pace; the two-level groups
    # route around it (host 6 sends its own update straight to the server)
    b = _pipeline_batch(7, ([10.0] * 6 + [1.0], [10.0] * 7), 2.0)
    g = reference(b)[1]
    assert g.makespan < g.pipeline < inf
    assert all(a.upstream is None for a in g.aggregates)
    check_against_reference(b)


@native
def test_cut_through_pipeline_impossible_equals_the_reference():
    # host 3 may not aggregate, so no chain; the aggregates still relay cut-through
    b = _pipeline_batch(5, ([10.0] * 5, [4.0] + [10.0] * 4), aggs=[4, 2])
    g = reference(b)[1]
    assert g.pipeline == inf and g.aggregates
    check_against_reference(b)


def fractional_batch(rng):
    """A small cut_through batch on links with fractional rates and breakpoints: capped relays
    there often walk several segments, and the capped walk then rounds an ulp short of its
    inbound's end (t_en_relay's last branch)."""
    rates = (1.0, 2.5, 3.3, 5.0, 10.0, 0.7, 1.1)

    def link():
        times = [0.0] + sorted(rng.sample([0.1, 0.25, 0.3, 0.5, 0.7, 1.0, 1.3, 2.0],
                                          rng.randint(0, 4)))
        return [(t, rng.choice(rates)) for t in times]

    hosts = rng.randint(3, 6)
    network = Network([link() for _ in range(hosts)], [link() for _ in range(hosts)])
    ups = [Update(i, rng.randint(1, hosts - 1), rng.choice([0.3, 0.7, 1.1, 3.3, 1.0, 2.2]), 0,
                  ready=rng.choice([0.0, 0.1, 0.3])) for i in range(rng.randint(2, 6))]
    every = rng.random() < 0.5
    aggs = rng.sample(range(1, hosts), hosts - 1 if every else rng.randint(1, hosts - 1))
    return dict(updates=ups, network=network, server=0, aggs=aggs, tau_max=inf, v_init=0,
                start=0.0, agg_scale=rng.choice([1.0, 2.0]), cut_through=True)


@native
def test_cut_through_rounded_relays_equal_the_reference(monkeypatch):
    rounded = []
    relay = Network.t_en_relay

    def counting(nw, src, dst, size, start, inbound_end):
        end, segs = relay(nw, src, dst, size, start, inbound_end)
        if end == inbound_end and segs and inbound_end > start:
            free = nw.t_en(src, dst, size, start)[0]
            capped = network_module.t_en([nw.links[k] for k in nw.path(src, dst)]
                                         + [Profile(size / (inbound_end - start))], size, start)
            rounded.append(free < inbound_end and capped[0] < inbound_end)
        return end, segs

    monkeypatch.setattr(Network, "t_en_relay", counting)
    rng = random.Random(5)
    for _ in range(800):
        check_against_reference(fractional_batch(rng))
    assert sum(rounded) >= 5   # the instances do reach the rounding branch


@native
@pytest.mark.parametrize("cut_through", [False, True])
@PROPS
@given(batches(max_updates=16), st.sampled_from(scheduler.MODES), st.booleans(),
       st.sampled_from([None, 0.2, 5.0]), st.integers(0, 3))
def test_fast_schedule_equals_the_reference_schedule(cut_through, b, mode, momentum, after,
                                                     seed):
    kw = dict(aggregators=b["aggs"], tau_max=b["tau_max"], v_init=b["v_init"], start=b["start"],
              seed=seed, mode=mode, momentum=momentum, after=after, cut_through=cut_through)
    ref_plan, ref_net = scheduler.schedule(b["updates"], b["network"], 0, engine="reference", **kw)
    for engine in ("fast", "plain", "auto"):
        plan, net = scheduler.schedule(b["updates"], b["network"], 0, engine=engine, **kw)
        assert_same_fields(ref_plan, plan)
        assert bits(net) == bits(ref_net)
        assert str(plan) == str(ref_plan)


@native
def test_look_ahead_does_not_judge_a_bucket_by_the_forced_updates_worker():
    """Position 1: update 7, the shortest, is picked freely, and updates 0 and 1 (same bytes,
    same egress rate) share a bucket. Position 2: update 5 is due (dl = 2), 10 bytes over a
    1/s egress. The look-ahead must see that update 1 would finish long before it (so 5 is
    dropped), although update 0 — the bucket's lowest id — is now stuck behind 5 on its worker."""
    nw = Network([10.0, 1.0, 1.0, 1.0], [10.0] * 4)
    ups = [Update(7, 3, 0.5, 20), Update(5, 1, 10.0, 11), Update(0, 1, 1.0, 20),
           Update(1, 2, 1.0, 20)]
    b = dict(updates=ups, network=nw, server=0, aggs=[], tau_max=1, v_init=10, start=0.0,
             agg_scale=1.0)
    assert reference(b)[0].dropped == {5: "lookahead"}
    check_against_reference(b)


@native
def test_pruning_keeps_a_case_that_is_better_by_one_ulp():
    """Case 1 beats case 0 by a rounding error, and Alg. 3 keeps the strictly smaller one: a case
    may be cut only once its t_max reaches the best makespan so far, exactly."""
    ups = [Update(0, 1, 0.7, 0, ready=0.1), Update(1, 3, 0.3, 0, ready=0.1), Update(2, 1, 0.7, 0),
           Update(3, 2, 0.7, 0)]
    b = dict(updates=ups, network=Network.uniform(4, 1.1), server=0, aggs=[1, 2], tau_max=inf,
             v_init=0, start=0.0, agg_scale=1.0)
    g = reference(b)[1]
    assert g.n_direct == 1 and g.cases[1] == math.nextafter(g.cases[0], 0)
    check_against_reference(b)


@native
def test_group_one_keeps_the_orderings_transfers():
    # §5.2: group 1's schedules are Alg. 2's; the fast path hands back the very same objects
    b = random_batch(random.Random(7), 30)
    o, g = fast.schedule_fast(**b)
    assert all(t is o.transfers[t.ids[0]] for t in g.direct)


@native
def test_timings_account_for_the_phases():
    kw = bench.instance(20)
    t = {}
    scheduler.schedule(**kw, engine="fast", timings=t)
    assert set(t) == {"input", "order", "aggregate", "native_rest", "build"}
    assert all(v >= 0 for v in t.values())


# --- why no lazy heap of stale t_en values -------------------------------------------------------

@native
def test_a_reservation_can_shrink_t_en_so_stale_values_are_no_lower_bound():
    """Alg. 1 on three updates. Updates 0 and 1 both finish at 1.1 at first; once update 2 is
    reserved, update 1's walk is split at a new breakpoint and rounds to 1.0999999999999999,
    while update 0's stays 1.1. A lazy min-heap that trusts stale t_en values as lower bounds
    would take update 0 (its fresh 1.1 ties update 1's stale 1.1 and has the lower id); the
    reference takes update 1, and so does the fast path."""
    nw = Network([1.0, 1.0, 2.5, 2.5], [5.0, 2.5, 1.0, 10.0])
    ups = [Update(0, 1, 1.1, 0), Update(1, 3, 1.0, 0, ready=0.7), Update(2, 2, 2.0, 0, ready=0.1)]
    first = [nw.t_en(u.worker, 0, u.size, u.ready)[0] for u in ups]
    assert first[0] == first[1] == 1.1 and first[2] < 1.1
    after = nw.copy()
    after.send(2, 0, 2.0, 0.1)
    again = [after.t_en(u.worker, 0, u.size, u.ready)[0] for u in ups[:2]]
    assert again[0] == 1.1 and again[1] < 1.1 and again[1] == math.nextafter(1.1, 0)
    assert ordering.order_updates(ups, nw, 0).order == [2, 1, 0]
    assert fast.schedule_fast(ups, nw, 0, [])[0].order == [2, 1, 0]


# --- input checks --------------------------------------------------------------------------------

def _bad(**change):
    b = dict(updates=[Update(1, 1, 5.0, 3), Update(2, 2, 5.0, 3)], network=Network.uniform(4, 10.0),
             server=0, aggs=[3], tau_max=4, v_init=3)
    b.update(change)
    return b


@native
@pytest.mark.parametrize("change, match", [
    (dict(updates=[Update(1, 1, 5.0, 3), Update(1, 2, 5.0, 3)]), "ids must be unique"),
    (dict(aggs=[0]), "cannot be one of its aggregators"),
    (dict(aggs=[9]), "host 9 is not in this network"),
    (dict(server=-1), "host -1 is not in this network"),
    (dict(updates=[Update(1, 4, 5.0, 3)]), "host 4 is not in this network"),
    (dict(updates=[Update(1, 1, 5.0, 3, ready=-1.0)], start=-0.5),
     r"send time max\(ready, start\) must be >= 0, got -0.5"),
    (dict(updates=[Update(1, 1, math.nan, 3)]), "must not be NaN"),
    (dict(tau_max=-1), "tau_max must be >= 0, got -1"),
    (dict(agg_scale=0.5), "agg_scale must be >= 1, got 0.5"),
    (dict(network=[10.0]), "network must be a mlfabric.sched.Network"),
])
def test_bad_input_is_refused(change, match):
    with pytest.raises(ValueError, match=match):
        fast.schedule_fast(**_bad(**change))


@native
def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        scheduler.schedule([], Network.uniform(2, 1.0), 0, mode="eventual", engine="fast")
    with pytest.raises(ValueError, match="engine must be one of"):
        scheduler.schedule([], Network.uniform(2, 1.0), 0, engine="turbo")


def test_without_the_native_part_it_says_so(monkeypatch):
    monkeypatch.setattr(fast, "_run", None)
    assert not fast.available()
    with pytest.raises(RuntimeError, match="without the scheduler's fast path"):
        fast.schedule_fast(**_bad())
    # 'auto' falls back to the reference loops, which give the same plan
    b = random_batch(random.Random(3), 12)
    kw = dict(aggregators=b["aggs"], tau_max=b["tau_max"], v_init=b["v_init"], start=b["start"])
    auto, _ = scheduler.schedule(b["updates"], b["network"], 0, **kw)
    monkeypatch.undo()
    assert str(auto) == str(scheduler.schedule(b["updates"], b["network"], 0, engine="fast",
                                               **kw)[0])


# --- the benchmark -------------------------------------------------------------------------------

def test_benchmark_instance_follows_the_papers_setup():
    n = 40
    kw = bench.instance(n, seed=3)
    nw, ups = kw["network"], kw["updates"]
    assert nw.hosts == n // 2 + 1 and kw["server"] == 0
    assert kw["aggregators"] == list(range(1, n // 2 + 1))
    assert sorted(u.id for u in ups) == list(range(n))
    assert all(u.size == 100e6 and u.ready == 0.0 and u.worker != 0 for u in ups)
    assert all(sum(u.worker == w for u in ups) == 2 for w in kw["aggregators"])
    dl = [ordering.deadline(u, kw["tau_max"], kw["v_init"]) for u in ups]
    assert all(1 <= d <= 2 * n and d == int(d) for d in dl)
    rates = {p.v[0] for p in nw.links}
    assert all(len(p.t) == 1 for p in nw.links) and rates <= {1.25e9, 6.25e8}  # N1: 10, 5 Gbps
    with pytest.raises(ValueError, match="rates must be one of"):
        bench.instance(4, rates="N9")


@native
def test_benchmark_prints_and_records_every_column(tmp_path, capsys):
    path = tmp_path / "sched.json"
    assert bench_entry.main(["sched", "--sizes", "0,5,12", "--repeat", "2", "--profile",
                             "--json", str(path)]) == 0
    out = capsys.readouterr()
    assert "ms_median" in out.out and "where the fast path's time goes" in out.out
    assert "reference loops (Python), |U| = 12" in out.err
    rows = json.loads(path.read_text())["results"]
    assert [r["updates"] for r in rows] == [0, 5, 12]
    for r in rows:
        assert set(bench.COLUMNS) <= set(r) and r["match"] is True
        assert r["paper_ms"] == 5.0 and r["speedup_vs_paper"] > 0
        assert set(r["profile_ms"]) == {"input", "order", "aggregate", "native_rest", "build"}


def test_benchmark_rejects_bad_sizes():
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "10,x"])
    with pytest.raises(SystemExit):
        bench.main(["--repeat", "0"])
