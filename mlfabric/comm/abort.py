"""Abort notices: how a rank that gave up on a communicator tells its peers, so that none of them
goes on to match messages that belong to calls the others abandoned.

A rank gives up on a communicator when one of its calls cannot finish in step with its peers: a
timeout (a request left parked, its message perhaps still to come), a failure in the middle of a
call, calls entered from two threads at once. From then on every call of that rank on the
communicator fails at once (it never posts another message there), and each peer is sent one
small notice, on a communicator of its own, saying who gave up and why. A peer reads the notice
when it starts a call, while it waits inside one (comm/p2p.py polls it), and when a call on the
MPI path ends; then it gives up too. So a late rank fails instead of pairing its messages with a
retry or with a call queued behind the one that timed out.

Notices are never waited on: a dead peer never receives its notice, and the send request is kept
for the life of the process (it holds the buffer MPI may still read)."""
import numpy as np
from mpi4py import MPI

TAG = 0x6D68      # on the notice communicator only; 0x6D66 is the algorithms' tag, 0x6D67 the
MAX_BYTES = 1024  # torch backend's: distinct, so a notice is never taken for either
_kept = []        # (request, buffer) of notices sent: MPI may read the buffer until delivered


class AbortChannel:
    """The notices of one communicator (`comm`: mlfabric's private duplicate for them)."""

    def __init__(self, comm):
        self.comm = comm
        self.reason = None  # why this rank or a peer gave up (the first heard of); None: usable

    def tell(self, reason):
        """Give up on the communicator: remember `reason`, send each peer a notice (once)."""
        if self.reason is not None:
            return
        self.reason = reason
        text = f"rank {self.comm.rank} gave up on the communicator: {reason}"
        msg = np.frombuffer(text.encode()[:MAX_BYTES], np.uint8).copy()
        for peer in range(self.comm.size):
            if peer != self.comm.rank:
                try:
                    _kept.append((self.comm.Isend([msg, MPI.BYTE], peer, TAG), msg))
                except MPI.Exception:  # a dead peer (ULFM): nobody to tell there
                    pass

    def heard(self):
        """The reason the communicator is unusable (this rank's, or a peer's notice once it has
        come), or None. Costs one MPI_Iprobe while nothing has been heard."""
        if self.reason is not None:
            return self.reason
        status = MPI.Status()
        try:
            if not self.comm.Iprobe(MPI.ANY_SOURCE, TAG, status):
                return None
            buf = np.empty(max(status.Get_count(MPI.BYTE), 0), np.uint8)
            self.comm.Recv([buf, MPI.BYTE], status.Get_source(), TAG)
        except MPI.Exception as exc:  # ULFM: a peer died (its failure is the news)
            self.reason = f"MPI reports a failed peer: {exc.Get_error_string()}"
            return self.reason
        self.reason = buf.tobytes().decode(errors="replace")
        return self.reason
