"""mlfabric.torch beside torch's own backends, in one process: importing it leaves torch's env://
rendezvous as it is for gloo (a missing variable is torch's error, with no MPI started; set, a
world of one works), and Horovod's elastic exceptions are importable from it and mapped onto
mlfabric's failure error."""
import subprocess
import sys

import pytest

from tests import mpi_util
from tests.mpi_util import mpi_env


def _cwd():
    """Where the harness runs its jobs: with an installed mlfabric, a directory without the
    source tree's unbuilt package (run_dir), which `-c` and `-m` would otherwise import."""
    return mpi_util.run_dir() if hasattr(mpi_util, "run_dir") else mpi_util.ROOT

pytest.importorskip("torch")

GLOO = r"""
import os, socket
import torch, torch.distributed as dist
import mlfabric, mlfabric.torch
for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
    os.environ.pop(v, None)
try:
    dist.init_process_group("gloo")
except ValueError as exc:
    print("GLOO-UNSET", type(exc).__name__, "environment variable" in str(exc))
print("MLFABRIC-STARTED", mlfabric.initialized())
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
print("GLOO-SET", dist.get_backend(), dist.get_world_size(), t.tolist())
dist.destroy_process_group()
"""


def test_gloo_env_rendezvous_is_torchs_own_after_importing_mlfabric_torch():
    proc = subprocess.run([sys.executable, "-c", GLOO], cwd=_cwd(), env=mpi_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "GLOO-UNSET ValueError True" in proc.stdout, proc.stdout
    assert "MLFABRIC-STARTED False" in proc.stdout, proc.stdout
    assert "GLOO-SET gloo 1 [1.0, 1.0, 1.0]" in proc.stdout, proc.stdout


def test_horovod_elastic_exceptions():
    import mlfabric.torch as hvd
    from mlfabric.errors import MlfabricError, PeerTimeoutError
    from mlfabric.torch import HorovodInternalError, HostsUpdatedInterrupt
    from mlfabric.torch.elastic import is_failure
    assert hvd.HorovodInternalError is HorovodInternalError is PeerTimeoutError
    assert "HorovodInternalError" in hvd.__all__ and "HostsUpdatedInterrupt" in hvd.__all__
    # what mlfabric raises when a peer fails is caught as Horovod's error, and counts as a failure
    try:
        raise PeerTimeoutError("peer 1 did not arrive")
    except HorovodInternalError as exc:
        assert is_failure(exc)
    interrupt = HostsUpdatedInterrupt(skip_sync=True)
    assert isinstance(interrupt, RuntimeError) and isinstance(interrupt, MlfabricError)
    assert interrupt.skip_sync and not HostsUpdatedInterrupt().skip_sync
    assert not is_failure(interrupt)
