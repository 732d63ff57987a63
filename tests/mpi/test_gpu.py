"""GPU arrays over NCCL. The multi-rank cases (tests/mpi_cases/gpu_cases.py) run only where torch
sees a GPU and libnccl loads: on a machine with fewer GPUs than ranks they share one GPU through
MLFABRIC_NCCL_SHARE_GPU=1. What needs no GPU is tested everywhere: how a missing libnccl and a
bad setting are reported."""
import subprocess
import sys

import pytest

from mlfabric.comm import nccl

from tests.mpi_util import ROOT, run_cases

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

HAVE_GPU = torch is not None and torch.cuda.is_available() and nccl.available()
gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU, a CUDA build of torch and libnccl")
pytestmark = pytest.mark.cuda


def _in_fresh_python(code, env=None):
    import os
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, timeout=120,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def test_missing_libnccl_is_a_clear_error():
    out = _in_fresh_python(
        "import mlfabric\n"
        "from mlfabric.comm import nccl\n"
        "print(mlfabric.nccl_built(), nccl.available())\n"
        "try:\n"
        "    nccl.library()\n"
        "except mlfabric.MlfabricError as e:\n"
        "    print('ERROR', e)\n",
        env={"MLFABRIC_NCCL_LIB": "/nonexistent/libnccl.so.2"})
    assert out.startswith("False False"), out
    assert "ERROR GPU arrays need NCCL, and no usable libnccl was found (set MLFABRIC_NCCL_LIB" \
        in out and "/nonexistent/libnccl.so.2" in out, out


def test_share_gpu_setting_is_checked():
    out = _in_fresh_python(
        "import mlfabric\n"
        "from mlfabric import _config\n"
        "try:\n"
        "    _config.nccl_share_gpu()\n"
        "except mlfabric.MlfabricError as e:\n"
        "    print('ERROR', e)\n",
        env={"MLFABRIC_NCCL_SHARE_GPU": "yes"})
    assert "ERROR MLFABRIC_NCCL_SHARE_GPU must be 0 or 1, got 'yes'" in out, out


@gpu
@pytest.mark.parametrize("n", [1, 2, 3])
def test_gpu_cases(n):
    share = "1" if torch.cuda.device_count() < n else "0"
    run_cases("gpu_cases", n, timeout=600, env={"MLFABRIC_NCCL_SHARE_GPU": share,
                                                "MLFABRIC_TIMEOUT": "60"})


@gpu
def test_train_script_on_gpus_reaches_95_percent():
    """The main job, allreduce mode, with --device cuda: 2 ranks (sharing a GPU where there is
    only one), digits, 10 epochs: the same accuracy target as on the CPU."""
    from tests.mpi_util import run_mpi
    from tests.integration.test_train_script import SCRIPT, result
    share = "1" if torch.cuda.device_count() < 2 else "0"
    proc = run_mpi(2, [SCRIPT, "--device", "cuda", "--quiet"], timeout=400,
                   env={"MLFABRIC_NCCL_SHARE_GPU": share})
    assert proc.returncode == 0, proc.stdout
    r = result(proc.stdout)
    assert r["device"].startswith("cuda") and r["test_accuracy"] >= 0.95, r


@gpu
def test_gpu_benchmarks_run_small_and_check_their_results(tmp_path):
    """Both GPU benchmarks at a tiny size, 2 ranks: every collective's result right against
    float64, DistributedOptimizer's weights equal to DDP's (the script exits 1 otherwise; at
    lr 0.01 ranks that skipped the reduction would end ~6e-3 apart, 60x the tolerance)."""
    from tests.mpi_util import run_script_json
    out = str(tmp_path / "coll.json")
    doc, log = run_script_json(2, [f"{ROOT}/benchmarks/gpu_collectives.py", "--max-bytes", "64K",
                                   "--iters", "2", "--rounds", "1", "--out", out], out, 300)
    assert doc["rows"] and all(not any(r["wrong"].values()) for r in doc["rows"]), log
    out = str(tmp_path / "opt.json")
    doc, log = run_script_json(2, [f"{ROOT}/benchmarks/gpu_optimizer.py", "--inputs", "128",
                                   "--hidden", "256", "--layers", "2", "--batch", "64",
                                   "--steps", "2", "--rounds", "2", "--lr", "0.01", "--out", out],
                                  out, 300)
    assert doc["wrong"] == 0 and set(doc["variants"]) == {"alone", "hvd", "ddp-nccl"}, log
