"""Starts real mpirun jobs from pytest, each bounded by a timeout. The Open MPI root variables are
set here (the test harness), never in library code.

The ranks import the same mlfabric as pytest: this tree's (an editable or in-place build), or an
installed package. In the second case the tree must not be on the ranks' path (its mlfabric/ has no
built _C), so the jobs run from run_dir(), a directory that mirrors the tree without mlfabric/:
relative paths (benchmarks/..., scripts/...) and `-m tests...` work the same, and `-c` or `-m`
put no source tree before the installed package."""
import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlfabric_from_tree():
    """True when the mlfabric this process imported (or would import) is this tree's, or none is
    importable; False for a package installed elsewhere (a non-editable install)."""
    module = sys.modules.get("mlfabric")
    path = getattr(module, "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec("mlfabric")
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None else None
    if path is None:
        return True
    return (os.path.dirname(os.path.realpath(path))
            == os.path.join(os.path.realpath(ROOT), "mlfabric"))


_RUN_DIR = []


def run_dir():
    """Where jobs start: ROOT when pytest's mlfabric is the tree's; else a temporary directory of
    links to every entry of ROOT but mlfabric/ (made once, removed at exit)."""
    if not _RUN_DIR:
        if mlfabric_from_tree():
            _RUN_DIR.append(ROOT)
        else:
            d = tempfile.mkdtemp(prefix="mlfabric-tests-")
            atexit.register(shutil.rmtree, d, True)  # the links only: rmtree never follows them
            for name in os.listdir(ROOT):
                if name != "mlfabric":
                    os.symlink(os.path.join(ROOT, name), os.path.join(d, name))
            _RUN_DIR.append(d)
    return _RUN_DIR[0]


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
    # tests (and, from the tree, mlfabric) for scripts whose own directory is elsewhere
    env["PYTHONPATH"] = run_dir() + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


# mpirun itself failing to start, before any rank ran (seen once in a CI-like run here, gone on
# the next launch): such a launch is retried once; a job that started is never rerun
LAUNCH_FAILURES = ("The PMIx server's listener thread failed to start",)


def run_mpi(n, args, timeout=180, env=None, mpirun_args=(), prefix=()):
    """Run `mpirun -n n python args...`; return the CompletedProcess (output merged). prefix: a
    command that runs mpirun (its arguments appended), e.g. small_shm_prefix()'s."""
    mpirun = mpirun_path()
    assert mpirun, "mpirun not found next to python or on PATH"
    cmd = [*prefix, mpirun, "--oversubscribe", *mpirun_args, "-n", str(n), sys.executable, *args]
    for _ in range(2):
        proc = _run_bounded(cmd, env, timeout)
        if proc.returncode == 0 or not any(m in proc.stdout for m in LAUNCH_FAILURES):
            return proc
    return proc


def _run_bounded(cmd, env, timeout):
    """Run cmd in its own process group (setsid); past `timeout` s, fail naming what still runs and where each
    Python rank is stuck (SIGABRT: PYTHONFAULTHANDLER prints every thread's stack), so a hang
    seen once in CI can be read from the log rather than guessed at."""
    import resource
    import signal
    import pytest

    def no_core_files():  # SIGABRT below must not leave core dumps in the checkout
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    proc = subprocess.Popen(cmd, cwd=run_dir(), env=mpi_env({"PYTHONFAULTHANDLER": "1", **(env or {})}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=no_core_files)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            ps = subprocess.run(["ps", "-s", str(proc.pid), "-o", "pid,stat,etime,args"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            ps = f"(no process list: {exc})"
        ranks = [int(line.split()[0]) for line in ps.splitlines()[1:]
                 if sys.executable in line and line.split()[0] != str(proc.pid)]
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGABRT)
            except OSError:
                pass
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)}\nstill running after {timeout} s; its processes then:\n"
                    f"{ps}\noutput (with the stuck ranks' stacks):\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def run_script_json(n, script_args, out, timeout):
    """Run `mpirun -n n python script_args...` (a benchmark script writing JSON to `out`); fail
    with its output unless it exits 0; return (the JSON document, the output)."""
    import json
    proc = run_mpi(n, script_args, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(script_args)} at {n} ranks failed "
                                  f"(rc={proc.returncode}):\n{proc.stdout}")
    with open(out) as f:
        return json.load(f), proc.stdout


def run_cases(module, n, pattern="", timeout=180, env=None, prefix=()):
    """Run tests/mpi_cases/<module>.py's case_* functions on n ranks; fail with the job's output."""
    proc = run_mpi(n, ["-m", "tests.mpi_cases.runner", module, pattern], timeout=timeout, env=env,
                   prefix=prefix)
    assert proc.returncode == 0, f"mpirun -n {n} {module} failed (rc={proc.returncode}):\n{proc.stdout}"
    assert " 0 failed" in proc.stdout, proc.stdout
    return proc.stdout


_SMALL_SHM = {}


def small_shm_prefix(size="64m"):
    """(prefix, None): a command prefix (run_mpi's prefix) that runs mpirun in a private mount
    namespace with a tmpfs of `size` over /dev/shm, as a Docker container has (64m by default);
    or (None, the reason) where this machine does not allow it (not root, no unshare, mounts
    refused). Asked once per size."""
    if size not in _SMALL_SHM:
        mount = f"mount -t tmpfs -o size={size} tmpfs /dev/shm"
        prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                  f'{mount} && exec "$@"', "sh"]
        try:
            probe = subprocess.run([*prefix, "true"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, timeout=30)
            why = None if probe.returncode == 0 else probe.stdout.strip() or "failed"
        except (OSError, subprocess.SubprocessError) as exc:
            why = str(exc)
        _SMALL_SHM[size] = (prefix, None) if why is None else (None, f"{mount} in a private "
                                                               f"mount namespace: {why}")
    return _SMALL_SHM[size]
