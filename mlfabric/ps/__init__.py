"""mlfabric.ps: parameter-server training on the mlfabric runtime (paper §4-§7).

The API of the paper's Table 1 (api.py), with the paper's names as aliases:
registerAsWorker = register_as_worker, push, get, AllReduce = allreduce, registerAsServer =
register_as_server, registerUpdateCallback = on_update, registerRequestCallback = on_request,
registerAsReplica = register_as_replica.

Modes (init(mode=...)): 'mlfabric-A' (async, tau_max, drops, aggregation), 'mlfabric-S' (sync
with dynamic aggregation), 'ssp' (stale synchronous, slack K), 'async' (vanilla parameter server:
no scheduling, no aggregation), and the MPI baselines 'rr-sync' / 'tr-sync' (ring / binary-tree
allreduce among the workers, mlfabric.ps.allreduce_baselines).
"""
from .api import (agree_to_start, allreduce, applied_log, dropped, finish, get, init,
                  local_model, on_request, on_update, push, register_as_replica,
                  register_as_server, register_as_worker, role, serve)

# the paper's names (Table 1)
registerAsWorker = register_as_worker
registerAsServer = register_as_server
registerAsReplica = register_as_replica
registerUpdateCallback = on_update
registerRequestCallback = on_request
AllReduce = allreduce

__all__ = ["init", "agree_to_start", "role", "register_as_worker", "push", "get", "dropped", "finish", "register_as_server",
           "on_update", "on_request", "register_as_replica", "serve", "local_model", "applied_log",
           "registerAsWorker", "registerAsServer", "registerAsReplica", "registerUpdateCallback",
           "registerRequestCallback", "allreduce", "AllReduce"]
