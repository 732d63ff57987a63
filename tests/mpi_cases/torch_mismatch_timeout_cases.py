"""After a MismatchError the ranks' calls may no longer line up: here rank 0's async allreduce
met the others' blocking one, every rank raised MismatchError, and rank 0's own blocking call,
queued behind its async one, then waits for peers that will never issue it. Its PeerTimeoutError
(within MLFABRIC_TIMEOUT, 3 s in the harness) names that earlier mismatch, which rank 0 has not
seen yet (an async call's error waits for synchronize()). Runs alone: the engine is unusable
after a timeout by design."""
import time

import pytest
import torch

import mlfabric.torch as hvd
from mlfabric.errors import MismatchError, PeerTimeoutError


def setup():
    torch.set_num_threads(1)
    hvd.init()


def case_timeout_after_a_mismatch_names_it():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    # a mismatch every rank saw and handled, then calls that line up again (a grouped one
    # too): the timeout below names the later mismatch, not this one
    with pytest.raises(MismatchError):
        hvd.allreduce(torch.ones(4), name=f"old{r}")
    hvd.grouped_reducescatter([torch.ones(4), torch.ones(6)])
    if r != 0:
        with pytest.raises(MismatchError, match="names differ"):
            hvd.allreduce(torch.ones(4), name="b")
        return
    handle = hvd.allreduce_async(torch.ones(4), name="a")
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"earlier call allreduce 'a' failed with "
                                               r"MismatchError.*names differ") as info:
        hvd.allreduce(torch.ones(4), name="b")
    assert time.monotonic() - t0 < 15, "waited past the bound"
    assert "allreduce 'b'" in str(info.value) and "old" not in str(info.value), str(info.value)
    with pytest.raises(MismatchError, match="names differ"):
        hvd.synchronize(handle)
