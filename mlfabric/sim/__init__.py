"""mlfabric.sim: a discrete-event simulator of parameter-server training traffic under mlfabric's
scheduler and under uncontrolled baselines (paper §3.1.1, §5-§7), for planning beyond one machine.

    from mlfabric.sim import SimConfig, simulate, compare
    report = simulate(SimConfig(workers=30, hosts=15, updates=100), "mlfabric")
    print(report)                       # the metrics; report.to_json() for machines
    reports = compare(SimConfig(), ["mlfabric", "async", "buffered"])

The mlfabric policies plan every batch with mlfabric.sched.schedule (and replicate with
mlfabric.sched.replication) — the functions the runtime calls — on a lagged view of the network, and
execute the plans on the true one. CLI: python -m mlfabric.sim --help. Documentation:
docs/sched/simulator.md.

Modules: presets (C1-C3, N1-N3 traces), config (settings, layout), engine (event queue), fairshare
(max-min solvers), truth (the true network), monitor (the scheduler's lagged view), accounts (update
log, versions, SSP gate), models (replica divergence), run (the worker cycle), scheduled (mlfabric,
mlfabric-ssp, mlfabric-sync), buffering and baselines (async, buffered), report, cli.
"""
from dataclasses import replace

from .config import POLICIES, SimConfig
from mlfabric.emulate.presets import (COMPUTE_PRESETS, NET_PRESETS, ComputeTrace, NicTrace, network_traces)
from .report import Report, plot, table

__all__ = ["POLICIES", "SimConfig", "Report", "simulate", "compare", "table", "plot",
           "COMPUTE_PRESETS", "NET_PRESETS", "ComputeTrace", "NicTrace", "network_traces"]


def simulate(config=None, policy="mlfabric", *, progress=False, **settings):
    """Run one policy; returns its Report. `config` is a SimConfig (default: the paper's setting);
    keyword settings override its fields (simulate(workers=10, updates=20))."""
    cfg = config if config is not None else SimConfig()
    if not isinstance(cfg, SimConfig):
        raise ValueError("config must be a SimConfig, got %r" % (config,))
    if settings:
        cfg = replace(cfg, **settings)
    if policy not in POLICIES:
        raise ValueError("unknown policy %r (known: %s)" % (policy, ", ".join(POLICIES)))
    if policy in ("async", "buffered"):
        from .baselines import FairShareRun
        return FairShareRun(cfg, policy, progress).simulate()
    from .scheduled import ScheduledRun
    return ScheduledRun(cfg, policy, progress).simulate()


def compare(config=None, policies=("mlfabric", "async", "buffered"), *, progress=False,
            **settings):
    """Run several policies on the same settings and seed (so the same stragglers and NIC rates);
    returns their Reports in order."""
    if isinstance(policies, str):
        policies = [p.strip() for p in policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise ValueError("unknown policy %r (known: %s)" % (p, ", ".join(POLICIES)))
    return [simulate(config, p, progress=progress, **settings) for p in policies]
