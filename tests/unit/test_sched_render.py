"""mlfabric.sched.render: the PNG is written and non-empty for plans with and without aggregation
and replica transfers (and for sharded plans and distributions); the ASCII chart has one row per
host used and marks every commit."""
import re
import sys
from dataclasses import dataclass
from math import inf

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlfabric.sched import Commit, Network, Transfer, Update, gbps, schedule
from mlfabric.sched.distribution import distribute
from mlfabric.sched.network import Segment
from mlfabric.sched.render import timeline, timeline_text
from mlfabric.sched.sharded import ShardedUpdate, schedule_sharded

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _net(hosts=8):
    # a 2.5 Gbit/s server ingress makes aggregation worth it
    return Network([gbps(10)] * hosts, [gbps(2.5)] + [gbps(10)] * (hosts - 1))


def _updates(n=7, hosts=8):
    return [Update(i, 1 + i % (hosts - 1), 2e7, i % 3) for i in range(n)]


@dataclass
class FakeReplica:
    """Stands in for the replication step's output: render needs transfers(); `replica` (its
    host) and `commits`, when there, put the replica's commits on its row."""
    moves: list
    replica: int = None
    commits: list = None

    def transfers(self):
        return list(self.moves)


def _replica_transfer(src, dst, t0, t1, uid):
    rate = 1e7 / (t1 - t0)
    return Transfer(src, dst, 1e7, t0, t1, (Segment(t0, t1, rate),), "replica-update", (uid,))


def _plans():
    net = _net()
    plain, _ = schedule(_updates(), net, 0, tau_max=3, v_init=2)
    agg, nw = schedule(_updates(), net, 0, aggregators=[5, 6, 7])
    rep, _ = schedule(_updates(), net, 0, aggregators=[5, 6, 7])
    rep.replica = FakeReplica([_replica_transfer(1, 7, 0.0, 0.05, 0),
                               _replica_transfer(7, 6, 0.05, 0.08, 0)])
    empty, _ = schedule([], net, 0)
    return dict(plain=(plain, None), aggregated=(agg, nw), replica=(rep, net), empty=(empty, net))


def _png_ok(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000


@pytest.mark.parametrize("name", ["plain", "aggregated", "replica", "empty"])
def test_png_written(tmp_path, name):
    plan, net = _plans()[name]
    if name == "aggregated":
        assert plan.aggregates
    if name == "plain":
        assert plan.dropped and not plan.aggregates
    out = tmp_path / ("%s.png" % name)
    assert timeline(plan, out, network=net) == out
    _png_ok(out)
    import matplotlib.image
    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 100 and img.shape[1] > 100


def test_png_for_sharded_plan_and_distribution(tmp_path):
    net = _net()
    ups = [ShardedUpdate(i, 2 + i % 5, (2e7, 1e7), i % 2) for i in range(6)]
    sp, _ = schedule_sharded(ups, net, [0, 1], aggregators=[5, 6, 7])
    timeline(sp, tmp_path / "sharded.png", network=net)
    _png_ok(tmp_path / "sharded.png")
    d, _ = distribute(range(1, 8), Network([gbps(1)] + [gbps(10)] * 7, [gbps(10)] * 8), 0, 1e8,
                      distributors=[6, 7])
    timeline(d, tmp_path / "dist.png")
    _png_ok(tmp_path / "dist.png")


def test_png_needs_matplotlib(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    plan, _ = _plans()["aggregated"]
    with pytest.raises(ImportError, match="matplotlib"):
        timeline(plan, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    assert "commit" in timeline_text(plan)   # the text chart needs nothing


# --- ASCII -------------------------------------------------------------------------------------

def _rows(text):
    """{host: the row's cells} from the chart's body."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"h(\d+) [^|]*\|(.*)\|$", line)
        if m:
            assert int(m.group(1)) not in rows
            rows[int(m.group(1))] = m.group(2)
    return rows


def _hosts_used(plan):
    return {plan.server} | {h for t in plan.transfers() for h in (t.src, t.dst)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 9), st.integers(0, 10), st.sampled_from([inf, 1, 3]),
       st.lists(st.integers(1, 8), max_size=3, unique=True), st.integers(10, 100),
       st.integers(0, 2 ** 16))
def test_ascii_rows_and_commits(hosts, n, tau_max, aggs, width, seed):
    import random
    rng = random.Random(seed)
    net = Network([gbps(rng.choice([1, 5, 10])) for _ in range(hosts)],
                  [gbps(rng.choice([1, 5, 10])) for _ in range(hosts)])
    ups = [Update(i, rng.randrange(1, hosts), rng.choice([1e6, 1e7, 5e7]), rng.randrange(3),
                  rng.choice([0.0, 0.01])) for i in range(n)]
    plan, _ = schedule(ups, net, 0, aggregators=[a for a in aggs if a < hosts], tau_max=tau_max,
                       v_init=2, seed=seed)
    text = timeline_text(plan, width=width)
    rows = _rows(text)
    assert set(rows) == _hosts_used(plan)           # one row per host used, no other
    assert all(len(r) == width for r in rows.values())
    server_row = rows[plan.server]
    digits = [c for c in server_row if c.isdigit() or c == "+"]
    if all(c.isdigit() for c in digits):
        assert sum(int(c) for c in digits) == len(plan.commits)
    else:
        assert len(plan.commits) >= 10
    listed = re.findall(r"^commit (\d+) at S%d: t=(\S+) s, (.*) via h(\d+)$" % plan.server, text,
                        re.M)
    assert len(listed) == len(plan.commits)
    for (i, t, ids, via), c in zip(listed, plan.commits):
        assert float(t) == pytest.approx(c.time, rel=1e-5)
        assert ids.split() == ["u%d" % u for u in c.ids] and int(via) == c.via
    for uid in plan.dropped:
        assert "dropped u%d " % uid in text


def test_ascii_marks_transfers_on_sender_rows():
    plan, _ = _plans()["aggregated"]
    rows = _rows(timeline_text(plan))
    for a in plan.aggregates:
        assert "#" in rows[a.aggregator]            # the aggregate leaves the aggregator
        for t in a.inbound:
            if t.segments:
                assert "-" in rows[t.src]
    for t in plan.direct:
        assert "=" in rows[t.src]


def test_ascii_sharded_has_a_row_per_server_with_its_commits():
    net = _net()
    ups = [ShardedUpdate(i, 2 + i % 5, (2e7, 1e7), 0) for i in range(5)]
    sp, _ = schedule_sharded(ups, net, [0, 1])
    text = timeline_text(sp)
    rows = _rows(text)
    for p in sp.plans:
        assert sum(int(c) for c in rows[p.server] if c.isdigit()) == len(p.commits)


def test_replica_rows_and_commits(tmp_path):
    plan, net = _plans()["replica"]
    plan.replica.replica = 7
    plan.replica.commits = [Commit(0.08, (0,), 6)]
    text = timeline_text(plan)
    rows = _rows(text)
    assert set(rows) == _hosts_used(plan)
    assert "r" in rows[1] and "1" in rows[7]
    assert "commit 1 at replica h7: t=0.08 s, u0 via h6" in text
    assert re.search(r"^h7 \S*replica", text, re.M)   # h7 also works: "replica/worker"
    timeline(plan, tmp_path / "replica.png", network=net)
    _png_ok(tmp_path / "replica.png")


def test_ascii_bad_input():
    plan, _ = _plans()["plain"]
    with pytest.raises(ValueError, match="width"):
        timeline_text(plan, width=3)
    with pytest.raises(ValueError, match="expected a Plan"):
        timeline_text(object())
