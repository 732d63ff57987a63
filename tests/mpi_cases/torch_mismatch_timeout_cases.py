"""After a MismatchError the ranks' calls line up again; an async call that only rank 0 issues is
set aside while the others' call runs (reorder.py), and waiting for it ends in a PeerTimeoutError
within MLFABRIC_TIMEOUT (3 s in the harness) that names it. Runs alone: the engine is unusable
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
        assert torch.equal(hvd.allreduce(torch.ones(4), name="b"), torch.ones(4))
        return
    # rank 0's async 'a' meets the others' 'b': it is set aside, 'b' runs everywhere, and 'a',
    # which no peer issues, times out when waited for, naming it
    handle = hvd.allreduce_async(torch.ones(4), name="a")
    assert torch.equal(hvd.allreduce(torch.ones(4), name="b"), torch.ones(4))
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError) as info:
        hvd.synchronize(handle)
    assert time.monotonic() - t0 < 15, "waited past the bound"
    assert "'a'" in str(info.value) and "old" not in str(info.value), str(info.value)
