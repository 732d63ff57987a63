"""The benchmark driver (mlfabric/bench/harness.py) and its table of entries (benchmarks/*.py):
every script is an Entry that accepts --help (exit 0, printed once under MPI), the common
options are spelled alike, and a written JSON carries the common envelope in "meta" beside the
script's own keys. One process and no MPI where possible; one tiny mpirun of one script."""
import glob
import json
import os
import subprocess
import sys

import pytest

from mlfabric.bench import harness

from tests.mpi_util import ROOT, mpi_env, run_mpi, run_script_json

SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "benchmarks",
                                                                          "*.py")))

# Imports every script (MPI not started: mpi4py.rc.initialize off), builds its parser from its
# Entry and parses --help; prints one JSON line per script.
PROBE = r"""
import contextlib, importlib.util, io, json, sys
import mpi4py
mpi4py.rc.initialize = False
from mlfabric.bench import harness
for name in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("bench_" + name, "benchmarks/%s.py" % name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    entry = getattr(module, "ENTRY", None)
    out, code = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            harness.make_parser(entry).parse_args(["--help"])
        except SystemExit as e:
            code = e.code
    print(json.dumps({"name": name, "entry": isinstance(entry, harness.Entry),
                      "entry_name": getattr(entry, "name", None), "code": code,
                      "help": out.getvalue()}))
"""


@pytest.fixture(scope="module")
def helps():
    proc = subprocess.run([sys.executable, "-c", PROBE, *SCRIPTS], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return {d["name"]: d for d in map(json.loads, proc.stdout.splitlines())}


def test_every_script_is_listed():
    assert len(SCRIPTS) >= 11 and "ps_modes" in SCRIPTS and "pipeline" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_is_an_entry_that_accepts_help(helps, name):
    d = helps[name]
    assert d["entry"] and d["entry_name"] == name
    assert d["code"] == 0
    assert d["help"].startswith("usage:")
    if name != "pipeline":  # pipeline's options belong to its subcommands
        assert "--out OUT, --json OUT" in d["help"] or "--out FILE.json, --json FILE.json" \
            in d["help"], d["help"]


@pytest.mark.parametrize("name,options", [
    ("torch_grouped", ["--iters", "--rounds", "--threads"]),
    ("torch_sparse", ["--iters", "--rounds", "--threads"]),
    ("torch_optimizer", ["--iters", "--rounds", "--threads"]),
    ("gpu_collectives", ["--iters", "--rounds"]),
    ("shm_paths", ["--iters", "--rounds"]),
    ("cuda_kernels", ["--repeats", "--iters"]),
])
def test_common_options_spelled_alike(helps, name, options):
    for option in options:
        assert option in helps[name]["help"], (name, option)


def test_document_envelope_beside_the_records():
    records = {"meta": {"command": "theirs", "ranks": 7, "extra": 1}, "rows": [1.5, float("inf")]}
    doc = harness.jsonable(harness.document(records))
    assert list(doc) == ["meta", "rows"] and doc["rows"] == [1.5, "inf"]
    meta = doc["meta"]
    assert set(harness.ENVELOPE_KEYS) <= set(meta)
    assert meta["command"] == "theirs" and meta["ranks"] == 7 and meta["extra"] == 1
    assert meta["schema"] == harness.SCHEMA and meta["cpu_count"] == os.cpu_count()
    json.dumps(doc)  # JSON holds it as it is


def test_stats_and_git_state():
    s = harness.stats([3, 1, 2])
    assert s == {"n": 3, "mean": 2.0, "median": 2.0, "p90": 3.0, "max": 3.0, "min": 1.0}
    assert "min" not in harness.stats([1], with_min=False) and harness.stats([]) is None
    git = harness.git_state()
    if git is not None:
        assert set(git) == {"commit", "dirty", "modified", "diff_sha1"}
        assert git["dirty"] == bool(git["modified"])


def check_envelope(meta, name, n, argv):
    assert set(harness.ENVELOPE_KEYS) <= set(meta), set(harness.ENVELOPE_KEYS) - set(meta)
    assert meta["schema"] == harness.SCHEMA and meta["benchmark"] == name
    assert meta["ranks"] == n
    assert meta["argv"][1:] == ["benchmarks/%s.py" % name, *argv]
    assert meta["command"].startswith("mpirun -n %d python benchmarks/%s.py" % (n, name))
    assert meta["hostname"] and meta["cpu"] and meta["cpu_count"] >= 1 and meta["machine"]
    assert meta["gpu"] is None or isinstance(meta["gpu"], str)
    assert meta["git"] is None or {"commit", "dirty"} <= set(meta["git"])
    assert meta["timestamp"].endswith("+00:00")


@pytest.mark.mpi
def test_help_on_every_rank():
    proc = run_mpi(2, ["benchmarks/ps_modes.py", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("usage:") == 1, proc.stdout  # printed once, by rank 0


@pytest.mark.mpi
def test_tiny_run_writes_the_envelope(tmp_path):
    pytest.importorskip("torch")
    out = str(tmp_path / "out.json")
    argv = ["--count", "2", "--small", "8", "--iters", "1", "--rounds", "1", "--json", out]
    doc, _ = run_script_json(2, ["benchmarks/torch_grouped.py", *argv], out, 120)
    assert list(doc) == ["meta", "results", "wrong"]  # the script's own keys kept
    check_envelope(doc["meta"], "torch_grouped", 2, argv)
    assert doc["meta"]["threads_per_rank"] == 1 and doc["wrong"] is False
