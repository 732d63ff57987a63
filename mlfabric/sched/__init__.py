"""mlfabric.sched: the MLfabric scheduler's algorithms as pure computation (no MPI, no I/O, no
sleeping). It takes plain data — ready updates, the network's residual capacity over time — and
returns a Plan: per update its position or drop reason, next hop and transfer intervals; per
aggregate its members; the server's commit times; the replica's frozen and punted transfers.

Paper sections: network model and t_en §5.1/Fig. 4 (network.py), ordering Alg. 1-2 (ordering.py),
aggregation Alg. 3 (aggregation.py), the batch pipeline and sync/SSP modes §6 (scheduler.py).
"""
from .network import GBPS, Network, Profile, Segment, gbps, t_en
from .plan import (DROP_LOOKAHEAD, DROP_NO_PATH, DROP_REASONS, DROP_STALE, Aggregate, Commit, Plan,
                   Transfer, Update)
from .scheduler import MODES, schedule

__all__ = ["GBPS", "gbps", "Network", "Profile", "Segment", "t_en", "Update", "Transfer",
           "Aggregate", "Commit", "Plan", "DROP_STALE", "DROP_LOOKAHEAD", "DROP_NO_PATH",
           "DROP_REASONS", "MODES", "schedule"]
