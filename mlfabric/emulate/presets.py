"""Background load presets of the paper's evaluation (§7), as named, seeded traces.

Compute stragglers C1-C3: each worker, each iteration, is slowed down by a factor s with
probability r. NIC-rate processes N1-N3: every T seconds (5 s in the paper) each NIC direction of
every worker machine is independently set to one of {1, 2.5, 3.3, 5, 10} Gbps with probabilities p,
emulating {9, 3, 2, 1, 0} contending flows. Rates are scaled to a base rate (the paper's 10 Gbps).

Traces are counter-based: the draw for (worker, iteration) or (period, link) depends only on the
seed and those indices, never on the order in which a simulation asks for them, so every policy
run with the same seed sees the same stragglers and the same NIC rates.

Choices where the paper is silent:
- All NICs change rate on one grid (t = kT), each drawing independently (the paper says "every T
  seconds", not with which phase).
- Only worker machines vary: the server and the replica are on dedicated machines (§7), whose
  NICs run at the base rate throughout.
- A straggling iteration takes s times the base compute time; other iterations take exactly the
  base time (the paper's emulation slows the compute stage and adds no other noise).
- Update norms, needed by the divergence bound, are drawn Uniform(0.5, 1.5) per (worker,
  iteration) from the same seeded stream.
"""
from dataclasses import dataclass

import numpy as np

RATES_GBPS = (1.0, 2.5, 3.3, 5.0, 10.0)  # the paper's NIC rates; 10 Gbps is the base rate
PAPER_BASE_GBPS = 10.0

_COMPUTE_STREAM = 0x43   # seed-sequence tags, so compute and network draws never share a stream
_NIC_STREAM = 0x4E
_CHUNK = 256             # iterations (or periods) generated per draw


@dataclass(frozen=True)
class ComputePreset:
    """(r, s): each iteration is slowed by factor `slowdown` with probability `prob`."""
    name: str
    prob: float
    slowdown: float


@dataclass(frozen=True)
class NetPreset:
    """Probabilities of the rates RATES_GBPS (scaled to the base rate), redrawn every period."""
    name: str
    probs: tuple


COMPUTE_PRESETS = {
    "C0": ComputePreset("C0", 0.0, 1.0),    # no stragglers (a reference point, not in the paper)
    "C1": ComputePreset("C1", 0.10, 2.0),   # the paper's default
    "C2": ComputePreset("C2", 0.10, 4.0),
    "C3": ComputePreset("C3", 0.04, 2.0),
}
NET_PRESETS = {
    "N0": NetPreset("N0", (0.0, 0.0, 0.0, 0.0, 1.0)),  # constant base rate (not in the paper)
    "N1": NetPreset("N1", (0.0, 0.0, 0.0, 0.1, 0.9)),  # the paper's default
    "N2": NetPreset("N2", (0.0, 0.1, 0.1, 0.1, 0.7)),
    "N3": NetPreset("N3", (0.5, 0.0, 0.0, 0.0, 0.5)),
}


def compute_preset(name):
    """The ComputePreset named `name` (C0-C3), or ValueError naming it."""
    if isinstance(name, ComputePreset):
        return name
    key = name.upper() if isinstance(name, str) else None
    if key not in COMPUTE_PRESETS:
        raise ValueError("unknown compute preset %r (known: %s)"
                         % (name, ", ".join(COMPUTE_PRESETS)))
    return COMPUTE_PRESETS[key]


def net_preset(name):
    """The NetPreset named `name` (N0-N3), or ValueError naming it."""
    if isinstance(name, NetPreset):
        return name
    key = name.upper() if isinstance(name, str) else None
    if key not in NET_PRESETS:
        raise ValueError("unknown network preset %r (known: %s)"
                         % (name, ", ".join(NET_PRESETS)))
    return NET_PRESETS[key]


class ComputeTrace:
    """Compute time and update norm of every (worker, iteration) for a compute preset."""

    def __init__(self, preset, workers, base_time, seed=0):
        self.preset = compute_preset(preset)
        if not base_time > 0:
            raise ValueError("compute time must be > 0 seconds, got %r" % (base_time,))
        self.workers = int(workers)
        self.base_time = float(base_time)
        self.seed = int(seed)
        self._chunks = {}  # (worker, chunk) -> (times list, norms list)

    def _chunk(self, w, c):
        key = (w, c)
        got = self._chunks.get(key)
        if got is None:
            rng = np.random.default_rng([self.seed, _COMPUTE_STREAM, w, c])
            slow = rng.random(_CHUNK) < self.preset.prob
            times = np.where(slow, self.base_time * self.preset.slowdown, self.base_time)
            norms = rng.uniform(0.5, 1.5, _CHUNK)
            got = self._chunks[key] = (times.tolist(), norms.tolist())
        return got

    def time(self, w, i):
        """Seconds worker w spends computing its i-th update (0-based)."""
        return self._chunk(w, i // _CHUNK)[0][i % _CHUNK]

    def norm(self, w, i):
        """L2 norm of worker w's i-th update."""
        return self._chunk(w, i // _CHUNK)[1][i % _CHUNK]


class NicTrace:
    """NIC rates of `links` varying links (bytes/s), piecewise constant over periods of `period` s.

    rate(link, t) is the rate at time t; period_rates(k) all links' rates in period k (a numpy
    array); steps(link, until) the trace as [(t, rate), ...] from t = 0, the form
    mlfabric.sched.Network takes."""

    def __init__(self, preset, links, base_rate, period=5.0, seed=0):
        self.preset = net_preset(preset)
        if not base_rate > 0:
            raise ValueError("base rate must be > 0 bytes/s, got %r" % (base_rate,))
        if not period > 0:
            raise ValueError("the rate-change period T must be > 0 seconds, got %r" % (period,))
        self.links = int(links)
        self.base_rate = float(base_rate)
        self.period = float(period)
        self.seed = int(seed)
        self.levels = np.array(RATES_GBPS) * (self.base_rate / PAPER_BASE_GBPS)
        self._cdf = np.cumsum(self.preset.probs)
        self._cdf[-1] = 1.0
        self._chunks = {}
        self._lists = {}  # period -> rates as a Python list (fast scalar reads)

    def _chunk(self, c):
        got = self._chunks.get(c)
        if got is None:
            rng = np.random.default_rng([self.seed, _NIC_STREAM, c])
            u = rng.random((_CHUNK, self.links))
            idx = np.searchsorted(self._cdf, u, side="right")
            got = self._chunks[c] = self.levels[np.minimum(idx, len(self.levels) - 1)]
        return got

    def period_index(self, t):
        return max(0, int(t // self.period))

    def period_rates(self, k):
        """Rates of all links during period k (k*T <= t < (k+1)*T)."""
        return self._chunk(k // _CHUNK)[k % _CHUNK]

    def rate(self, link, t):
        """Rate of `link` at time t (t < 0 reads period 0)."""
        k = int(t // self.period) if t > 0 else 0
        rates = self._lists.get(k)
        if rates is None:
            if len(self._lists) > 4:
                self._lists.clear()
            rates = self._lists[k] = self.period_rates(k).tolist()
        return rates[link]

    def steps(self, link, until):
        """[(t, rate), ...] from 0 covering [0, until] (the last rate holds after)."""
        out = []
        for k in range(self.period_index(until) + 1):
            r = float(self.period_rates(k)[link])
            if not out or out[-1][1] != r:
                out.append((k * self.period, r))
        return out


def network_traces(preset, worker_hosts, base_rate, until, period=5.0, seed=0, fixed_hosts=1):
    """Egress and ingress capacity traces for mlfabric.sched.Network: `worker_hosts` machines whose
    NICs follow the preset, then `fixed_hosts` dedicated machines (server, replica) at the base
    rate. Returns (egress, ingress), one [(t, rate), ...] list per host."""
    tr = NicTrace(preset, 2 * worker_hosts, base_rate, period, seed)
    egress = [tr.steps(h, until) for h in range(worker_hosts)]
    ingress = [tr.steps(worker_hosts + h, until) for h in range(worker_hosts)]
    fixed = [[(0.0, float(base_rate))] for _ in range(fixed_hosts)]
    return egress + fixed, ingress + [list(f) for f in fixed]
