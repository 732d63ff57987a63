"""The control plane: small messages between daemons and the scheduler on a communicator of their
own (paper §4), so a large payload never delays a control message. Messages are (kind, body) tuples
sent pickled with non-blocking sends; the channel keeps each send's request until it completes and
gives up on a peer that takes no message for MLFABRIC_TIMEOUT seconds.

Kinds (body in brackets; job times are the scheduler's):
  worker -> scheduler    ready [(id, server, bytes, version, norm, sent at), ...]; done [pushed];
                         lost [(id, reason), ...] (members a failure took from its aggregates)
  scheduler -> worker    send [(sent at, [(id, hop, destination, not_before, rate, last send)])];
                         drop [(id, reason), ...]; release [ids] (no replica copy will be asked);
                         aggregate [Assignment, ...]; promote [(server, new rank, None)]
  scheduler -> server    expect [(key, ids, versions, replica count needed, via), ...] in commit
                         order (a replica's carry the norms sixth); dropped [ids];
                         iteration [version] (sync: all of it planned); replica-gone [];
                         distribute [(tag, direct sends, relays)] (a pull batch's plan)
  server -> scheduler    applied [ids]; pulls [(tag, bytes, [(worker, key), ...])]; lost [...]
  server <-> replica     server-count [(version, count it waits for)]; replicated [count]
  replica <-> scheduler  promote [(server, rank, SSP counts)]; promoted [(server, applied ids)]
  worker -> server       get [(request id, worker clock)]
  any -> scheduler       report [(egress, ingress available, out, in achieved)] (the monitor)
  scheduler -> all       stop []; summary [Summary]; any -> scheduler: ledger [Ledger]
  any -> all             error [text] (a daemon failed: everyone stops with that message)
"""
import time

from mpi4py import MPI

from .. import _config
from ..errors import PeerTimeoutError

TAG = 0x6D63  # "mc": control traffic


class Channel:
    """Control messages of one rank. Used by its daemon thread only."""

    def __init__(self, comm):
        self.comm = comm
        self.inflight = []   # (request, dst, kind, posted at)
        self.dead = set()    # ranks known failed (ULFM): nothing more is sent to them
        self._status = MPI.Status()
        self._inbox = []     # received before an interruption, not yet handed out

    def send(self, dst, kind, body=None):
        if dst in self.dead:
            return
        self.inflight.append((self.comm.isend((kind, body), dst, TAG), dst, kind,
                              time.monotonic()))

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
                kind, body = comm.recv(source=src, tag=TAG)
                out.append((src, kind, body))
                if not comm.Iprobe(MPI.ANY_SOURCE, TAG, st):
                    break
        except MPI.Exception:
            self._inbox = out
            raise
        return out

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
        end = time.monotonic() + timeout
        while self.inflight and time.monotonic() < end:
            self.progress(time.monotonic())
            time.sleep(0.0005)
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
