"""Server and replica models, for the replica's divergence (paper §3.3, eq. 2, eq. 11).

Without update vectors the simulator only has norms, and reports the norm-only bound on
||w_s - w_r||. With vectors=d every update carries a random direction in R^d scaled to its norm, and
both models evolve exactly by eq. 2 (mlfabric.sched.divergence.Momentum): in async SGD every update
is one momentum step (an aggregate has exactly its members' effect applied one by one, which the
aggregator achieves by sending the weighted sums of divergence.aggregate_weights); in sync SGD an
iteration is one step (§6). The exact ||w_s - w_r|| is then reported next to the bound.

ChainBound is the bound for a replica fed by the server itself (chain replication, the baselines):
the replica applies a prefix of the server's sequence, so its history bound is the server's at that
prefix and eq. 11 telescopes to H_{r+1} + ... + H_s (divergence.lead_bounds), a difference of prefix
sums: O(1) per update.
"""
import numpy as np

from mlfabric.sched.divergence import Momentum

_VECTOR_STREAM = 0x56


class UpdateVectors:
    """Update uid's vector: a seeded random direction scaled to its norm (same for every policy)."""

    def __init__(self, dim, seed, per_worker, norm_of):
        self.dim = dim
        self.seed = seed
        self.per_worker = per_worker
        self.norm_of = norm_of

    def __call__(self, uid):
        w, i = divmod(uid, self.per_worker)
        x = np.random.default_rng([self.seed, _VECTOR_STREAM, w, i]).standard_normal(self.dim)
        return x * (self.norm_of(w, i) / np.linalg.norm(x))


class ModelPair:
    """The server's and the replica's models, both from rest at w = 0."""

    def __init__(self, vectors, gamma):
        self.vec = vectors
        self.server = Momentum(np.zeros(vectors.dim), gamma=gamma)
        self.replica = Momentum(np.zeros(vectors.dim), gamma=gamma)

    def apply_server(self, uid, ends_step=True):
        self.server.apply(self.vec(uid), ends_step)

    def apply_replica(self, uid, ends_step=True):
        self.replica.apply(self.vec(uid), ends_step)

    def end_server_step(self):
        self.server.end_step()

    def divergence(self):
        return float(np.linalg.norm(self.server.w - self.replica.w))


class ChainBound:
    """Norm-only bound on ||w_s - w_r|| when the replica has applied a prefix of the server's
    (async) sequence: sum of the server's history bounds H_k over the replica's lag."""

    def __init__(self, gamma):
        self.gamma = gamma
        self.h = 0.0           # H after the server's last update
        self.prefix = [0.0]    # prefix[k] = H_1 + ... + H_k

    def server_applied(self, norm):
        self.h = norm + self.gamma * self.h
        self.prefix.append(self.prefix[-1] + self.h)

    def bound(self, replica_applied):
        return max(0.0, self.prefix[-1] - self.prefix[replica_applied])
