"""Tests of the microbenchmark driver (mlfabric.bench): its pieces in-process (sizes, impl names,
data patterns and the result check, which must catch wrong output), and small sweeps under real
mpirun at 1, 2 and 3 ranks checking the exit status and the JSON records."""
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from mlfabric.bench import driver, impls, report
from tests.mpi_util import shared_memory_btl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 120
FIELDS = {"impl", "coll", "dtype", "op", "bytes", "count", "ranks", "time_us", "algbw", "busbw",
          "wrong", "hostname", "cpu_count", "timestamp", "mpi_library", "mlfabric_version",
          "algorithm", "backend", "device"}
BACKENDS = {"shm", "tree", "rhd", "ring", "nccl"}


def have(module):
    try:
        __import__(module)
        return True
    except Exception:
        return False


# --- in-process: the pieces ----------------------------------------------------------------------

def test_parse_size():
    assert driver.parse_size("8") == 8
    assert driver.parse_size("64K") == 65536
    assert driver.parse_size("128M") == 128 << 20
    assert driver.parse_size("1G") == 1 << 30
    assert driver.parse_size("4KiB") == 4096
    assert driver.parse_size("1.5k") == 1536
    for bad in ("", "x", "0", "1.3", "-8", "2T", "inf", "nan"):
        with pytest.raises(ValueError):
            driver.parse_size(bad)


def test_size_sweep():
    assert driver.size_sweep(8, 64, 2) == [8, 16, 32, 64]
    assert driver.size_sweep(8, 100, 4) == [8, 32]
    assert driver.size_sweep(16, 16, 1) == [16]
    with pytest.raises(ValueError):
        driver.size_sweep(64, 8, 2)
    with pytest.raises(ValueError):
        driver.size_sweep(8, 64, 1)


def test_plan_counts_follow_the_size_convention():
    coll = driver.COLLS["allgather"]
    counts, dropped = driver.plan_counts(coll, [8, 16, 64], "float32", 3)
    assert dropped == [8]              # 2 elements cannot be split over 3 ranks
    assert counts == [3, 15]           # rounded down to a multiple of the ranks
    assert coll.counts(15, 3) == (5, 15)                                  # size = output
    assert driver.COLLS["reduce_scatter"].counts(15, 3) == (15, 5)        # size = input
    assert driver.COLLS["allreduce"].counts(7, 3) == (7, 7)


def test_busbw_factors():
    f = {name: c.busbw_factor for name, c in driver.COLLS.items()}
    assert f["allreduce"](4) == pytest.approx(1.5)
    assert f["allgather"](4) == f["reduce_scatter"](4) == pytest.approx(0.75)
    assert f["broadcast"](4) == f["pingpong"](2) == 1.0
    assert f["allreduce"](1) == 0.0
    assert f["alltoall"](4) == pytest.approx(0.75)     # nccl-tests' PERFORMANCE.md
    assert f["reduce"](4) == f["sendrecv"](4) == 1.0


def test_resolve_impls():
    assert impls.resolve("mpi") == [("mpi", "mpi"), ("mpi", "mpi-oop")]
    assert impls.resolve("mpi-oop,gloo,mpi-oop") == [("mpi", "mpi-oop"), ("gloo", "gloo")]
    assert [v for _, v in impls.resolve("mlfabric")] == ["mlfabric", "mlfabric-oop",
                                                          "mlfabric-shared"]
    assert impls.resolve("hvd,gloo") == [("hvd", "hvd"), ("gloo", "gloo")]
    with pytest.raises(ValueError, match="unknown implementation 'nccl'.*known: mlfabric"):
        impls.resolve("mpi,nccl")
    # GPU buffers: mlfabric's NCCL path and torch.distributed's NCCL backend, nothing else
    assert impls.resolve("mlfabric,torch-nccl", "cuda") == [
        ("mlfabric", "mlfabric"), ("mlfabric", "mlfabric-oop"), ("torch-nccl", "torch-nccl")]
    with pytest.raises(ValueError, match="'torch-nccl' for --device cpu .it runs with --device "
                                         "cuda"):
        impls.resolve("torch-nccl")
    with pytest.raises(ValueError, match="'mpi' for --device cuda .it runs with --device cpu"):
        impls.resolve("mpi", "cuda")
    with pytest.raises(ValueError, match="'mlfabric-shared' for --device cuda"):
        impls.resolve("mlfabric-shared", "cuda")


def params(coll, n, rank, count, dtype="float32", op="sum", root=0):
    c = driver.COLLS[coll]
    send, recv = c.counts(count, n)
    return driver.Params(coll, dtype, op if c.reduces else None, root if c.rooted else -1,
                         n, rank, count, send, recv)


def correct_output(coll, p):
    """What a correct implementation leaves in this rank's output, in a numpy/torch buffer."""
    out = impls.alloc(p.recv_count, p.dtype)
    impls.write(out, 0, driver.COLLS[coll].expected(p, 0, p.recv_count))
    return out


DTYPES = [d for d in driver.DTYPES if d != "bfloat16" or have("torch")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("coll", list(driver.COLLS))
def test_check_accepts_correct_and_counts_wrong(coll, dtype):
    c = driver.COLLS[coll]
    ops = ["sum", "prod", "min", "max"] + (["avg"] if dtype in driver.EPS else [])
    for op in ops if c.reduces else [None]:
        for n in (2, 3, 5):
            # rank 1 is checked: the root of a reduce, a pingpong partner
            root = 1 if coll == "reduce" else n - 1
            p = params(coll, n, 1, 30 * n, dtype, op or "sum", root=root)
            out = correct_output(coll, p)
            assert driver.check_output(c, p, out) == 0, (coll, dtype, op, n)
            impls.write(out, 3, c.expected(p, 3, 5) + 1)           # two elements off by one
            assert driver.check_output(c, p, out) == 2, (coll, dtype, op, n)
            impls.fill_const(out, driver.SENTINEL)                 # an impl that wrote nothing
            assert driver.check_output(c, p, out) == p.recv_count
    p = params(coll, 2, 0, 8, dtype)
    assert driver.check_output(c, p, None) == p.recv_count      # no output at all
    assert driver.check_output(c, p, impls.alloc(1, dtype)) == p.recv_count  # wrong length


def test_inputs_and_results_are_exact_in_low_precision():
    """Every input and every expected result is an integer the dtype holds exactly."""
    torch = pytest.importorskip("torch")
    for n in (2, 3, 8, 64):
        for op in driver.OPS[:4]:
            p = params("allreduce", n, 0, 4096, "bfloat16", op)
            idx = np.arange(4096)
            vals = [driver.pattern(p, r, idx) for r in range(n)]
            vals.append(driver.reduce_over_ranks(p, idx))
            for v in vals:
                for dt in (torch.bfloat16, torch.float16):
                    t = torch.from_numpy(np.asarray(v, dtype=np.float64)).to(dt)
                    assert np.array_equal(t.to(torch.float64).numpy(), v), (n, op)


def test_patterns_differ_between_ranks_and_elements():
    p = params("allgather", 4, 0, 4096)
    idx = np.arange(1024)
    rows = [driver.pattern(p, r, idx) for r in range(4)]
    assert all(not np.array_equal(rows[i], rows[j]) for i in range(4) for j in range(i))
    assert not np.array_equal(rows[0][:-61], rows[0][61:])      # no short period
    pp = params("allreduce", 3, 0, 64, op="prod")
    prod = driver.reduce_over_ranks(pp, np.arange(4096))
    assert set(np.unique(prod)) <= {-2.0, -1.0, 1.0, 2.0} and (prod != 1).any()


def test_avg_tolerance():
    want = np.array([1 / 3, 2.5, 100.0])
    assert driver.count_wrong(want * (1 + 2 ** -24), want, "float32", "avg") == 0
    assert driver.count_wrong(want * 1.001, want, "float32", "avg") == 3
    assert driver.count_wrong(np.array([np.nan, 2.5, 100]), want, "float32", "avg") == 1


def test_report_row_and_summary():
    rec = {"bytes": 1024, "count": 256, "dtype": "float32", "op": "sum", "root": -1,
           "impl": "mpi", "time_us": 10.0, "algbw": 0.1024, "busbw": 0.1024, "wrong": 0}
    row = report.table_row(rec)
    assert "1024" in row and "mpi" in row and "10.00" in row
    fast = dict(rec, impl="mlfabric", time_us=5.0)
    text = report.summary([rec, fast], ["mpi", "mlfabric"], "mpi")
    assert "2.00" in text
    assert report.human_size(1 << 20) == "1 MiB" and report.human_size(1536) == "1.5 KiB"


def test_table_pairs_out_of_place_with_in_place():
    base = {"bytes": 64, "count": 16, "dtype": "float32", "op": "sum", "root": -1,
            "algbw": 1.0, "busbw": 1.5, "wrong": 0}
    recs = [dict(base, impl="mpi", in_place=True, time_us=2.0),
            dict(base, impl="mpi-oop", in_place=False, time_us=3.0),
            dict(base, impl="gloo", in_place=True, time_us=9.0)]
    assert [(n, o and o["impl"], i and i["impl"]) for n, o, i in report.pairs(recs)] == [
        ("mpi", "mpi-oop", "mpi"), ("gloo", None, "gloo")]
    mpi, gloo = report.table_rows(recs).splitlines()
    assert mpi.split()[5:] == ["mpi", "-", "3.00", "1.000", "1.500", "0", "2.00", "1.000",
                               "1.500", "0"]
    assert gloo.split()[7:11] == ["n/a"] * 4 and gloo.split()[11] == "9.00"
    # the backend column: what mlfabric's algorithm resolved to, per form where they differ
    mlf = [dict(base, impl="mlfabric", in_place=True, time_us=2.0, backend="tree"),
           dict(base, impl="mlfabric-oop", in_place=False, time_us=3.0, backend="tree")]
    assert report.table_rows(mlf).split()[5:7] == ["mlfabric", "tree"]
    mlf[0]["backend"] = "shm"
    assert report.table_rows(mlf).split()[5:7] == ["mlfabric", "tree/shm"]
    assert "backend" in report.table_header("allreduce")
    assert "out-of-place" in report.table_header("allreduce")
    assert "in-place" in report.table_header("allreduce")
    driver.add_in_place(recs)
    assert recs[1]["inplace_time_us"] == 2.0 and recs[1]["inplace_impl"] == "mpi"
    assert "inplace_time_us" not in recs[0] and "inplace_time_us" not in recs[2]


def test_kernels_subcommand_is_routed(monkeypatch):
    import mlfabric.bench
    from mlfabric.bench import __main__ as entry
    seen = []
    fake = types.ModuleType("mlfabric.bench.kernels")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "mlfabric.bench.kernels", fake)
    monkeypatch.setattr(mlfabric.bench, "kernels", fake, raising=False)
    assert entry.main(["kernels", "--sizes", "1K"]) == 0
    assert seen == [["--sizes", "1K"]]


# --- under mpirun --------------------------------------------------------------------------------

def mpirun():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def bench(n, *args, tmp_path=None, timeout=TIMEOUT, env=None):
    """Run `mpirun -n n python -m mlfabric.bench args...` (with the extra environment `env`):
    (returncode, output, records)."""
    exe = mpirun()
    if exe is None:
        pytest.skip("mpirun not found next to python or on PATH")
    args = list(args)
    path = None
    if tmp_path is not None:
        path = os.path.join(str(tmp_path), "bench.json")
        args += ["--json", path]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", OMPI_MCA_btl="self," + shared_memory_btl(),
               MLFABRIC_TIMEOUT="30", **(env or {}))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [exe, "--oversubscribe", "-n", str(n), sys.executable, "-m", "mlfabric.bench", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    records = None
    if path and os.path.exists(path):
        with open(path) as f:
            records = json.load(f)
    return proc.returncode, proc.stdout, records


QUICK = ("--iters", "3", "--warmup", "1", "--quiet")
FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
          "pingpong": lambda n: 1.0, "alltoall": lambda n: (n - 1) / n, "reduce": lambda n: 1.0,
          "sendrecv": lambda n: 1.0}
ITEM = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}


def check_records(records, coll, n, impl_names, dtype="float32"):
    assert records, "no JSON records"
    assert {r["impl"] for r in records} == set(impl_names)
    for r in records:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert (r["coll"], r["ranks"], r["dtype"]) == (coll, n, dtype)
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e3), rel=1e-9)
        assert r["busbw"] == pytest.approx(r["algbw"] * FACTOR[coll](n), rel=1e-12)
        assert r["bytes"] == r["count"] * ITEM[dtype]
        assert r["device"] == "cpu"
        # the algorithm as asked and what it resolved to: both, or neither (no choice)
        assert (r["algorithm"] is None) == (r["backend"] is None), r
        assert r["backend"] is None or r["backend"] in BACKENDS, r
        assert (r["algorithm"] is not None) == (r["impl"].startswith("mlfabric")
                                                and coll == "allreduce"), r
        if coll == "allgather":     # the size is the gathered output
            assert r["recv_count"] == r["count"] == r["send_count"] * n
        if coll == "reduce_scatter":  # the size is the input
            assert r["send_count"] == r["count"] == r["recv_count"] * n


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_allreduce_mpi(n, tmp_path):
    rc, out, recs = bench(n, "allreduce", "-b", "8", "-e", "64K", "-f", "4", "--impl", "mpi",
                          *QUICK, tmp_path=tmp_path)
    assert rc == 0, out
    check_records(recs, "allreduce", n, ["mpi", "mpi-oop"])
    assert sorted({r["bytes"] for r in recs}) == [8 * 4 ** k for k in range(7)]
    by = {(r["impl"], r["bytes"]): r for r in recs}
    for r in recs:          # the table's in-place group, kept in the out-of-place record too
        assert r["in_place"] == (r["impl"] == "mpi")
        if r["impl"] == "mpi-oop":
            ip = by["mpi", r["bytes"]]
            assert (r["inplace_time_us"], r["inplace_wrong"]) == (ip["time_us"], ip["wrong"])
    assert "out-of-place" in out and "in-place" in out
    assert "#wrong" in out and "busbw relative to mpi" in out
    assert "Out of bounds values : 0 OK" in out


@pytest.mark.mpi
@pytest.mark.parametrize("coll,n,dtype,op", [
    ("broadcast", 3, "float16", "sum"),
    ("allgather", 3, "int64", "sum"),
    ("reduce_scatter", 3, "float64", "max"),
    ("reduce_scatter", 2, "float32", "avg"),
    ("pingpong", 2, "int32", "sum"),
])
def test_collectives_mpi(coll, n, dtype, op, tmp_path):
    rc, out, recs = bench(n, coll, "-b", "8", "-e", "64K", "-f", "8", "--impl", "mpi",
                          "--dtype", dtype, "--op", op, *QUICK, tmp_path=tmp_path)
    assert rc == 0, out
    two = coll in ("allgather", "reduce_scatter")
    check_records(recs, coll, n, ["mpi", "mpi-oop"] if two else ["mpi"], dtype)


@pytest.mark.mpi
def test_pingpong_with_idle_ranks(tmp_path):
    rc, out, recs = bench(3, "pingpong", "-b", "8", "-e", "4K", "-f", "8", "--impl", "mpi",
                          *QUICK, tmp_path=tmp_path)
    assert rc == 0, out
    check_records(recs, "pingpong", 3, ["mpi"])


@pytest.mark.mpi
@pytest.mark.skipif(not have("torch"), reason="gloo needs torch")
def test_gloo_against_mpi(tmp_path):
    rc, out, recs = bench(2, "allreduce", "-b", "8", "-e", "16K", "-f", "8", "--impl", "mpi,gloo",
                          "--dtype", "bfloat16", *QUICK, tmp_path=tmp_path)
    assert rc == 0, out
    assert "mpi skipped for allreduce/bfloat16" in out      # MPI has no bfloat16 sum
    check_records(recs, "allreduce", 2, ["gloo"], "bfloat16")


def mlfabric_importable():
    try:
        import mlfabric
        return hasattr(mlfabric, "allreduce") and hasattr(mlfabric, "shared_empty")
    except Exception:
        return False


@pytest.mark.mpi
@pytest.mark.skipif(not mlfabric_importable(), reason="mlfabric's API is not there yet")
@pytest.mark.parametrize("coll", list(driver.COLLS))
def test_mlfabric(coll, tmp_path):
    rc, out, recs = bench(3, coll, "-b", "8", "-e", "64K", "-f", "8", "--impl", "mlfabric,mpi",
                          *QUICK, tmp_path=tmp_path)
    assert rc == 0, out
    names = {"allreduce": ["mlfabric", "mlfabric-oop", "mlfabric-shared", "mpi", "mpi-oop"],
             "broadcast": ["mlfabric", "mlfabric-shared", "mpi"],
             "pingpong": ["mlfabric", "mlfabric-shared", "mpi"],
             "sendrecv": ["mlfabric", "mlfabric-shared", "mpi"]}
    check_records(recs, coll, 3, names.get(coll, ["mlfabric", "mlfabric-shared", "mpi",
                                                  "mpi-oop"]))


@pytest.mark.mpi
@pytest.mark.skipif(not have("torch"), reason="hvd needs torch")
@pytest.mark.parametrize("coll, dtype, op", [("allreduce", "float64", "avg"),
                                             ("allreduce", "int32", "max"),
                                             ("broadcast", "bfloat16", "sum"),
                                             ("allgather", "float16", "sum"),
                                             ("reduce_scatter", "float32", "sum")])
def test_hvd(coll, dtype, op, tmp_path):
    # mlfabric.torch's Horovod API beside MPI, every result checked by the driver
    rc, out, recs = bench(3, coll, "-b", "8", "-e", "16K", "-f", "8", "--impl", "hvd,mpi-oop",
                          "--dtype", dtype, "--op", op, *QUICK, tmp_path=tmp_path)
    assert rc == 0, out
    check_records([r for r in recs if r["impl"] == "hvd"], coll, 3, ["hvd"], dtype)


@pytest.mark.mpi
@pytest.mark.skipif(not have("torch"), reason="hvd needs torch")
def test_hvd_skips_what_horovod_lacks(tmp_path):
    rc, out, recs = bench(2, "reduce_scatter", "-b", "8", "-e", "64", "-f", "8", "--impl",
                          "hvd,mpi-oop", "--op", "max", *QUICK, tmp_path=tmp_path)
    assert rc == 0, out
    assert "hvd.reducescatter reduces with Sum or Average only" in out
    assert {r["impl"] for r in recs} == {"mpi-oop"}


@pytest.mark.mpi
def test_wrong_results_fail_the_run(tmp_path):
    rc, out, recs = bench(2, "allgather", "-b", "64", "-e", "256", "-f", "2", "--impl", "mpi-oop",
                          "--inject-error", *QUICK, tmp_path=tmp_path)
    assert rc != 0, out
    assert recs and all(r["wrong"] == 1 for r in recs)
    assert "FAILED" in out


@pytest.mark.mpi
def test_unknown_impl_is_an_error_on_every_rank():
    rc, out, _ = bench(2, "allreduce", "--impl", "mpi,nccl", timeout=60)
    assert rc == 2, out
    assert "unknown implementation 'nccl'" in out
    assert out.count("unknown implementation") == 1    # said once (rank 0), not per rank


@pytest.mark.mpi
@pytest.mark.skipif(not have("matplotlib"), reason="matplotlib is not installed")
def test_plot(tmp_path):
    png = os.path.join(str(tmp_path), "bw.png")
    rc, out, _ = bench(2, "broadcast", "-b", "8", "-e", "1K", "-f", "8", "--impl", "mpi",
                       "--plot", png, *QUICK)
    assert rc == 0, out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# --- the command line: bad arguments are usage errors, before any work --------------------------

UNWRITABLE = "/nonexistent-mlfabric-dir/out.json"


def run_cli(*args, timeout=60):
    """`python *args` (one process, no mpirun): (returncode, stdout + stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def assert_usage_error(rc, out, *needles):
    assert rc == 2, out
    assert "Traceback" not in out, out
    assert "usage:" in out or "error:" in out, out
    for needle in needles:
        assert needle in out, out


def test_output_path_checks_without_creating(tmp_path):
    from mlfabric.bench import script
    fresh = tmp_path / "new.json"
    assert script.output_path(str(fresh)) == str(fresh) and not fresh.exists()
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    assert script.output_path(str(existing)) == str(existing)
    assert existing.read_text() == "kept"
    for bad, why in ((UNWRITABLE, "does not exist"), (str(tmp_path), "is a directory"),
                     (str(existing / "x.json"), "does not exist"), ("", "empty")):
        with pytest.raises(Exception, match=why):
            script.output_path(bad)


def test_byte_sizes_and_counts_as_argparse_types():
    import argparse
    from mlfabric.bench import script
    assert script.byte_size("64K") == 65536 and script.byte_size("1.5KiB") == 1536
    assert script.byte_size("16B") == 16 and script.byte_size("1g") == 1 << 30
    for bad in ("-1", "0", "", "x", "1.3", "2T", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            script.byte_size(bad)
    assert script.positive_int("3") == 3 and script.nonnegative_int("0") == 0
    for fn, bad in ((script.positive_int, "0"), (script.positive_int, "x"),
                    (script.nonnegative_int, "-1")):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(bad)


@pytest.mark.parametrize("args", [("--size", "-1"), ("--sizes", "0"), ("--sizes", "abc"),
                                  ("--sizes", "1M,-4K"), ("--sizes", ","), ("--repeats", "0"),
                                  ("--warmup", "-1"), ("--json", UNWRITABLE)],
                         ids=lambda a: " ".join(a))
def test_kernels_bad_arguments_are_usage_errors(args):
    rc, out = run_cli("-m", "mlfabric.bench", "kernels", *args)
    assert_usage_error(rc, out, "argument --")


@pytest.mark.parametrize("command", ["sched", "sched-oracle"])
def test_single_process_benchmarks_refuse_an_unwritable_json_at_once(command):
    rc, out = run_cli("-m", "mlfabric.bench", command, "--json", UNWRITABLE)
    assert_usage_error(rc, out, "cannot write", "does not exist")


@pytest.mark.mpi
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_is_a_usage_error_before_the_run(option):
    rc, out, _ = bench(2, "allreduce", "-b", "8", "-e", "64K", "--impl", "mpi", *QUICK,
                       option, UNWRITABLE, timeout=60)
    assert_usage_error(rc, out, "cannot write", "does not exist")
    assert out.count("cannot write") == 1       # said once (rank 0), not per rank
    assert "# mlfabric.bench allreduce" not in out  # nothing ran


@pytest.mark.mpi
@pytest.mark.parametrize("size", ["-1", "0", "12Q"])
def test_bad_sizes_are_usage_errors_on_every_rank(size):
    rc, out, _ = bench(2, "allreduce", "-b", size, "--impl", "mpi", *QUICK, timeout=60)
    assert rc == 2 and "Traceback" not in out and "bad size" in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("script,args", [
    ("torch_grouped.py", ["--count", "2", "--small", "256", "--iters", "1", "--rounds", "1"]),
    ("pipeline.py", ["bubbles", "--m", "4", "--repeats", "1"]),
    ("ps_modes.py", ["sync"]),
])
def test_benchmark_scripts_refuse_an_unwritable_out_before_the_run(script, args):
    if script == "torch_grouped.py":
        pytest.importorskip("torch")
    exe = mpirun()
    if exe is None:
        pytest.skip("mpirun not found next to python or on PATH")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", OMPI_MCA_btl="self," + shared_memory_btl(),
               MLFABRIC_TIMEOUT="30")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [exe, "--oversubscribe", "-n", "2", sys.executable, f"benchmarks/{script}", *args,
           "--out", UNWRITABLE]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=90)
    assert_usage_error(proc.returncode, proc.stdout, "cannot write", "does not exist")
    assert proc.stdout.count("cannot write") == 1, proc.stdout


# --- nccl-tests' spellings -----------------------------------------------------------------------

def case_keys(records):
    return [(r["impl"], r["bytes"], r["count"], r["dtype"], r["op"], r["wrong"]) for r in records]


@pytest.mark.mpi
def test_nccl_tests_spellings_match_the_long_forms(tmp_path):
    short = tmp_path / "short"
    long_ = tmp_path / "long"
    short.mkdir()
    long_.mkdir()
    rc, out_s, recs_s = bench(2, "allreduce", "-b", "8", "-e", "1K", "-f", "4", "-n", "2", "-w",
                              "1", "-d", "half", "-o", "max", "-c", "1", "-a", "3", "-T", "30",
                              "-J", str(short / "bench.json"), "--impl", "mpi", "--quiet")
    assert rc == 0, out_s
    with open(short / "bench.json") as f:
        recs_s = json.load(f)
    rc, out_l, recs_l = bench(2, "allreduce", "--minbytes", "8", "--maxbytes", "1K",
                              "--stepfactor", "4", "--iters", "2", "--warmup", "1", "--dtype",
                              "float16", "--op", "max", "--impl", "mpi", "--quiet",
                              tmp_path=long_)
    assert rc == 0, out_l
    assert case_keys(recs_s) == case_keys(recs_l)
    assert [set(r) for r in recs_s] == [set(r) for r in recs_l]
    check_records(recs_s, "allreduce", 2, ["mpi", "mpi-oop"], "float16")
    assert len(recs_s) == 2 * 4                                 # 8, 32, 128, 512 B x 2 impls

    def rows(out):
        return [ln.split()[:5] for ln in out.splitlines() if " float16 " in ln]
    assert rows(out_s) == rows(out_l) and len(rows(out_s)) == len(recs_s) // 2  # mpi | mpi-oop


@pytest.mark.mpi
def test_additive_sweep_average_modes_and_no_check(tmp_path):
    rc, out, recs = bench(2, "allgather", "-b", "64", "-e", "256", "-i", "64", "-n", "2", "-w",
                          "1", "-a", "0", "-c", "0", "--impl", "mpi-oop", "--quiet",
                          tmp_path=tmp_path)
    assert rc == 0, out
    assert [r["bytes"] for r in recs] == [64, 128, 192, 256]
    assert all(r["wrong"] is None and r["checked"] is False and r["average"] == 0 for r in recs)
    assert "N/A" in out
    for mode in ("1", "2"):
        rc, out, recs = bench(2, "allreduce", "-b", "8", "-e", "64", "-n", "2", "-w", "1", "-a",
                              mode, "--impl", "mpi", "--quiet", tmp_path=tmp_path)
        assert rc == 0, out
        assert all(r["wrong"] == 0 and r["average"] == int(mode) for r in recs)


@pytest.mark.mpi
def test_all_dtypes_and_ops(tmp_path):
    rc, out, recs = bench(3, "allreduce", "-b", "8", "-e", "1K", "-f", "8", "-n", "2", "-w", "1",
                          "-d", "all", "-o", "all", "--impl", "mlfabric,mpi-oop", "--quiet",
                          tmp_path=tmp_path)
    assert rc == 0, out
    seen = {(r["dtype"], r["op"]) for r in recs}
    dtypes = [d for d in driver.DTYPES if d != "bfloat16" or have("torch")]
    want = {(d, o) for d in dtypes for o in driver.OPS if o != "avg" or d in driver.EPS}
    assert seen == want
    assert all(r["wrong"] == 0 for r in recs)
    assert "Out of bounds values : 0 OK" in out


@pytest.mark.mpi
@pytest.mark.parametrize("args, needle", [
    (("-d", "int8"), "'int8' is not a dtype"),
    (("-a", "7"), "invalid choice: 7"),
    (("-c", "2"), "invalid choice: 2"),
    (("-g", "2"), "one GPU per rank"),
    (("-g", "0", "--device", "cuda"), "-g 0 contradicts --device cuda"),
    (("-g", "1", "--device", "cpu"), "-g 1 contradicts --device cpu"),
    (("--algorithm", "nccl"), "--algorithm nccl moves GPU buffers: add --device cuda"),
    (("--device", "cuda"), "unknown implementation 'mpi' for --device cuda"),
], ids=lambda a: " ".join(a) if isinstance(a, tuple) else "")
def test_bad_nccl_tests_values_are_usage_errors(args, needle):
    rc, out, _ = bench(2, "allreduce", "--impl", "mpi", *QUICK, *args, timeout=60)
    assert_usage_error(rc, out, needle)
    assert out.count(needle) == 1       # said once (rank 0), not per rank


# --- the resolved backend ------------------------------------------------------------------------

def logged_paths(out, rank=0):
    """{(size as the logger writes it, ranks): backend} of rank `rank`'s mlfabric path log lines
    ("[mlfabric rank 0] INFO comm: allreduce 8 B float32 on 3 ranks -> tree")."""
    seen = {}
    for ln in out.splitlines():
        head, sep, tail = ln.partition(f"[mlfabric rank {rank}] INFO comm: allreduce ")
        if sep and " float32 on " in tail and " -> " in tail:
            size, rest = tail.split(" float32 on ", 1)
            ranks, backend = rest.split(" ranks -> ", 1)
            seen[size, int(ranks)] = backend.split()[0]
    return seen


@pytest.mark.mpi
@pytest.mark.skipif(not mlfabric_importable(), reason="mlfabric's API is not there yet")
def test_records_name_the_backend_auto_resolves_to_as_the_log_does(tmp_path):
    """Without the shared-memory engine, auto picks an MPI algorithm by size (at 3 ranks: the
    tree for a small call, the ring for a large one): each record keeps the algorithm asked for
    and names the backend the mlfabric logger reports for its size; MPI's records name none."""
    from mlfabric._core.log import human
    rc, out, recs = bench(3, "allreduce", "-b", "8", "-e", "64K", "-f", "8192",
                          "--impl", "mlfabric,mpi", *QUICK, tmp_path=tmp_path,
                          env={"MLFABRIC_SHM": "0", "MLFABRIC_LOG_LEVEL": "info"})
    assert rc == 0, out
    check_records(recs, "allreduce", 3, ["mlfabric", "mlfabric-oop", "mlfabric-shared", "mpi",
                                         "mpi-oop"])
    logged = logged_paths(out)
    backends = {}
    for r in recs:
        if r["family"] != "mlfabric":
            assert r["backend"] is None and r["algorithm"] is None, r
            continue
        assert r["algorithm"] == "auto", r
        assert r["backend"] == logged[human(r["bytes"]), 3], (r, logged)
        backends.setdefault(r["bytes"], set()).add(r["backend"])
    assert backends == {8: {"tree"}, 65536: {"ring"}}, backends
    rows = {ln.split()[0]: ln.split()[6] for ln in out.splitlines()
            if " mlfabric " in ln and not ln.startswith("#")}
    assert rows == {"8": "tree", "65536": "ring"}, out     # the table's backend column


@pytest.mark.mpi
@pytest.mark.skipif(not mlfabric_importable(), reason="mlfabric's API is not there yet")
def test_records_name_an_asked_for_algorithm_as_their_backend(tmp_path):
    rc, out, recs = bench(2, "allreduce", "-b", "8", "-e", "64K", "-f", "8192", "--algorithm",
                          "ring", "--impl", "mlfabric", *QUICK, tmp_path=tmp_path)
    assert rc == 0, out
    assert recs and all((r["algorithm"], r["backend"]) == ("ring", "ring") for r in recs), recs


# --- GPU buffers (--device cuda, -g 1) -----------------------------------------------------------

def have_cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def test_gpu_mode_pieces():
    """The GPU mode's command line and families, in-process (no GPU needed)."""
    args = driver.build_parser().parse_args(["allreduce", "-g", "1"])
    assert driver.resolve_device(args) == "cuda"
    assert (args.impl, args.baseline) == ("mlfabric,torch-nccl", "torch-nccl")
    args = driver.build_parser().parse_args(["allreduce"])
    assert driver.resolve_device(args) == "cpu"
    assert (args.impl, args.baseline) == ("mlfabric,mpi,gloo", "mpi")
    fams = impls.families("cuda")
    assert fams["mlfabric"].variants == ("mlfabric", "mlfabric-oop")
    gpu = fams["mlfabric"]()
    assert "host arrays only" in gpu.missing("pingpong") and gpu.missing("allreduce") is None
    assert all(fams["torch-nccl"]().missing(c) is None
               for c in ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall",
                         "reduce", "pingpong"))
    if not have_cuda():
        assert impls.cuda_problem()


@pytest.mark.mpi
@pytest.mark.skipif(have_cuda(), reason="this host has a GPU")
@pytest.mark.parametrize("n,args", [(1, ("--device", "cuda")), (3, ("--device", "cuda")),
                                    (2, ("-g", "1")), (2, ("-g", "1", "--impl", "torch-nccl"))],
                         ids=lambda a: " ".join(a) if isinstance(a, tuple) else str(a))
def test_gpu_mode_without_a_gpu_is_an_error_on_every_rank(n, args):
    rc, out, _ = bench(n, "allreduce", *QUICK, *args, timeout=60)
    assert_usage_error(rc, out, "no CUDA device: ")
    assert out.count("no CUDA device") == 1, out    # said once (rank 0), every rank exits 2
    assert ("every rank" if n > 1 else "rank 0") in out
    assert "# mlfabric.bench allreduce" not in out  # nothing ran


@pytest.mark.mpi
@pytest.mark.skipif(have_cuda(), reason="this host has a GPU")
def test_gpu_collectives_script_without_a_gpu_is_an_error_on_every_rank():
    exe = mpirun()
    if exe is None:
        pytest.skip("mpirun not found next to python or on PATH")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl="self," + shared_memory_btl(), MLFABRIC_TIMEOUT="30")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([exe, "--oversubscribe", "-n", "2", sys.executable,
                           "benchmarks/gpu_collectives.py", "--max-bytes", "64K", "--iters", "2",
                           "--rounds", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=90)
    assert_usage_error(proc.returncode, proc.stdout, "no CUDA device: ")
    assert proc.stdout.count("no CUDA device") == 1, proc.stdout


def test_gpu_collectives_script_is_the_driver_in_gpu_mode():
    """benchmarks/gpu_collectives.py's options map onto the driver's GPU mode, and its rows are
    the medians over rounds of the driver's records."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "gpu_collectives", os.path.join(ROOT, "benchmarks", "gpu_collectives.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from mlfabric.bench import harness
    args = harness.parse(mod.ENTRY, ["--max-bytes", "64K", "--iters", "2", "--rounds", "3"])
    dargs = mod.driver_args(args, "allgather")
    assert (dargs.coll, dargs.device, dargs.iters, dargs.impl) == (
        "allgather", "cuda", 2, "mlfabric,torch-nccl")
    assert driver.validate(dargs, 2)[0] == [1024, 4096, 16384, 65536]
    rec = {"coll": "allreduce", "bytes": 1000, "busbw_factor": 1.0, "wrong": 0}
    recs = [dict(rec, impl=impl, time_us=t) for impl, ts in
            (("mlfabric", (1.0, 3.0, 2.0)), ("torch-nccl", (4.0, 4.0, 5.0))) for t in ts]
    (row,) = mod.rows_of(recs, 2)
    assert row["mlfabric"]["us"] == 2.0 and row["torch-nccl"]["us"] == 4.0
    assert row["torch_over_mlfabric"] == 2.0 and row["wrong"] == {"mlfabric": 0, "torch-nccl": 0}
    assert row["mlfabric"]["busbw_GBs"] == pytest.approx(1000 / 2e-6 / 1e9)


# --- alltoall, reduce, sendrecv ------------------------------------------------------------------

def test_new_collectives_expected_results():
    """alltoall's block j is rank j's block `rank`; reduce is checked on the root only; sendrecv
    receives the previous rank's input."""
    n, count = 3, 6
    p = params("alltoall", n, 1, count)
    ins = [driver.pattern(p, r, np.arange(count)) for r in range(n)]
    want = np.concatenate([ins[j][2:4] for j in range(n)])
    assert np.array_equal(driver.COLLS["alltoall"].expected(p, 0, count), want)
    p = params("sendrecv", n, 0, count)
    assert np.array_equal(driver.COLLS["sendrecv"].expected(p, 0, count), ins[2])
    c = driver.COLLS["reduce"]
    assert driver.check_output(c, params("reduce", n, 1, count, root=0), None) == 0
    assert driver.check_output(c, params("reduce", n, 0, count, root=0), None) == count


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("coll", ["alltoall", "reduce", "sendrecv"])
def test_new_collectives(coll, n, tmp_path):
    extra = ("-o", "avg", "-r", str(n - 1)) if coll == "reduce" else ()
    rc, out, recs = bench(n, coll, "-b", "8", "-e", "1K", "-f", "4", "-n", "2", "-w", "1",
                          "--impl", "mlfabric,mpi", "--quiet", *extra, tmp_path=tmp_path)
    assert rc == 0, out
    names = ["mlfabric", "mlfabric-shared", "mpi"] + (["mpi-oop"] if coll != "sendrecv" else [])
    check_records(recs, coll, n, names)
    assert "Out of bounds values : 0 OK" in out


@pytest.mark.mpi
def test_new_collectives_catch_wrong_results(tmp_path):
    rc, out, recs = bench(2, "alltoall", "-b", "64", "-e", "64", "--impl", "mpi-oop",
                          "--inject-error", *QUICK, tmp_path=tmp_path)
    assert rc != 0 and recs and all(r["wrong"] == 1 for r in recs), out
