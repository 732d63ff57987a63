"""How far a replica's model can be from the server's, from update norms only (paper §3.3, eq. 2,
eq. 5-8, eq. 11). Owns the momentum model, the exact lead formula, its norm-only bound (eq. 11 for
any lead), the bound on the replica's history norm, an exact simulator over numpy vectors (for the
tests), and the weights an aggregator must use so that an aggregate has the effect of its members
applied one by one. The replication step (replication.py, §5.3) uses the bounds; nothing here looks
at a network or a plan. Derivations in full: docs/sched/replication.md.

Model (eq. 2): w_{t+1} = w_t + u_t + gamma (w_t - w_{t-1}). With the history h_t = w_t - w_{t-1}:
    h_{t+1} = gamma h_t + u_t,   w_{t+1} = w_t + h_{t+1}.
Server and replica apply the same updates in the same order (§3.3); the replica applies a prefix.

Lead formula: if the server is L updates u_1..u_L ahead of the replica, whose state is (w_r, h):
    w_s - w_r = sum_{k=1..L} h_k,  h_k = gamma^k h + sum_{i<=k} gamma^(k-i) u_i, so
    w_s - w_r = c_h h + sum_i c_i u_i,   c_h = gamma (1 - gamma^L) / (1 - gamma),
                                         c_i = (1 - gamma^(L-i+1)) / (1 - gamma)   (i = 1..L).
(With 0-based u_0..u_{L-1} the last reads (1 - gamma^(L-i)) / (1 - gamma).) L = 2 gives eq. 7:
(gamma + gamma^2) h + (1 + gamma) u_1 + u_2.

Eq. 11, from norms only: by the triangle inequality (Cauchy-Schwarz on each cross term of the
square), ||w_s - w_r|| <= c_h ||h|| + sum_i c_i ||u_i||. Squared and expanded for L = 2 this is
eq. 11 with a1 = (gamma+gamma^2)^2, a2 = (1+gamma)^2, a3 = 1, a4 = 2 gamma (1+gamma)^2 (on
||h||.||u1||), a5 = 2 (1+gamma) (on ||u1||.||u2||), a6 = 2 gamma (1+gamma) (on ||u2||.||h||). The
paper prints a6's term as ||u1||.||h0||, which repeats a4's; the expansion gives ||u2||.||h0||. We
compute the unsquared sum (the same value, without square root or overflow).

The replica's ||h|| is not a function of update norms, so it is bounded: H_{t+1} = ||u_t|| +
gamma H_t from H_0 >= ||h_0|| (0 when training starts from rest). By induction ||h_t|| <= H_t: if
||h_t|| <= H_t then ||h_{t+1}|| = ||gamma h_t + u_t|| <= gamma ||h_t|| + ||u_t|| <= gamma H_t +
||u_t||. It stays valid as long as each reported norm is at least the true one and each update (or
aggregate) has exactly the effect of its members applied in order (see `aggregate_weights`). The
lead bound telescopes: c_h H + sum_i c_i ||u_i|| = H_1 + ... + H_L, the history bounds along the
server's lead (because w_s - w_r = h_1 + ... + h_L); `lead_bounds` uses that form.

Steps (sync SGD, §6): a step is what one momentum term covers. In async SGD every update is a step.
In sync SGD an iteration is one step: its updates are added linearly as they arrive (w += u) and the
momentum term once, when the iteration ends (w += gamma h, then h = gamma h + the iteration's sum);
the model at the iteration's end is eq. 2 with u = the iteration's sum, whatever order or grouping
its updates arrived in. `ends` flags mark the updates that close a step.

Choices where the paper is silent, and why:
- gamma must lie in [0, 1): the coefficients grow without bound at 1.
- A norm may be inf ("unknown"): every bound that depends on it is inf, so the replica must catch
  up; it is never treated as 0. 0 * inf is taken as 0 (an absent term, e.g. gamma = 0).
- Aggregates: one weighted sum cannot carry its members' momentum effects (`aggregate_weights`):
  the aggregator must send two (async), which doubles an aggregate's bytes when gamma > 0.
- An iteration without updates is no step (sync).
"""
from dataclasses import dataclass
from math import inf, isnan

import numpy as np


# --- checks --------------------------------------------------------------------------------------
def check_gamma(gamma):
    """gamma (momentum) as a float in [0, 1), or ValueError naming it."""
    try:
        g = float(gamma)
    except (TypeError, ValueError):
        raise ValueError("gamma (momentum) must be a number in [0, 1), got %r" % (gamma,)) from None
    if not 0.0 <= g < 1.0:
        raise ValueError("gamma (momentum) must be in [0, 1), got %r" % (gamma,))
    return g


def check_norm(x, what="norm"):
    """A norm (or norm bound) as a float >= 0; inf means unknown."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError("%s must be a number >= 0, got %r" % (what, x)) from None
    if isnan(v) or v < 0:
        raise ValueError("%s must be >= 0 (inf if unknown), got %r" % (what, x))
    return v


def _mul(c, x):
    """c * x where a zero coefficient removes the term even when x is inf (unknown norm)."""
    return 0.0 if c == 0 else c * x


# --- the lead formula and its bound ---------------------------------------------------------------
def lead_coefficients(lead, gamma):
    """(c_h, [c_1..c_L]): w_s - w_r = c_h h + sum_i c_i u_i when the server applied u_1..u_L (in
    that order) after the replica's state (w_r, h). Computed as the geometric sums they are
    (c_L = 1, c_i = 1 + gamma c_{i+1}, c_h = gamma c_1), which stays exact as gamma nears 1."""
    gamma = check_gamma(gamma)
    if not (isinstance(lead, (int, np.integer)) and not isinstance(lead, bool) and lead >= 0):
        raise ValueError("lead must be an integer >= 0, got %r" % (lead,))
    c = [0.0] * lead
    acc = 0.0
    for i in range(lead - 1, -1, -1):
        acc = 1.0 + gamma * acc
        c[i] = acc
    return (gamma * c[0] if lead else 0.0), c


def eq11_coefficients(gamma):
    """(a1, ..., a6) of eq. 11 for a lead of two: the bound is sqrt(a1 H^2 + a2 n1^2 + a3 n2^2 +
    a4 H n1 + a5 n1 n2 + a6 n2 H) with H >= ||h0||, n_i = ||u_i|| (a6 multiplies n2 H: see the
    module notes on the paper's a6)."""
    g = check_gamma(gamma)
    ch, c1, c2 = g + g * g, 1 + g, 1.0
    return (ch * ch, c1 * c1, c2 * c2, 2 * ch * c1, 2 * c1 * c2, 2 * c2 * ch)


def eq11(history_bound, n1, n2, gamma):
    """Eq. 11 in the paper's squared form (a6 on n2 H, corrected): the bound for a lead of two
    updates. Equal to divergence_bound([n1, n2], gamma, history_bound)."""
    a1, a2, a3, a4, a5, a6 = eq11_coefficients(gamma)
    h = check_norm(history_bound, "history_bound")
    n1, n2 = check_norm(n1), check_norm(n2)
    if inf in (h, n1, n2):  # the squared form would meet 0 * inf
        return divergence_bound([n1, n2], gamma, h)
    return (a1 * h * h + a2 * n1 * n1 + a3 * n2 * n2 + a4 * h * n1 + a5 * n1 * n2
            + a6 * n2 * h) ** 0.5


def divergence_bound(norms, gamma, history_bound=0.0):
    """Eq. 11 for any lead: c_h H + sum_i c_i ||u_i|| >= ||w_s - w_r||, where the server has applied
    updates of these norms (in order) beyond the replica, whose history norm is at most H."""
    norms = [check_norm(n) for n in norms]
    h = check_norm(history_bound, "history_bound")
    ch, c = lead_coefficients(len(norms), gamma)
    return _mul(ch, h) + sum(ci * n for ci, n in zip(c, norms))


def next_history_bound(history_bound, norm, gamma):
    """H' = ||u|| + gamma H: a bound on the history after applying an update of this norm (or, in
    sync mode, after a step whose updates' norms sum to `norm`)."""
    return check_norm(norm) + _mul(check_gamma(gamma), check_norm(history_bound, "history_bound"))


@dataclass
class LeadBounds:
    """For a server that has applied all n updates of a sequence and a replica that has applied the
    first p (p = 0..n): bound[p] >= ||w_s - w_r|| (non-increasing in p, bound[n] = 0); history[p]
    bounds the replica's history after its last completed step; partial[p] sums the norms it has
    applied of its open step (sync mode; 0 in async)."""
    bound: list
    history: list
    partial: list


def lead_bounds(norms, gamma, history_bound=0.0, *, ends=None, partial_norm=0.0):
    """The divergence bound for every replica position along a sequence the server has applied.

    norms: the sequence's update norms, in order. ends: per update, whether it closes a step
    (default: all, async). history_bound, partial_norm: the replica's state before the sequence —
    its history bound and, in sync mode, the norms it already applied of the step the sequence
    begins in.

    With the replica inside step k (it applied part of it) and the server past it:
        w_s - w_r = gamma h_r + (rest of step k) + h_{k+1} + ... + h_K + (server's open tail),
    bounded term by term: gamma H_r + sum(rest's norms) + H_{k+1} + ... + H_K + sum(tail's norms).
    In async mode (every update a step) this is eq. 11: H_{r+1} + ... + H_s."""
    gamma = check_gamma(gamma)
    norms = [check_norm(n) for n in norms]
    h0 = check_norm(history_bound, "history_bound")
    p0 = check_norm(partial_norm, "partial_norm")
    n = len(norms)
    ends = [True] * n if ends is None else [bool(e) for e in ends]
    if len(ends) != n:
        raise ValueError("ends must flag each of the %d updates, got %d flags" % (n, len(ends)))
    steps, a = [], 0
    for i, e in enumerate(ends):
        if e:
            steps.append((a, i + 1, True))
            a = i + 1
    if a < n:
        steps.append((a, n, False))  # the server's open step (sync, mid-iteration)
    # H[k]: history bound after the first k closed steps (H[0] is the replica's now)
    hist = [h0]
    for k, (a, b, closed) in enumerate(steps):
        if closed:
            step_norm = (p0 if k == 0 else 0.0) + _sum(norms[a:b])
            hist.append(step_norm + _mul(gamma, hist[-1]))
    n_closed = len(hist) - 1
    tail = _sum(norms[steps[-1][0]:]) if steps and not steps[-1][2] else 0.0
    # after[k] = H[k+1] + ... + H[n_closed]: history bounds of the closed steps after step k-1
    after = [0.0] * (n_closed + 1)
    for k in range(n_closed - 1, -1, -1):
        after[k] = after[k + 1] + hist[k + 1]
    bound, history, partial = [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * (n + 1)
    for k, (a, b, closed) in enumerate(steps):
        rest = 0.0
        for p in range(b - 1, a - 1, -1):  # sums built by adding only: inf stays inf, no inf-inf
            rest += norms[p]
            bound[p] = (_mul(gamma, hist[k]) + rest + after[k + 1] + tail) if closed else rest
        done = p0 if k == 0 else 0.0
        for p in range(a, b):
            history[p] = hist[k]
            partial[p] = done
            done += norms[p]
        partial[n] = 0.0 if closed else done  # the last step decides; open: still partial
    if not steps:
        partial[n] = p0
    history[n] = hist[n_closed]
    return LeadBounds(bound, history, partial)


def _sum(xs):
    s = 0.0
    for x in xs:
        s += x
    return s


# --- exact quantities over real vectors (for tests and the runtime's checks) ----------------------
def exact_divergence(h, updates, gamma):
    """||c_h h + sum_i c_i u_i||: the true divergence when the server leads by `updates` (vectors,
    in order) and the replica's history is `h`."""
    ch, c = lead_coefficients(len(updates), gamma)
    d = ch * np.asarray(h, dtype=float)
    for ci, u in zip(c, updates):
        d = d + ci * np.asarray(u, dtype=float)
    return float(np.linalg.norm(d))


class Momentum:
    """Eq. 2 applied exactly to numpy vectors: the model w, the history h, and (sync mode) acc, the
    sum of the open step's updates, already added to w. apply(u) with ends_step=True is one async
    update; in sync mode apply the iteration's updates with ends_step=False, then end_step()."""

    def __init__(self, w, h=None, gamma=0.0):
        self.gamma = check_gamma(gamma)
        self.w = np.array(w, dtype=float)
        self.h = np.zeros_like(self.w) if h is None else np.array(h, dtype=float)
        self.acc = np.zeros_like(self.w)

    def copy(self):
        m = Momentum(self.w, self.h, self.gamma)
        m.acc = self.acc.copy()
        return m

    def apply(self, u, ends_step=True):
        u = np.asarray(u, dtype=float)
        self.w = self.w + u
        self.acc = self.acc + u
        if ends_step:
            self.end_step()

    def end_step(self):
        self.w = self.w + self.gamma * self.h
        self.h = self.gamma * self.h + self.acc
        self.acc = np.zeros_like(self.w)


# --- what an aggregate must carry -----------------------------------------------------------------
def aggregate_weights(m, gamma):
    """Async: an aggregate of m updates u_1..u_m (in order) has exactly their effect when the
    aggregator sends two weighted sums, A = sum_i a_i u_i with a_i = c_i (the lead coefficients for
    m) and B = sum_i b_i u_i with b_i = gamma^(m-i), and the receiver (server or replica) applies
        w <- w + c_h h + A,   h <- gamma^m h + B,   c_h = gamma (1 - gamma^m) / (1 - gamma).
    Returns (c_h, gamma^m, a, b). One weighted sum cannot do it for m >= 2 and 0 < gamma < 1: a and
    b are not proportional. (Equivalently send S = sum u_i and B: A = (S - gamma B) / (1 - gamma).)
    """
    ch, a = lead_coefficients(m, gamma)
    g = check_gamma(gamma)
    b = [g ** (m - 1 - i) for i in range(m)]
    return ch, g ** m, a, b


@dataclass
class Effect:
    """The effect of applying members u_1..u_m in order (with step ends) on the state (w, h, acc):
    new (w, h, acc) = state @ (w, h, acc) + members @ (u_1..u_m). The aggregator sends the rows of
    `members @ U` that are not zero (at most three; two in async, one for a sync aggregate within
    one iteration); the receiver applies `receive`."""
    state: np.ndarray    # 3 x 3
    members: np.ndarray  # 3 x m

    def sums(self, updates):
        """What the aggregator computes: the three weighted sums (rows) of the member vectors."""
        return self.members @ np.asarray(updates, dtype=float)

    def receive(self, w, h, acc, sums):
        x = self.state @ np.stack([np.asarray(w, float), np.asarray(h, float),
                                   np.asarray(acc, float)])
        x = x + sums
        return x[0], x[1], x[2]


def chunk_effect(gamma, ends):
    """The Effect of members whose step-closing flags are `ends` (all True in async), found by
    running the momentum recurrence on coefficients instead of vectors."""
    g = check_gamma(gamma)
    m = len(ends)
    basis = np.eye(3 + m)
    w, h, acc = basis[0].copy(), basis[1].copy(), basis[2].copy()
    for i, e in enumerate(ends):
        w = w + basis[3 + i]
        acc = acc + basis[3 + i]
        if e:
            w = w + g * h
            h = g * h + acc
            acc = np.zeros(3 + m)
    rows = np.stack([w, h, acc])
    return Effect(rows[:, :3], rows[:, 3:])
