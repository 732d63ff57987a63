"""The paced data plane (mlfabric.runtime.dataplane) and the RR-Sync / Tr-Sync baselines over it
(mlfabric.ps.allreduce_baselines) under real mpirun at 1, 2, 3 and 5 ranks: delivery of many
flows of every shape, egress / ingress / rate-cap / not_before pacing, bounded waits on dead
peers, and both allreduces against float64 references, with and without a slow NIC. The cases
are in mpi_cases/dataplane_cases.py. Nothing here imports mpi4py, so the pytest process itself never
initializes MPI."""
import pytest

from tests.mpi_util import run_cases


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_dataplane(n):
    out = run_cases("dataplane_cases", n, timeout=120)
    assert "case_peer_timeout_allreduce: ok" in out, out
