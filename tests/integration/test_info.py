"""`python -m mlfabric.info`: exits 0 here with every probe in --json; exits 1 with a reason that
says what to do when the MPI library cannot load, or when the mpirun found belongs to another
MPI; never starts an MPI job."""
import json
import os
import stat
import subprocess
import sys

import pytest

from mlfabric import info

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {"usable", "problems", "warnings", "cuda_built", "nccl_built", "mlfabric", "python",
        "numpy", "mpi4py", "mpi", "mpirun", "ulfm", "shm", "cma", "isa", "gpu", "torch",
        "settings"}


def _info(*args, env=None):
    full = dict(os.environ)
    full["PYTHONPATH"] = ROOT + os.pathsep + full.get("PYTHONPATH", "")
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "mlfabric.info", *args], cwd=ROOT, env=full,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=120)


def test_json_here():
    proc = _info("--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert KEYS <= set(report), sorted(KEYS - set(report))
    assert report["usable"] and report["problems"] == []
    assert report["mpi"]["loaded"] and report["mpi"]["vendor"] and report["mpi"]["version"]
    assert report["mpirun"]["path"] and report["mpirun"]["matches"] is True
    assert report["isa"]["chosen"] in report["isa"]["supported"]
    assert report["shm"]["needed_bytes"] > 0 and report["cma"]["allowed"] in (True, False)
    assert isinstance(report["cuda_built"], bool) and isinstance(report["nccl_built"], bool)
    for key in KEYS - {"usable", "problems", "warnings", "cuda_built", "nccl_built"}:
        assert report[key]["status"] in ("ok", "warning", "error", "-") and report[key]["detail"]


def test_table_here():
    proc = _info("-n", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["check", "status", "detail"]
    assert {line.split()[0] for line in lines[1:] if line.strip()} >= {"mpi", "mpirun", "shm"}
    assert "for 4 ranks" in proc.stdout and lines[-1].startswith("mlfabric can run here")


def test_mpi_that_cannot_load_is_an_error_that_says_what_to_do():
    proc = _info(env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "mlfabric cannot run here" in proc.stdout
    assert "mlfabric.info: mpi: mpi4py" in proc.stderr and "cannot load an MPI library" in \
        proc.stderr and "MPI4PY_LIBMPI=/nonexistent/libmpi.so does not load: unset it" in \
        proc.stderr, proc.stderr
    report = json.loads(_info("--json", env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"}).stdout)
    assert not report["usable"] and report["mpi"]["loaded"] is False
    assert report["problems"] and report["problems"][0].startswith("mpi: ")


def test_settings_bad_values_are_errors_and_misspellings_warnings():
    proc = _info("--json", env={"MLFABRIC_SHM_BLOCK": "12", "MLFABRIC_TIMOUT": "3"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["settings"]["status"] == "error"
    assert report["settings"]["bad"] == ["MLFABRIC_SHM_BLOCK='12' must be at least 4096"]
    assert report["settings"]["unknown"] == [{"name": "MLFABRIC_TIMOUT",
                                              "closest": "MLFABRIC_TIMEOUT"}]
    assert report["shm"]["status"] == "-" and "not checked" in report["shm"]["detail"]
    assert "MLFABRIC_SHM_BLOCK='12' must be at least 4096" in proc.stderr
    proc = _info(env={"MLFABRIC_TIMOUT": "3"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MLFABRIC_TIMOUT is not an mlfabric setting (did you mean MLFABRIC_TIMEOUT?)" in \
        proc.stdout and "(with the warnings above)" in proc.stdout


@pytest.mark.parametrize("text, want", [
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution", ("Open MPI", "5.0.11")),
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org", ("Open MPI",
                                                                           "5.0.11")),
    ("MPICH Version:      4.1.2\nMPICH Release date: Tue Jun  6 2023", ("MPICH", "4.1.2")),
    ("HYDRA build details:\n    Version:                                 4.1.2",
     ("MPICH", "4.1.2")),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", ("Intel MPI", "2021.10")),
    ("something else", (None, None))])
def test_vendor_and_version(text, want):
    assert info._vendor_version(text) == want


def test_an_mpirun_of_another_mpi_is_an_error(tmp_path, monkeypatch):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.1.2'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    mpi = {"loaded": True, "vendor": "Open MPI", "version": "5.0.11"}
    out = info.probe_mpirun(mpi)
    assert out["status"] == "error" and out["matches"] is False
    assert out["path"] == str(fake) and "rank 0 of 1" in out["detail"]
    # the same MPI, another version: a warning
    out = info.probe_mpirun({"loaded": True, "vendor": "MPICH", "version": "4.2.0"})
    assert out["status"] == "warning" and out["matches"] is False
    out = info.probe_mpirun({"loaded": True, "vendor": "MPICH", "version": "4.1.2"})
    assert out["status"] == "ok" and out["matches"] is True
