"""Matrix factorisation by SGD: a seeded low-rank matrix with noise, seen through a random subset
of its entries, learned as R ~ U V^T. The model is one flat vector

    model = [ U row-major, shape (rows, rank) | V row-major, shape (cols, rank) ]

MfWorker.gradient(model, batch) returns the update -lr * grad of the minibatch loss

    L(batch) = 1/2 sum_{(i, j, r) in batch} [ (u_i . v_j - r)^2 + l2 (|u_i|^2 + |v_j|^2) ]

(a sum, not a mean, over entries: the classic SGD step per rating, so lr does not shrink with how
rarely a row is seen; regularisation on the rows a batch touches, as in SGD matrix
factorisation). rmse(model, entries) is the metric; with enough observed entries the test RMSE
falls to about the noise level.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Entries:
    """Observed entries (i[n], j[n], value[n]) of a rows x cols matrix."""
    i: np.ndarray
    j: np.ndarray
    value: np.ndarray
    rows: int
    cols: int

    def __post_init__(self):
        i, j, v = (np.asarray(a) for a in (self.i, self.j, self.value))
        if not (i.ndim == j.ndim == v.ndim == 1 and i.size == j.size == v.size):
            raise ValueError(f"i, j and value must be 1-D of one length, got shapes {i.shape}, "
                             f"{j.shape}, {v.shape}")
        if int(self.rows) < 1 or int(self.cols) < 1:
            raise ValueError(f"rows and cols must be >= 1, got {self.rows} x {self.cols}")
        if i.size and (i.min() < 0 or i.max() >= self.rows or j.min() < 0 or j.max() >= self.cols):
            raise ValueError(f"entry indices out of a {self.rows} x {self.cols} matrix")

    def __len__(self):
        return len(self.value)

    def take(self, idx):
        """The entries at positions idx (an index array or slice)."""
        return Entries(self.i[idx], self.j[idx], self.value[idx], self.rows, self.cols)

    def shard(self, rank, size):
        """Worker `rank` of `size`'s contiguous part (sizes differ by at most one)."""
        rank, size = int(rank), int(size)
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size, got rank={rank}, size={size}")
        n = len(self)
        return self.take(slice(n * rank // size, n * (rank + 1) // size))


def _split(model, rows, cols):
    """(U, V) views of a flat model over a rows x cols matrix; the rank follows from the size."""
    model = np.asarray(model)
    if model.ndim != 1 or model.size == 0 or model.size % (rows + cols):
        raise ValueError(f"a factor model of a {rows} x {cols} matrix is a 1-D vector of "
                         f"rank * {rows + cols} entries, got shape {model.shape}")
    rank = model.size // (rows + cols)
    return model[:rows * rank].reshape(rows, rank), model[rows * rank:].reshape(cols, rank)


def low_rank_problem(rows, cols, rank, density=0.3, noise=0.1, test_fraction=0.2, seed=0):
    """A seeded problem: R = U* V*^T + N(0, noise^2), with U*, V* entries N(0, 1/sqrt(rank)) so
    that R's entries have unit variance. A `density` fraction of the entries is observed; those
    are split into (train, test) Entries. Returns (train, test, true_model)."""
    rows, cols, rank = int(rows), int(cols), int(rank)
    if min(rows, cols, rank) < 1:
        raise ValueError(f"rows, cols and rank must be >= 1, got {rows}, {cols}, {rank}")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    rng = np.random.default_rng([seed, 13])
    scale = rank ** -0.25
    U = scale * rng.standard_normal((rows, rank))
    V = scale * rng.standard_normal((cols, rank))
    n_obs = max(2, int(round(density * rows * cols)))
    flat = rng.choice(rows * cols, size=min(n_obs, rows * cols), replace=False)
    i, j = flat // cols, flat % cols
    value = np.einsum("nk,nk->n", U[i], V[j]) + noise * rng.standard_normal(flat.size)
    n_test = max(1, int(round(test_fraction * flat.size)))
    obs = Entries(i, j, value, rows, cols)
    return obs.take(slice(n_test, None)), obs.take(slice(0, n_test)), np.concatenate(
        [U.ravel(), V.ravel()])


def init_model(rows, cols, rank, seed=0, scale=0.1):
    """Small seeded random factors (zero factors are a saddle point SGD never leaves)."""
    rng = np.random.default_rng([seed, 17])
    return scale * rng.standard_normal((int(rows) + int(cols)) * int(rank))


def rmse(model, entries):
    """Root mean squared error of U V^T over the given entries."""
    if len(entries) == 0:
        raise ValueError("rmse needs at least one entry")
    U, V = _split(model, entries.rows, entries.cols)
    err = np.einsum("nk,nk->n", U[entries.i], V[entries.j]) - entries.value
    return float(np.sqrt(np.mean(err ** 2)))


def loss(model, batch, l2=0.0):
    """The minibatch loss L(batch) above (float64), the function gradient() differentiates."""
    U, V = _split(np.asarray(model, dtype=np.float64), batch.rows, batch.cols)
    u, v = U[batch.i], V[batch.j]
    err = np.einsum("nk,nk->n", u, v) - batch.value
    return float(0.5 * (err @ err + l2 * ((u * u).sum() + (v * v).sum())))


class MfWorker:
    """One worker's observed entries. gradient(model, batch) is the update from a given batch;
    step(model) takes the worker's next minibatch (reshuffled every epoch, fixed by seed)."""

    def __init__(self, entries, rank, lr=0.05, l2=0.01, batch_size=64, seed=0):
        if not isinstance(entries, Entries):
            raise ValueError(f"entries must be an mf.Entries, got {type(entries).__name__}")
        if len(entries) == 0:
            raise ValueError("a worker needs at least one observed entry")
        if int(rank) < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if not lr > 0 or l2 < 0:
            raise ValueError(f"need lr > 0 and l2 >= 0, got lr={lr!r}, l2={l2!r}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.entries, self.rank = entries, int(rank)
        self.lr, self.l2, self.batch_size, self.seed = lr, l2, int(batch_size), seed
        self.size = (entries.rows + entries.cols) * self.rank
        self.epoch, self._order, self._at = 0, self._permutation(0), 0

    def _permutation(self, epoch):
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.entries))

    def model0(self):
        return init_model(self.entries.rows, self.entries.cols, self.rank, self.seed)

    def next_batch(self):
        if self._at >= len(self._order):
            self.epoch += 1
            self._order, self._at = self._permutation(self.epoch), 0
        idx = self._order[self._at:self._at + self.batch_size]
        self._at += self.batch_size
        return self.entries.take(idx)

    def gradient(self, model, batch):
        """-lr * dL(batch)/dmodel, a dense vector of the model's size (zero outside the rows and
        columns the batch touches), in the model's floating dtype."""
        model = np.asarray(model)
        if model.shape != (self.size,) or not np.issubdtype(model.dtype, np.floating):
            raise ValueError(f"expected a floating model of {self.size} entries, got shape "
                             f"{model.shape} dtype {model.dtype}")
        if (batch.rows, batch.cols) != (self.entries.rows, self.entries.cols):
            raise ValueError(f"batch is of a {batch.rows} x {batch.cols} matrix, the worker's of "
                             f"{self.entries.rows} x {self.entries.cols}")
        U, V = _split(model.astype(np.float64, copy=False), batch.rows, batch.cols)
        u, v = U[batch.i], V[batch.j]
        err = np.einsum("nk,nk->n", u, v) - batch.value
        grad = np.zeros(self.size)
        gU, gV = _split(grad, batch.rows, batch.cols)
        # np.add.at: an entry's row or column may repeat within a batch; contributions add
        np.add.at(gU, batch.i, err[:, None] * v + self.l2 * u)
        np.add.at(gV, batch.j, err[:, None] * u + self.l2 * v)
        grad *= -self.lr
        return grad.astype(model.dtype, copy=False)

    def step(self, model):
        """The update from this worker's next minibatch, computed at `model`."""
        return self.gradient(model, self.next_batch())
