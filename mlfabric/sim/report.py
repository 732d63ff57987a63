"""What a simulation measured: a dataclass with a text form, JSON, a side-by-side table of several
policies and an optional PNG plot.

Metrics (simulated time = when the last update was applied or dropped):
- updates_per_s: updates applied per simulated second (an aggregate of m counts m).
- delay_*: over applied updates, tau = server version after the update - version it was computed
  from (so a lone worker's update has delay 1); histogram by delay; over_tau_max counts delays above
  the configured bound (0 for mlfabric and buffered by construction).
- dropped_fraction and dropped_reasons: mlfabric.sched.plan's DROP_* reasons.
- server_util: bytes into the server's NIC / (its capacity x simulated time); server_out_util the
  same for the server's egress (model pulls, and replica copies under chain replication).
- replica_bytes, divergence_bound (largest norm-only bound on ||w_s - w_r|| where checked: every
  batch end for mlfabric, iteration ends for sync, every server update for chain replication),
  divergence_exact (with update vectors), divergence_violations (checks where exact > bound),
  bound_unmet (batches where the replication step could not meet Div_max), replica_lag (updates the
  replica still lacks at the end).
- sched_*: wall time of mlfabric.sched.schedule (+ replicate) per batch.
"""
import json
from dataclasses import asdict, dataclass
from math import inf

import numpy as np

from .accounts import AGGREGATED, DIRECT, DROPPED


@dataclass
class Report:
    policy: str
    config: dict
    pushed: int
    applied: int
    aggregated: int
    dropped: int
    dropped_reasons: dict
    dropped_fraction: float
    sim_time: float
    updates_per_s: float
    delay_mean: float
    delay_var: float
    delay_max: int
    delay_hist: dict
    over_tau_max: int
    latency_mean: float
    server_bytes: float
    server_util: float
    server_out_bytes: float
    server_out_util: float
    replica_bytes: float = None
    replica_lag: int = None
    divergence_bound: float = None
    divergence_exact: float = None
    divergence_checks: int = 0
    divergence_violations: int = 0
    bound_unmet: int = 0
    held: int = None
    batches: int = 0
    sched_time_mean: float = 0.0
    sched_time_max: float = 0.0
    sched_time_total: float = 0.0
    wall_time: float = 0.0
    events: int = 0

    def to_dict(self):
        return _plain(asdict(self))

    def to_json(self, **kw):
        return json.dumps(self.to_dict(), **kw)

    def __str__(self):
        return table([self])


def build_report(run, wall):
    cfg, log = run.cfg, run.log
    status = np.frombuffer(bytes(log.status), dtype=np.uint8)
    applied_mask = (status == DIRECT) | (status == AGGREGATED)
    delays = np.array(log.delay, dtype=np.int64)[applied_mask]
    done = np.array(log.done)
    ready = np.array(log.ready)
    sim_time = float(done.max()) if len(done) else 0.0
    applied = int(applied_mask.sum())
    reasons = {}
    for r in log.reason.values():
        reasons[r] = reasons.get(r, 0) + 1
    hist = {}
    if applied:
        vals, counts = np.unique(delays, return_counts=True)
        hist = {int(v): int(c) for v, c in zip(vals, counts)}
    cap = cfg.base_rate * sim_time
    times = run.sched_times
    return Report(
        policy=run.policy, config=cfg.as_dict(), pushed=log.n_pushed, applied=applied,
        aggregated=int((status == AGGREGATED).sum()), dropped=int((status == DROPPED).sum()),
        dropped_reasons=reasons, dropped_fraction=float((status == DROPPED).mean()),
        sim_time=sim_time, updates_per_s=applied / sim_time if sim_time > 0 else 0.0,
        delay_mean=float(delays.mean()) if applied else 0.0,
        delay_var=float(delays.var()) if applied else 0.0,
        delay_max=int(delays.max()) if applied else 0, delay_hist=hist,
        over_tau_max=int((delays > cfg.tau_max).sum()) if applied else 0,
        latency_mean=float((done - ready)[applied_mask].mean()) if applied else 0.0,
        server_bytes=run.server_bytes, server_util=run.server_bytes / cap if cap else 0.0,
        server_out_bytes=run.server_out_bytes,
        server_out_util=run.server_out_bytes / cap if cap else 0.0,
        replica_bytes=run.replica_bytes, replica_lag=getattr(run, "replica_lag", None),
        divergence_bound=run.div_bound, divergence_exact=run.div_exact,
        divergence_checks=run.div_checks, divergence_violations=run.div_violations,
        bound_unmet=run.bound_unmet,
        held=getattr(getattr(run, "buffer", None), "held", None),
        batches=len(times), sched_time_mean=float(np.mean(times)) if times else 0.0,
        sched_time_max=float(np.max(times)) if times else 0.0,
        sched_time_total=float(np.sum(times)) if times else 0.0,
        wall_time=wall, events=run.engine.events)


def _plain(x):
    """JSON-safe: inf/nan as strings, numpy scalars as Python numbers, dict keys as strings."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if x != x:
            return "nan"
        if x in (inf, -inf):
            return "inf" if x > 0 else "-inf"
        return x
    return x


# --- text -----------------------------------------------------------------------------------------
_ROWS = [
    ("updates applied / s", lambda r: "%.2f" % r.updates_per_s),
    ("applied (aggregated)", lambda r: "%d (%d)" % (r.applied, r.aggregated)),
    ("dropped", lambda r: "%.1f%% %s" % (100 * r.dropped_fraction, _reasons(r.dropped_reasons))),
    ("delay mean / var", lambda r: "%.2f / %.2f" % (r.delay_mean, r.delay_var)),
    ("delay max", lambda r: "%d" % r.delay_max),
    ("delays > tau_max", lambda r: "%d" % r.over_tau_max),
    ("held in server buffer", lambda r: "-" if r.held is None else "%d" % r.held),
    ("push->apply latency s", lambda r: "%.3f" % r.latency_mean),
    ("server NIC in util", lambda r: "%.1f%%" % (100 * r.server_util)),
    ("bytes at server GB", lambda r: "%.2f" % (r.server_bytes / 1e9)),
    ("server NIC out util", lambda r: "%.1f%%" % (100 * r.server_out_util)),
    ("replica bytes GB", lambda r: "-" if r.replica_bytes is None
     else "%.2f" % (r.replica_bytes / 1e9)),
    ("replica lag at end", lambda r: "-" if r.replica_lag is None else "%d" % r.replica_lag),
    ("divergence bound max", lambda r: _num(r.divergence_bound)),
    ("divergence exact max", lambda r: _num(r.divergence_exact)),
    ("exact > bound / unmet", lambda r: "-" if r.divergence_bound is None
     else "%d / %d" % (r.divergence_violations, r.bound_unmet)),
    ("simulated time s", lambda r: "%.2f" % r.sim_time),
    ("batches", lambda r: "%d" % r.batches),
    ("scheduler ms/batch", lambda r: "-" if not r.batches
     else "%.2f (max %.1f)" % (1e3 * r.sched_time_mean, 1e3 * r.sched_time_max)),
    ("wall time s", lambda r: "%.2f" % r.wall_time),
]


def _num(x):
    return "-" if x is None else "%.4g" % x


def _reasons(d):
    return "" if not d else "(" + ", ".join("%s %d" % kv for kv in sorted(d.items())) + ")"


def table(reports):
    """The policies side by side, one column each."""
    head = ["metric"] + [r.policy for r in reports]
    rows = [[name] + [f(r) for r in reports] for name, f in _ROWS]
    width = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(width[0]) if i == 0 else c.rjust(width[i])  # noqa: E731
                                for i, c in enumerate(row))
    return "\n".join([fmt(head), "  ".join("-" * w for w in width)] + [fmt(r) for r in rows])


def plot(reports, path):
    """PNG: delay histograms (left) and update rate / dropped fraction (right) per policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in reports:
        if r.delay_hist:
            xs = sorted(r.delay_hist)
            ys = np.array([r.delay_hist[x] for x in xs], dtype=float)
            ax1.step(xs, ys / ys.sum(), where="mid", label=r.policy)
    tau = reports[0].config.get("tau_max") if reports else None
    if tau not in (None, inf):
        ax1.axvline(tau, color="k", ls="--", lw=0.8, label="tau_max")
    ax1.set_xlabel("delay (versions)")
    ax1.set_ylabel("fraction of applied updates")
    ax1.legend()
    names = [r.policy for r in reports]
    x = np.arange(len(reports))
    ax2.bar(x - 0.2, [r.updates_per_s for r in reports], 0.4, label="updates applied / s")
    ax2.set_xticks(x)
    ax2.set_xticklabels(names)
    ax2.set_ylabel("updates applied / s")
    ax3 = ax2.twinx()
    ax3.bar(x + 0.2, [100 * r.dropped_fraction for r in reports], 0.4, color="tab:red",
            label="dropped %")
    ax3.set_ylabel("dropped %")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
