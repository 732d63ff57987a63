"""mlfabricrun (mlfabric/run.py): the mpirun command it builds for several command lines (in this
process, with a fake core count and environment), its usage errors, and a real launch of 3 ranks
on this 2-core host (--oversubscribe added by the launcher) that see rank and size after init()
and torchrun's variables exported by it."""
import os
import subprocess
import sys

import pytest

from mlfabric import run
from tests import mpi_util
from tests.mpi_util import mpi_env


def _cwd():
    """Where the harness runs its jobs: with an installed mlfabric, a directory without the
    source tree's unbuilt package (run_dir), which `-c` and `-m` would otherwise import."""
    return mpi_util.run_dir() if hasattr(mpi_util, "run_dir") else mpi_util.ROOT

MPIRUN = "/opt/mpi/bin/mpirun"


def build(argv, env=None, cores=2, ucx=False):
    cmd, verbose, dry = run.build_command(argv, env=env or {}, cores=cores, mpirun=MPIRUN,
                                          ucx=ucx)
    return cmd, verbose, dry


def test_oversubscribes_past_the_cores_of_one_host_only():
    assert build(["-np", "2", "python", "t.py"])[0] == [
        MPIRUN, "-n", "2", "--mca", "osc", "^ucx", "python", "t.py"]
    assert build(["-np", "3", "python", "t.py"])[0] == [
        MPIRUN, "-n", "3", "--oversubscribe", "--mca", "osc", "^ucx", "python", "t.py"]
    # hosts named: their slots decide, not this host's cores
    assert build(["-np", "8", "-H", "a:4,b:4", "python", "t.py"])[0] == [
        MPIRUN, "-n", "8", "--host", "a:4,b:4", "--mca", "osc", "^ucx", "python", "t.py"]
    # asked for already: not twice
    cmd = build(["-np", "3", "--oversubscribe", "python", "t.py"])[0]
    assert cmd.count("--oversubscribe") == 1


def test_forwards_mlfabric_variables_and_keeps_the_users_osc_choice():
    env = {"MLFABRIC_TIMEOUT": "5", "MLFABRIC_ALGORITHM": "ring", "HOME": "/root"}
    cmd = build(["-n", "2", "python", "t.py"], env=env)[0]
    assert cmd == [MPIRUN, "-n", "2", "-x", "MLFABRIC_ALGORITHM", "-x", "MLFABRIC_TIMEOUT",
                   "--mca", "osc", "^ucx", "python", "t.py"]
    # a UCX device on this host, or the user's own osc choice: no osc default
    assert "osc" not in build(["-np", "2", "python", "t.py"], ucx=True)[0]
    assert "^ucx" not in build(["-np", "2", "python", "t.py"], env={"OMPI_MCA_osc": "pt2pt"})[0]
    cmd = build(["-np", "2", "--mca", "osc", "rdma", "python", "t.py"])[0]
    assert cmd == [MPIRUN, "-n", "2", "--mca", "osc", "rdma", "python", "t.py"]


def test_passes_other_options_through_with_their_values(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\n")
    cmd = build(["-np", "4", "--hostfile", str(hostfile), "--bind-to", "none", "-x", "FOO",
                 "--report-bindings", "python", "-u", "t.py", "--lr", "0.1"], ucx=True)[0]
    assert cmd == [MPIRUN, "-n", "4", "--hostfile", str(hostfile), "--bind-to", "none", "-x",
                   "FOO", "--report-bindings", "python", "-u", "t.py", "--lr", "0.1"]
    # after `--` everything is the program's; before it, every token is an option
    cmd = build(["-np", "2", "--unknown-opt", "value", "--", "python", "-np", "9"], ucx=True)[0]
    assert cmd == [MPIRUN, "-n", "2", "--unknown-opt", "value", "python", "-np", "9"]
    _, verbose, dry = build(["-v", "--dry-run", "-np", "1", "prog"])
    assert verbose and dry


@pytest.mark.parametrize("argv, message", [
    (["python", "t.py"], "-np N"),
    (["-np", "0", "python", "t.py"], "positive number"),
    (["-np", "two", "python", "t.py"], "positive number"),
    (["-np"], "needs a value"),
    (["-np", "2"], "no program"),
    (["-np", "2", "--"], "no program"),
    (["-np", "2", "-H", "a:1", "--hostfile", "f", "p"], "not both"),
    (["-np", "2", "--hostfile", "/no/such/hostfile", "p"], "no such file"),
])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(run.UsageError, match=message):
        build(argv)
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "usage: mlfabricrun" in err


def test_no_mpirun_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(run, "find_mpirun", lambda: None)
    assert run.main(["-np", "2", "python", "t.py"]) == 2
    assert "mpirun not found beside" in capsys.readouterr().err
    monkeypatch.undo()
    # beside the given Python first, else PATH
    (tmp_path / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "mpirun").chmod(0o755)
    assert run.find_mpirun(str(tmp_path / "python"), path="") == str(tmp_path / "mpirun")
    assert run.find_mpirun("/no/such/dir/python", path=str(tmp_path)) == str(tmp_path / "mpirun")
    assert run.find_mpirun("/no/such/dir/python", path="") is None


def test_dry_run_prints_the_command(capsys):
    assert run.main(["--dry-run", "-np", "3", "python", "t.py"]) == 0
    out = capsys.readouterr().out
    assert " -n 3 " in out and out.rstrip().endswith("python t.py")


PROGRAM = ("import os, mlfabric as mf; mf.init(); "
           "print('RANKINFO', mf.rank(), mf.size(), os.environ['RANK'], "
           "os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], os.environ['MASTER_ADDR'], "
           "os.environ['MASTER_PORT'], flush=True)")


@pytest.mark.mpi
def test_three_ranks_on_two_cores():
    env = mpi_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "mlfabric.run", "-v", "-np", "3",
                           sys.executable, "-c", PROGRAM], cwd=_cwd(), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout
    rows = sorted(ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith("RANKINFO"))
    assert len(rows) == 3, proc.stdout
    ports = {row[6] for row in rows}
    assert len(ports) == 1 and int(ports.pop()) > 0, rows
    for r, row in enumerate(rows):
        assert row[:6] == [str(r), "3", str(r), "3", str(r), "127.0.0.1"], rows
    if os.cpu_count() and run.host_cores() < 3:
        assert "--oversubscribe" in proc.stdout  # -v printed the command
