"""Multi-rank cases for the mlfabric.torch timeline's record of allreduce backends: each call
that ran allreduces names the backend auto resolved for them (args "algorithm"), the one
mlfabric.comm.collectives.chosen_backend gives for the same buffer on this rank; calls that
ran none name nothing; a stopped timeline leaves the allreduces nothing to report to. Run by
tests/mpi/test_torch_timeline.py with and without the shared-memory engine (MLFABRIC_SHM)."""
import json
import os
import tempfile

import numpy as np
import torch

import mlfabric.torch as hvd
from mlfabric.comm import collectives

SMALL = 4  # float32 elements: the tree's without shared memory
LARGE = 64 * 1024  # 256 KiB: rhd on a power-of-two number of ranks, else the ring


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()


def _expected(count, dtype=np.float32):
    return collectives.chosen_backend(np.zeros(count, dtype))


def case_timeline_names_each_allreduce_backend():
    n, r = hvd.size(), hvd.rank()
    folder = hvd.broadcast_object(tempfile.mkdtemp(prefix="mlfabric-tl-") if r == 0 else None)
    assert collectives.backend_sink is None  # off: allreduces report nowhere
    mine = hvd.start_timeline(os.path.join(folder, "trace.json"))
    small = hvd.allreduce(torch.full((SMALL,), float(r)), op=hvd.Sum, name="tl.small")
    large = hvd.allreduce(torch.full((LARGE,), float(r)), op=hvd.Sum, name="tl.large")
    h = hvd.allreduce_async(torch.full((LARGE,), 1.0), op=hvd.Average, name="tl.async")
    averaged = hvd.synchronize(h)
    grouped = hvd.grouped_allreduce([torch.ones(SMALL), torch.ones(LARGE, dtype=torch.float64)],
                                    op=hvd.Sum, name="tl.grouped")
    hvd.allgather(torch.ones(r + 1), name="tl.gather")
    hvd.barrier()
    hvd.stop_timeline()
    assert collectives.backend_sink is None
    hvd.allreduce(torch.ones(SMALL), name="tl.after")  # not recorded

    total = float(sum(range(n)))  # the results are right whatever the backend
    assert small.tolist() == [total] * SMALL and torch.equal(large, torch.full((LARGE,), total))
    assert torch.equal(averaged, torch.ones(LARGE))
    assert grouped[0].tolist() == [float(n)] * SMALL
    assert torch.equal(grouped[1], torch.full((LARGE,), float(n), dtype=torch.float64))

    with open(mine) as f:
        events = json.load(f)
    calls = {e["name"]: e for e in events
             if e["ph"] == "X" and e["name"] not in ("QUEUE", "NEGOTIATE")}
    algorithm = {what: e.get("args", {}).get("algorithm") for what, e in calls.items()}
    # a grouped call of two dtypes runs an allreduce per dtype: their backends, in order
    both = list(dict.fromkeys([_expected(SMALL), _expected(LARGE, np.float64)]))
    assert algorithm == {
        "allreduce 'tl.small'": _expected(SMALL),
        "allreduce 'tl.large'": _expected(LARGE),
        "allreduce 'tl.async'": _expected(LARGE),
        "grouped_allreduce 'tl.grouped'": ", ".join(both),
        "allgather 'tl.gather'": None,
        "barrier": None,
    }, algorithm
    names = set(collectives.ALGORITHMS) - {"auto"}
    assert {a for v in algorithm.values() if v for a in v.split(", ")} <= names, algorithm
    shm = os.environ.get("MLFABRIC_SHM", "1") == "1"
    if shm:
        assert algorithm["allreduce 'tl.large'"] == "shm", algorithm
    else:
        assert algorithm["allreduce 'tl.small'"] == "tree", algorithm
        assert algorithm["allreduce 'tl.large'"] == ("rhd" if n & (n - 1) == 0 else "ring")
    hvd.barrier()
