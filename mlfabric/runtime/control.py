"""The control plane: small messages between daemons and the scheduler on a communicator of their
own (paper §4), so a large payload never delays a control message. Messages are (kind, body) tuples
sent pickled with non-blocking sends, a plan's parts as the typed records of messages.py
(deliver() sends a lowered plan); the channel keeps each send's request until it completes and
gives up on a peer that takes no message for MLFABRIC_TIMEOUT seconds.

Kinds (body in brackets; job times are the scheduler's):
  worker -> scheduler    ready [ReadyUpdate, ...]; done [pushed];
                         lost [DropUpdate, ...] (members a failure took from its aggregates)
  scheduler -> worker    send [(sent at, [SendUpdate, ...])]; drop [DropUpdate, ...];
                         release [ids] (no replica copy will be asked);
                         aggregate [SumUpdates, ...]; promote [(server, new rank, None)]
  scheduler -> server    expect [ExpectCommit, ...] in commit order (a replica's carry the
                         norms); dropped [DropUpdate, ...];
                         iteration [version] (sync: all of it planned); replica-gone [];
                         distribute [(tag, direct sends, relays, ranks whose downlink
                         paces the server's send to them)] (a pull batch's plan)
  server -> scheduler    applied [ids]; pulls [(tag, bytes, [(worker, key), ...])];
                         lost [DropUpdate, ...]
  server <-> replica     server-count [(version, count it waits for)]; replicated [count]
  replica <-> scheduler  promote [(server, rank, SSP counts)]; promoted [(server, applied ids)]
  worker -> server       get [(request id, worker clock)]
  any -> scheduler       report [(egress, ingress available, out, in achieved)] (the monitor)
  scheduler -> all       stop []; summary [Summary]; any -> scheduler: ledger [Ledger];
                         alive [] (every t_lag: the others know the scheduler is running)
  any -> all             error [text] (a daemon failed: everyone stops with that message)

Every message carries its sequence number on its (sender, receiver) pair, so a lost or stale
message is an error naming it, never a silent hang. At the end of a job every rank receives what
its peers sent it but it has not yet taken (close()), before the communicator is freed: Open MPI
reuses a freed communicator's context id, and a message left unreceived on the old one would
otherwise be matched on the next job's control communicator in place of a real one.
"""
import time

import numpy as np
from mpi4py import MPI

from .._core import config as _config
from ..comm.wait import Backoff
from ..errors import MlfabricError, PeerTimeoutError
from .messages import DropUpdate, ExpectCommit, SendUpdate, SumUpdates

TAG = 0x6D63  # "mc": control traffic
POLL_S = 0.0005  # the longest nap of close() and flush() between polls (comm.wait.Backoff)
# ULFM (mpirun --with-ft ulfm): a peer died (or a receive from any source cannot tell whether
# the dead one would have sent), or the communicator was revoked
FAILURE_CLASSES = {MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED}


class Channel:
    """Control messages of one rank. Used by its daemon thread only."""

    def __init__(self, comm):
        self.comm = comm
        self.inflight = []   # (request, dst, kind, posted at)
        self.dead = set()    # ranks known failed (ULFM): nothing more is sent to them
        # a send refused because its destination died before the daemon heard of it: the MPI
        # error, for the daemon to acknowledge the failure once its handler has finished
        self.failure = None
        self._status = MPI.Status()
        self._inbox = []     # received before an interruption, not yet handed out
        self.sent = np.zeros(comm.size, np.int64)      # messages sent to each rank
        self.received = np.zeros(comm.size, np.int64)  # messages taken from each rank
        # time.monotonic() of the last message from each rank (from the start, for none yet):
        # liveness, read by the training thread at the end of a job (api._end)
        self.heard = np.full(comm.size, time.monotonic())

    def send(self, dst, kind, body=None):
        """Post a message. Never raises for a dead destination: a send to a rank that died
        before the daemon was told (ULFM refuses it) is dropped, as every later one is, and
        the error kept in `failure`. A handler sends to several ranks in turn (a plan's parts,
        a promotion's news); raising at the dead one would skip the live ones after it, and the
        rest of the handler's work, without anyone noticing."""
        if dst in self.dead:
            return
        seq = int(self.sent[dst])
        try:
            req = self.comm.isend((seq, kind, body), dst, TAG)
        except MPI.Exception as e:
            if e.Get_error_class() not in FAILURE_CLASSES:
                raise
            if self.failure is None:
                self.failure = e
            return
        self.sent[dst] += 1
        self.inflight.append((req, dst, kind, time.monotonic()))

    def take_failure(self):
        """The failure a send met since the last call (an MPI.Exception), or None."""
        e, self.failure = self.failure, None
        return e

    def put_back(self, messages):
        """Messages receive() handed out that were not handled (a failure interrupted their
        handling): receive() hands them out again first, in their order."""
        self._inbox[:0] = messages

    def forget(self, rank):
        """`rank` died: stop sending to it and drop what it never took."""
        self.dead.add(rank)
        self.inflight = [x for x in self.inflight if x[1] != rank]

    def receive(self):
        """Every control message that has arrived: a list of (src, kind, body). When ULFM
        interrupts the probing (a peer died), what was received so far is kept for the next call."""
        out, self._inbox = self._inbox, []
        comm, st = self.comm, self._status
        try:
            if not probe(comm, TAG, st):
                return out
            while True:
                src = st.Get_source()
                seq, kind, body = comm.recv(source=src, tag=TAG)
                self._count(src, seq, kind)
                out.append((src, kind, body))
                if not comm.Iprobe(MPI.ANY_SOURCE, TAG, st):
                    break
        except MPI.Exception:
            self._inbox = out
            raise
        return out

    def _count(self, src, seq, kind):
        want = self.received[src]
        if seq != want:
            raise MlfabricError(
                "control channel of rank %d: message %r from rank %d is number %d on that pair, "
                "expected number %d: a control message was lost or left over from an earlier "
                "job (an internal error; please report it)" % (self.comm.rank, kind, src, seq, want))
        self.received[src] = want + 1
        self.heard[src] = time.monotonic()

    def close(self, timeout):
        """Collective, once every daemon has stopped sending: take every message peers sent this
        rank that it has not received yet (late monitor reports, ...) and discard it, so none is
        left on the communicator when it is freed. True when done; False when it could not be
        (a peer failed, or did not reach the end within `timeout`): then the communicator must
        be kept, never freed, so that its context id is never reused."""
        comm = self.comm
        back = Backoff(timeout, max_sleep=POLL_S)   # one bound for both phases
        try:
            due = np.empty_like(self.sent)
            req = comm.Ialltoall(self.sent, due)
            while not req.Test():
                if not back.pause():
                    return False
            while (self.received < due).any():
                if not self.receive() and not back.pause():
                    return False
        except MPI.Exception:
            return False
        return True

    def progress(self, now):
        """Retire completed sends; PeerTimeoutError for one a peer has not taken in time."""
        if not self.inflight:
            return
        keep = []
        limit = _config.timeout_s()
        for item in self.inflight:
            req, dst, kind, t = item
            if not req.Test():
                if now - t > limit:
                    raise PeerTimeoutError("control message %r to rank %d not taken within "
                                           "MLFABRIC_TIMEOUT=%gs: the rank died or hangs"
                                           % (kind, dst, limit))
                keep.append(item)
        self.inflight = keep

    def flush(self, timeout):
        """Wait (bounded) until every send has been taken."""
        back = Backoff(timeout, max_sleep=POLL_S)
        while self.inflight and not back.expired():
            self.progress(time.monotonic())
            back.pause()
        return not self.inflight


def probe(comm, tag, status):
    """Is a message with `tag` waiting, from any source (status says whose)? Open MPI makes
    progress inside a call: the first probe after a sleep moves what arrived meanwhile and the
    second sees it, so one probe alone would cost a whole sleep period of latency."""
    return comm.Iprobe(MPI.ANY_SOURCE, tag, status) or comm.Iprobe(MPI.ANY_SOURCE, tag, status)


def clock_offsets(comm, root=0, rounds=4):
    """Collective: each rank's offset to add to its time.monotonic() to get `root`'s, estimated
    from the round trip with the least delay (Cristian's method). On one host it is ~0; across hosts
    it lets the scheduler's plan times mean the same instant everywhere."""
    best = (float("inf"), 0.0)
    for r in range(1, comm.size):
        for _ in range(rounds):
            if comm.rank == root:
                comm.recv(source=r, tag=TAG + 1)
                comm.send(time.monotonic(), r, TAG + 1)
            elif comm.rank == r:
                t0 = time.monotonic()
                comm.send(None, root, TAG + 1)
                ts = comm.recv(source=root, tag=TAG + 1)
                t1 = time.monotonic()
                if t1 - t0 < best[0]:
                    best = (t1 - t0, ts - (t0 + t1) / 2)
    return best[1] if comm.rank != root else 0.0


# the control kind that carries each record to a rank (the server is told of drops as 'dropped')
_KIND = {ExpectCommit: "expect", SumUpdates: "aggregate", SendUpdate: "send", DropUpdate: "drop"}


def deliver(rt, parts, server=None, kinds=(ExpectCommit, SumUpdates, SendUpdate, DropUpdate)):
    """Send each rank its part of a lowered plan ({rank: [record, ...]}), one control message per
    rank and kind, the kinds in the order `kinds` gives: commits first (the server and replica
    know what comes before it comes), then the aggregators' sums, the workers' sends (with the
    job time they left, for the plan's latency), the drops. `server`: the rank told of drops as
    'dropped'."""
    for cls in kinds:
        if cls is SendUpdate:
            sent = rt.now()
        for rank, records in parts.items():
            mine = [m for m in records if type(m) is cls]
            if not mine:
                continue
            if cls is SendUpdate:
                rt.channel.send(rank, "send", (sent, mine))
            elif cls is DropUpdate and rank == server:
                rt.channel.send(rank, "dropped", mine)
            else:
                rt.channel.send(rank, _KIND[cls], mine)
