"""A rank that never joins a collective: its peers raise PeerTimeoutError within MLFABRIC_TIMEOUT
(the harness sets it to 3 s for this module) instead of hanging. Runs last: the engine is unusable
afterwards by design."""
import re
import time

import numpy as np
import pytest

import mlfabric as mf

from .common import setup  # noqa: F401


def case_missing_peer_times_out():
    n, r = mf.size(), mf.rank()
    if n == 1:
        return
    if r == n - 1:
        time.sleep(6)  # "dead" to its peers, which give up at 3 s
        # arriving late, it finds them gone: an error too, not a result of its own data alone
        with pytest.raises(mf.PeerTimeoutError, match="a peer already gave up"):
            mf.allreduce(np.ones(10))
        return
    t0 = time.monotonic()
    with pytest.raises(mf.PeerTimeoutError, match="timed out|no progress") as info:
        mf.allreduce(np.ones(10))
    waited = time.monotonic() - t0
    assert 2.5 < waited < 10, waited
    # The message names the missing rank (engine: "local rank(s) 2 (round", MPI: "rank(s) [2]").
    assert re.search(rf"rank\(s\) \[?{n - 1}\b", str(info.value)), str(info.value)
