"""A Horovod-style script started by torchrun (2 processes that MPI does not connect: each would
train alone as rank 0 of 1) is refused by hvd.init() on both, with the error saying how to launch
(mlfabric/comm/launch.py)."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT, mpi_env

pytest.importorskip("torch")

# torchrun stops the other process once one fails: each waits (bounded) for the other's error
# before raising its own, so that both are seen
SCRIPT = """
import os, sys, time
import mlfabric.torch as hvd
here = os.path.dirname(os.path.abspath(__file__))
try:
    hvd.init()
except hvd.MlfabricError as exc:
    print("LAUNCH-ERROR rank", os.environ["RANK"], exc, flush=True)
    open(os.path.join(here, "refused." + os.environ["RANK"]), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(here, "refused." + r)) for r in ("0", "1")):
        time.sleep(0.1)
    raise
print("INITIALISED rank", hvd.rank(), "of", hvd.size(), flush=True)
"""


@pytest.mark.mpi
def test_torchrun_with_two_processes_is_refused_on_both(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not installed")
    script = tmp_path / "hvd_script.py"
    script.write_text(SCRIPT)
    env = mpi_env()
    for name in list(env):   # as a user's shell: not inside an mpirun
        if name.startswith(("OMPI_COMM_WORLD", "PMIX_")):
            del env[name]
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2",
                           "--tee", "3", str(script)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "INITIALISED" not in proc.stdout, proc.stdout
    for rank in (0, 1):
        line = next((ln for ln in proc.stdout.splitlines()
                     if f"LAUNCH-ERROR rank {rank} " in ln), None)
        assert line is not None, proc.stdout
        assert "torchrun started 2 processes" in line and "mpirun -n 2" in line, line
        assert "mlfabricrun -np 2" in line, line
        assert (tmp_path / f"refused.{rank}").exists()
