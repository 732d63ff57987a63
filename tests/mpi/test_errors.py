"""Bad input under real mpirun (tests/mpi_cases/errors_cases.py, timeout_cases.py), and the
single-process errors: use before init, bad environment settings."""
import subprocess
import sys

import pytest

import mlfabric as mf
from tests.mpi_util import ROOT, mpi_env, run_cases


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_errors(n):
    run_cases("errors_cases", n, timeout=300)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_dead_peer_times_out(n):
    run_cases("timeout_cases", n, timeout=120, env={"MLFABRIC_TIMEOUT": "3"})


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_timeout_after_a_mismatch_names_it(n):
    run_cases("torch_mismatch_timeout_cases", n, timeout=120, env={"MLFABRIC_TIMEOUT": "3"})


@pytest.mark.mpi
def test_a_late_sender_never_writes_after_a_receive_timed_out():
    run_cases("p2p_timeout_cases", 2, timeout=120, env={"MLFABRIC_TIMEOUT": "2"})


@pytest.mark.mpi
@pytest.mark.parametrize("n", [4, 5])
def test_ps_job_end_is_bounded_by_liveness(n):
    run_cases("ps_liveness_cases", n, timeout=120, env={"MLFABRIC_TIMEOUT": "3"})


def _python(code, env=None):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=mpi_env(env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


def test_calls_before_init_raise():
    code = """
import numpy as np, mlfabric as mf
for f in (lambda: mf.allreduce(np.ones(3)), mf.rank, mf.size, mf.barrier,
          lambda: mf.shared_empty(3), lambda: mf.broadcast(np.ones(2))):
    try:
        f()
    except mf.NotInitializedError as e:
        assert "mlfabric.init()" in str(e)
    else:
        raise SystemExit("no error before init")
mf.init(); mf.init()  # idempotent
assert mf.size() == 1 and mf.rank() == 0 and mf.local_size() == 1
mf.finalize()
try:
    mf.allreduce(np.ones(3))
except mf.NotInitializedError:
    print("OK")
"""
    proc = _python(code)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout


def test_bad_environment_values_are_errors():
    proc = _python("import mlfabric as mf; mf.init()", {"MLFABRIC_TIMEOUT": "soon"})
    assert proc.returncode != 0 and "MLFABRIC_TIMEOUT" in proc.stdout
    proc = _python("import mlfabric as mf; mf.init()", {"MLFABRIC_SHM": "yes"})
    assert proc.returncode != 0 and "MLFABRIC_SHM" in proc.stdout


def test_shm_can_be_disabled():
    code = ("import numpy as np, mlfabric as mf; from mlfabric import context; mf.init(); "
            "assert context.get().shm is None; "
            "assert (mf.allreduce(np.ones(5)) == 1).all(); print('OK')")
    proc = _python(code, {"MLFABRIC_SHM": "0"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout


def _mpmd_init(name, value):
    """rank 0 with the environment as it is, rank 1 with name=value: what each printed."""
    from tests.mpi_util import mpirun_path
    code = ("import mlfabric as mf\ntry:\n    mf.init()\nexcept mf.MlfabricError as e:\n"
            "    print('REFUSED', mf.rank() if mf.initialized() else '?', e)\nelse:\n"
            "    print('ACCEPTED')")
    cmd = [mpirun_path(), "--oversubscribe", "-n", "1", sys.executable, "-c", code, ":",
           "-n", "1", "env", f"{name}={value}", sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    return proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("name,value,shown", [
    ("MLFABRIC_SHM_BLOCK", "1048576", "262144 on rank(s) [0]; 1048576 on rank(s) [1]"),
    ("MLFABRIC_NCCL_SHARE_GPU", "1", "False on rank(s) [0]; True on rank(s) [1]"),
    ("MLFABRIC_FUSION_THRESHOLD", "5", "4194304 on rank(s) [0]; 5 on rank(s) [1]")])
def test_ranks_with_different_settings_fail_at_init(name, value, shown):
    # MPMD launch: rank 1 runs with another setting than rank 0; values compared as read
    out = _mpmd_init(name, value)
    assert out.count("REFUSED") == 2, out
    assert f"ranks disagree on {name}: {shown}" in out, out


@pytest.mark.mpi
def test_a_setting_at_its_default_agrees_with_it_unset():
    out = _mpmd_init("MLFABRIC_SHM", "1")
    assert out.count("ACCEPTED") == 2, out


@pytest.mark.mpi
@pytest.mark.parametrize("name,value,own", [
    ("MLFABRIC_SHM_SLOTS", "x", "MLFABRIC_SHM_SLOTS='x' is not a number"),
    ("MLFABRIC_ISA", "bogus", "MLFABRIC_ISA must be one of auto, scalar, avx2, avx512")])
def test_a_bad_setting_on_one_rank_fails_every_rank(name, value, own):
    """The rank with the bad value raises its own error, its peer one naming it: nobody waits."""
    out = _mpmd_init(name, value)
    assert out.count("REFUSED") == 2, out
    assert out.count(own) == 2 and "rank(s) [1] have a bad setting" in out, out


def test_non_finite_and_unknown_values_are_errors():
    for env, needle in (({"MLFABRIC_TIMEOUT": "nan"}, "MLFABRIC_TIMEOUT='nan' must be a finite"),
                        ({"MLFABRIC_TIMEOUT": "inf"}, "MLFABRIC_TIMEOUT='inf' must be a finite"),
                        ({"MLFABRIC_DEBUG": "false"}, "MLFABRIC_DEBUG must be 0 or 1")):
        proc = _python("import mlfabric as mf, mlfabric.runtime.daemon; mf.init()", env)
        assert proc.returncode != 0 and needle in proc.stdout, (env, proc.stdout)


def test_a_gpu_and_a_host_call_disagree_on_the_algorithm():
    """The header word a GPU call carries ('nccl') against a host call's: the message every
    rank raises (tests/mpi_cases/gpu_cases.py checks it end to end on a GPU machine)."""
    from mlfabric.comm import header
    gpu = header.make("allreduce", 0, 0, False, 0, (5,), "nccl")
    host = header.make("allreduce", 0, 0, False, 0, (5,), "shm")
    with pytest.raises(mf.MismatchError,
                       match=r"allreduce: ranks disagree on algorithm: nccl on rank\(s\) \[0, 2\]; "
                             r"shm on rank\(s\) \[1\]"):
        header.check([gpu, host, gpu], "allreduce")
    header.check([gpu, gpu], "allreduce")  # agreeing GPU calls pass
