"""mlfabric.emulate: a shared cluster's effects on one machine (paper §7), by the paper's names.

Compute stragglers C1-C3 (each worker, each iteration, slowed by s with probability r) and NIC-rate
processes N1-N3 (every T = 5 s each NIC direction redrawn from {1, 2.5, 3.3, 5, 10} Gbps), seeded
and counter-based, so every training mode run with the same seed meets the same stragglers and the
same rates. The runtime applies them by pacing its data plane (EmulatedNic) and by stretching each
worker's compute step (Emulation.compute_trace); the simulator (mlfabric.sim) reads the same traces.

    Emulation("C2", "N1", base_rate=50e6)   # 10 Gbps of the paper stands for 50 MB/s here
"""
from .nic import EmulatedNic, Emulation
from .presets import (COMPUTE_PRESETS, NET_PRESETS, RATES_GBPS, ComputePreset, ComputeTrace,
                      NetPreset, NicTrace, compute_preset, net_preset, network_traces)

__all__ = ["Emulation", "EmulatedNic", "COMPUTE_PRESETS", "NET_PRESETS", "RATES_GBPS",
           "ComputePreset", "NetPreset", "ComputeTrace", "NicTrace", "compute_preset",
           "net_preset", "network_traces"]
