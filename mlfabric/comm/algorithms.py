"""Collective algorithms over MPI point-to-point: ring, Rabenseifner (recursive halving/doubling)
and binomial-tree allreduce, tree reduce/broadcast, ring allgather and ring reduce-scatter. These
are mlfabric's path between hosts (ranks on one host use the shared-memory engine instead) and what
users get when they name an algorithm explicitly.

Contract: every function is blocking and collective over all ranks of `comm` (each rank calls it
with the same count, dtype, op, root and algorithm; that is the caller's to check: ranks that
disagree end in an MPI error or a PeerTimeoutError). Arrays are 1-D contiguous numpy arrays of the
storage dtype of `code` (_core.dtypes.storage_dtype: bfloat16 is carried as uint16), owned by
the caller and worked on in place. The only temporary is a scratch buffer of at most one chunk
(never more than two message segments, or one segment per tree child; see p2p.SEGMENT_BYTES),
cached per thread between calls. Results are bit-for-bit identical on every rank: each element is
reduced by exactly one rank, in an order fixed by the algorithm, then copied to the others. All
traffic goes through mlfabric.comm.p2p (a dedicated tag, bounded waits), so a dead or diverged peer
raises PeerTimeoutError instead of hanging.

The ring and the exchange steps move messages through a link (MpiLink, over p2p, by default): an
object with size and rank (this member's position, 0..size-1), isend(buf, peer) and irecv(buf,
peer) (buf: a uint8 array; peer: a position) returning requests, wait(reqs, what) that completes
them (what: an optional description for errors), and segments(nbytes) (the (start, stop) byte ranges of the
messages that carry nbytes). Messages between two members match in the order they are posted, as
MPI's do. ring_allreduce_on() runs the ring over any link: the parameter server's baselines
(ps/allreduce_baselines.py) run it over the paced data plane.

`op` is a kernel op code (_core.dtypes.OP_CODES) or an op name; "avg" (floating dtypes only)
is a sum scaled by 1/n, applied by the rank that finishes each chunk, so it costs no extra pass.
"""
import threading

import numpy as np
from mpi4py import MPI

from .. import _C
from .._core import dtypes as _dtypes
from . import p2p
from .p2p import isend, irecv, segments, wait

ALGORITHMS = ("ring", "rhd", "tree")

_STORAGE = tuple(_dtypes.storage_dtype(c) for c in range(len(_dtypes.DTYPE_NAMES)))
_SUM = _dtypes.OP_CODES["sum"]
_RECV, _SEND = (True,), (False,)  # request kinds for p2p.wait (receives get cancelled)


# ---------------------------------------------------------------------------------------------
# argument checks, pointers, scratch

def _check(arr, code, name="arr"):
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be a 1-D contiguous array, got shape {arr.shape}")
    if not isinstance(code, (int, np.integer)) or not 0 <= code < len(_STORAGE):
        raise ValueError(f"unknown dtype code {code!r}; expected 0..{len(_STORAGE) - 1} "
                         f"({', '.join(_dtypes.DTYPE_NAMES)})")
    if arr.dtype != _STORAGE[code]:
        raise TypeError(f"{name} has dtype {arr.dtype}, but dtype code {code} "
                        f"({_dtypes.DTYPE_NAMES[code]}) is stored as {_STORAGE[code]}")


def _op_scale(op, code, n):
    """(kernel op code, scale) for op given as a code or a name."""
    opc = _dtypes.OP_CODES.get(op) if isinstance(op, str) else None  # the fast, common case
    if opc is not None:
        return opc, 1.0
    if isinstance(op, str):
        opc, avg = _dtypes.op_code(op, code)
        return opc, (1.0 / n if avg else 1.0)
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool) \
            and 0 <= op < len(_dtypes.OPS):
        return int(op), 1.0
    raise ValueError(f"unknown reduction op {op!r}; expected a name ({', '.join(_dtypes.ALL_OPS)}) "
                     f"or a code 0..{len(_dtypes.OPS) - 1}")


def _addr(a):
    """Address of a contiguous array's first byte (MPI.buffer: ~8x cheaper than a.ctypes.data)."""
    return MPI.buffer(a).address


_tls = threading.local()


def _scratch(nbytes):
    """(uint8 array, address) of at least nbytes: the per-thread scratch buffer, grown on demand.
    A timeout may leave a parked receive pointing into it, so after one a fresh buffer is made."""
    c = getattr(_tls, "scratch", None)
    if c is None or c[0].size < nbytes or c[2] != p2p.timeouts:
        buf = np.empty(max(nbytes, 4096), np.uint8)
        c = _tls.scratch = (buf, _addr(buf), p2p.timeouts)
    return c[0], c[1]


class MpiLink:
    """The default link (see the module header): MPI point-to-point on comm through p2p, peers
    are ranks of comm, a message longer than p2p.SEGMENT_BYTES goes as several."""

    __slots__ = ("comm", "size", "rank")

    def __init__(self, comm):
        self.comm, self.size, self.rank = comm, comm.Get_size(), comm.Get_rank()

    def isend(self, buf, peer):
        return isend(self.comm, buf, peer), peer, False

    def irecv(self, buf, peer):
        return irecv(self.comm, buf, peer), peer, True

    def wait(self, reqs, what="a point-to-point wait"):
        if reqs:
            wait([q[0] for q in reqs], [q[1] for q in reqs], what, [q[2] for q in reqs])

    @staticmethod
    def segments(nbytes):
        return segments(nbytes)


class _Call:
    """What every step of one collective call needs."""

    __slots__ = ("comm", "link", "n", "r", "b", "isz", "base", "code", "op", "name")

    def __init__(self, comm, arr, code, op, name, link=None):
        self.comm = comm   # the tree's own steps post on it directly (None over another link)
        self.link = MpiLink(comm) if link is None else link
        self.n, self.r = self.link.size, self.link.rank
        self.b = arr.view(np.uint8)  # byte view: messages are byte ranges of it
        self.isz, self.base = arr.itemsize, _addr(arr)
        self.code, self.op, self.name = code, op, name


def _scale_in_place(arr, code, scale):
    if scale != 1.0 and arr.size:
        p = _addr(arr)
        _C.reduce(p, [p], arr.size, code, _SUM, scale)


# ---------------------------------------------------------------------------------------------
# steps: one exchange with up to two peers

def _elements(x, lo, hi):
    """uint8 view of elements [lo, hi) of the call's array."""
    return x.b[lo * x.isz:hi * x.isz]


def _post(link, reqs, post, buf, peer):
    """Post buf to or from peer as the link's messages (post: link.isend or link.irecv)."""
    for s, e in link.segments(buf.size):
        reqs.append(post(buf[s:e], peer))


def _exchange(x, send, recv, what):
    """Send elements send=(peer, lo, hi) and receive recv=(peer, lo, hi) into place (either may
    be None); the ranges must not overlap. The allgather/broadcast step."""
    link, reqs = x.link, []
    if recv is not None:
        peer, lo, hi = recv
        _post(link, reqs, link.irecv, _elements(x, lo, hi), peer)
    if send is not None:
        peer, lo, hi = send
        _post(link, reqs, link.isend, _elements(x, lo, hi), peer)
    link.wait(reqs, what)


def _exchange_reduce(x, send, recv, scale, what):
    """Send elements send=(peer, lo, hi) while receiving recv=(peer, lo, hi) and reducing it into
    place: arr[lo:hi] = scale * op(arr[lo:hi], received). The reduce-scatter step."""
    link, reqs = x.link, []
    peer, lo, hi = recv
    nbytes = (hi - lo) * x.isz
    segs = link.segments(nbytes)
    if len(segs) <= 1:  # one message (or none): receive it all, then reduce
        scratch, sptr = _scratch(nbytes)
        for s, e in segs:
            reqs.append(link.irecv(scratch[s:e], peer))
        if send is not None:
            _post(link, reqs, link.isend, _elements(x, send[1], send[2]), send[0])
        link.wait(reqs, what)
        if nbytes:
            dst = x.base + lo * x.isz
            _C.reduce(dst, [dst, sptr], hi - lo, x.code, x.op, scale)
        return
    if send is not None:
        _post(link, reqs, link.isend, _elements(x, send[1], send[2]), send[0])
    isz = x.isz
    _reduce_stream(x, [(peer, lo + s // isz, lo + e // isz, scale if k == len(segs) - 1 else 1.0)
                       for k, (s, e) in enumerate(segs)], what)
    link.wait(reqs, what)


def _reduce_stream(x, jobs, what, after=None):
    """Receive and reduce a stream of messages, each at most one segment, in order.

    jobs[j] = (peer, lo, hi, scale): the next message from peer holds elements [lo, hi); reduce it
    into place with that scale. Two scratch slots double-buffer: message j+1 arrives while j is
    reduced. after(j), if given, runs once job j is reduced (the tree forwards finished
    segments there)."""
    isz = x.isz
    slot = max((hi - lo) * isz for _, lo, hi, _ in jobs)
    scratch, sptr = _scratch(slot * min(len(jobs), 2))
    link, code, op, base = x.link, x.code, x.op, x.base
    reqs = [None] * len(jobs)

    def post(j):
        peer, lo, hi, _ = jobs[j]
        at = (j & 1) * slot
        reqs[j] = link.irecv(scratch[at:at + (hi - lo) * isz], peer)

    post(0)
    if len(jobs) > 1:
        post(1)
    for j, (peer, lo, hi, scale) in enumerate(jobs):
        link.wait(reqs[j:j + 1], what)
        reqs[j] = None
        dst = base + lo * isz
        _C.reduce(dst, [dst, sptr + (j & 1) * slot], hi - lo, code, op, scale)
        if j + 2 < len(jobs):
            post(j + 2)
        if after is not None:
            after(j)


# ---------------------------------------------------------------------------------------------
# ring

def _ring_reduce_scatter(x, chunks, scale):
    """Afterwards member r's chunk chunks[r] = (lo, hi) (elements) holds the full reduction (the
    other chunks hold partial results). n - 1 steps: in step s member r passes chunk r-s-1 to
    the right and reduces chunk r-s-2 from the left into its own, so chunk c is reduced starting
    from member c+1's contribution and ending at member c's."""
    n, r = x.n, x.r
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        sc, rc = (r - s - 1) % n, (r - s - 2) % n
        _exchange_reduce(x, (right, *chunks[sc]), (left, *chunks[rc]),
                         scale if s == n - 2 else 1.0,
                         ("{} (rank {}, reduce-scatter step {})", x.name, r, s))


def _ring_allgather(x, chunks):
    """Member r holds chunk r; afterwards every member holds every chunk. In step s member r
    passes chunk r-s to the right and receives chunk r-s-1 from the left, in place."""
    n, r = x.n, x.r
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        sc, rc = (r - s) % n, (r - s - 1) % n
        _exchange(x, (right, *chunks[sc]), (left, *chunks[rc]),
                  ("{} (rank {}, allgather step {})", x.name, r, s))


def _offsets(counts):
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return offs


def _chunks(offs):
    """[(lo, hi)] of the consecutive chunks that offsets offs bound."""
    return list(zip(offs, offs[1:]))


def _even_offsets(count, n):
    """n chunks as equal as possible, the first count % n one element longer (empty ones when
    count < n)."""
    q, rem = divmod(count, n)
    return _offsets([q + (i < rem) for i in range(n)])


def ring_allreduce(comm, arr, code, op):
    """Allreduce arr in place: ring reduce-scatter then ring allgather over n chunks (unequal when
    count % n != 0, empty when count < n). 2(n-1) steps of count/n elements each: bandwidth-
    optimal, the choice for large messages. Returns arr."""
    return ring_allreduce_on(MpiLink(comm), arr, code, op)


def ring_allreduce_on(link, arr, code, op, chunks=None, name="ring_allreduce"):
    """ring_allreduce over `link` (see the module header). chunks: [(lo, hi)] elements of each
    member's chunk, in ring order (member r finishes chunk r's reduction: chunk c is summed from
    member c+1's contribution round to member c's); by default consecutive, as equal as
    possible. Returns arr."""
    _check(arr, code)
    n = link.size
    opc, scale = _op_scale(op, code, n)
    if n == 1 or arr.size == 0:
        _scale_in_place(arr, code, scale)
        return arr
    x = _Call(None, arr, code, opc, name, link)
    if chunks is None:
        chunks = _chunks(_even_offsets(arr.size, n))
    _ring_reduce_scatter(x, chunks, scale)
    _ring_allgather(x, chunks)
    return arr


def ring_reduce_scatter(comm, arr, code, op, counts):
    """Reduce arr across ranks, leaving rank r's chunk reduced: counts[r] elements at offset
    sum(counts[:r]) (sum(counts) == arr.size, the same counts on every rank). Returns that chunk,
    a view of arr. The rest of arr is used as scratch and holds partial results afterwards."""
    _check(arr, code)
    n, r = comm.Get_size(), comm.Get_rank()
    counts = [int(c) for c in counts]
    if len(counts) != n or min(counts) < 0 or sum(counts) != arr.size:
        raise ValueError(f"counts must be {n} non-negative numbers summing to arr.size "
                         f"({arr.size}), got {counts}")
    opc, scale = _op_scale(op, code, n)
    offs = _offsets(counts)
    if n == 1 or arr.size == 0:
        _scale_in_place(arr, code, scale)
    else:
        _ring_reduce_scatter(_Call(comm, arr, code, opc, "ring_reduce_scatter"), _chunks(offs),
                             scale)
    return arr[offs[r]:offs[r + 1]]


def ring_allgather(comm, inp, out):
    """out = the concatenation, in rank order, of every rank's inp (all the same size and dtype;
    inp may be this rank's own slot of out). Moves bytes, so any dtype goes. Returns out."""
    n, r = comm.Get_size(), comm.Get_rank()
    for name, a in (("inp", inp), ("out", out)):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a 1-D contiguous numpy array")
    if out.dtype != inp.dtype or out.size != n * inp.size:
        raise ValueError(f"out must hold {n} x {inp.size} elements of {inp.dtype}, "
                         f"got {out.size} of {out.dtype}")
    m = inp.size
    if m == 0:
        return out
    mine = out[r * m:(r + 1) * m]
    if _addr(mine) != MPI.buffer(inp).address:
        mine[...] = inp
    if n > 1:
        _ring_allgather(_Call(comm, out, 0, 0, "ring_allgather"),
                        [(i * m, (i + 1) * m) for i in range(n)])
    return out


# ---------------------------------------------------------------------------------------------
# Rabenseifner: recursive halving reduce-scatter + recursive doubling allgather

def rhd_allreduce(comm, arr, code, op):
    """Allreduce arr in place, Rabenseifner's way: reduce-scatter by recursive halving, then
    allgather by recursive doubling, over pof2 blocks (pof2 = largest power of two <= n):
    2 log2(pof2) steps moving count/2 + count/4 + ... elements each way, fewer steps than the ring
    at the same volume. For n not a power of two, the first 2*rem ranks (rem = n - pof2) pair up:
    each even one hands its vector to its odd neighbour and sits out, and gets the result back at
    the end (two extra whole-vector steps for those pairs). Returns arr."""
    _check(arr, code)
    n, r = comm.Get_size(), comm.Get_rank()
    opc, scale = _op_scale(op, code, n)
    if n == 1 or arr.size == 0:
        _scale_in_place(arr, code, scale)
        return arr
    count = arr.size
    x = _Call(comm, arr, code, opc, "rhd_allreduce")
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    fold = ("{} (rank {}, {})", x.name, r, "fold-in")

    if r < 2 * rem:  # fold the extra ranks in
        if r % 2 == 0:
            _exchange(x, (r + 1, 0, count), None, fold)
            newrank = -1
        else:
            _exchange_reduce(x, None, (r - 1, 0, count), 1.0, fold)
            newrank = r // 2
    else:
        newrank = r - rem

    if newrank != -1:
        offs = _even_offsets(count, pof2)

        def real(nr):  # the comm rank of participant nr
            return nr * 2 + 1 if nr < rem else nr + rem

        # Recursive halving: with the partner at distance mask, keep one half of the current
        # block range (the lower half for the lower partner), send the other, and reduce the
        # partner's copy of the kept half into it. The last step finishes the blocks: scale there.
        mask, send_idx, recv_idx, last_idx = 1, 0, 0, pof2
        while mask < pof2:
            partner = newrank ^ mask
            half = pof2 // (mask * 2)
            if newrank < partner:
                send_idx = recv_idx + half
                send, recv = (send_idx, last_idx), (recv_idx, send_idx)
            else:
                recv_idx = send_idx + half
                send, recv = (send_idx, recv_idx), (recv_idx, last_idx)
            dst = real(partner)
            _exchange_reduce(x, (dst, offs[send[0]], offs[send[1]]),
                             (dst, offs[recv[0]], offs[recv[1]]),
                             scale if mask * 2 == pof2 else 1.0,
                             ("{} (rank {}, halving distance {})", x.name, r, mask))
            send_idx = recv_idx
            mask <<= 1
            if mask < pof2:
                last_idx = recv_idx + pof2 // mask

        # Recursive doubling: retrace the steps backwards, swapping finished blocks.
        mask >>= 1
        while mask > 0:
            partner = newrank ^ mask
            half = pof2 // (mask * 2)
            if newrank < partner:
                if mask != pof2 // 2:
                    last_idx += half
                recv_idx = send_idx + half
                send, recv = (send_idx, recv_idx), (recv_idx, last_idx)
            else:
                recv_idx = send_idx - half
                send, recv = (send_idx, last_idx), (recv_idx, send_idx)
            dst = real(partner)
            _exchange(x, (dst, offs[send[0]], offs[send[1]]), (dst, offs[recv[0]], offs[recv[1]]),
                      ("{} (rank {}, doubling distance {})", x.name, r, mask))
            if newrank > partner:
                send_idx = recv_idx
            mask >>= 1

    if r < 2 * rem:  # hand the result back to the ranks that sat out
        fold = ("{} (rank {}, {})", x.name, r, "fold-out")
        if r % 2 == 1:
            _exchange(x, (r - 1, 0, count), None, fold)
        else:
            _exchange(x, None, (r + 1, 0, count), fold)
    return arr


# ---------------------------------------------------------------------------------------------
# binomial tree

def _tree(n, vrank):
    """(parent vrank or None, child vranks nearest first) in the binomial tree rooted at vrank 0."""
    children, mask = [], 1
    while mask < n:
        if vrank & mask:
            return vrank - mask, children
        if vrank + mask < n:
            children.append(vrank + mask)
        mask <<= 1
    return None, children


def tree_reduce(comm, arr, code, op, root=0):
    """Reduce arr onto root, in place there, along a binomial tree: log2(n) steps of the whole
    vector, the fewest messages. On every other rank arr is clobbered (it ends up holding the
    partial result of that rank's subtree). Large vectors are pipelined: each segment goes up as
    soon as this rank's subtree has reduced it. Returns arr."""
    _check(arr, code)
    n = comm.Get_size()
    if not 0 <= root < n:
        raise ValueError(f"root {root} out of range for {n} ranks")
    opc, scale = _op_scale(op, code, n)
    if arr.size:
        _tree_reduce(_Call(comm, arr, code, opc, "tree_reduce"), arr, root, scale)
    return arr


def _tree_reduce(x, arr, root, scale):
    n, r = x.n, x.r
    vparent, vchildren = _tree(n, (r - root) % n)
    parent = None if vparent is None else (vparent + root) % n
    children = [(v + root) % n for v in vchildren]
    what = ("{} (rank {}, root {})", x.name, r, root)
    if not children:
        if parent is None:
            _scale_in_place(arr, x.code, scale)
        else:
            _exchange(x, (parent, 0, arr.size), None, what)
        return
    nbytes = arr.nbytes
    k = len(children)
    # The children's contributions are reduced in a fixed order (nearest subtree first); the last
    # one finishes the vector, which then goes up, or gets the scale on the root.
    last_scale = scale if parent is None else 1.0
    if nbytes <= p2p.SEGMENT_BYTES:
        # One message per child: receive them all at once (k <= log2 n slots), reduce in order.
        scratch, sptr = _scratch(k * nbytes)
        reqs = [irecv(x.comm, scratch[i * nbytes:(i + 1) * nbytes], c)
                for i, c in enumerate(children)]
        for i, c in enumerate(children):
            wait([reqs[i]], [c], what, _RECV)
            _C.reduce(x.base, [x.base, sptr + i * nbytes], arr.size, x.code, x.op,
                      last_scale if i == k - 1 else 1.0)
        if parent is not None:
            wait([isend(x.comm, x.b, parent)], [parent], what, _SEND)
        return
    isz = x.isz
    segs = [(s // isz, e // isz) for s, e in segments(nbytes)]
    jobs = [(c, lo, hi, last_scale if i == k - 1 else 1.0) for lo, hi in segs
            for i, c in enumerate(children)]
    ups = p2p.Batch(x.comm)

    def forward(j):
        if parent is not None and j % k == k - 1:
            lo, hi = segs[j // k]
            ups.add(isend(x.comm, _elements(x, lo, hi), parent), parent, False)

    _reduce_stream(x, jobs, what, forward)
    ups.wait(what)


def tree_broadcast(comm, arr, root=0):
    """Copy root's arr into every rank's arr (same size and dtype everywhere; any dtype: it moves
    bytes) along a binomial tree, farthest subtree first; large vectors are pipelined: each
    segment is forwarded as soon as it arrives. Returns arr."""
    n = comm.Get_size()
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError("arr must be a 1-D contiguous numpy array")
    if not 0 <= root < n:
        raise ValueError(f"root {root} out of range for {n} ranks")
    if n > 1 and arr.size:
        _tree_broadcast(_Call(comm, arr, 0, 0, "tree_broadcast"), root)
    return arr


def _tree_broadcast(x, root):
    n, r = x.n, x.r
    vparent, vchildren = _tree(n, (r - root) % n)
    children = [(v + root) % n for v in reversed(vchildren)]  # farthest (largest subtree) first
    what = ("{} (rank {}, root {})", x.name, r, root)
    comm, b = x.comm, x.b
    segs = segments(b.size)
    sends = p2p.Batch(comm)
    if vparent is None:
        for s, e in segs:
            for c in children:
                sends.add(isend(comm, b[s:e], c), c, False)
    else:
        parent = (vparent + root) % n
        recvs = [irecv(comm, b[s:e], parent) for s, e in segs]
        for (s, e), req in zip(segs, recvs):
            wait([req], [parent], what, _RECV)
            for c in children:
                sends.add(isend(comm, b[s:e], c), c, False)
    sends.wait(what)


def tree_allreduce(comm, arr, code, op):
    """Allreduce arr in place: binomial-tree reduce to rank 0, then binomial broadcast from it.
    2 log2(n) steps of the whole vector: the fewest messages, for latency-bound sizes."""
    _check(arr, code)
    n = comm.Get_size()
    opc, scale = _op_scale(op, code, n)
    if n == 1 or arr.size == 0:
        _scale_in_place(arr, code, scale)
        return arr
    x = _Call(comm, arr, code, opc, "tree_allreduce")
    _tree_reduce(x, arr, 0, scale)
    _tree_broadcast(x, 0)
    return arr


# ---------------------------------------------------------------------------------------------
# choice and dispatch

# Crossover points, measured on a VM with 2 cores, Open MPI 5 over btl self,sm, so n=3
# and n=4 are oversubscribed; the machine was shared and noisy, so each number is the best of
# 3 runs x 15 trials, in microseconds per float32-sum allreduce, as MPI.Allreduce/tree/rhd/ring:
#    bytes   n=2                    n=3                    n=4
#        8   1.6/11.5/17/17         6.1/25/31/43           7.6/36/52/95
#    1 Ki    2.4/13/19/18           10/29/41/75            14/45/92/105
#    4 Ki    4.9/24/13/13           24/44/47/70            28/55/79/108
#   16 Ki    16/43/32/32            41/46/56/102           46/63/112/157
#   64 Ki    43/132/78/77           75/95/166/174          93/137/206/244
#  256 Ki    151/362/181/245        184/212/198/176        216/254/313/326
#    1 Mi    302/625/340/373        428/627/533/740        459/684/657/693
#    4 Mi    1087/1824/1336/1273    1572/2848/2643/1772    1846/2731/1962/2127
# (a small call costs ~6 us of Python over MPI's C path; the ratio is what it is for 8 bytes.)
# Reading: on 2 ranks (the one unoversubscribed case) the tree wins up to 1 KiB and loses from
# 4 KiB: ring/rhd move half the vector each way at once, the tree the whole vector twice in turn.
# On 3-4 ranks the tree wins up to 64-256 KiB here, but oversubscription flatters it (a ring or
# halving step needs every rank on a core at once); between hosts, where the tree's log2(n)
# whole-vector steps cost real bandwidth, its limit should be lower, so we take 16 KiB. Rabenseifner
# wins 1-4 MiB on 4 ranks and is never worse than the ring in steps or volume for a power-of-two n;
# for other n its fold-in/fold-out add two whole-vector steps, so the ring takes over. The ring is
# kept for large messages, where its neighbour-only traffic suits hierarchical networks. Users can
# always name an algorithm.
TREE_MAX_BYTES_2 = 2 * 1024
TREE_MAX_BYTES = 16 * 1024
RHD_MAX_BYTES = 4 << 20


def tree_fits(nbytes, n):
    """Whether the tree is the pick for nbytes per rank on n ranks (see the measurements above)."""
    return n <= 1 or nbytes <= (TREE_MAX_BYTES_2 if n == 2 else TREE_MAX_BYTES)


def rhd_fits(nbytes, n):
    """Whether Rabenseifner is the pick where the tree is not: up to RHD_MAX_BYTES on a power-of-
    two number of ranks."""
    return nbytes <= RHD_MAX_BYTES and n & (n - 1) == 0


def choose_allreduce(nbytes, n):
    """The algorithm allreduce(..., "auto") uses for nbytes per rank on n ranks: "tree", "rhd"
    or "ring" (see the measurements above), the first that fits in that order."""
    if tree_fits(nbytes, n):
        return "tree"
    if rhd_fits(nbytes, n):
        return "rhd"
    return "ring"


_IMPL = {"ring": ring_allreduce, "rhd": rhd_allreduce, "tree": tree_allreduce}


def allreduce(comm, arr, code, op, algorithm="auto"):
    """Allreduce arr in place with the named algorithm ("ring", "rhd", "tree", or "auto" for
    choose_allreduce's pick). Returns arr."""
    impl = _IMPL.get(algorithm)
    if impl is None:
        if algorithm != "auto":
            raise ValueError(f"unknown allreduce algorithm {algorithm!r}; expected one of "
                             f"{', '.join(ALGORITHMS + ('auto',))}")
        impl = _IMPL[choose_allreduce(arr.nbytes, comm.Get_size())]
    return impl(comm, arr, code, op)
