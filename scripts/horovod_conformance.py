"""Runs Horovod's own PyTorch test suite (`test/parallel/test_torch.py`, kept unmodified outside the
project) against mlfabric.torch, and writes one record per test and rank count.

`horovod.torch` is an alias of `mlfabric.torch` (a shim package in a temporary directory: nothing is
implemented in it), and each test runs in its own `mpirun --oversubscribe -n N python -m pytest
FILE::TorchTests::NAME` job with a timeout, so one failing test cannot desynchronise the next. A test
passes when it passes on every rank; it is skipped when every rank skips it.

    python scripts/horovod_conformance.py --suite ../shared/conformance/horovod --ranks 2,3 --json FILE

Records: {"test", "ranks", "outcome" (passed / failed / skipped / timeout), "fair", "reason",
"seconds"}; "reason" says why for skips and for tests that are not fair targets (UNFAIR below, also
and UNFAIR_AT, also listed in docs/horovod.md)."""
import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

SUITE_FILE = os.path.join("parallel", "test_torch.py")

_MUON = ("loops over every torch.optim optimizer and meets Muon, which takes 2-D parameters only "
         "(Horovod itself fails it the same way with this torch)")
_GPU = "needs a GPU (skipped on CPU-only machines)"
_GLOO = "runs only under Horovod's Gloo launcher (HOROVOD_RANK set); skipped under mpirun"
# Tests that cannot pass against any library but Horovod, or on this hardware, with the reason.
UNFAIR = {
    "test_optimizer_no_named_parameters": "reads Horovod's private optimizer._parameter_names",
    "test_broadcast_state": _MUON,
    "test_broadcast_state_options": _MUON,
    "test_force_allreduce": _MUON,
    "test_timeline_api": "skipped upstream (pytest.mark.skip, horovod/horovod#2496)",
    "test_horovod_reinit": _GLOO,
    "test_horovod_is_initialized": _GLOO,
    **{name: _GPU for name in (
        "test_gpu_required", "test_horovod_allreduce_multi_gpu",
        "test_horovod_allreduce_cpu_gpu_error", "test_horovod_grouped_allreduce_cpu_gpu_error",
        "test_horovod_alltoall_splits_on_gpu", "test_broadcast_state_gpu", "test_model_parallelism",
        "test_delta_optimizer", "test_horovod_sync_batch_norm")},
}

_F16_SUM = ("compares a float16 sum of 3 ranks' values with its unrounded float32 value (exact for 2 "
            "values only): no float16 result passes on a CPU; Horovod's CPU path fails it alike")
# Tests fair at some rank counts only: {ranks: {test: reason}}.
UNFAIR_AT = {3: {
    "test_horovod_allreduce_prescale": _F16_SUM,
    "test_horovod_reducescatter_prescale": _F16_SUM,
    "test_horovod_grouped_reducescatter_prescale": _F16_SUM,
    "test_horovod_join_allreduce":
        "expects float32 Average as a division, (2t)/3; Horovod's CPU path multiplies by "
        "float(1/3) (its ScaleBuffer), one ulp away on about a third of the values, and mlfabric "
        "does Horovod's arithmetic",
}}


def unfair_reason(name, ranks):
    """Why a test is not a fair target at this rank count, or None."""
    return UNFAIR.get(name) or UNFAIR_AT.get(ranks, {}).get(name)


def suite_tests(suite):
    """Names of the TorchTests test methods, in file order (read, not imported: importing needs MPI)."""
    with open(os.path.join(suite, SUITE_FILE)) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TorchTests":
            return [n.name for n in node.body
                    if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    raise SystemExit(f"{suite}/{SUITE_FILE}: no TorchTests class")


def make_shim(root):
    """A `horovod` package whose `horovod.torch` is mlfabric.torch, and the one runner helper the
    suite's common.py imports (its torch tests never call it)."""
    pkg = os.path.join(root, "horovod")
    os.makedirs(os.path.join(pkg, "torch"))
    os.makedirs(os.path.join(pkg, "runner", "util"))
    for d in ("", "runner", os.path.join("runner", "util")):
        open(os.path.join(pkg, d, "__init__.py"), "w").close()
    with open(os.path.join(pkg, "torch", "__init__.py"), "w") as f:
        f.write("import sys, mlfabric.torch as m\nsys.modules[__name__] = m\n")
    with open(os.path.join(pkg, "runner", "util", "threads.py"), "w") as f:
        f.write("import threading\n\n\ndef in_thread(target, args=(), name=None, daemon=True):\n"
                "    t = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
                "    t.start()\n    return t\n")


def mpirun():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def outcome_of(xml_files):
    """(outcome, reason) from the ranks' JUnit reports: failed if any rank failed or errored,
    skipped if all skipped, passed if all passed."""
    results = []
    for path in xml_files:
        if not os.path.exists(path):
            return "failed", "a rank wrote no report (it crashed or was killed)"
        case = ET.parse(path).getroot().find(".//testcase")
        if case is None:
            return "failed", "test not collected"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            return "failed", (bad.get("message") or "").splitlines()[0][:300] if bad.get("message") else ""
        skip = case.find("skipped")
        results.append(("skipped", skip.get("message", "")) if skip is not None else ("passed", ""))
    if all(r[0] == "skipped" for r in results):
        return "skipped", results[0][1]
    if any(r[0] == "skipped" for r in results):
        return "failed", "skipped on some ranks only"
    return "passed", ""


def run_one(suite, shim, name, ranks, timeout, workdir):
    out = os.path.join(workdir, f"{name}-{ranks}")
    os.makedirs(out, exist_ok=True)
    node = f"{os.path.join(suite, SUITE_FILE)}::TorchTests::{name}"
    pytest = (f"exec {sys.executable} -m pytest -q -p no:cacheprovider -c /dev/null "
              f"--rootdir {workdir} --junitxml {out}/rank-$OMPI_COMM_WORLD_RANK.xml {node}")
    env = dict(os.environ)
    # a test harness (not library code): containers often run as root, which Open MPI refuses
    # without these
    for var in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        env.setdefault(var, "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [shim, os.path.join(suite, "utils")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [mpirun(), "--oversubscribe", "-n", str(ranks), "sh", "-c", pytest]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace")
        return "timeout", f"no result in {timeout} s", time.monotonic() - start, log
    log = proc.stdout.decode(errors="replace")
    outcome, reason = outcome_of([os.path.join(out, f"rank-{r}.xml") for r in range(ranks)])
    return outcome, reason, time.monotonic() - start, log


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", required=True, help="folder holding parallel/test_torch.py and utils/")
    p.add_argument("--ranks", default="2,3", help="comma-separated rank counts (default 2,3)")
    p.add_argument("--json", help="write the records here")
    p.add_argument("-k", dest="only", default="",
                   help="comma-separated test names (default: every test of the suite)")
    p.add_argument("--timeout", type=float, default=180, help="seconds per mpirun job (default 180)")
    p.add_argument("--logs", help="keep each failed job's output in this folder")
    args = p.parse_args(argv)
    suite = os.path.abspath(args.suite)
    if not os.path.exists(os.path.join(suite, SUITE_FILE)):
        p.error(f"{suite}/{SUITE_FILE} does not exist")
    if mpirun() is None:
        p.error("no mpirun beside this Python or on PATH")
    names = suite_tests(suite)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            p.error(f"not in the suite: {', '.join(unknown)}")
        names = [n for n in names if n in wanted]
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks takes comma-separated integers, got {args.ranks!r}")
    if any(r < 1 for r in ranks):
        p.error(f"--ranks must be >= 1, got {args.ranks!r}")
    records = []
    with tempfile.TemporaryDirectory(prefix="hvd-conformance-") as tmp:
        shim = os.path.join(tmp, "shim")
        make_shim(shim)
        for n in ranks:
            for i, name in enumerate(names):
                outcome, reason, seconds, log = run_one(suite, shim, name, n, args.timeout, tmp)
                why = unfair_reason(name, n)
                fair = why is None
                if not fair:
                    reason = why + (f" ({reason})" if reason else "")
                records.append(dict(test=name, ranks=n, outcome=outcome, fair=fair,
                                    reason=reason, seconds=round(seconds, 1)))
                print(f"[{n} ranks {i + 1}/{len(names)}] {name}: {outcome}"
                      + ("" if fair else " (not a fair target)")
                      + (f" -- {reason}" if outcome != "passed" and reason else ""), flush=True)
                if args.logs and outcome in ("failed", "timeout"):
                    os.makedirs(args.logs, exist_ok=True)
                    with open(os.path.join(args.logs, f"{name}-{n}.log"), "w") as f:
                        f.write(log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    for n in ranks:
        mine = [r for r in records if r["ranks"] == n]
        fair = [r for r in mine if r["fair"]]
        count = {o: sum(r["outcome"] == o for r in fair) for o in ("passed", "failed", "skipped", "timeout")}
        print(f"{n} ranks: fair tests {len(fair)}: " + ", ".join(f"{v} {k}" for k, v in count.items())
              + f"; not fair targets {len(mine) - len(fair)}")
    bad = [r for r in records if r["fair"] and r["outcome"] in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
