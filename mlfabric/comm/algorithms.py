"""Collective algorithms over MPI point-to-point: ring, Rabenseifner (recursive halving/doubling)
and binomial-tree allreduce, tree reduce/broadcast, ring allgather and ring reduce-scatter. These
are mlfabric's path between hosts (ranks on one host use the shared-memory engine instead) and what
users get when they name an algorithm explicitly.

Contract: every function is blocking, collective over all ranks of `comm` (each rank calls it with
the same count, dtype, op, root and algorithm), and works in place on 1-D contiguous numpy arrays
of the storage dtype of `code` (mlfabric._dtypes.storage_dtype: bfloat16 is carried as uint16).
The caller owns the arrays; the only temporary is one scratch array of at most one chunk (capped at
two message segments, see p2p.SEGMENT_BYTES). Results are bit-for-bit identical on every rank:
each element is reduced by exactly one rank, in an order fixed by the algorithm, and then copied
to the others. All traffic goes through mlfabric.comm.p2p (one dedicated tag, bounded waits): a
dead or diverged peer raises PeerTimeoutError instead of hanging. Ranks are not checked for
agreeing arguments here (the caller's job); disagreeing ranks end in an MPI error or a timeout.

`op` is a kernel op code (mlfabric._dtypes.OP_CODES) or an op name; "avg" (floating dtypes only)
is a sum scaled by 1/n, applied by the rank that finishes each chunk, so it costs no extra pass.
"""
import numpy as np

from .. import _C, _dtypes
from . import p2p
from .p2p import Batch, as_bytes

ALGORITHMS = ("ring", "rhd", "tree")


# ---------------------------------------------------------------------------------------------
# helpers

def _check(arr, code, name="arr"):
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be a 1-D contiguous array, got shape {arr.shape}")
    want = _dtypes.storage_dtype(code)
    if arr.dtype != want:
        raise TypeError(f"{name} has dtype {arr.dtype}, but dtype code {code} "
                        f"({_dtypes.DTYPE_NAMES[code]}) is stored as {want}")


def _op_scale(op, code, n):
    """(kernel op code, scale) for op given as a code or a name."""
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool):
        if not 0 <= op < len(_dtypes.OPS):
            raise ValueError(f"unknown reduction op code {op}; expected 0..{len(_dtypes.OPS) - 1}")
        return int(op), 1.0
    opc, avg = _dtypes.op_code(op, code)
    return opc, (1.0 / n if avg else 1.0)


def _offsets(counts):
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return offs


def _even_offsets(count, n):
    """n chunks as equal as possible, the first count % n one element longer (empty if count < n)."""
    q, rem = divmod(count, n)
    return _offsets([q + (i < rem) for i in range(n)])


def _scratch(max_elems, itemsize, slots):
    """The one scratch array: `slots` (1 or 2) slots, each the largest single receive (a range of
    max_elems elements, or one segment if that is smaller)."""
    slot = min(max_elems * itemsize, p2p.SEGMENT_BYTES)
    return np.empty(max(slots * slot, 1), np.uint8)


def _scale_in_place(arr, code, scale):
    if scale != 1.0 and arr.size:
        ptr = arr.ctypes.data
        _C.reduce(ptr, [ptr], arr.size, code, _dtypes.OP_CODES["sum"], scale)


def _recv_reduce(comm, jobs, arr, scratch, code, op, what, after=None):
    """Receive and reduce a stream of messages into arr.

    jobs[j] = (peer, lo, hi, scale): the next message from peer holds elements [lo, hi) (at most
    one segment); arr[lo:hi] = scale * op(arr[lo:hi], message). Jobs run in order, so the order of
    reduction is fixed. Two scratch slots double-buffer: job j+1 arrives while job j is reduced.
    after(j), if given, runs once job j is reduced (the tree forwards finished segments there)."""
    if not jobs:
        return
    isz = arr.itemsize
    stride = scratch.size // 2 if len(jobs) > 1 else 0  # slot 1 starts here
    base = arr.ctypes.data
    sbase = scratch.ctypes.data
    reqs = [None] * len(jobs)

    def post(j):
        peer, lo, hi, _ = jobs[j]
        slot = (j & 1) * stride
        reqs[j] = p2p.irecv(comm, scratch[slot:slot + (hi - lo) * isz], peer)

    post(0)
    if len(jobs) > 1:
        post(1)
    for j, (peer, lo, hi, scale) in enumerate(jobs):
        p2p.wait([reqs[j]], [peer], what)
        reqs[j] = None
        if hi > lo:
            dst = base + lo * isz
            _C.reduce(dst, [dst, sbase + (j & 1) * stride], hi - lo, code, op, scale)
        if j + 2 < len(jobs):
            post(j + 2)
        if after is not None:
            after(j)


def _range_jobs(peer, lo, hi, isz, scale):
    """Jobs receiving elements [lo, hi) from peer, cut into segments exactly as Batch.send cuts
    the same range on the sending side; the last segment carries the scale."""
    segs = p2p.segments((hi - lo) * isz)
    return [(peer, lo + s // isz, lo + e // isz, scale if k == len(segs) - 1 else 1.0)
            for k, (s, e) in enumerate(segs)]


def _send_recv_reduce(comm, arr, scratch, code, op, what, send, recv, scale=1.0):
    """Send elements send=(peer, lo, hi) of arr while receiving recv=(peer, lo, hi) and reducing
    it into arr (scaled by scale); the two ranges must not overlap. Either may be None."""
    b = Batch(comm)
    if send is not None:
        b.send(as_bytes(arr, send[1], send[2]), send[0])
    if recv is not None:
        _recv_reduce(comm, _range_jobs(recv[0], recv[1], recv[2], arr.itemsize, scale),
                     arr, scratch, code, op, what)
    b.wait(what)


def _send_recv(comm, arr, what, send, recv):
    """Send elements send=(peer, lo, hi) of arr and receive recv=(peer, lo, hi) into arr."""
    b = Batch(comm)
    if recv is not None:
        b.recv_into(as_bytes(arr, recv[1], recv[2]), recv[0])
    if send is not None:
        b.send(as_bytes(arr, send[1], send[2]), send[0])
    b.wait(what)


# ---------------------------------------------------------------------------------------------
# ring

def _ring_reduce_scatter(comm, arr, code, op, offs, scale, what):
    """After this, rank r's chunk [offs[r], offs[r+1]) of arr holds the full reduction (other
    chunks hold partial sums). n - 1 steps; in step s rank r passes chunk r-s-1 to the right and
    reduces chunk r-s-2 from the left into its own copy, so chunk c is summed starting from rank
    c+1's contribution and ending at rank c's."""
    n, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    biggest = max(offs[i + 1] - offs[i] for i in range(n))
    scratch = _scratch(biggest, arr.itemsize, 2 if biggest * arr.itemsize > p2p.SEGMENT_BYTES else 1)
    for s in range(n - 1):
        sc, rc = (r - s - 1) % n, (r - s - 2) % n
        _send_recv_reduce(comm, arr, scratch, code, op, f"{what} (rank {r}, reduce-scatter step {s})",
                          (right, offs[sc], offs[sc + 1]), (left, offs[rc], offs[rc + 1]),
                          scale if s == n - 2 else 1.0)


def _ring_allgather(comm, arr, offs, what):
    """Rank r holds chunk r of arr; afterwards every rank holds every chunk. In step s rank r
    passes chunk r-s to the right and receives chunk r-s-1 from the left, in place."""
    n, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        sc, rc = (r - s) % n, (r - s - 1) % n
        _send_recv(comm, arr, f"{what} (rank {r}, allgather step {s})",
                   (right, offs[sc], offs[sc + 1]), (left, offs[rc], offs[rc + 1]))


def ring_allreduce(comm, arr, code, op):
    """Allreduce arr in place: ring reduce-scatter then ring allgather over n chunks (the first
    count % n one element longer; empty when count < n). 2(n-1) steps each moving count/n
    elements: bandwidth-optimal, so the choice for large messages."""
    _check(arr, code)
    n = comm.Get_size()
    opc, scale = _op_scale(op, code, n)
    if n == 1:
        _scale_in_place(arr, code, scale)
        return arr
    offs = _even_offsets(arr.size, n)
    _ring_reduce_scatter(comm, arr, code, opc, offs, scale, "ring_allreduce")
    _ring_allgather(comm, arr, offs, "ring_allreduce")
    return arr


def ring_reduce_scatter(comm, arr, code, op, counts):
    """Reduce arr across ranks and leave rank r's chunk (counts[r] elements, at offset
    sum(counts[:r]); sum(counts) == arr.size) reduced. Returns that chunk: a view of arr. The rest
    of arr is used as scratch and holds partial results afterwards."""
    _check(arr, code)
    n, r = comm.Get_size(), comm.Get_rank()
    counts = [int(c) for c in counts]
    if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != arr.size:
        raise ValueError(f"counts must be {n} non-negative numbers summing to arr.size "
                         f"({arr.size}), got {counts}")
    opc, scale = _op_scale(op, code, n)
    offs = _offsets(counts)
    if n == 1:
        _scale_in_place(arr, code, scale)
    else:
        _ring_reduce_scatter(comm, arr, code, opc, offs, scale, "ring_reduce_scatter")
    return arr[offs[r]:offs[r + 1]]


def ring_allgather(comm, inp, out):
    """out = the concatenation, in rank order, of every rank's inp (all the same size and dtype;
    inp may be out's own slot). Works on raw bytes, so any dtype goes. Returns out."""
    n, r = comm.Get_size(), comm.Get_rank()
    for name, a in (("inp", inp), ("out", out)):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a 1-D contiguous numpy array")
    if out.dtype != inp.dtype or out.size != n * inp.size:
        raise ValueError(f"out must hold {n} x {inp.size} elements of {inp.dtype}, "
                         f"got {out.size} of {out.dtype}")
    ob = as_bytes(out)
    m = inp.nbytes
    mine = ob[r * m:(r + 1) * m]
    if m and not (mine.ctypes.data == inp.ctypes.data):
        np.copyto(mine, as_bytes(inp))
    if n > 1:
        _ring_allgather(comm, ob, [i * m for i in range(n + 1)], "ring_allgather")
    return out


# ---------------------------------------------------------------------------------------------
# Rabenseifner: recursive halving reduce-scatter + recursive doubling allgather

def rhd_allreduce(comm, arr, code, op):
    """Allreduce arr in place, Rabenseifner's way: reduce-scatter by recursive halving, then
    allgather by recursive doubling, over pof2 (largest power of two <= n) blocks: 2 log2(pof2)
    steps moving count/2 + count/4 + ... elements. For n not a power of two, the first 2*rem ranks
    (rem = n - pof2) pair up: each even one hands its vector to its odd neighbour and sits out, and
    gets the result back at the end (two extra full-vector steps for those pairs)."""
    _check(arr, code)
    n, r = comm.Get_size(), comm.Get_rank()
    opc, scale = _op_scale(op, code, n)
    if n == 1:
        _scale_in_place(arr, code, scale)
        return arr
    count = arr.size
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    scratch = _scratch(count, arr.itemsize, 2 if arr.nbytes > p2p.SEGMENT_BYTES else 1)
    what = f"rhd_allreduce (rank {r}"

    # Fold the extra ranks in.
    if r < 2 * rem:
        if r % 2 == 0:
            _send_recv(comm, arr, what + ", fold-in)", (r + 1, 0, count), None)
            newrank = -1
        else:
            _send_recv_reduce(comm, arr, scratch, code, opc, what + ", fold-in)", None,
                              (r - 1, 0, count))
            newrank = r // 2
    else:
        newrank = r - rem

    if newrank != -1:
        offs = _even_offsets(count, pof2)

        def real(nr):  # rank in comm of the rank numbered nr among the pof2 taking part
            return nr * 2 + 1 if nr < rem else nr + rem

        # Recursive halving: at distance mask, keep the half of the current block range that
        # belongs with the lower (or upper) partner and reduce the partner's copy of it.
        mask, send_idx, recv_idx, last_idx = 1, 0, 0, pof2
        while mask < pof2:
            dst = real(newrank ^ mask)
            half = pof2 // (mask * 2)
            if newrank < (newrank ^ mask):
                send_idx = recv_idx + half
                send, recv = (send_idx, last_idx), (recv_idx, send_idx)
            else:
                recv_idx = send_idx + half
                send, recv = (send_idx, recv_idx), (recv_idx, last_idx)
            _send_recv_reduce(comm, arr, scratch, code, opc, f"{what}, halving mask {mask})",
                              (dst, offs[send[0]], offs[send[1]]),
                              (dst, offs[recv[0]], offs[recv[1]]),
                              scale if mask * 2 == pof2 else 1.0)
            send_idx = recv_idx
            mask <<= 1
            if mask < pof2:
                last_idx = recv_idx + pof2 // mask

        # Recursive doubling: retrace the steps, swapping finished blocks.
        mask >>= 1
        while mask > 0:
            newdst = newrank ^ mask
            dst = real(newdst)
            half = pof2 // (mask * 2)
            if newrank < newdst:
                if mask != pof2 // 2:
                    last_idx += half
                recv_idx = send_idx + half
                send, recv = (send_idx, recv_idx), (recv_idx, last_idx)
            else:
                recv_idx = send_idx - half
                send, recv = (send_idx, last_idx), (recv_idx, send_idx)
            _send_recv(comm, arr, f"{what}, doubling mask {mask})",
                       (dst, offs[send[0]], offs[send[1]]), (dst, offs[recv[0]], offs[recv[1]]))
            if newrank > newdst:
                send_idx = recv_idx
            mask >>= 1

    # Hand the result back to the ranks that sat out.
    if r < 2 * rem:
        if r % 2 == 1:
            _send_recv(comm, arr, what + ", fold-out)", (r - 1, 0, count), None)
        else:
            _send_recv(comm, arr, what + ", fold-out)", None, (r + 1, 0, count))
    return arr


# ---------------------------------------------------------------------------------------------
# binomial tree

def tree_reduce(comm, arr, code, op, root=0):
    """Reduce arr onto root (in place there) along a binomial tree: log2(n) steps of the whole
    vector, the fewest messages, so the choice for small ones. On the other ranks arr is clobbered
    (it holds the partial result of their subtree). Each segment is passed up as soon as this
    rank's subtree has reduced it, so large vectors pipeline through the tree. Returns arr."""
    _check(arr, code)
    n, r = comm.Get_size(), comm.Get_rank()
    if not 0 <= root < n:
        raise ValueError(f"root {root} out of range for {n} ranks")
    opc, scale = _op_scale(op, code, n)
    _tree_reduce(comm, arr, code, opc, root, scale, "tree_reduce")
    return arr


def _tree_reduce(comm, arr, code, op, root, scale, what):
    n, r = comm.Get_size(), comm.Get_rank()
    vrank = (r - root) % n
    children, parent, mask = [], None, 1
    while mask < n:
        if vrank & mask:
            parent = (vrank - mask + root) % n
            break
        if vrank + mask < n:
            children.append((vrank + mask + root) % n)
        mask <<= 1
    isz = arr.itemsize
    segs = [(s // isz, e // isz) for s, e in p2p.segments(arr.size * isz)]
    what = f"{what} (rank {r}, root {root})"
    if not children:
        if parent is None:
            _scale_in_place(arr, code, scale)
        else:
            _send_recv(comm, arr, what, (parent, 0, arr.size), None)
        return
    # Per segment, the children in a fixed order (nearest subtree first); the last child's
    # reduction finishes the segment, which then goes up (or gets the scale, on the root).
    last = len(children) - 1
    jobs = [(child, lo, hi, scale if parent is None and k == last else 1.0)
            for lo, hi in segs for k, child in enumerate(children)]
    up = Batch(comm)

    def forward(j):
        if parent is not None and j % len(children) == last:
            lo, hi = segs[j // len(children)]
            up.send(as_bytes(arr, lo, hi), parent)

    _recv_reduce(comm, jobs, arr, _scratch(arr.size, isz, 2 if len(jobs) > 1 else 1), code, op,
                 what, forward)
    up.wait(what)


def tree_broadcast(comm, arr, root=0):
    """Broadcast root's arr into every rank's arr (same size and dtype everywhere; any dtype: it
    moves bytes) along a binomial tree; each segment is forwarded to the children as soon as it
    arrives, so large vectors pipeline. Returns arr."""
    n, r = comm.Get_size(), comm.Get_rank()
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError("arr must be a 1-D contiguous numpy array")
    if not 0 <= root < n:
        raise ValueError(f"root {root} out of range for {n} ranks")
    _tree_broadcast(comm, as_bytes(arr), root, "tree_broadcast")
    return arr


def _tree_broadcast(comm, buf, root, what):
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        return
    vrank = (r - root) % n
    parent, mask = None, 1
    while mask < n:
        if vrank & mask:
            parent = (vrank - mask + root) % n
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:  # farthest subtree first: it has the most ranks still to reach
        if vrank + mask < n:
            children.append((vrank + mask + root) % n)
        mask >>= 1
    what = f"{what} (rank {r}, root {root})"
    segs = p2p.segments(buf.size)
    down = Batch(comm)
    if parent is None:
        for s, e in segs:
            for c in children:
                down.send(buf[s:e], c)
    else:
        reqs = [p2p.irecv(comm, buf[s:e], parent) for s, e in segs]
        for (s, e), req in zip(segs, reqs):
            p2p.wait([req], [parent], what)
            for c in children:
                down.send(buf[s:e], c)
    down.wait(what)


def tree_allreduce(comm, arr, code, op):
    """Allreduce arr in place: binomial-tree reduce to rank 0, then binomial broadcast from it.
    2 log2(n) steps of the whole vector: few messages, for latency-bound sizes."""
    _check(arr, code)
    n = comm.Get_size()
    opc, scale = _op_scale(op, code, n)
    _tree_reduce(comm, arr, code, opc, 0, scale, "tree_allreduce")
    _tree_broadcast(comm, as_bytes(arr), 0, "tree_allreduce")
    return arr


# ---------------------------------------------------------------------------------------------
# choice and dispatch

def choose_allreduce(nbytes, n):
    """The algorithm `allreduce(..., "auto")` uses for nbytes per rank on n ranks."""
    if n <= 1:
        return "tree"
    if nbytes <= TREE_MAX_BYTES:
        return "tree"
    if nbytes <= RHD_MAX_BYTES:
        return "rhd"
    return "ring"


TREE_MAX_BYTES = 4096
RHD_MAX_BYTES = 1 << 20

_IMPL = {"ring": ring_allreduce, "rhd": rhd_allreduce, "tree": tree_allreduce}


def allreduce(comm, arr, code, op, algorithm="auto"):
    """Allreduce arr in place with the named algorithm ("ring", "rhd", "tree", or "auto" for
    choose_allreduce's pick). Returns arr."""
    if algorithm == "auto":
        algorithm = choose_allreduce(arr.nbytes, comm.Get_size())
    impl = _IMPL.get(algorithm)
    if impl is None:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; expected one of "
                         f"{', '.join(ALGORITHMS + ('auto',))}")
    return impl(comm, arr, code, op)
