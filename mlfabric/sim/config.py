"""A simulation's settings, checked once, and the layout they imply (which host runs what).

Defaults follow the paper's evaluation (§7): 30 workers on 15 machines, 10 Gbps NICs, a 100 MB model
(ResNet-50), C1 stragglers, N1 NIC rates redrawn every T = 5 s, monitor lag 0.2 s, a batch every
100 ms, tau_max = 30. The paper does not state the number of aggregators, the compute time per
iteration or the update norms; the defaults here (4 aggregators, or every worker machine if there
are fewer; 0.2 s; norms Uniform(0.5, 1.5)) are choices, listed in docs/sched/simulator.md.

Layout: hosts 0..hosts-1 are worker machines (worker w runs on host w % hosts, so workers spread
evenly), host `hosts` is the server's dedicated machine, host `hosts`+1 the replica's (paper §7:
scheduler, server and replica on a dedicated machine; the replica gets its own here because the
replication step needs its own NIC). The server's aggregators are k worker machines drawn with the
seed; the replica's k' = k are drawn from the other worker machines (fewer if too few are left).
"""
import random
from dataclasses import asdict, dataclass
from math import inf, isfinite

from mlfabric.sched import GBPS

from mlfabric.emulate.presets import compute_preset, net_preset

POLICIES = ("mlfabric", "mlfabric-ssp", "mlfabric-sync", "async", "buffered")
SCHEDULED = {"mlfabric": "async", "mlfabric-ssp": "ssp", "mlfabric-sync": "sync"}
DEFAULT_AGGREGATORS = 4  # the paper does not say how many it used


@dataclass
class SimConfig:
    """Every setting of a run (units: bytes, seconds, Gbit/s for rate_gbps); bad values raise
    ValueError naming them. See the module header for the defaults and the layout."""
    workers: int = 30
    hosts: int = 15                 # worker machines
    updates: int = 100              # updates pushed per worker (iterations in sync)
    size: float = 100e6             # bytes per update and per model
    compute_time: float = 0.2       # seconds per iteration before stragglers
    compute: str = "C1"             # straggler preset
    net: str = "N1"                 # NIC-rate preset
    rate_gbps: float = 10.0         # base NIC rate
    period: float = 5.0             # T: seconds between NIC-rate redraws
    t_lag: float = 0.2              # monitor lag (s)
    batch: float = 0.1              # scheduler batch interval (s)
    tau_max: float = 30             # delay bound (mlfabric; buffered)
    slack: int = 2                  # SSP slack K
    aggregators: int = None         # k aggregators for the server (and k' for the replica);
    #                                 None: 4, or every worker machine if there are fewer
    replica: bool = False
    div_max: float = inf            # Div_max (L2, units of the update norms)
    gamma: float = 0.9              # momentum (eq. 2)
    vectors: int = 0                # d > 0: real update vectors of dimension d (exact divergence)
    distribution: bool = False      # mlfabric policies: batched pulls through distribution trees
    seed: int = 0

    def __post_init__(self):
        def integer(name, lo):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError("%s must be an integer >= %d, got %r" % (name, lo, v))

        def positive(name):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float))
                    or not (isfinite(v) and v > 0)):
                raise ValueError("%s must be a finite number > 0, got %r" % (name, v))

        integer("workers", 1)
        integer("hosts", 1)
        integer("updates", 1)
        integer("slack", 0)
        if self.aggregators is not None:
            integer("aggregators", 0)
        integer("vectors", 0)
        integer("seed", 0)
        for name in ("size", "compute_time", "rate_gbps", "period", "batch"):
            positive(name)
        if self.hosts > self.workers:
            raise ValueError("hosts (%d) must not exceed workers (%d): every worker machine runs "
                             "at least one worker" % (self.hosts, self.workers))
        if self.k > self.hosts:
            raise ValueError("aggregators (%d) must not exceed the worker machines (%d) they run on"
                             % (self.k, self.hosts))
        if not (isinstance(self.t_lag, (int, float)) and isfinite(self.t_lag) and self.t_lag >= 0):
            raise ValueError("t_lag must be a finite number >= 0 seconds, got %r" % (self.t_lag,))
        if not (isinstance(self.tau_max, (int, float)) and self.tau_max >= 0
                and (self.tau_max == inf or float(self.tau_max).is_integer())):
            raise ValueError("tau_max must be a whole number >= 0 or inf, got %r" % (self.tau_max,))
        if not (isinstance(self.div_max, (int, float)) and self.div_max >= 0):
            raise ValueError("div_max must be a number >= 0 (inf: unbounded), got %r"
                             % (self.div_max,))
        if not (isinstance(self.gamma, (int, float)) and 0 <= self.gamma < 1):
            raise ValueError("gamma (momentum) must be in [0, 1), got %r" % (self.gamma,))
        if self.vectors and not self.replica:
            raise ValueError("vectors=%d only serve the exact replica divergence: set replica=True"
                             % self.vectors)
        compute_preset(self.compute)
        net_preset(self.net)

    # --- layout -----------------------------------------------------------------------------------
    @property
    def base_rate(self):
        return self.rate_gbps * GBPS

    @property
    def k(self):
        """The number of aggregators (aggregators=None: 4, or every worker machine if fewer)."""
        if self.aggregators is None:
            return min(DEFAULT_AGGREGATORS, self.hosts)
        return self.aggregators

    @property
    def server(self):
        return self.hosts

    @property
    def replica_host(self):
        return self.hosts + 1 if self.replica else None

    @property
    def fixed_hosts(self):
        return 2 if self.replica else 1

    def host_of(self, w):
        return w % self.hosts

    def aggregator_hosts(self):
        """(server's aggregators, replica's aggregators): worker machines drawn with the seed."""
        rnd = random.Random(self.seed * 7919 + 17)
        hosts = list(range(self.hosts))
        rnd.shuffle(hosts)
        k = self.k
        return sorted(hosts[:k]), sorted(hosts[k:2 * k])

    def as_dict(self):
        d = asdict(self)
        d["aggregators"] = self.k
        return d
