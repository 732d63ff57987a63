"""mlfabric.runtime.idset.IdSet, the accounting's compact id set: it behaves as a Python set of
the same ids under every operation the ledger uses, and stays small."""
import pickle

from hypothesis import given, settings, strategies as st

from mlfabric.runtime.idset import IdSet

# update ids as the runtime makes them: (rank << 32) | index, some with bit 31 (allreduce)
ids = st.builds(lambda rank, ar, i: (rank << 32) | (ar << 31) | i,
                st.integers(0, 5), st.integers(0, 1), st.integers(0, 300))
id_lists = st.lists(ids, max_size=60)


@settings(max_examples=200, deadline=None)
@given(id_lists, id_lists)
def test_behaves_as_a_set(a, b):
    sa, sb = IdSet(a), IdSet(b)
    assert len(sa) == len(set(a)) and list(sa) == sorted(set(a))
    assert all(x in sa for x in a) and all((x in sa) == (x in set(a)) for x in b)
    assert list(sa | sb) == sorted(set(a) | set(b))
    assert list(sa & sb) == sorted(set(a) & set(b))
    assert list(sa - sb) == sorted(set(a) - set(b))
    assert (sa <= sb) == (set(a) <= set(b))
    assert list(sa & set(b)) == sorted(set(a) & set(b))   # a plain set on the right
    assert sa == IdSet(reversed(a)) and sa == set(a)
    assert (sa == IdSet(a + b)) == (set(b) <= set(a))
    merged = IdSet(a)
    merged |= set(b)
    assert list(merged) == sorted(set(a) | set(b)) and len(merged) == len(set(a) | set(b))
    merged.update(b)  # adding what is there changes nothing
    assert len(merged) == len(set(a) | set(b))
    for x in b:
        merged.discard(x)
    assert list(merged) == sorted(set(a) - set(b)) and len(merged) == len(set(a) - set(b))
    # pickling round trip (the ledgers travel to the scheduler)
    back = pickle.loads(pickle.dumps(sa))
    assert list(back) == list(sa) and len(back) == len(sa)


def test_copies_are_independent():
    a = IdSet([1, 2])
    b = a.copy()
    b.add(3)
    c = a | [5 << 32]
    assert list(a) == [1, 2] and list(b) == [1, 2, 3] and list(c) == [1, 2, 5 << 32]


def test_a_long_jobs_ids_stay_small():
    # 8 workers x 50,000 pushes: about a byte per id, where a set of ints takes ~30-70
    n = 50_000
    everything = [(w << 32) | i for w in range(2, 10) for i in range(n)]
    s = IdSet(everything)
    assert len(s) == 8 * n
    assert len(pickle.dumps(s)) < 2 * 8 * n                      # < 2 bytes per id
    assert len(pickle.dumps(set(everything))) > 4 * len(pickle.dumps(s))


reasons = st.sampled_from(["stale", "lookahead", "server-failed", "worker-failed"])
drop_lists = st.lists(st.tuples(ids, reasons), max_size=60)


@settings(max_examples=200, deadline=None)
@given(drop_lists, drop_lists, id_lists)
def test_drops_behave_as_a_dict_of_reasons(a, b, pushed):
    """ledger.Drops, the dropped ids by reason: as a dict id -> reason (the last reason recorded
    for an id wins, in writes and in merges), and its counts are of distinct ids."""
    from mlfabric.runtime.ledger import Drops
    ref, d = {}, Drops()
    for uid, why in a:
        ref[uid] = why
        d[uid] = why
    assert len(d) == len(ref) and sorted(d.items()) == sorted(ref.items())
    assert sorted(d) == sorted(ref) and list(d.ids()) == sorted(ref)
    assert all(d[uid] == why for uid, why in ref.items())
    assert all((uid in d) == (uid in ref) for uid, _ in b)
    other = dict(b)
    ref.update(other)
    d.update(Drops(other))
    assert sorted(d.items()) == sorted(ref.items()) and len(d) == len(ref)
    counts = {}
    for uid, why in ref.items():
        if uid in set(pushed):
            counts[why] = counts.get(why, 0) + 1
    assert {r: n for r, n in d.counts(IdSet(pushed)).items() if n} == counts
    back = pickle.loads(pickle.dumps(d))
    assert sorted(back.items()) == sorted(d.items())
    never = 7 << 40      # no worker's id
    assert never not in d
    try:
        d[never]
    except KeyError:
        pass
    else:
        raise AssertionError("a never-dropped id has a reason")
