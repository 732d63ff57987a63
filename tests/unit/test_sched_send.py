"""The one-transfer accelerator of mlfabric.sched.network (csrc/sched_send.cc: t_en, NetUp and
send_path on the Profiles' own lists) against the module's Python, bit for bit: the same ends, the
same segments and the same lists afterwards, float for float (compared by float.hex)."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.sched import aggregation, network
from mlfabric.sched.network import Network, Profile, Segment

native = pytest.mark.skipif(network._t_en is None, reason="mlfabric._C without sched_send")

RATES = [0.0, 10.0, 25.0, 33.3, 60.0, 100.0, 0.1 + 0.2]


def _hex(p):
    return [x.hex() for x in p.t], [x.hex() for x in p.v]


def _seg_hex(segs):
    return None if segs is None else [(s.t0.hex(), s.t1.hex(), s.rate.hex()) for s in segs]


@st.composite
def profiles(draw):
    steps, t = [], 0.0
    for _ in range(draw(st.integers(1, 8))):
        steps.append((t, draw(st.sampled_from(RATES))))
        t += draw(st.sampled_from([0.1, 0.25, 0.5, 1.0, 1.7, 3.0]))
    if draw(st.booleans()):  # never zero forever, or t_en may find no capacity at all
        steps.append((t, draw(st.sampled_from(RATES[1:]))))
    return Profile(steps)


def _python(monkeypatch):
    monkeypatch.setattr(network, "_t_en", None)
    monkeypatch.setattr(network, "_subtract", None)
    monkeypatch.setattr(network, "_send_path", None)


def _copies(ps):
    return [p.copy() for p in ps]


@native
@settings(max_examples=60, deadline=None)
@given(st.lists(profiles(), min_size=1, max_size=4), st.floats(0.0, 5000.0),
       st.floats(0.0, 12.0), st.sampled_from([math.inf, 5.0, 20.0]), st.data())
def test_native_send_path_is_the_python_bit_for_bit(ps, size, start, limit, data):
    """send_path (and so t_en and subtract): the same (end, segments) and the same lists."""
    mp = pytest.MonkeyPatch()
    fast, slow = _copies(ps), _copies(ps)
    got = [network.send_path(fast, size, start, limit)]
    got_t_en = network.t_en(fast, size, start)
    more = data.draw(st.lists(st.tuples(st.floats(0.0, 900.0), st.floats(0.0, 8.0)), max_size=5))
    got += [network.send_path(fast, s, t, limit) for s, t in more]
    try:
        _python(mp)
        want = [network.send_path(slow, size, start, limit)]
        want_t_en = network.t_en(slow, size, start)
        want += [network.send_path(slow, s, t, limit) for s, t in more]
    finally:
        mp.undo()
    assert [(e.hex(), _seg_hex(s)) for e, s in got] == [(e.hex(), _seg_hex(s)) for e, s in want]
    assert (got_t_en[0].hex(), _seg_hex(got_t_en[1])) == (want_t_en[0].hex(),
                                                          _seg_hex(want_t_en[1]))
    assert [_hex(p) for p in fast] == [_hex(p) for p in slow]


@native
@settings(max_examples=60, deadline=None)
@given(profiles(), st.lists(st.tuples(st.floats(0.0, 10.0), st.sampled_from([0.0, 0.3, 1.0, 2.5,
                                                                               math.inf]),
                                      st.sampled_from([0.0, 5.0, 10.0, 0.1])), max_size=8))
def test_native_subtract_is_profile_subtract(p, cuts):
    """Profile.subtract (split, take off, merge the touched window) on arbitrary intervals, also
    driving values negative and back: the same lists as the Python, equal neighbours merged."""
    mp = pytest.MonkeyPatch()
    fast, slow = p.copy(), p.copy()
    for t0, d, r in cuts:
        fast.subtract(t0, t0 + d, r)
    try:
        _python(mp)
        for t0, d, r in cuts:
            slow.subtract(t0, t0 + d, r)
    finally:
        mp.undo()
    assert _hex(fast) == _hex(slow)
    assert all(a != b for a, b in zip(fast.v, fast.v[1:]))


@native
def test_network_send_and_segments_are_the_plain_objects(monkeypatch):
    def build():
        return Network([[(0.0, 10.0), (1.0, 5.0)], 20.0], [30.0, [(0.0, 4.0), (2.0, 8.0)]])
    nw = build()
    end, segs = nw.send(0, 1, 25.0, 0.5)
    assert all(type(s) is Segment for s in segs) and len(segs) > 1
    with monkeypatch.context() as mp:
        _python(mp)
        ref = build()
        assert (end, segs) == ref.send(0, 1, 25.0, 0.5)
    assert [p.steps() for p in nw.links] == [p.steps() for p in ref.links]
    with pytest.raises(Exception):
        segs[0].rate = 1.0  # still frozen
    assert network.send_path(nw.links[:1], 1.0, 0.0, segments=False) == (0.1, None)


def test_send_path_reserves_nothing_past_the_limit_or_without_capacity():
    p, q = Profile([(0.0, 10.0), (2.0, 0.0)]), Profile(20.0)
    assert network.send_path((p, q), 15.0, 0.0, limit=1.0) == (1.5, None)
    assert p.steps() == [(0.0, 10.0), (2.0, 0.0)] and q.steps() == [(0.0, 20.0)]
    end, segs = network.send_path((p, q), 50.0, 0.0)
    assert end == math.inf and segs is None and p.steps() == [(0.0, 10.0), (2.0, 0.0)]
    with pytest.raises(ValueError, match="before time 0"):
        network.send_path((p,), 1.0, -1.0)
    assert network.send_path((), 5.0, 3.0) == (3.0, ())


def test_t_en_falls_back_to_python_for_objects_that_are_not_lists():
    class Tuples:
        def __init__(self, t, v):
            self.t, self.v = t, v
    end, segs = network.t_en([Tuples((0.0, 1.0), (10.0, 20.0))], 30.0, 0.0)
    assert end == 2.0 and segs == (Segment(0.0, 1.0, 10.0), Segment(1.0, 2.0, 20.0))


@pytest.mark.skipif(aggregation._shuffle_seeded is None, reason="no native shuffle_seeded")
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10 ** 6), max_size=40, unique=True),
       st.one_of(st.integers(-2 ** 64 + 1, 2 ** 64 - 1), st.integers(-50, 50),
                 st.sampled_from([2 ** 32 - 1, 2 ** 32, -2 ** 32])))
def test_native_group_order_is_random_shuffle(aggs, seed):
    """The aggregators' pre-assignment: the very permutation of random.Random(seed).shuffle,
    computed natively."""
    assert aggregation.group_order(aggs, seed) == aggregation.group_order_python(aggs, seed)


def test_native_group_order_past_one_twist_of_the_generator():
    """More than 624 draws: the generator's lazy first twist, then ordinary ones."""
    for n, seed in ((230, 5), (700, 2 ** 40 + 3), (1300, 0)):
        assert (aggregation.group_order(range(n), seed)
                == aggregation.group_order_python(range(n), seed))


def test_group_order_falls_back_for_other_seeds():
    for seed in (2 ** 64, -2 ** 70, True, 3.5, "abc"):
        assert (aggregation.group_order([1, 2, 3, 4], seed)
                == aggregation.group_order_python([1, 2, 3, 4], seed))


def test_planned_network_builds_its_links_on_first_use_as_a_copy():
    """schedule()'s network after the plan: the reference engine's, also when the input network
    changes after the call (its links were copied, not shared)."""
    from mlfabric.sched import Update, schedule
    ups = [Update(1, 1, 500.0, 0, 0.0), Update(2, 2, 800.0, 0, 0.1)]
    nets = [Network.uniform(4, 100.0) for _ in range(2)]
    _, fast = schedule(ups, nets[0], 0, aggregators=[3], tau_max=5)
    _, ref = schedule(ups, nets[1], 0, aggregators=[3], tau_max=5, engine="reference")
    nets[0].send(1, 0, 1000.0, 0.0)
    assert isinstance(fast, Network) and fast.hosts == ref.hosts
    assert [p.steps() for p in fast.links] == [p.steps() for p in ref.links]
    assert fast.copy().links[0].steps() == ref.links[0].steps()


def test_planned_network_copies_and_pickles_like_a_network():
    import copy
    import pickle
    from mlfabric.sched import Update, schedule
    ups = [Update(1, 1, 500.0, 0, 0.0)]
    _, ref = schedule(ups, Network.uniform(3, 100.0), 0, engine="reference")
    for dup in (copy.deepcopy, lambda n: pickle.loads(pickle.dumps(n))):
        _, nw = schedule(ups, Network.uniform(3, 100.0), 0)
        assert [p.steps() for p in dup(nw).links] == [p.steps() for p in ref.links]
