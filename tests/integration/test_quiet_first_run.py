"""The Quick start's main job, `mpirun --oversubscribe -n 4 python scripts/train.py`, prints no
Open MPI "Error:" line (such as the UCX one-sided component's "OSC UCX component priority set
inside component query failed") when nothing but mlfabric sets Open MPI's defaults: the harness's
own OMPI_MCA_osc is left out, as a user's shell has none."""
import os
import subprocess
import sys

import pytest

from tests import mpi_util

pytest.importorskip("torch")
pytest.importorskip("sklearn")


@pytest.mark.mpi
def test_quick_start_main_job_prints_no_error_line():
    env = mpi_util.mpi_env()
    env.pop("OMPI_MCA_osc", None)
    # the ranks' working directory as the harness runs them (a tree without the unbuilt package
    # when testing an installed one)
    cwd = mpi_util.run_dir() if hasattr(mpi_util, "run_dir") else mpi_util.ROOT
    cmd = [mpi_util.mpirun_path(), "--oversubscribe", "-n", "4", sys.executable,
           os.path.join("scripts", "train.py"), "--quiet"]
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    errors = [ln for ln in proc.stdout.splitlines() if ln.lstrip().startswith("Error:")
              or " Error: " in ln]
    assert not errors, proc.stdout
    assert "RESULT " in proc.stdout, proc.stdout
