"""LDA topic modelling by collapsed Gibbs sampling, split the way a parameter-server or allreduce
trainer runs it (paper §7, after PLDA / Yahoo LDA): a worker owns its documents, their topic
assignments z and doc-topic counts n_dk; the shared model is the word-topic count matrix n_wk and
the topic totals n_k, as one flat float64 vector

    model = [ n_wk row-major, shape (vocab, topics) | n_k, shape (topics,) ]

(word-major, so the counts of one token's word are one contiguous row). LdaWorker.sweep(model)
resamples every one of its tokens against the given, possibly stale, model and returns the count
DELTA to push; the global model is the sum of every worker's deltas, so it always equals the
counts of the workers' current assignments. Counts are integers held exactly in float64 (up to
2**53; a float32 model would round above 2**24).

Sampling order (why it is not token-by-token): a numpy loop per token costs tens of microseconds,
too slow. A sweep instead walks token POSITIONS: step j resamples token j of every document at
once (in chunks of `chunk` documents), vectorised over documents. Doc-topic counts stay exact
(one token per document per step); the only approximation is that the tokens of one step see the
word-topic counts without all of that step's old assignments, the AD-LDA approximation at a
granularity of one token per document, well inside what stale models already do.

Metrics: log_likelihood() is the per-token log p(w | phi, theta) with phi from the model and each
document's theta folded in by EM (the paper's -7.94 on NYTimes is a per-token figure of this
kind); word_log_likelihood() + sum of LdaWorker.doc_log_likelihood() is the collapsed joint
log p(w, z) of Griffiths & Steyvers. topic_recovery() compares learned and true topics after a
Hungarian matching.
"""
from dataclasses import dataclass

import numpy as np


def _scipy(what):
    try:
        import scipy.optimize
        import scipy.special
    except ImportError as e:
        raise ImportError(f"mlfabric.workloads.lda.{what} needs scipy: pip install scipy") from e
    return scipy


@dataclass(frozen=True)
class LdaConfig:
    """The model's shape and the Dirichlet priors: alpha on doc-topic, beta on topic-word."""
    vocab: int
    topics: int
    alpha: float = 0.1
    beta: float = 0.01

    def __post_init__(self):
        if int(self.vocab) < 1 or int(self.topics) < 1:
            raise ValueError(f"vocab and topics must be >= 1, got vocab={self.vocab}, "
                             f"topics={self.topics}")
        if not (self.alpha > 0 and self.beta > 0):
            raise ValueError(f"alpha and beta must be > 0, got alpha={self.alpha}, "
                             f"beta={self.beta}")

    @property
    def size(self):
        return self.vocab * self.topics + self.topics

    def zeros(self):
        """The empty model (no token counted yet)."""
        return np.zeros(self.size)

    def split(self, model):
        """(n_wk of shape (vocab, topics), n_k) as views of a flat model."""
        model = np.asarray(model)
        if model.shape != (self.size,):
            raise ValueError(f"an LDA model with vocab={self.vocab}, topics={self.topics} is a "
                             f"1-D vector of {self.size}, got shape {model.shape}")
        if not np.issubdtype(model.dtype, np.floating):
            raise ValueError(f"the LDA model must be floating point, got {model.dtype}")
        v, k = self.vocab, self.topics
        return model[:v * k].reshape(v, k), model[v * k:]


def _tokens(docs, vocab):
    """(words, doc index, document start offsets) of a corpus given as a list of word-id arrays."""
    if isinstance(docs, np.ndarray) and docs.ndim == 2:
        docs = list(docs)
    docs = [np.asarray(d) for d in docs]
    for i, d in enumerate(docs):
        if d.ndim != 1 or (d.size and not np.issubdtype(d.dtype, np.integer)):
            raise ValueError(f"document {i} must be a 1-D array of integer word ids, "
                             f"got shape {d.shape} dtype {d.dtype}")
    lengths = np.array([d.size for d in docs], dtype=np.int64)
    words = np.concatenate(docs).astype(np.int64) if docs else np.zeros(0, np.int64)
    if words.size and (words.min() < 0 or words.max() >= vocab):
        raise ValueError(f"word ids must be in [0, {vocab}), got {words.min()}..{words.max()}")
    doc = np.repeat(np.arange(len(docs)), lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if docs else lengths
    return words, doc, starts, lengths


def generate_corpus(docs, vocab, topics, doc_len, alpha=0.1, beta=0.01, seed=0):
    """A corpus drawn from LDA's generative model: phi_k ~ Dir(beta) for each topic, theta_d ~
    Dir(alpha) for each document, then each of a document's doc_len tokens draws z ~ theta_d and
    w ~ phi_z. Returns (documents, phi): a list of int64 word-id arrays and the true topic-word
    distributions, shape (topics, vocab), rows summing to 1."""
    docs, vocab, topics, doc_len = int(docs), int(vocab), int(topics), int(doc_len)
    if min(docs, vocab, topics, doc_len) < 1:
        raise ValueError(f"docs, vocab, topics and doc_len must be >= 1, got {docs}, {vocab}, "
                         f"{topics}, {doc_len}")
    if not (alpha > 0 and beta > 0):
        raise ValueError(f"alpha and beta must be > 0, got alpha={alpha}, beta={beta}")
    rng = np.random.default_rng([seed, 11])
    phi = rng.dirichlet(np.full(vocab, beta), size=topics)
    theta = rng.dirichlet(np.full(topics, alpha), size=docs)
    # inverse-CDF draws, vectorised: z per (doc, position), then w per token grouped by topic
    z = (np.cumsum(theta, 1)[:, None, :] < rng.random((docs, doc_len, 1))).sum(-1)
    z = np.minimum(z, topics - 1)
    words = np.empty((docs, doc_len), dtype=np.int64)
    cum_phi = np.cumsum(phi, 1)
    u = rng.random((docs, doc_len))
    for k in range(topics):
        at = z == k
        words[at] = np.minimum(np.searchsorted(cum_phi[k], u[at] * cum_phi[k, -1], "right"),
                               vocab - 1)
    return list(words), phi


class LdaWorker:
    """One worker's share of the corpus: its tokens' topic assignments and doc-topic counts. It
    starts from a seeded random assignment that no model has counted yet, so its first sweep's
    delta carries its whole count; later deltas carry only the changes. Give each worker its own
    seed (e.g. (seed, rank))."""

    def __init__(self, docs, config, seed=0, chunk=1024):
        if not isinstance(config, LdaConfig):
            raise ValueError(f"config must be an LdaConfig, got {type(config).__name__}")
        if int(chunk) < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.config = config
        self.words, self.doc, starts, self.lengths = _tokens(docs, config.vocab)
        self.rng = np.random.default_rng(seed)
        k = config.topics
        self.z = self.rng.integers(0, k, self.words.size)
        self.ndk = np.zeros((len(self.lengths), k), dtype=np.int64)
        np.add.at(self.ndk, (self.doc, self.z), 1)
        self.counted = False           # whether a delta with this worker's counts has gone out
        self.sweeps = 0
        # Step j resamples token j of every document: group token ids by position, then chunk.
        pos = np.arange(self.words.size) - starts[self.doc]
        order = np.argsort(pos, kind="stable")
        cuts = np.cumsum(np.bincount(pos, minlength=1))[:-1] if pos.size else []
        self.schedule = [c[i:i + int(chunk)] for c in np.split(order, cuts)
                         for i in range(0, c.size, int(chunk)) if c.size]

    @property
    def tokens(self):
        return int(self.words.size)

    @property
    def size(self):
        return self.config.size

    def model0(self):
        return self.config.zeros()

    def counts(self):
        """This worker's own contribution to the model: the counts of its current assignments."""
        out = self.config.zeros()
        nwk, nk = self.config.split(out)
        np.add.at(nwk, (self.words, self.z), 1)
        nk += np.bincount(self.z, minlength=self.config.topics)
        return out

    def sweep(self, model):
        """Resample every token once against `model` (plus this worker's own changes as it goes)
        and return the delta: the model counts after minus the model given. The model may be
        stale and may lack this worker's earlier deltas; counts that go negative locally because
        of that are read as zero when sampling."""
        cfg = self.config
        local = np.array(model, dtype=np.float64, copy=True)
        nwk, nk = cfg.split(local)
        if not self.counted:   # the initial assignment has never been pushed: count it now
            np.add.at(nwk, (self.words, self.z), 1)
            nk += np.bincount(self.z, minlength=cfg.topics)
        ndk, alpha, beta, vbeta = self.ndk, cfg.alpha, cfg.beta, cfg.vocab * cfg.beta
        for idx in self.schedule:
            w, d, old = self.words[idx], self.doc[idx], self.z[idx]
            ndk[d, old] -= 1        # d has no repeats within a step: plain fancy indexing is exact
            np.subtract.at(nwk, (w, old), 1)
            nk -= np.bincount(old, minlength=cfg.topics)
            # p(z = k | rest) ∝ (n_dk + alpha) (n_wk + beta) / (n_k + V beta)
            p = (ndk[d] + alpha) * (np.maximum(nwk[w], 0) + beta) / (np.maximum(nk, 0) + vbeta)
            cum = np.cumsum(p, 1)
            new = (cum < self.rng.random(len(idx))[:, None] * cum[:, -1:]).sum(1)
            new = np.minimum(new, cfg.topics - 1)
            ndk[d, new] += 1
            np.add.at(nwk, (w, new), 1)
            nk += np.bincount(new, minlength=cfg.topics)
            self.z[idx] = new
        self.counted = True
        self.sweeps += 1
        return local - model

    step = sweep   # the name every workload's update has

    def doc_log_likelihood(self):
        """log p(z) of this worker's documents: sum over d of
        lnG(K a) - K lnG(a) + sum_k lnG(n_dk + a) - lnG(n_d + K a)."""
        gl = _scipy("LdaWorker.doc_log_likelihood").special.gammaln
        a, k = self.config.alpha, self.config.topics
        return float(len(self.lengths) * (gl(k * a) - k * gl(a)) + gl(self.ndk + a).sum()
                     - gl(self.lengths + k * a).sum())


def word_log_likelihood(model, config):
    """log p(w | z) from the model's counts alone: K (lnG(V b) - V lnG(b)) +
    sum_k (sum_w lnG(n_wk + b) - lnG(n_k + V b)). Plus every worker's doc_log_likelihood() it is
    the collapsed joint log p(w, z)."""
    gl = _scipy("word_log_likelihood").special.gammaln
    nwk, nk = config.split(model)
    b, v, k = config.beta, config.vocab, config.topics
    return float(k * (gl(v * b) - v * gl(b)) + gl(np.maximum(nwk, 0) + b).sum()
                 - gl(np.maximum(nk, 0) + v * b).sum())


def topic_word(model, config):
    """phi as (vocab, topics): the smoothed estimate (n_wk + beta) / (n_k + V beta)."""
    nwk, nk = config.split(model)
    return (np.maximum(nwk, 0) + config.beta) / (np.maximum(nk, 0) + config.vocab * config.beta)


def log_likelihood(model, docs, config, iters=30):
    """Mean per-token log p(w | phi, theta_d) (natural log) of `docs`: phi from the model,
    each document's theta folded in by `iters` EM steps with phi held fixed (deterministic).
    Higher is better; for held-out documents it measures generalisation."""
    phi = topic_word(model, config)
    words, doc, starts, lengths = _tokens(docs, config.vocab)
    if words.size == 0:
        raise ValueError("log_likelihood needs at least one token")
    k, a = config.topics, config.alpha
    total = 0.0
    # blocks of consecutive non-empty documents of about 2**22 token-topic cells, to bound memory
    keep = np.flatnonzero(lengths)
    block = (np.cumsum(lengths[keep]) * k - 1) // 2**22
    for ds in np.split(keep, np.flatnonzero(np.diff(block)) + 1):
        sel = slice(starts[ds[0]], starts[ds[-1]] + lengths[ds[-1]])
        pw = phi[words[sel]]                              # (tokens, topics)
        seg = np.concatenate(([0], np.cumsum(lengths[ds])[:-1]))
        local_doc = np.repeat(np.arange(ds.size), lengths[ds])
        theta = np.full((ds.size, k), 1.0 / k)
        for _ in range(iters):
            r = theta[local_doc] * pw
            r /= r.sum(1, keepdims=True)
            theta = (np.add.reduceat(r, seg, axis=0) + a) / (lengths[ds, None] + k * a)
        total += np.log((theta[local_doc] * pw).sum(1)).sum()
    return float(total / words.size)


def topic_recovery(model, true_phi, metric="cosine"):
    """How well the learned topics match the true ones: learned and true topics are paired by a
    Hungarian matching, and the mean over pairs is returned - of the cosine similarity of the
    count vectors (metric="cosine", 1 is perfect) or of the L1 distance between the normalised
    distributions (metric="l1", 0 is perfect, 2 the worst)."""
    true_phi = np.asarray(true_phi, dtype=np.float64)
    if true_phi.ndim != 2:
        raise ValueError(f"true_phi must be (topics, vocab), got shape {true_phi.shape}")
    v = true_phi.shape[1]
    model = np.asarray(model)
    if model.ndim != 1 or model.size % (v + 1):
        raise ValueError(f"a model over a vocabulary of {v} has topics * {v + 1} entries, "
                         f"got shape {model.shape}")
    learned = np.maximum(model[:v * (model.size // (v + 1))].reshape(v, -1).T, 0)  # (topics, V)
    if metric == "cosine":
        def unit(m):
            return m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-300)
        score, maximize = unit(learned) @ unit(true_phi).T, True
    elif metric == "l1":
        def dist(m):
            return m / np.maximum(m.sum(1, keepdims=True), 1e-300)
        score = np.abs(dist(learned)[:, None, :] - dist(true_phi)[None, :, :]).sum(-1)
        maximize = False
    else:
        raise ValueError(f"metric must be 'cosine' or 'l1', got {metric!r}")
    rows, cols = _scipy("topic_recovery").optimize.linear_sum_assignment(score, maximize=maximize)
    return float(score[rows, cols].mean())
