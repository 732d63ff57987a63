"""mlfabric.sched: the MLfabric scheduler's algorithms as pure computation (no MPI, no I/O, no
sleeping). It takes plain data — ready updates, the network's residual capacity over time — and
returns a Plan: per update its position or drop reason, next hop and transfer intervals; per
aggregate its members; the server's commit times; the replica's frozen and punted transfers.

Paper sections, module by module (docs/sched/ explains each next to its section):
  network.py      network model, t_en, NetUp (§5.1, Fig. 4)
  ordering.py     shortest transfer first, deadlines, look-ahead drop (Alg. 1, Alg. 2)
  aggregation.py  k+1 groups through aggregators (Alg. 3)
  scheduler.py    one batch: ordering then aggregation; async / SSP / sync modes (§5, §6)
  divergence.py   server-replica divergence under momentum, the eq. 11 bound
  replication.py  bounded-divergence replication: freeze, punt, delay the last transfer (§5.3)
  sharded.py      a model split across servers (§10.2, eq. 18)
  distribution.py model distribution trees (§10.3)
  oracle.py       the §10.1 ILP as an exact oracle for tiny instances (needs scipy)
  fast.py         the same ordering and aggregation in C++ (mlfabric._C)
  render.py       text and PNG timelines of a plan
"""
from .distribution import Distribution, distribute
from .network import GBPS, Network, Profile, Segment, gbps, t_en
from .plan import (DROP_LOOKAHEAD, DROP_NO_PATH, DROP_REASONS, DROP_SLOW, DROP_STALE, Aggregate,
                   Commit, Plan, Transfer, Update)
from .render import timeline, timeline_text
from .replication import ReplicaPlan, ReplicaState, replicate
from .scheduler import MODES, schedule
from .sharded import ShardedPlan, ShardedUpdate, schedule_sharded

__all__ = ["GBPS", "gbps", "Network", "Profile", "Segment", "t_en", "Update", "Transfer",
           "Aggregate", "Commit", "Plan", "DROP_STALE", "DROP_LOOKAHEAD", "DROP_NO_PATH",
           "DROP_SLOW", "DROP_REASONS", "MODES", "schedule", "ReplicaState", "ReplicaPlan",
           "replicate",
           "ShardedUpdate", "ShardedPlan", "schedule_sharded", "Distribution", "distribute",
           "timeline", "timeline_text"]
