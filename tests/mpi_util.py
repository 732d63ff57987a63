"""Starts real mpirun jobs from pytest, each bounded by a timeout. The Open MPI root variables are
set here (the test harness), never in library code."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpirun_path():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


_SHARED_MEMORY_BTL = []


def shared_memory_btl():
    """Open MPI's on-host transport: "sm" from 5.0 on, "vader" in 3.x and 4.x (asked of mpirun
    once, without importing mpi4py here)."""
    if not _SHARED_MEMORY_BTL:
        try:
            out = subprocess.run([mpirun_path() or "mpirun", "--version"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        old = any(f"Open MPI) {v}." in out or f"Open MPI {v}." in out for v in "1234")
        _SHARED_MEMORY_BTL.append("vader" if old else "sm")
    return _SHARED_MEMORY_BTL[0]


def mpi_env(extra=None):
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", MLFABRIC_TIMEOUT=env.get("MLFABRIC_TIMEOUT", "20"),
               # Keep Open MPI from probing networks: everything is on this host.
               OMPI_MCA_btl="self," + shared_memory_btl(), OMPI_MCA_osc="^ucx")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


# mpirun itself failing to start, before any rank ran (seen once in a CI-like run here, gone on
# the next launch): such a launch is retried once; a job that started is never rerun
LAUNCH_FAILURES = ("The PMIx server's listener thread failed to start",)


def run_mpi(n, args, timeout=180, env=None, mpirun_args=()):
    """Run `mpirun -n n python args...`; return the CompletedProcess (output merged)."""
    mpirun = mpirun_path()
    assert mpirun, "mpirun not found next to python or on PATH"
    cmd = [mpirun, "--oversubscribe", *mpirun_args, "-n", str(n), sys.executable, *args]
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if proc.returncode == 0 or not any(m in proc.stdout for m in LAUNCH_FAILURES):
            return proc
    return proc


def run_script_json(n, script_args, out, timeout):
    """Run `mpirun -n n python script_args...` (a benchmark script writing JSON to `out`); fail
    with its output unless it exits 0; return (the JSON document, the output)."""
    import json
    proc = run_mpi(n, script_args, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(script_args)} at {n} ranks failed "
                                  f"(rc={proc.returncode}):\n{proc.stdout}")
    with open(out) as f:
        return json.load(f), proc.stdout


def run_cases(module, n, pattern="", timeout=180, env=None):
    """Run tests/mpi_cases/<module>.py's case_* functions on n ranks; fail with the job's output."""
    proc = run_mpi(n, ["-m", "tests.mpi_cases.runner", module, pattern], timeout=timeout, env=env)
    assert proc.returncode == 0, f"mpirun -n {n} {module} failed (rc={proc.returncode}):\n{proc.stdout}"
    assert " 0 failed" in proc.stdout, proc.stdout
    return proc.stdout
