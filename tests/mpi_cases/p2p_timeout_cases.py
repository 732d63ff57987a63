"""An irecv whose sender comes too late: wait() raises PeerTimeoutError within MLFABRIC_TIMEOUT
(2 s in the harness), and the late message is never written into the receiver's array (both of
the receive's requests are cancelled, not only the one waited on). Runs alone: a timeout leaves
the communicator unusable by design."""
import time

import numpy as np
import pytest

import mlfabric as mf

from .common import setup  # noqa: F401


def case_late_sender_never_writes_after_a_timeout():
    n, r = mf.size(), mf.rank()
    if n == 1 or r > 1:
        return
    if r == 0:
        time.sleep(3)  # past rank 1's bound
        mf.isend(np.full(8, 7.0), 1, tag=1)  # (never completes: nobody receives it)
        time.sleep(2)
        return
    x = np.zeros(8)
    with pytest.raises(mf.PeerTimeoutError, match="recv from rank 0"):
        mf.irecv(x, 0, tag=1).wait()
    time.sleep(4)  # the late message has come and gone
    assert not x.any(), x
