"""The paper's MPI baselines (§7: RR-Sync and Tr-Sync) as allreduces over the paced data plane, so
they meet the same emulated NICs as MLfabric's own transfers and can be compared side by side.

- ring_allreduce (RR-Sync): reduce-scatter then allgather around the ring of `ranks`, 2(n-1) steps
  of one block (1/n of the vector) each: bandwidth-optimal, but every step waits for the slowest
  link of the ring. It is comm.algorithms' ring (ring_allreduce_on), run over a link on the data
  plane (_DataPlaneLink): one message per block and step.
- tree_allreduce (Tr-Sync): reduce up a binary tree to ranks[0], then broadcast down it, pipelined
  in segments as MPI's segmented tree reduce/bcast do: a node forwards segment k as soon as its
  children's segment k is in, while segment k+1 is still arriving.
  Segment count: at least SEGMENT_MIN_BYTES per segment and at most MAX_SEGMENTS segments. Filling
  the pipeline costs about 2*depth segment times, so more segments shrink the fill (with 64 and
  depth 4 it is ~12% of the transfer); every segment is a message with a fixed cost (a header, a
  Python turn of the event loop), so a floor of 64 KiB keeps that cost small next to its transfer
  at the emulated rates (a few ms per segment at 10-100 MB/s). Up to PIPELINE_DEPTH segments are
  in flight per link: the data plane shares a link round robin among its flows, so posting every
  segment at once would make them all finish together and undo the pipelining.

Contract: blocking; each member of `ranks` calls the function with the same `ranks`, the same size
and dtype, in the same order as its other baseline calls on this data plane (calls are numbered
per (algorithm, ranks) to keep successive calls' messages apart). x is a 1-D contiguous float32 or
float64 numpy array, summed in place (every rank ends with identical bits: each block or segment is
reduced by one rank in a fixed order, then copied). The data plane is the caller's but must not be
driven by anyone else during the call; messages meant for other keys that arrive meanwhile are kept
in a mailbox on the data plane for later baseline calls. A peer that lets `timeout` seconds
(default: the data plane's MLFABRIC_TIMEOUT) pass without any message or send completing raises
PeerTimeoutError naming the ranks waited on.
"""
import collections
import time
import weakref

import numpy as np

from .. import kernels
from .._core import dtypes as _dtypes
from ..comm import algorithms
from ..errors import MismatchError, PeerTimeoutError

SEGMENT_MIN_BYTES = 64 << 10
MAX_SEGMENTS = 64
PIPELINE_DEPTH = 2
POLL_S = 0.0005   # longest nap while waiting: a message may come at any time, wake_in() cannot know

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_mailboxes = weakref.WeakKeyDictionary()   # data plane -> {(src, key): Message}
_calls = weakref.WeakKeyDictionary()       # data plane -> {(algorithm, ranks): calls so far}


def ring_allreduce(dp, ranks, x, timeout=None):
    """Sum x in place over `ranks` (world ranks of dp.comm, this one among them) with a ring
    reduce-scatter then ring allgather. Blocking; returns x."""
    ranks, pos, n = _check(dp, ranks, x, "ring_allreduce")
    if n == 1:
        return x
    s = _Call(dp, "ring_allreduce", ranks, timeout)
    link = _DataPlaneLink(s, pos, ("rr", s.call_id("ring", "rr")), x.dtype)
    bounds = _split(x.size, n)
    # Block b (of n nearly equal ones) is the ring's chunk b - 1: member pos finishes block
    # pos + 1, and block b is summed from member b's contribution round to member b - 1's.
    chunks = [(bounds[(c + 1) % n], bounds[(c + 1) % n + 1]) for c in range(n)]
    algorithms.ring_allreduce_on(link, x, _dtypes.numpy_dtype_code(x.dtype), "sum", chunks,
                                 "ring_allreduce")
    return x


def tree_allreduce(dp, ranks, x, timeout=None):
    """Sum x in place over `ranks` with a pipelined binary-tree reduce to ranks[0] followed by a
    pipelined binary-tree broadcast (positions in `ranks`: parent (i-1)//2, children 2i+1, 2i+2).
    Blocking; returns x."""
    ranks, pos, n = _check(dp, ranks, x, "tree_allreduce")
    if n == 1:
        return x
    s = _Call(dp, "tree_allreduce", ranks, timeout)
    cid = s.call_id("tree", "tr")
    parent = ranks[(pos - 1) // 2] if pos else None
    children = [ranks[c] for c in (2 * pos + 1, 2 * pos + 2) if c < n]
    nseg = max(1, min(MAX_SEGMENTS, -(-x.nbytes // SEGMENT_MIN_BYTES)))
    bounds = _split(x.size, nseg)
    seg = [x[bounds[k]:bounds[k + 1]] for k in range(nseg)]
    up = [_Link(s, parent)] if parent is not None else []
    down = [_Link(s, c) for c in children]
    reduced = final = 0      # segments summed over the subtree / holding the result, in order
    links = up + down
    while final < nseg or any(link.busy() for link in links):
        moved = False
        # Up: sum the children's segment into ours (fixed order), pass it to the parent.
        while reduced < nseg:
            key = ("tr", cid, 0, reduced)
            if not all(s.has(c, key) for c in children):
                break
            part = seg[reduced]
            if children:
                msgs = [s.take(c, key, part) for c in children]
                kernels.reduce([part] + [m.data for m in msgs], out=part)
            if parent is not None:
                up[0].push(key, part)
            reduced += 1
            moved = True
        # Down: a segment is final at the root once reduced, elsewhere once the parent sent it
        # (and our own copy has left: the parent's data overwrites it).
        while final < reduced:
            key = ("tr", cid, 1, final)
            if parent is not None:
                if not (up[0].sent(("tr", cid, 0, final)) and s.has(parent, key)):
                    break
                seg[final][...] = s.take(parent, key, seg[final]).data
            for link in down:
                link.push(key, seg[final])
            final += 1
            moved = True
        if not moved:
            s.wait_once(children + ([parent] if parent is not None else []))
    return x


# ------------------------------------------------------------------------------------------

def _check(dp, ranks, x, what):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what}: x must be a numpy array, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{what}: x has dtype {x.dtype}; supported: float32, float64")
    if x.ndim != 1:
        raise ValueError(f"{what}: x must be 1-D, got shape {x.shape}")
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError(f"{what}: x must be contiguous and writeable (it is summed in place)")
    try:
        ranks = tuple(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: ranks must be a list of ranks, got {ranks!r}") from None
    size, me = dp.comm.Get_size(), dp.comm.Get_rank()
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
        raise ValueError(f"{what}: ranks must be distinct ranks in 0..{size - 1}, got "
                         f"{list(ranks)}")
    if me not in ranks:
        raise ValueError(f"{what}: this rank ({me}) is not in ranks {list(ranks)}")
    return ranks, ranks.index(me), len(ranks)


def _split(count, parts):
    """Boundaries of `parts` nearly equal pieces of count elements (the first count % parts get
    one more)."""
    q, r = divmod(count, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


class _Call:
    """One blocking call: drives the data plane, files arriving messages in the mailbox, and
    enforces the timeout (measured from the last sign of life: a message or a send completing)."""

    def __init__(self, dp, what, ranks, timeout):
        self.dp, self.what, self.ranks = dp, what, ranks
        self.timeout = dp.timeout if timeout is None else float(timeout)
        self.box = _mailboxes.setdefault(dp, {})
        self.last = time.monotonic()
        self.own = None   # (tag, call number) that this call's keys start with (call_id)

    def call_id(self, algorithm, tag):
        """This call's number among `algorithm`'s over these ranks; its keys start (tag, it)."""
        calls = _calls.setdefault(self.dp, {})
        k = (algorithm, self.ranks)
        calls[k] = calls.get(k, 0) + 1
        self.own = (tag, calls[k])
        return calls[k]

    def send(self, dst, key, payload, flag, then=None):
        """Hand payload to the data plane; flag[0] becomes True once the receiver has it."""
        def done():
            flag[0] = True
            self.last = time.monotonic()
            if then is not None:
                then()
        self.dp.send(dst, key, payload, on_done=done)

    def has(self, src, key):
        return (src, key) in self.box

    def take(self, src, key, like):
        """The message `key` from src, checked to match the array `like` it is combined with."""
        msg = self.box.pop((src, key))
        if msg.data.dtype != like.dtype or msg.data.size != like.size:
            raise MismatchError(f"{self.what}: rank {src} sent {msg.data.dtype}"
                                f"[{msg.data.size}] for {key!r}, this rank expected "
                                f"{like.dtype}[{like.size}] (ranks disagree on the size or dtype "
                                "of x)")
        return msg

    def wait_once(self, peers):
        """One turn of the event loop: progress, file messages, nap until there is work."""
        dp = self.dp
        try:
            msgs = dp.progress()
        except PeerTimeoutError as e:
            key = getattr(e, "key", None)
            if key is None or key[:2] == self.own:
                raise
            # a flow an earlier call left when it failed (its own bound fired first): that call
            # is over and the data plane has dropped the flow; this one goes on
            msgs = []
        now = time.monotonic()
        if msgs:
            for m in msgs:
                self.box[(m.src, m.key)] = m
            self.last = now
            return
        if now - self.last > self.timeout:
            raise PeerTimeoutError(
                f"{self.what} over ranks {list(self.ranks)}: nothing from rank(s) "
                f"{sorted(set(peers))} within {self.timeout:g} s (MLFABRIC_TIMEOUT); a peer died "
                "or is not in this call")
        nap = dp.wake_in(now)
        if nap > 0:
            time.sleep(min(nap, POLL_S))


class _DataPlaneLink:
    """comm.algorithms' link (see its module header) over a call's data plane: peers are
    positions in the call's ranks; the k-th message to a peer goes under the key own + (k,) and
    the k-th receive from it takes that key, so messages match in order, as MPI's do. A message
    is one whole block (no segments), carried as x's dtype; a received one is checked against the
    buffer it lands in (MismatchError when the ranks disagree on x) and copied there."""

    def __init__(self, call, pos, own, dtype):
        self.s, self.own, self.dtype = call, own, dtype
        self.size, self.rank = len(call.ranks), pos
        self.sent = collections.Counter()       # peer rank -> messages sent to it
        self.received = collections.Counter()   # peer rank -> receives posted from it

    @staticmethod
    def segments(nbytes):
        return ((0, nbytes),)   # an empty block is a message too, as any other

    def isend(self, buf, peer):
        dst = self.s.ranks[peer]
        key = self.own + (self.sent[dst],)
        self.sent[dst] += 1
        flag = [False]
        self.s.send(dst, key, buf.view(self.dtype), flag)
        return dst, flag, None

    def irecv(self, buf, peer):
        src = self.s.ranks[peer]
        key = self.own + (self.received[src],)
        self.received[src] += 1
        return src, key, buf.view(self.dtype)

    def wait(self, reqs, what=None):
        """Drive the data plane until every request is done: a send once the receiver has it,
        a receive once its message is in (then copied into its buffer)."""
        pending = list(reqs)
        while True:
            pending = [q for q in pending if not self._done(q)]
            if not pending:
                return
            self.s.wait_once(sorted({q[0] for q in pending}))

    def _done(self, q):
        peer, key, into = q
        if into is None:
            return key[0]   # (a send: key is its flag)
        if not self.s.has(peer, key):
            return False
        into[...] = self.s.take(peer, key, into).data
        return True


class _Link:
    """Sends to one peer in order, at most PIPELINE_DEPTH in flight (the next one is handed to
    the data plane from the completion callback of an earlier one)."""

    def __init__(self, call, dst):
        self.s, self.dst = call, dst
        self.queue = collections.deque()   # (key, payload) not yet handed to the data plane
        self.done = {}                     # key -> [sent?]
        self.inflight = 0

    def push(self, key, payload):
        self.queue.append((key, payload))
        self._pump()

    def _pump(self):
        while self.queue and self.inflight < PIPELINE_DEPTH:
            key, payload = self.queue.popleft()
            flag = self.done[key] = [False]
            self.inflight += 1
            self.s.send(self.dst, key, payload, flag, then=self._sent)

    def _sent(self):
        self.inflight -= 1
        self._pump()

    def sent(self, key):
        f = self.done.get(key)
        return f is not None and f[0]

    def busy(self):
        return bool(self.queue) or self.inflight > 0
