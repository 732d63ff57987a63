"""mlfabric/comm/respawn.py's pieces that need no failure (the spawn itself is tested where a rank
dies: tests/mpi/test_torch_elastic.py, tests/integration/test_train_script.py): how a program is started again,
the transport check, the limit's parsing, and that a process nobody spawned does not wait."""
import subprocess
import sys

import pytest

from mlfabric.comm import respawn
from mlfabric._core.config import elastic_replace
from mlfabric.errors import MlfabricError

from tests.mpi_util import ROOT, mpi_env


def test_command_of_a_script_and_of_c(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("from mlfabric import respawn\nprint(respawn.command())\n")
    env = mpi_env()

    def run(*args):
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert run(str(script), "--epochs", "3") == repr([str(script), "--epochs", "3"])
    assert run("-c", "from mlfabric import respawn; print(respawn.command())") == "None"


def test_command_of_a_module(tmp_path):
    pkg = tmp_path / "pkg_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text("from mlfabric import respawn\nprint(respawn.command())\n")
    env = mpi_env()
    env["PYTHONPATH"] = str(tmp_path) + ":" + env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-m", "pkg_probe.job", "--a", "1"], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=60)
    assert proc.stdout.strip() == repr(["-m", "pkg_probe.job", "--a", "1"]), proc.stderr


@pytest.mark.parametrize("btl, refused", [(None, False), ("self,sm", True), ("self,vader", True),
                                          ("self,sm,tcp", False), ("^openib", False)])
def test_transport_between_jobs(monkeypatch, btl, refused):
    if btl is None:
        monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    else:
        monkeypatch.setenv("OMPI_MCA_btl", btl)
    why = respawn._unreachable()
    assert (why is not None) == refused, why
    if refused:
        assert btl in why and "tcp" in why


def test_limit_parsing(monkeypatch):
    monkeypatch.delenv("MLFABRIC_ELASTIC_REPLACE", raising=False)
    assert elastic_replace() == 0
    monkeypatch.setenv("MLFABRIC_ELASTIC_REPLACE", "3")
    assert elastic_replace() == 3
    for bad in ("x", "-1", "1.5"):
        monkeypatch.setenv("MLFABRIC_ELASTIC_REPLACE", bad)
        with pytest.raises(MlfabricError, match="MLFABRIC_ELASTIC_REPLACE"):
            elastic_replace()


def test_a_process_nobody_spawned_does_not_wait():
    assert respawn.join() is None
    assert respawn.joining is False
