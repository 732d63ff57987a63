"""Datasets for the classifier workloads, and how a worker gets its part of them.

digits(): scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), the small stand-in for
the paper's ImageNet runs (§7); synthetic_classification(): seeded Gaussian blobs needing nothing
beyond numpy. shard() gives each data-parallel worker a contiguous, deterministic slice; batches()
walks a slice in a per-epoch shuffled order. Features are float32, labels int64.
"""
import numpy as np


def _check_fraction(test_fraction):
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")


def _split(X, y, seed, test_fraction):
    """A seeded random train/test split: (X_train, y_train, X_test, y_test)."""
    n = len(X)
    n_test = int(round(n * float(test_fraction)))
    if not 0 < n_test < n:
        raise ValueError(f"test_fraction={test_fraction} leaves an empty train or test set "
                         f"out of {n} samples")
    order = np.random.default_rng(seed).permutation(n)
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def digits(seed=0, test_fraction=0.2):
    """The 8x8 digits as (X_train, y_train, X_test, y_test): X float32 of shape (n, 64) in [0, 1]
    (the raw pixels are 0..16), y int64 in 0..9. The split is a seeded permutation."""
    _check_fraction(test_fraction)
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("mlfabric.workloads.digits needs scikit-learn: "
                          "pip install scikit-learn") from e
    d = load_digits()
    X = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    return _split(X, y, seed, test_fraction)


def synthetic_classification(n, features, classes, seed=0, test_fraction=0.2, separation=4.0):
    """Gaussian blobs, a drop-in for digits() with no dependency: (X_train, y_train, X_test,
    y_test). Class centres are random directions at distance `separation` from the origin; each
    sample is its centre plus N(0, 1) noise per feature, so with many features the classes are
    close to linearly separable (pairwise centre distance about separation * sqrt(2))."""
    n, features, classes = int(n), int(features), int(classes)
    if features < 1:
        raise ValueError(f"features must be >= 1, got {features}")
    if classes < 2:
        raise ValueError(f"classes must be >= 2, got {classes}")
    if n < 2 * classes:
        raise ValueError(f"n must be at least 2 * classes = {2 * classes}, got {n}")
    if not separation > 0:
        raise ValueError(f"separation must be > 0, got {separation!r}")
    _check_fraction(test_fraction)
    rng = np.random.default_rng([seed, 7])
    centres = rng.standard_normal((classes, features))
    centres *= separation / np.linalg.norm(centres, axis=1, keepdims=True)
    y = np.arange(n, dtype=np.int64) % classes      # balanced classes
    X = (centres[y] + rng.standard_normal((n, features))).astype(np.float32)
    return _split(X, y, seed, test_fraction)


def shard(X, y, rank, size):
    """Worker `rank` of `size`'s contiguous part of (X, y), as views. Shard sizes differ by at
    most one and the shards, in rank order, cover the data exactly once."""
    if len(X) != len(y):
        raise ValueError(f"X and y differ in length: {len(X)} vs {len(y)}")
    rank, size = int(rank), int(size)
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    n = len(X)
    a, b = n * rank // size, n * (rank + 1) // size
    return X[a:b], y[a:b]


def batches(X, y, batch_size, seed=0, epoch=0, drop_last=False):
    """Yield (X_batch, y_batch) over one epoch in a shuffled order fixed by (seed, epoch), so every
    worker and every rerun sees the same sequence. The last batch is short unless drop_last."""
    if len(X) != len(y):
        raise ValueError(f"X and y differ in length: {len(X)} vs {len(y)}")
    batch_size = int(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = np.random.default_rng([seed, epoch]).permutation(len(X))
    stop = len(X) - len(X) % batch_size if drop_last else len(X)
    for a in range(0, stop, batch_size):
        idx = order[a:a + batch_size]
        yield X[idx], y[idx]
