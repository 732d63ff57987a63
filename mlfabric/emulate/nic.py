"""The emulated NIC of one rank and the emulation settings of a job.

An EmulatedNic keeps two calendars, egress and ingress: taking n bytes at time `now` books them
behind everything booked before at the direction's current rate and returns when they are through.
The data plane sends (or admits) a chunk only when its calendar says so, which is how a shared
link's rate is enforced on a machine whose real links are shared memory.

Choices where the paper is silent (also in mlfabric/emulate/presets.py):
- Ranks that are not workers (scheduler, servers, replicas) sit on dedicated machines (§7): their
  NICs run at the base rate throughout, whatever the preset.
- A chunk is charged at the rate in force when it is booked; chunks are small (milliseconds of
  transfer), so a rate change is felt within one chunk.
"""
import time
from dataclasses import dataclass

from .presets import ComputeTrace, NicTrace, compute_preset, net_preset


@dataclass(frozen=True)
class Emulation:
    """What to emulate: compute preset (C0-C3), network preset (N0-N3), the bytes/s that stand for
    the paper's 10 Gbps, the rate-change period T and the seed. C0/N0 mean no stragglers and
    constant base-rate NICs; `base_rate=None` turns pacing off (links as fast as the machine)."""
    compute: str = "C0"
    network: str = "N0"
    base_rate: float = 100e6
    period: float = 5.0
    seed: int = 0

    def __post_init__(self):
        compute_preset(self.compute)   # ValueError naming the unknown preset
        net_preset(self.network)
        if self.base_rate is not None and not self.base_rate > 0:
            raise ValueError("base_rate must be > 0 bytes/s (or None: no pacing), got %r"
                             % (self.base_rate,))
        if not self.period > 0:
            raise ValueError("period must be > 0 seconds, got %r" % (self.period,))

    def nic(self, worker_index, workers, t0):
        """The NIC of a rank: worker number `worker_index` of `workers` follows the preset; None
        (a dedicated machine) runs at the base rate. Time is counted from t0 (time.monotonic())."""
        if self.base_rate is None:
            return EmulatedNic(None, None, None, t0)
        if worker_index is None:
            return EmulatedNic(None, self.base_rate, self.base_rate, t0)
        trace = NicTrace(self.network, 2 * workers, self.base_rate, self.period, self.seed)
        return EmulatedNic(trace, worker_index, workers + worker_index, t0)

    def compute_trace(self, workers, base_time):
        """The compute preset's step times for `workers` workers of nominal step base_time
        (ComputeTrace.time(worker, iteration); a straggling step takes s times as long)."""
        return ComputeTrace(self.compute, workers, base_time, self.seed)


class EmulatedNic:
    """Rates and pacing calendars of one rank's NIC. With no trace, `egress`/`ingress` are constant
    rates in bytes/s, or None for unlimited; with a trace they are the trace's link numbers."""

    def __init__(self, trace, egress, ingress, t0):
        self.trace, self._egress, self._ingress, self.t0 = trace, egress, ingress, t0
        self.egress_free = self.ingress_free = 0.0  # when each calendar is next free (monotonic)
        self.bytes_out = self.bytes_in = 0          # totals, for the monitor

    @property
    def paced(self):
        return self.trace is not None or self._egress is not None

    def egress_rate(self, now=None):
        """Bytes/s out at `now` (time.monotonic(); default now); None when unlimited."""
        return self._rate(self._egress, now)

    def ingress_rate(self, now=None):
        return self._rate(self._ingress, now)

    def _rate(self, link, now):
        if self.trace is None:
            return link
        now = time.monotonic() if now is None else now
        return self.trace.rate(link, now - self.t0)

    def take_egress(self, nbytes, now):
        """Book nbytes out at `now`; returns when they are through (now, when unlimited)."""
        self.bytes_out += nbytes
        self.egress_free = self._take(self.egress_free, self.egress_rate(now), nbytes, now)
        return self.egress_free

    def take_ingress(self, nbytes, now):
        self.bytes_in += nbytes
        self.ingress_free = self._take(self.ingress_free, self.ingress_rate(now), nbytes, now)
        return self.ingress_free

    @staticmethod
    def _take(free, rate, nbytes, now):
        start = free if free > now else now
        return start if rate is None else start + nbytes / rate
