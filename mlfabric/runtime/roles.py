"""Which rank does what, decided in one place (paper §4): rank 0 is the scheduler, the next
`servers` ranks are the servers (the model sharded across them, §10.2), the next `replicas` ranks
replicate the first `replicas` servers one each, and every other rank is a worker. Aggregators and
distributors are not ranks of their own: they are the workers' daemons, as in the paper, where they
are co-hosted with workers.
"""
from dataclasses import dataclass

from ..errors import MlfabricError

SCHEDULER, SERVER, REPLICA, WORKER = "scheduler", "server", "replica", "worker"


@dataclass(frozen=True)
class Roles:
    size: int
    servers: int = 1
    replicas: int = 0

    def __post_init__(self):
        if not (isinstance(self.servers, int) and self.servers >= 1):
            raise MlfabricError("servers must be an int >= 1, got %r" % (self.servers,))
        if not (isinstance(self.replicas, int) and 0 <= self.replicas <= self.servers):
            raise MlfabricError("replicas must be an int in [0, servers=%d] (one replica per "
                                "server at most), got %r" % (self.servers, self.replicas))
        need = 1 + self.servers + self.replicas + 1
        if self.size < need:
            raise MlfabricError(
                "%d ranks are too few for 1 scheduler, %d server(s), %d replica(s) and at least "
                "one worker: start at least %d (mpirun -n %d ...)"
                % (self.size, self.servers, self.replicas, need, need))

    @property
    def scheduler(self):
        return 0

    @property
    def server_ranks(self):
        return list(range(1, 1 + self.servers))

    @property
    def replica_ranks(self):
        return list(range(1 + self.servers, 1 + self.servers + self.replicas))

    @property
    def worker_ranks(self):
        return list(range(1 + self.servers + self.replicas, self.size))

    def role(self, rank):
        if rank == 0:
            return SCHEDULER
        if rank <= self.servers:
            return SERVER
        if rank <= self.servers + self.replicas:
            return REPLICA
        return WORKER

    def replica_of(self, server):
        """The replica rank of server rank `server`, or None."""
        i = server - 1
        return 1 + self.servers + i if 0 <= i < self.replicas else None

    def server_of(self, replica):
        return replica - self.servers

    def worker_index(self, rank):
        """0-based number of a worker rank (its row in the emulation's traces), None otherwise."""
        return rank - (1 + self.servers + self.replicas) if self.role(rank) == WORKER else None

    def describe(self):
        return ("scheduler 0, servers %s, replicas %s, workers %s"
                % (self.server_ranks, self.replica_ranks or "none", _span(self.worker_ranks)))


def _span(ranks):
    return "%d-%d" % (ranks[0], ranks[-1]) if len(ranks) > 1 else str(ranks[0])
