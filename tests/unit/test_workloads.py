"""Tests of the training workloads (mlfabric.workloads): datasets and sharding, the torch models and
their flat parameters, LDA by collapsed Gibbs sampling, matrix factorisation. Single process,
seeded, a few seconds in all."""
import itertools
import math
import sys

import numpy as np
import pytest

from mlfabric.workloads import data, lda, mf

torch = pytest.importorskip("torch")
from mlfabric.workloads import models  # noqa: E402  (after the torch check)


# ---------------------------------------------------------------- data

def test_digits_shapes_ranges_and_seeded_split():
    pytest.importorskip("sklearn")
    Xtr, ytr, Xte, yte = data.digits(seed=0)
    assert Xtr.shape == (1438, 64) and Xte.shape == (359, 64)   # round(0.2 * 1797) test
    assert Xtr.dtype == Xte.dtype == np.float32 and ytr.dtype == yte.dtype == np.int64
    for X in (Xtr, Xte):
        assert X.min() == 0.0 and X.max() == 1.0
    assert set(np.unique(ytr)) == set(range(10)) and set(np.unique(yte)) <= set(range(10))
    again = data.digits(seed=0)
    assert all(np.array_equal(a, b) for a, b in zip((Xtr, ytr, Xte, yte), again))
    other = data.digits(seed=1)
    assert not np.array_equal(Xte, other[2])
    # the split is a partition of the 1797 images: same pixel total either way
    assert np.isclose(Xtr.sum(dtype=np.float64) + Xte.sum(dtype=np.float64),
                      other[0].sum(dtype=np.float64) + other[2].sum(dtype=np.float64))
    assert len(data.digits(test_fraction=0.5)[2]) == 898
    with pytest.raises(ValueError, match="test_fraction"):
        data.digits(test_fraction=1.0)


def test_digits_without_sklearn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)   # import now fails
    with pytest.raises(ImportError, match="pip install scikit-learn"):
        data.digits()


def test_synthetic_classification_is_seeded_and_separable():
    Xtr, ytr, Xte, yte = data.synthetic_classification(600, 20, 5, seed=3)
    assert Xtr.shape == (480, 20) and Xte.shape == (120, 20) and Xtr.dtype == np.float32
    assert np.bincount(np.concatenate([ytr, yte])).tolist() == [120] * 5
    again = data.synthetic_classification(600, 20, 5, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((Xtr, ytr, Xte, yte), again))
    # nearest class mean, fitted on train, classifies test almost perfectly
    means = np.stack([Xtr[ytr == c].mean(0) for c in range(5)])
    pred = np.argmin(((Xte[:, None, :] - means[None]) ** 2).sum(-1), 1)
    assert (pred == yte).mean() >= 0.95
    for bad in (dict(n=5), dict(features=0), dict(classes=1)):
        args = dict(n=600, features=20, classes=5) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            data.synthetic_classification(**args)


@pytest.mark.parametrize("n", [0, 1, 6, 23, 100])
def test_shards_cover_the_data_exactly_once(n):
    X, y = np.arange(n * 2).reshape(n, 2), np.arange(n)
    for size in range(1, 8):
        parts = [data.shard(X, y, r, size) for r in range(size)]
        lengths = [len(py) for _, py in parts]
        assert max(lengths) - min(lengths) <= 1
        assert np.array_equal(np.concatenate([py for _, py in parts]), y)
        assert np.array_equal(np.concatenate([px for px, _ in parts]), X)
        assert all(np.array_equal(px[:, 0] // 2, py) for px, py in parts)   # rows stay paired


def test_shard_bad_inputs():
    X, y = np.zeros((10, 2)), np.zeros(10)
    with pytest.raises(ValueError, match="rank must be in"):
        data.shard(X, y, 3, 3)
    with pytest.raises(ValueError, match="rank must be in"):
        data.shard(X, y, -1, 3)
    with pytest.raises(ValueError, match="size must be"):
        data.shard(X, y, 0, 0)
    with pytest.raises(ValueError, match="differ in length"):
        data.shard(X, y[:9], 0, 1)


def test_batches_walk_each_epoch_once_in_a_seeded_order():
    X, y = np.arange(50)[:, None] * 10, np.arange(50)
    ep0 = list(data.batches(X, y, 8, seed=1, epoch=0))
    assert [len(b[1]) for b in ep0] == [8] * 6 + [2]
    seen = np.concatenate([b[1] for b in ep0])
    assert sorted(seen) == list(range(50)) and not np.array_equal(seen, np.arange(50))
    assert all(np.array_equal(bx[:, 0], by * 10) for bx, by in ep0)
    assert np.array_equal(seen, np.concatenate([b[1] for b in data.batches(X, y, 8, 1, 0)]))
    assert not np.array_equal(seen, np.concatenate([b[1] for b in data.batches(X, y, 8, 1, 1)]))
    assert [len(b[1]) for b in data.batches(X, y, 8, 1, 0, drop_last=True)] == [8] * 6
    with pytest.raises(ValueError, match="batch_size"):
        next(data.batches(X, y, 0))


# ---------------------------------------------------------------- models

def _params(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()


@pytest.mark.parametrize("name", models.MODELS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_models_build_and_flat_params_round_trip_exactly(name, dtype):
    rng_before = torch.random.get_rng_state()
    net = models.build(name, (64,), 10, seed=5, dtype=dtype)
    assert torch.equal(torch.random.get_rng_state(), rng_before)   # global RNG left alone
    flat = models.flat_params(net)
    assert flat.dtype == np.dtype(dtype) and flat.ndim == 1
    assert np.array_equal(flat, _params(net))
    assert np.array_equal(flat, models.flat_params(models.build(name, (64,), 10, seed=5,
                                                                dtype=dtype)))
    assert not np.array_equal(flat, models.flat_params(models.build(name, 64, 10, seed=6,
                                                                    dtype=dtype)))
    vec = np.random.default_rng(0).standard_normal(flat.size).astype(dtype)
    models.set_flat_params(net, vec)
    assert np.array_equal(models.flat_params(net), vec) and np.array_equal(_params(net), vec)
    flat[:] = 0.5     # the flat vector is the model's memory
    assert np.all(_params(net) == 0.5)
    for shape in ((5, 64), (5, 8, 8), (5, 1, 8, 8)):   # flat or shaped inputs
        assert net(torch.zeros(shape, dtype=getattr(torch, dtype))).shape == (5, 10)


def test_flat_grads_are_the_autograd_gradients_and_survive_zero_grad():
    net = models.build("mlp", 64, 10, seed=0)
    X, y = np.random.default_rng(1).random((16, 64), np.float32), np.arange(16) % 10
    update, loss = models.sgd_update(net, X, y, lr=0.1)
    g = models.flat_grads(net)
    assert np.array_equal(g, torch.cat([p.grad.reshape(-1) for p in net.parameters()]).numpy())
    assert np.allclose(update, -0.1 * g) and loss > 0
    torch.optim.SGD(net.parameters(), lr=0.1).zero_grad()   # sets the grads to None
    assert not models.flat_grads(net).any()


def test_update_is_minus_lr_times_the_float64_finite_difference_gradient():
    net = models.build("logreg", 64, 10, seed=2, dtype="float64")
    rng = np.random.default_rng(2)
    X, y = rng.random((8, 64)), rng.integers(0, 10, 8)
    w = models.flat_params(net).copy()
    update, _ = models.sgd_update(net, X, y, lr=0.5, weight_decay=0.1)

    def objective(v):
        models.set_flat_params(net, v)
        with torch.no_grad():
            ce = torch.nn.functional.cross_entropy(net(torch.as_tensor(X)), torch.as_tensor(y))
        return float(ce) + 0.05 * v @ v

    h = 1e-6
    for k in rng.choice(w.size, 25, replace=False):
        e = np.zeros_like(w)
        e[k] = h
        fd = (objective(w + e) - objective(w - e)) / (2 * h)
        assert update[k] == pytest.approx(-0.5 * fd, rel=1e-6, abs=1e-9)


def test_model_bad_inputs():
    with pytest.raises(ValueError, match="mlp, convnet, logreg"):
        models.build("resnet", 64, 10)
    with pytest.raises(ValueError, match="square"):
        models.build("convnet", 63, 10)
    with pytest.raises(ValueError, match="classes"):
        models.build("mlp", 64, 1)
    with pytest.raises(ValueError, match="dtype"):
        models.build("mlp", 64, 10, dtype="int32")
    net = models.build("logreg", 64, 10)
    with pytest.raises(ValueError, match="650"):
        models.set_flat_params(net, np.zeros(649))
    with pytest.raises(ValueError, match="samples"):
        models.accuracy(net, np.zeros((3, 64)), np.zeros(2))


def test_sgd_on_digits_mlp_reaches_95_percent():
    """Plain SGD driven the way a trainer drives it: model += step(model). lr 0.3, batch 32,
    10 epochs (450 steps); about 97% test accuracy in about a second."""
    pytest.importorskip("sklearn")
    Xtr, ytr, Xte, yte = data.digits(seed=0)
    clf = models.Classifier("mlp", Xtr, ytr, batch_size=32, lr=0.3, seed=0)
    w = clf.model0()
    assert w.dtype == np.float32 and w.size == clf.size == 64 * 128 + 128 + 128 * 10 + 10
    assert clf.accuracy(w, Xte, yte) < 0.3
    for _ in range(10 * math.ceil(len(Xtr) / 32)):
        w += clf.step(w)
    assert clf.epoch == 9
    assert clf.accuracy(w, Xte, yte) >= 0.95


def test_convnet_step_lowers_the_batch_loss():
    Xtr, ytr, _, _ = data.synthetic_classification(200, 64, 4, seed=0)
    clf = models.Classifier("convnet", Xtr, ytr, batch_size=200, lr=0.05, seed=1)
    w = clf.model0()
    for _ in range(5):
        w += clf.update(w, Xtr, ytr)
        before = clf.last_loss
    clf.update(w, Xtr, ytr)
    assert clf.last_loss < before


# ---------------------------------------------------------------- LDA

EASY = dict(docs=200, vocab=100, topics=5, doc_len=100, alpha=0.1, beta=0.1, seed=0)


def _easy():
    docs, phi = lda.generate_corpus(**EASY)
    return docs, phi, lda.LdaConfig(EASY["vocab"], EASY["topics"], EASY["alpha"], EASY["beta"])


def test_generate_corpus():
    docs, phi = lda.generate_corpus(**EASY)
    assert len(docs) == 200 and all(d.shape == (100,) and d.dtype == np.int64 for d in docs)
    assert phi.shape == (5, 100) and np.allclose(phi.sum(1), 1)
    words = np.concatenate(docs)
    assert words.min() >= 0 and words.max() < 100
    again, phi2 = lda.generate_corpus(**EASY)
    assert np.array_equal(phi, phi2) and all(np.array_equal(a, b) for a, b in zip(docs, again))
    with pytest.raises(ValueError, match="alpha"):
        lda.generate_corpus(**(EASY | dict(alpha=0)))


def _check_model(model, cfg, workers):
    nwk, nk = cfg.split(model)
    assert nwk.min() >= 0 and np.array_equal(nwk.sum(0), nk)
    assert nk.sum() == sum(w.tokens for w in workers)
    assert np.array_equal(model, sum(w.counts() for w in workers))   # the deltas' sum


@pytest.mark.parametrize("n_workers", [1, 2, 3, 5])
@pytest.mark.parametrize("stale", [False, True])
def test_lda_deltas_sum_to_the_counts(n_workers, stale):
    """Synchronous rounds (every worker sweeps the same model) or stale ones (each worker sees
    the model as it was before the previous round, and without its own last delta)."""
    docs, _, cfg = _easy()
    workers = [lda.LdaWorker(docs[r::n_workers], cfg, seed=(0, r)) for r in range(n_workers)]
    model, previous = cfg.zeros(), cfg.zeros()
    for _ in range(4):
        given = previous if stale else model
        deltas = [w.sweep(given) for w in workers]
        previous = model.copy()
        for d in deltas:
            assert np.array_equal(d, np.round(d))      # whole counts
            model += d
        _check_model(model, cfg, workers)


def test_lda_learns_the_topics_and_the_likelihood_improves():
    docs, phi, cfg = _easy()
    workers = [lda.LdaWorker(docs[r::3], cfg, seed=(1, r)) for r in range(3)]
    model, ll, joint = cfg.zeros(), [], []
    for _ in range(20):
        for d in [w.sweep(model) for w in workers]:
            model += d
        ll.append(lda.log_likelihood(model, docs, cfg))
        joint.append(lda.word_log_likelihood(model, cfg)
                     + sum(w.doc_log_likelihood() for w in workers))
    assert ll[-1] > ll[0] + 0.3 and joint[-1] > joint[0] + 1e4
    assert max(ll[-5:]) - min(ll[-5:]) < 0.02           # converged
    # the true topics score about the same per token as the learned ones
    truth = cfg.zeros()
    nwk, nk = cfg.split(truth)
    nwk[:], nk[:] = phi.T * 1e6, 1e6
    assert abs(ll[-1] - lda.log_likelihood(truth, docs, cfg)) < 0.05
    assert lda.topic_recovery(model, phi) >= 0.9
    assert lda.topic_recovery(model, phi, "l1") < 0.2
    assert lda.topic_recovery(truth, phi) == pytest.approx(1.0)
    assert lda.topic_recovery(cfg.zeros() + 1, phi) < 0.9


def test_lda_sweep_is_fast():
    import time
    docs, _ = lda.generate_corpus(200, 1000, 20, 100, seed=1)      # 20,000 tokens
    w = lda.LdaWorker(docs, lda.LdaConfig(1000, 20), seed=0)
    model = w.model0()
    t = time.perf_counter()
    model += w.sweep(model)
    assert time.perf_counter() - t < 1.0


def test_lda_sampler_draws_from_the_exact_posterior():
    """chunk=1 samples token by token: plain collapsed Gibbs, whose stationary distribution is
    p(z | w). On 4 tokens and 2 topics the 16 assignments' posterior is enumerable; compare it
    with the chain's visit frequencies."""
    docs = [np.array([0, 1]), np.array([1, 2])]
    cfg = lda.LdaConfig(vocab=3, topics=2, alpha=0.5, beta=0.5)
    words = np.concatenate(docs)
    lg = math.lgamma

    def log_joint(z):
        # the Dirichlet normalisers, 2 documents and 2 topics
        out = 2 * (lg(2 * cfg.alpha) - 2 * lg(cfg.alpha) + lg(3 * cfg.beta) - 3 * lg(cfg.beta))
        for d in range(2):
            ndk = np.bincount(z[2 * d:2 * d + 2], minlength=2)
            out += sum(lg(n + cfg.alpha) for n in ndk) - lg(2 + 2 * cfg.alpha)
        for k in range(2):
            nwk = np.bincount(words[z == k], minlength=3)
            out += sum(lg(n + cfg.beta) for n in nwk) - lg(nwk.sum() + 3 * cfg.beta)
        return out

    states = [np.array(s) for s in itertools.product(range(2), repeat=4)]
    p = np.exp([log_joint(z) for z in states])
    p /= p.sum()
    w = lda.LdaWorker(docs, cfg, seed=4, chunk=1)
    model, visits = cfg.zeros(), np.zeros(16)
    for _ in range(3000):
        model += w.sweep(model)
        visits[int("".join(map(str, w.z)), 2)] += 1
    assert np.abs(visits / visits.sum() - p).max() < 0.03
    assert np.isclose(lda.word_log_likelihood(model, cfg) + w.doc_log_likelihood(),
                      log_joint(w.z))


def test_lda_bad_inputs():
    cfg = lda.LdaConfig(10, 3)
    with pytest.raises(ValueError, match="word ids"):
        lda.LdaWorker([np.array([1, 10])], cfg)
    with pytest.raises(ValueError, match="integer word ids"):
        lda.LdaWorker([np.array([0.5])], cfg)
    with pytest.raises(ValueError, match="alpha and beta"):
        lda.LdaConfig(10, 3, beta=0)
    w = lda.LdaWorker([np.array([1, 2, 3])], cfg)
    with pytest.raises(ValueError, match="vector of 33"):
        w.sweep(np.zeros(32))
    with pytest.raises(ValueError, match="metric"):
        lda.topic_recovery(cfg.zeros(), np.ones((3, 10)) / 10, "kl")
    with pytest.raises(ValueError, match="vocabulary of 10"):
        lda.topic_recovery(np.zeros(32), np.ones((3, 10)) / 10)


# ---------------------------------------------------------------- matrix factorisation

def test_low_rank_problem():
    train, test, truth = mf.low_rank_problem(40, 30, 2, density=0.5, noise=0.1, seed=0)
    assert len(train) + len(test) == 600 and len(test) == 120
    cells = set(zip(train.i, train.j)) | set(zip(test.i, test.j))
    assert len(cells) == 600                                       # distinct, train/test disjoint
    assert truth.shape == ((40 + 30) * 2,)
    assert mf.rmse(truth, test) == pytest.approx(0.1, rel=0.25)   # only the noise is left
    with pytest.raises(ValueError, match="density"):
        mf.low_rank_problem(4, 3, 1, density=0)


def test_mf_update_is_minus_lr_times_the_float64_finite_difference_gradient():
    train, _, _ = mf.low_rank_problem(6, 5, 2, density=1.0, seed=1)
    w = mf.MfWorker(train, rank=2, lr=0.1, l2=0.3, seed=0)
    batch = train.take(np.array([0, 1, 2, 0, 7, 3, 3, 12]))   # repeats: rows/cols hit twice
    assert len(set(batch.i.tolist())) < len(batch)
    model = np.random.default_rng(0).standard_normal(w.size)
    update = w.gradient(model, batch)
    h, fd = 1e-6, np.empty(w.size)
    for k in range(w.size):
        e = np.zeros(w.size)
        e[k] = h
        fd[k] = (mf.loss(model + e, batch, 0.3) - mf.loss(model - e, batch, 0.3)) / (2 * h)
    assert np.allclose(update, -0.1 * fd, rtol=1e-6, atol=1e-9)
    assert w.gradient(model.astype(np.float32), batch).dtype == np.float32


def test_mf_rmse_falls_to_the_noise_level():
    train, test, _ = mf.low_rank_problem(200, 150, 3, density=0.3, noise=0.1, seed=0)
    workers = [mf.MfWorker(train.shard(r, 3), rank=3, seed=r) for r in range(3)]
    model = workers[0].model0()
    start = mf.rmse(model, test)
    for _ in range(800):
        for w in workers:
            model += w.step(model)
    assert start > 0.9 and mf.rmse(model, test) < 0.125 and mf.rmse(model, train) < 0.11


def test_mf_bad_inputs():
    train, _, _ = mf.low_rank_problem(6, 5, 2, seed=0)
    with pytest.raises(ValueError, match="rank < size"):
        train.shard(2, 2)
    with pytest.raises(ValueError, match="out of a 6 x 5"):
        mf.Entries(np.array([6]), np.array([0]), np.array([1.0]), 6, 5)
    w = mf.MfWorker(train, rank=2)
    with pytest.raises(ValueError, match="22 entries"):
        w.gradient(np.zeros(21), train)
    with pytest.raises(ValueError, match="rank \\* 11"):
        mf.rmse(np.zeros(21), train)
    with pytest.raises(ValueError, match="lr"):
        mf.MfWorker(train, rank=2, lr=0)
