"""mlfabric.runtime: the machinery that turns the scheduler's plans into transfers (paper §4).

  roles.py      which rank is the scheduler, a server, a replica, a worker
  core.py       one rank's runtime: config, communicators, clock, start-up handshake
  control.py    the control plane (small pickled messages on their own communicator)
  dataplane.py  the data plane: paced point-to-point payloads on another communicator
  daemon.py     the background thread that drives both for the rank's role
  scheduler.py  the scheduler rank: batches, mlfabric.sched plans, plan parts to daemons
  worker.py     a worker's pushes, gets, aggregator duty
  server.py     a server's model, apply order, answers to gets
  replica.py    a replica: the server's order, bounded divergence
  monitor.py    the network monitor (reports every t_lag)
  ledger.py     accounting: pushed = applied + dropped, per update id
  idset.py      the accounting's compact sets of update ids (a byte per id)

The user-facing API (the paper's Table 1) is mlfabric.ps.
"""
from .core import ALLREDUCE_MODES, MODES, PS_MODES, Config
from .ledger import Ledger, Summary
from .roles import Roles

__all__ = ["Config", "MODES", "PS_MODES", "ALLREDUCE_MODES", "Roles", "Ledger", "Summary"]
