"""Command line: python -m mlfabric.sim — run policies on one setting and print them side by side.

    python -m mlfabric.sim --workers 30 --hosts 15 --updates 100 \\
        --policy mlfabric,async,buffered --compute C1 --net N1 --tau-max 30 \\
        [--replica --div-max 20 --gamma 0.9 [--vectors 64]] [--json out.json] [--plot out.png]

Every policy gets the same seed, hence the same stragglers and the same NIC-rate trace. Long runs
print a progress line on stderr every few seconds (--quiet turns it off).
"""
import argparse
import json
import sys
from math import inf

from .config import DEFAULT_AGGREGATORS, POLICIES, SimConfig
from mlfabric.emulate.presets import COMPUTE_PRESETS, NET_PRESETS


def _number_or_inf(text):
    if text.strip().lower() in ("inf", "infinity", "none"):
        return inf
    x = float(text)
    return int(x) if x.is_integer() else x


def parser():
    p = argparse.ArgumentParser(prog="python -m mlfabric.sim", description=(
        "Simulate parameter-server training traffic under mlfabric's scheduler and under "
        "uncontrolled baselines (docs/sched/simulator.md)."))
    d = SimConfig()
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--hosts", type=int, default=None,
                   help="worker machines (default: workers / 2, as the paper's 30 on 15)")
    p.add_argument("--updates", type=int, default=d.updates, help="updates pushed per worker")
    p.add_argument("--policy", default="mlfabric,async,buffered",
                   help="comma-separated, from: " + ", ".join(POLICIES))
    p.add_argument("--compute", default=d.compute, help="stragglers: " + ", ".join(COMPUTE_PRESETS))
    p.add_argument("--net", default=d.net, help="NIC rates: " + ", ".join(NET_PRESETS))
    p.add_argument("--tau-max", type=_number_or_inf, default=d.tau_max, help="delay bound (or inf)")
    p.add_argument("--slack", type=int, default=d.slack, help="SSP slack K (mlfabric-ssp)")
    p.add_argument("--aggregators", type=int, default=None,
                   help="k aggregators (default: %d, or every worker machine if fewer)"
                   % DEFAULT_AGGREGATORS)
    p.add_argument("--size-mb", type=float, default=d.size / 1e6, help="update and model size, MB")
    p.add_argument("--compute-time", type=float, default=d.compute_time,
                   help="seconds per iteration before stragglers")
    p.add_argument("--rate-gbps", type=float, default=d.rate_gbps, help="base NIC rate")
    p.add_argument("--period", type=float, default=d.period, help="T: NIC-rate redraw period, s")
    p.add_argument("--t-lag", type=float, default=d.t_lag, help="monitor lag, s")
    p.add_argument("--batch", type=float, default=d.batch, help="scheduler batch interval, s")
    p.add_argument("--replica", action="store_true", help="add a replica (mlfabric: §5.3 "
                   "bounded divergence; baselines: chain replication through the server)")
    p.add_argument("--div-max", type=_number_or_inf, default=d.div_max, help="Div_max (or inf)")
    p.add_argument("--gamma", type=float, default=d.gamma, help="momentum")
    p.add_argument("--vectors", type=int, default=0,
                   help="dimension of real update vectors (exact divergence; needs --replica)")
    p.add_argument("--distribution", action="store_true", help="mlfabric policies: answer each "
                   "batch of pulls with one version through distribution trees (§10.3)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="FILE", help="write the reports as JSON")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of delays and update rates")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    from . import compare, plot, table
    hosts = args.hosts if args.hosts is not None else max(1, args.workers // 2)
    try:
        cfg = SimConfig(
            workers=args.workers, hosts=hosts, updates=args.updates, size=args.size_mb * 1e6,
            compute_time=args.compute_time, compute=args.compute, net=args.net,
            rate_gbps=args.rate_gbps, period=args.period, t_lag=args.t_lag, batch=args.batch,
            tau_max=args.tau_max, slack=args.slack, aggregators=args.aggregators,
            replica=args.replica, div_max=args.div_max, gamma=args.gamma, vectors=args.vectors,
            distribution=args.distribution, seed=args.seed)
        reports = compare(cfg, args.policy, progress=not args.quiet)
    except ValueError as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    print(table(reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": reports[0].to_dict()["config"],
                       "reports": {r.policy: r.to_dict() for r in reports}}, f, indent=1)
    if args.plot:
        plot(reports, args.plot)
    return 0
