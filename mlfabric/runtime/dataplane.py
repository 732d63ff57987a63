"""The data plane of one rank: payload transfers over an MPI communicator of its own, paced so that
the rank behaves as if it sat behind its emulated NIC (paper §4, §7; DESIGN.md "Control plane and
data plane", "Emulating a shared cluster").

Owns: the wire protocol of payload messages, the pacing of their bytes by the rank's EmulatedNic
(egress at the sender, ingress at the receiver, a per-flow rate cap and start time from the plan),
and the bounded waits on peers. It never blocks: the owner (one event-loop thread, no locking here)
calls progress() when wake_in() says so, and gets back the messages that have arrived.

Protocol, per message ("flow"):
- The sender posts a small pickled header (key, dtype, shape, bytes, flow tag, chunk size) on
  HEADER_TAG with Issend, at the flow's `not_before` (not earlier: a receiver that saw the header
  would start reserving ingress for bytes that cannot come yet). The receiver probes for headers
  from any source at every progress() (a probe, not a standing any-source receive: under ULFM
  such a receive can keep failing after a peer's death was acknowledged).
- The payload follows in chunks on the flow's tag (cycled per destination in
  [FLOW_TAG_BASE, FLOW_TAG_BASE + FLOW_TAGS), a tag is reused only once its old flow is done).
  Chunk size = clamp(rate * chunk_s, min_chunk, max_chunk) with rate = min(flow cap, egress rate)
  when the flow starts: a few milliseconds of transfer, so a change of rate is felt within a chunk
  and a cancelled flow wastes little. Both ends cut the payload the same way from the header.
- Egress (sender): chunks of all outgoing flows take turns (round robin) on the NIC's egress
  calendar; a chunk is booked when the calendar is free and the flow's own rate cap allows it, and
  its Issend is posted when the calendar says its bytes are through ("end pacing": the receiver sees
  a chunk no earlier than a real link would have delivered it).
- Ingress (receiver): the receive of a flow's next chunk is posted only when the ingress calendar
  admits it, round robin over inbound flows, so several senders share the receiver's ingress
  fairly. A finished message is handed out no earlier than the calendar says its last chunk is
  through (the chunk was received when its receive was posted, i.e. at the start of its slot).
- At most WINDOW (8) chunks of a flow are outstanding (booked, posted or unmatched). Chunks go
  with Issend (synchronous mode: complete only once the receiver has matched them), so a sender
  is throttled by min(its egress, its share of the receiver's ingress), as on a real network,
  instead of MPI buffering the payload eagerly.
- Calendars are continued from where they ended when the event loop comes back late: up to one
  chunk_s always, and up to CATCH_UP_S when chunks were waiting for the calendar as it fell free
  (the link was not idle: the process was not scheduled in time). Otherwise every late wake-up
  would be lost link time, and on a loaded CPU one flow alone (a time-shared link, as the
  scheduler plans them) got half its rate or less. After an idle gap they restart at `now`, so
  bytes never go through earlier than a real link would let them. A flow's rate cap is
  continued across up to CATCH_UP_S of lateness, waiting or not (a token bucket that deep: a
  flow that paused for its stream's bytes may then run ahead of its cap for that long, never
  ahead of the NIC).
- The header goes with Issend too, so a zero-byte message is done (on_done) once it is taken, and
  a dead receiver is noticed even for a message with no payload.
- Cut-through (streamed flows): at an inbound header the owner's on_stream(src, key, Stream) may
  forward the flow before it has arrived, send(..., payload=stream.data,
  available=stream.available): a chunk is booked only once its bytes have come in, in order. Such
  a flow ends with a one-byte trailer on its tag (after the last chunk is taken): OK, or VOID
  when its source failed on the way (the sender died or timed out upstream; the forwarder then
  sends the rest as filler rather than leaving the receiver waiting). The receiver hands out an
  OK flow as usual and drops a VOID one, listing it in take_voided(). No control message and
  no cancelled request is needed, and a flow's tag is freed in the usual way. (The workers'
  relays and streaming sums use it: worker.py, relay.py.)
Limits of the emulation: pacing is at chunk granularity (milliseconds). The sender picks the
chunk size from its own rates, so a receiver much slower than the sender sees proportionally
longer chunks (a sender with unlimited egress sends max_chunk pieces; a receiver's share of ingress
is then coarse). Each end charges a chunk to its own calendar, as a store-and-forward hop would.

Bounded waits: a flow with requests outstanding whose peer lets `timeout` seconds pass without
completing one (MLFABRIC_TIMEOUT, read at construction) raises PeerTimeoutError from progress(),
naming the peer and the key; that flow is dropped (its requests parked, receives cancelled) and the
others go on. Messages between one (src, dst) pair arrive whole; different flows may finish in any
order.
"""
import collections
import math
import pickle
import time

import numpy as np
from mpi4py import MPI

from .._core import config as _config
from ..comm.wait import Backoff
from ..emulate.nic import EmulatedNic
from ..errors import MlfabricError, PeerTimeoutError
from .control import probe

HEADER_TAG = 1
FLOW_TAG_BASE = 2
FLOW_TAGS = 16000      # per destination; read when a flow starts (tests shrink it)
HEADER_MAX = 16384     # bytes of a pickled header (a key: small; a pipeline's nested forwards)
WINDOW = 8             # chunks outstanding per flow (2 let one flow on a loaded CPU reach
                       # half its rate: a chunk's round trip then takes several chunk times)
CATCH_UP_S = 0.025    # how late a busy calendar may be continued (see "Calendars" above)
CLOSE_POLL_S = 0.001  # close(): the longest nap between passes (the calendars' catch-up covers it)
IN_FLIGHT_WAKE_S = 0.005
IDLE_WAKE_S = 0.05

# Requests MPI may still complete after their flow was given up (a timeout, a dead peer, a data
# plane dropped unclosed), with the buffers they read or write: kept for the process's lifetime,
# whatever becomes of the DataPlane, so MPI never touches freed memory.
_PARKED = []

_dtype_to_descr = np.lib.format.dtype_to_descr
_descr_to_dtype = np.lib.format.descr_to_dtype


VOID = -1              # what an `available` callable returns once its source has failed
STATUS_OK, STATUS_VOID = b"\x00", b"\x01"


class Stream:
    """An inbound flow seen at its header (DataPlane.on_stream): `data` is the array it is being
    received into (dtype and shape as sent), `available()` the bytes of it received so far,
    in order, or VOID once the flow failed (its sender died or timed out). Forward it before it
    is complete with send(..., payload=stream.data, available=stream.available): cut-through.
    The same array becomes the Message's data when the flow completes: leave it unmodified until
    the forwards are done (their on_done)."""

    __slots__ = ("src", "key", "data", "_flow")

    def __init__(self, src, key, data, flow):
        self.src, self.key, self.data, self._flow = src, key, data, flow

    def available(self):
        f = self._flow
        if f.void is not None:
            return VOID
        return f.nbytes if f.prefix >= f.nchunks else f.prefix * f.chunk


class Message:
    """A fully received payload: `data` is a fresh array the receiver owns (dtype and shape as
    sent); `arrived` is the time.monotonic() at which its last byte was through."""

    __slots__ = ("src", "key", "data", "arrived")

    def __init__(self, src, key, data, arrived):
        self.src, self.key, self.data, self.arrived = src, key, data, arrived

    def __repr__(self):
        return (f"Message(src={self.src}, key={self.key!r}, "
                f"{self.data.dtype}{list(self.data.shape)}, arrived={self.arrived:.6f})")


class _TxFlow:
    __slots__ = ("dst", "key", "view", "payload", "rate", "not_before", "on_done", "tag", "chunk",
                 "nchunks", "booked", "taken", "staged", "reqs", "hdr", "hdr_req",
                 "cap_ready", "last", "available", "status", "status_req")

    def __init__(self, dst, key, payload, view, rate, not_before, on_done, available=None):
        self.dst, self.key, self.payload, self.view = dst, key, payload, view
        self.rate, self.not_before, self.on_done = rate, not_before, on_done
        self.available = available  # streamed (cut-through): bytes of payload there so far
        self.status = self.status_req = None  # streamed: the trailer (STATUS_OK / _VOID)
        self.tag = None          # set when the flow starts (header posted)
        self.chunk = self.nchunks = 0
        self.booked = 0          # chunks booked on the egress calendar so far
        self.taken = 0           # chunks the receiver has taken
        self.staged = collections.deque()  # (post_at, index): booked, Issend not yet posted
        self.reqs = []           # (request, index): posted, not yet matched
        self.hdr = self.hdr_req = None
        self.cap_ready = 0.0     # the flow's own rate-cap calendar
        self.last = 0.0          # last progress seen from the peer (for the timeout)

    def outstanding(self):
        return len(self.staged) + len(self.reqs)

    def chunk_ready(self, i):
        """May chunk i be booked? Always, unless streamed and its bytes are not there yet (a
        failed source: the rest goes as filler, and the trailer says void)."""
        if self.available is None:
            return True
        have = self.available()
        return have == VOID or have >= min((i + 1) * self.chunk, self.view.size)


class _RxFlow:
    __slots__ = ("src", "key", "tag", "dtype", "shape", "nbytes", "chunk", "nchunks", "buf",
                 "posted", "received", "reqs", "due", "last", "streamed", "prefix", "finished",
                 "status", "status_req", "void")

    def __init__(self, src, key, tag, dtype, shape, nbytes, chunk, now, streamed=False):
        self.src, self.key, self.tag = src, key, tag
        self.dtype, self.shape, self.nbytes, self.chunk = dtype, shape, nbytes, chunk
        self.nchunks = -(-nbytes // chunk) if nbytes else 0
        self.buf = np.empty(nbytes, np.uint8)
        self.posted = self.received = 0
        self.reqs = []
        self.due = now           # when the last booked chunk is through the ingress calendar
        self.last = now
        self.streamed = streamed  # its sender forwards as it receives: a trailer follows
        self.prefix = 0           # chunks received in order from the first (for Stream)
        self.finished = set()     # chunks received beyond the prefix
        self.status = self.status_req = None
        self.void = None          # why it failed, once it has

    def data(self):
        return self.buf.view(self.dtype).reshape(self.shape) if self.nbytes else np.empty(
            self.shape, self.dtype)


class DataPlane:
    """Paced payload transfers of one rank over `comm` (a communicator of the data plane's own,
    e.g. a Dup of the world; the owner frees it after close()). `nic` is the rank's EmulatedNic
    (None: no pacing). Single-threaded and non-blocking: nothing happens outside progress()."""

    def __init__(self, comm, nic, *, chunk_s=0.002, min_chunk=16 << 10, max_chunk=4 << 20):
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise MlfabricError(f"DataPlane needs an MPI communicator, got {comm!r}")
        if not chunk_s > 0:
            raise ValueError(f"chunk_s must be > 0 seconds, got {chunk_s!r}")
        if not 1 <= min_chunk <= max_chunk:
            raise ValueError(f"need 1 <= min_chunk <= max_chunk, got {min_chunk}, {max_chunk}")
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.nic = nic if nic is not None else EmulatedNic(None, None, None, time.monotonic())
        self.chunk_s, self.min_chunk, self.max_chunk = chunk_s, int(min_chunk), int(max_chunk)
        self.timeout = _config.timeout_s()
        self._tx = collections.deque()       # outgoing flows, in round-robin order
        self._rx = collections.deque()       # inbound flows, in round-robin order
        self._rx_by_tag = {}                 # (src, tag) -> _RxFlow
        self._rx_deferred = {}               # (src, tag) -> [header]: tag still busy here
        self._tags_busy = collections.defaultdict(set)   # dst -> flow tags in use
        self._next_tag = collections.defaultdict(int)    # dst -> next tag offset to try
        self._local = collections.deque()    # (not_before, key, payload, on_done) to self
        self._held = []                      # (due, Message): received, not yet through ingress
        self._done = []                      # messages to hand out
        # a calendar was busy while chunks waited for it, at the end of the last progress()
        self._rx_waiting = self._tx_waiting = False
        self._hdr_buf = bytearray(HEADER_MAX)
        self._hdr_status = MPI.Status()
        self._closed = False
        self._dead = set()                   # peers known failed: nothing is sent to them
        self._dead_done = []                 # on_done of sends to them, called in progress()
        self._voided = []                    # (src, key, why): streamed flows whose source failed
        # on_stream(src, key, Stream): called at each inbound header, before any byte, so the
        # owner can forward the flow as it arrives (cut-through); None: nobody asks
        self.on_stream = None

    # ------------------------------------------------------------------------------- public

    def send(self, dst, key, payload, *, rate=None, not_before=None, on_done=None,
             available=None):
        """Queue `payload` (a C-contiguous numpy array, not modified by the caller until on_done())
        for rank `dst` under `key` (a small picklable tuple naming it for the receiver). rate caps
        the flow in bytes/s (None: as fast as the NIC lets); no byte leaves before `not_before`
        (time.monotonic()); on_done() is called from progress() once the receiver has taken the
        last chunk. Sending to oneself delivers a copy at the next progress(), unpaced. Returns at
        once.

        available (cut-through): a callable giving how many leading bytes of payload are there
        yet (Stream.available of an inbound flow); a chunk leaves only once its bytes are. If it
        returns VOID (the source failed) the rest goes as filler and a trailer tells the
        receiver, which drops the message (take_voided()) instead of handing it out."""
        self._check_open()
        if not isinstance(dst, (int, np.integer)) or not 0 <= dst < self.size:
            raise ValueError(f"dst must be a rank in 0..{self.size - 1}, got {dst!r}")
        if not isinstance(key, tuple):
            raise TypeError(f"key must be a tuple, got {type(key).__name__}")
        if not isinstance(payload, np.ndarray):
            raise TypeError(f"payload must be a numpy array, got {type(payload).__name__}")
        if payload.dtype.hasobject:
            raise TypeError(f"payload dtype {payload.dtype} holds Python objects; send raw data")
        if not payload.flags.c_contiguous:
            raise ValueError(f"payload must be C-contiguous (shape {payload.shape}, strides "
                             f"{payload.strides}); pass np.ascontiguousarray(payload)")
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s or None, got {rate!r}")
        if not_before is not None and not math.isfinite(not_before):
            raise ValueError("not_before must be a finite time.monotonic() value, got "
                             f"{not_before!r}")
        if on_done is not None and not callable(on_done):
            raise TypeError("on_done must be callable")
        if available is not None and not callable(available):
            raise TypeError("available must be callable")
        dst = int(dst)
        nb = -math.inf if not_before is None else float(not_before)
        flow = _TxFlow(dst, key, payload, payload.reshape(-1).view(np.uint8),
                       None if rate is None else float(rate), nb, on_done, available)
        eff = _min_rate(flow.rate, self.nic.egress_rate())
        chunk = self.max_chunk if eff is None else int(eff * self.chunk_s)
        flow.chunk = max(self.min_chunk, min(self.max_chunk, chunk))
        flow.nchunks = -(-flow.view.size // flow.chunk) if flow.view.size else 0
        # Build (and size-check) the header now, for local sends too, so a bad key fails here
        # and the same everywhere, not later in progress().
        flow.hdr = self._header(flow)
        if dst == self.rank:
            if available is not None:
                raise ValueError("a streamed send (available=) cannot go to this rank itself")
            self._local.append((nb, key, payload, on_done))
        elif dst in self._dead:  # it died (forget_peer): nothing will ever take it
            if on_done is not None:
                self._dead_done.append(on_done)
        else:
            self._tx.append(flow)

    def progress(self, now=None):
        """Do all due non-blocking work (test requests, post headers, chunks and receives as the
        calendars allow, hand out finished messages); return the messages completed since the last
        call. Raises PeerTimeoutError for a flow whose peer stopped making progress."""
        self._check_open()
        now = time.monotonic() if now is None else now
        self._poll_headers(now)
        self._progress_rx(now)
        callbacks = self._progress_tx(now)
        if self._dead_done:
            callbacks += self._dead_done
            self._dead_done = []
        if self._local:
            self._deliver_local(now, callbacks)
        if self._held:
            self._release_held(now)
        for cb in callbacks:
            cb()
        self._check_timeouts(now)
        out, self._done = self._done, []
        return out

    def wake_in(self, now=None):
        """Seconds until progress() has timed work: 0 if now, else until the earliest pacing time,
        at most IN_FLIGHT_WAKE_S while requests are in flight (their completion is not timed) and
        at most IDLE_WAKE_S otherwise (also when idle)."""
        now = time.monotonic() if now is None else now
        if self._done:
            return 0.0
        t = math.inf
        inflight = False
        for nb, _, _, _ in self._local:
            t = min(t, nb)
        for due, _ in self._held:
            t = min(t, due)
        egress_free = self.nic.egress_free
        for f in self._tx:
            if f.tag is None:
                if f.not_before > now:
                    t = min(t, f.not_before)
                else:
                    inflight = True  # waiting for a flow tag to come free
                continue
            if f.hdr_req is not None or f.reqs or f.status_req is not None or (
                    f.booked < f.nchunks and not f.chunk_ready(f.booked)):
                inflight = True  # (a streamed flow waiting for its source's bytes, too)
            if f.staged:
                t = min(t, f.staged[0][0])
            if f.booked < f.nchunks and f.outstanding() < WINDOW:
                t = min(t, max(egress_free, f.cap_ready))
        ingress_free = self.nic.ingress_free
        for f in self._rx:
            if f.reqs or f.status_req is not None:
                inflight = True
            if f.posted < f.nchunks and len(f.reqs) < WINDOW:
                t = min(t, ingress_free)
        if self._rx_deferred:
            inflight = True
        if t <= now:
            return 0.0
        return min(t - now, IN_FLIGHT_WAKE_S if inflight else IDLE_WAKE_S)

    def take_voided(self):
        """The streamed messages dropped since the last call, as (src, key, why): their sender
        was forwarding them as they arrived and its own source failed, so what came is not the
        message. The owner accounts for them (a worker asks for its model again, ...)."""
        out, self._voided = self._voided, []
        return out

    def busy(self):
        """True while sends or receives are in flight (queued, paced or posted)."""
        return bool(self._tx or self._rx or self._local or self._held or self._rx_deferred
                    or self._done)

    def __del__(self):
        """Dropped with requests in flight (never closed, or closed by a failing job): park them
        with their buffers; an Issend whose receiver matched it goes on reading its payload."""
        try:
            for f in self._tx:
                _park_tx(f)
            for f in self._rx:
                _park_rx(f)
        except AttributeError:  # a constructor that failed half way
            pass

    def close(self, timeout=None):
        """Let in-flight sends finish (at most `timeout` seconds, default self.timeout), then
        cancel every posted receive. Messages that arrive meanwhile
        are dropped. Raises PeerTimeoutError if sends were left unfinished (their requests are
        parked, so MPI never touches freed memory). Idempotent."""
        if self._closed:
            return
        timeout = self.timeout if timeout is None else timeout
        back = Backoff(timeout, max_sleep=CLOSE_POLL_S)
        error = None
        try:
            while (self._tx or self._local) and not back.expired():
                self.progress()
                back.pause()
        except PeerTimeoutError as e:
            error = e
        finally:
            self._closed = True
            for f in self._rx:
                for req, _ in f.reqs:
                    self._cancel(req)
            self._rx.clear()
            self._rx_by_tag.clear()
            self._rx_deferred.clear()
            late = []
            for f in self._tx:
                late.append((f.dst, f.key))
                _park_tx(f)
            self._tx.clear()
            self._local.clear()
        if error is not None:
            raise error
        if late:
            raise PeerTimeoutError(
                f"data plane of rank {self.rank}: close() gave up after {timeout:g} s on sends "
                f"still in flight: " + ", ".join(f"{k!r} to rank {d}" for d, k in late[:8])
                + (" ..." if len(late) > 8 else ""))

    # ----------------------------------------------------------------------------- headers

    def _header(self, flow):
        hdr = pickle.dumps((flow.key, _dtype_to_descr(flow.payload.dtype), flow.payload.shape,
                            flow.view.size, flow.chunk, flow.available is not None),
                           protocol=pickle.HIGHEST_PROTOCOL)
        if len(hdr) + 8 > HEADER_MAX:
            raise ValueError(f"key {flow.key!r} is too large for a data-plane header "
                             f"({len(hdr)} bytes pickled, at most {HEADER_MAX - 8})")
        return hdr

    def _poll_headers(self, now):
        """Headers are probed for, not received into a standing any-source receive: under ULFM
        such a receive can keep failing (ERR_PROC_FAILED_PENDING) after a peer's death was
        acknowledged, while a new probe works. The sender's Issend waits for the match either
        way."""
        comm, st = self.comm, self._hdr_status
        if not probe(comm, HEADER_TAG, st):
            return
        while True:
            src = st.Get_source()
            comm.Recv([self._hdr_buf, MPI.BYTE], src, HEADER_TAG, st)
            count = st.Get_count(MPI.BYTE)
            tag = int.from_bytes(self._hdr_buf[:4], "little")
            key, descr, shape, nbytes, chunk, streamed = pickle.loads(
                bytes(self._hdr_buf[8:count]))
            self._take_header((src, tag, key, descr, shape, nbytes, chunk, streamed), now)
            if not comm.Iprobe(MPI.ANY_SOURCE, HEADER_TAG, st):
                return

    def _take_header(self, hdr, now):
        src, tag = hdr[0], hdr[1]
        if (src, tag) in self._rx_by_tag:
            # The sender reused the tag as soon as its old flow was matched; we have not seen
            # that flow's last receive complete yet. Start this one after it.
            self._rx_deferred.setdefault((src, tag), []).append(hdr)
        else:
            self._start_rx(hdr, now)

    def _start_rx(self, hdr, now):
        src, tag, key, descr, shape, nbytes, chunk, streamed = hdr
        f = _RxFlow(src, key, tag, _descr_to_dtype(descr), shape, nbytes, chunk, now, streamed)
        if self.on_stream is not None:
            self.on_stream(src, key, Stream(src, key, f.data(), f))
        if f.nchunks == 0 and not streamed:
            self._finish_rx(f, now)
            return
        self._rx_by_tag[(src, tag)] = f
        self._rx.append(f)

    # ----------------------------------------------------------------------------- receive

    def _progress_rx(self, now):
        finished = []
        for f in self._rx:
            if f.reqs:
                _retire_rx(f, now)
            if f.received == f.nchunks and _trailer_in(f, self.comm, now):
                finished.append(f)
        for f in finished:
            self._rx.remove(f)
            del self._rx_by_tag[(f.src, f.tag)]
            if f.status == STATUS_VOID:
                self._voided.append((f.src, f.key, "its sender's source failed mid-stream"))
            else:
                self._finish_rx(f, now)
            waiting = self._rx_deferred.get((f.src, f.tag))
            if waiting:
                hdr = waiting.pop(0)
                if not waiting:
                    del self._rx_deferred[(f.src, f.tag)]
                self._start_rx(hdr, now)
        # Post receives as the ingress calendar admits them, one chunk per flow per turn.
        rx, nic = self._rx, self.nic

        def may(f):
            return f.posted < f.nchunks and len(f.reqs) < WINDOW
        for t, f in self._turns(rx, lambda: nic.ingress_free, self._rx_waiting, may, now):
            i = f.posted
            lo = i * f.chunk
            hi = min(lo + f.chunk, f.nbytes)
            f.due = nic.take_ingress(hi - lo, t)
            if not f.reqs:
                f.last = now  # the peer's clock starts when we are waiting on it
            f.reqs.append((self.comm.Irecv([f.buf[lo:hi], MPI.BYTE], f.src, f.tag), i))
            f.posted += 1
        self._rx_waiting = nic.ingress_free > now and any(may(f) for f in rx)

    def _finish_rx(self, f, now):
        msg = Message(f.src, f.key, f.data(), max(now, f.due))
        if f.due > now:
            self._held.append((f.due, msg))
        else:
            self._done.append(msg)

    def _release_held(self, now):
        keep = []
        for due, msg in self._held:
            (self._done.append(msg) if due <= now else keep.append((due, msg)))
        self._held = keep

    def _deliver_local(self, now, callbacks):
        keep = collections.deque()
        for item in self._local:
            nb, key, payload, on_done = item
            if nb <= now:
                self._done.append(Message(self.rank, key, payload.copy(), now))
                if on_done is not None:
                    callbacks.append(on_done)
            else:
                keep.append(item)
        self._local = keep

    # -------------------------------------------------------------------------------- send

    def _progress_tx(self, now):
        callbacks, finished = [], []
        comm = self.comm
        for f in self._tx:
            if f.tag is None:
                if f.not_before > now or not self._start_tx(f, now):
                    continue
            if f.hdr_req is not None and f.hdr_req.Test():
                f.hdr_req = f.hdr = None
                f.last = now
            if f.reqs:
                f.taken += _retire(f, now)
            while f.staged and f.staged[0][0] <= now:
                self._post_chunk(f, f.staged.popleft()[1], now, comm)
            if f.taken == f.nchunks and f.hdr_req is None and _trailer_out(f, comm, now):
                finished.append(f)
        for f in finished:
            self._tx.remove(f)
            self._tags_busy[f.dst].discard(f.tag)
            if f.on_done is not None:
                callbacks.append(f.on_done)
        # Book chunks on the egress calendar, one per flow per turn; post each when it is through.
        tx, nic = self._tx, self.nic

        def may(f):
            return (f.tag is not None and f.booked < f.nchunks and f.outstanding() < WINDOW
                    and f.cap_ready <= now and f.chunk_ready(f.booked))
        for t, f in self._turns(tx, lambda: nic.egress_free, self._tx_waiting, may, now):
            i = f.booked
            lo = i * f.chunk
            n = min(lo + f.chunk, f.view.size) - lo
            post_at = nic.take_egress(n, t)
            if f.rate is not None:
                start = f.cap_ready if now - f.cap_ready <= CATCH_UP_S else now
                f.cap_ready = start + n / f.rate
                post_at = max(post_at, f.cap_ready)
            f.booked += 1
            if post_at <= now:
                self._post_chunk(f, i, now, comm)
            else:
                f.staged.append((post_at, i))
        self._tx_waiting = nic.egress_free > now and any(may(f) for f in tx)
        return callbacks

    def _start_tx(self, f, now):
        """Pick a free flow tag for the destination and post the header; False if none is free."""
        busy, ntags = self._tags_busy[f.dst], FLOW_TAGS
        if len(busy) >= ntags:
            return False
        off = self._next_tag[f.dst] % ntags
        while FLOW_TAG_BASE + off in busy:
            off = (off + 1) % ntags
        self._next_tag[f.dst] = off + 1
        f.tag = FLOW_TAG_BASE + off
        busy.add(f.tag)
        # The tag is known only now (a free one is picked when the flow starts): it goes in
        # front of the pickled header built by send().
        f.hdr = f.tag.to_bytes(4, "little") + bytes(4) + f.hdr
        f.hdr_req = self.comm.Issend([f.hdr, MPI.BYTE], f.dst, HEADER_TAG)
        f.last = now
        f.cap_ready = now
        return True

    def _post_chunk(self, f, i, now, comm):
        lo = i * f.chunk
        if not f.reqs and f.hdr_req is None:
            f.last = now
        f.reqs.append((comm.Issend([f.view[lo:lo + f.chunk], MPI.BYTE], f.dst, f.tag), i))

    def _turns(self, flows, free, waiting, may, now):
        """(start, flow) for each chunk a calendar takes now: round robin over the `flows` that
        `may` book one, while the calendar (next free at free()) has room."""
        while flows:
            t = self._slot(free(), now, waiting)
            if t is None:
                return
            f = _next_turn(flows, may)
            if f is None:
                return
            yield t, f

    def _slot(self, free, now, waiting):
        """Start time for the next booking on a calendar that is next free at `free`, or None if
        it is busy. A calendar that fell free less than a chunk_s ago, or less than CATCH_UP_S
        ago with chunks `waiting` for it then, is continued from `free` (the event loop came back
        late; that time was not idle link time)."""
        if free > now:
            return None
        late = now - free
        return free if late <= self.chunk_s or (waiting and late <= CATCH_UP_S) else now

    # ----------------------------------------------------------------------- failure paths

    def forget_peer(self, rank):
        """A peer is known dead (ULFM): drop every flow to or from it, keeping their requests
        parked (MPI may still hold their buffers), and any header it left waiting; later sends to
        it are dropped at once (their on_done still called: they are over). Returns the keys of
        the dropped sends and receives, so the owner can account for them. Idempotent."""
        self._dead.add(rank)
        lost = []
        for f in [f for f in self._tx if f.dst == rank]:
            self._tx.remove(f)
            self._tags_busy[f.dst].discard(f.tag)
            _park_tx(f)
            lost.append(("send", f.key))
        for f in [f for f in self._rx if f.src == rank]:
            self._rx.remove(f)
            del self._rx_by_tag[(f.src, f.tag)]
            f.void = "its sender died"  # flows forwarding it send filler and a void trailer
            _park_rx(f)
            lost.append(("receive", f.key))
        for key in [k for k in self._rx_deferred if k[0] == rank]:
            lost.extend(("receive", hdr[2]) for hdr in self._rx_deferred.pop(key))
        return lost

    def _check_timeouts(self, now):
        limit = now - self.timeout
        for f in self._tx:
            if (f.reqs or f.hdr_req is not None or f.status_req is not None) and f.last < limit:
                self._tx.remove(f)
                self._tags_busy[f.dst].discard(f.tag)
                _park_tx(f)
                raise _flow_timeout(
                    f"data plane of rank {self.rank}: send of {f.key!r} to rank {f.dst} made no "
                    f"progress within {self.timeout:g} s (MLFABRIC_TIMEOUT; "
                    f"{f.taken}/{f.nchunks} chunks taken): the peer died or stopped "
                    "driving its data plane", f.key, f.dst)
        for f in self._rx:
            if (f.reqs or f.status_req is not None) and f.last < limit:
                self._rx.remove(f)
                del self._rx_by_tag[(f.src, f.tag)]
                f.void = "its sender timed out"
                for req, _ in f.reqs:
                    self._cancel(req)
                self._cancel(f.status_req)
                raise _flow_timeout(
                    f"data plane of rank {self.rank}: receive of {f.key!r} from rank {f.src} made "
                    f"no progress within {self.timeout:g} s (MLFABRIC_TIMEOUT; "
                    f"{f.received}/{f.nchunks} chunks in): the peer died or stopped driving its "
                    "data plane", f.key, f.src)

    def _cancel(self, req):
        if req is None or req == MPI.REQUEST_NULL:
            return
        try:
            req.Cancel()
            req.Wait()  # a cancelled receive completes at once (or it had matched: then done)
        except MPI.Exception:
            _PARKED.append((req, None, None))

    def _check_open(self):
        if self._closed:
            raise MlfabricError("data plane is closed")


def _park_tx(f):
    """Park an outgoing flow's requests with its payload. (Cancelling a send is deprecated and
    unreliable in MPI 4; they may still complete if the peer turns up.)"""
    reqs = [r for r, _ in f.reqs] + [r for r in (f.hdr_req, f.status_req) if r is not None]
    _PARKED.extend((r, f.payload, f.hdr) for r in reqs)


def _park_rx(f):
    """Park an inbound flow's posted receives (and trailer receive) with their buffers."""
    _PARKED.extend((req, f.buf, None) for req, _ in f.reqs)
    if f.status_req is not None:
        _PARKED.append((f.status_req, f.status, None))


def _flow_timeout(text, key, peer):
    """The PeerTimeoutError of one flow, naming it (`key`, `peer`) for the owner."""
    err = PeerTimeoutError(text)
    err.key, err.peer = key, peer
    return err


def _next_turn(flows, may):
    """Round robin: rotate `flows` past the next one that `may` take a turn, and return it
    (None when none may)."""
    for _ in range(len(flows)):
        f = flows[0]
        flows.rotate(-1)
        if may(f):
            return f
    return None


def _retire(f, now):
    """Test a flow's posted requests: keep the unfinished ones, return how many finished (the
    peer made progress: its clock for the timeout restarts)."""
    keep = [item for item in f.reqs if not item[0].Test()]
    done = len(f.reqs) - len(keep)
    f.reqs = keep
    if done:
        f.last = now
    return done


def _retire_rx(f, now):
    """_retire for an inbound flow, also advancing its in-order prefix (chunks of one flow
    match in order, but their completions may be seen out of order)."""
    keep, done = [], []
    for item in f.reqs:
        (done if item[0].Test() else keep).append(item)
    if not done:
        return
    f.reqs = keep
    f.received += len(done)
    f.last = now
    f.finished.update(i for _, i in done)
    while f.prefix in f.finished:
        f.finished.discard(f.prefix)
        f.prefix += 1


def _trailer_in(f, comm, now):
    """All chunks of f are in: True once it is complete (a streamed flow: once its one-byte
    trailer has come too, posted now if not yet)."""
    if not f.streamed:
        return True
    if f.status_req is None:
        f.status = bytearray(1)
        f.status_req = comm.Irecv([f.status, MPI.BYTE], f.src, f.tag)
        f.last = now
    if not f.status_req.Test():
        return False
    f.status_req = None
    f.status = bytes(f.status)
    return True


def _trailer_out(f, comm, now):
    """Every chunk of f was taken: True once it is done (a streamed flow: once its trailer,
    saying whether its source failed on the way, has been taken too)."""
    if f.available is None:
        return True
    if f.status_req is None:
        f.status = STATUS_VOID if f.available() == VOID else STATUS_OK
        f.status_req = comm.Issend([f.status, MPI.BYTE], f.dst, f.tag)
        f.last = now
    if not f.status_req.Test():
        return False
    f.status_req = None
    return True


def _min_rate(a, b):
    if a is None:
        return b
    return a if b is None else min(a, b)
