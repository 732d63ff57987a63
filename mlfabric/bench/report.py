"""Presentation of the benchmark results: the nccl-tests-style table (streamed size by size, an
impl's out-of-place and in-place forms side by side on one row, with the backend mlfabric
resolved its algorithm to), the ratio summary against a baseline impl, the JSON records, the
busbw plot and the host (and GPU) description every record carries. Owns formats only; nothing
here communicates except host_info() and gpu_info()."""
import datetime
import json
import math
import os
import platform
import socket
import sys

CASE_COLUMNS = [  # (header, unit, width, record key, format)
    ("size", "(B)", 12, "bytes", "d"),
    ("count", "(elements)", 12, "count", "d"),
    ("type", "", 8, "dtype", "s"),
    ("redop", "", 6, "op", "s"),
    ("root", "", 4, "root", "d"),
    ("impl", "", -16, "impl", "s"),
    ("backend", "", -7, "backend", "s"),   # what mlfabric's algorithm resolved to ("-": no choice)
]
FORM_COLUMNS = [  # one group for the out-of-place form, one for the in-place form (nccl-tests')
    ("time", "(us)", 10, "time_us", ".2f"),
    ("algbw", "(GB/s)", 8, "algbw", ".3f"),
    ("busbw", "(GB/s)", 8, "busbw", ".3f"),
    ("#wrong", "", 6, "wrong", "d"),
]
COLUMNS = CASE_COLUMNS + FORM_COLUMNS + FORM_COLUMNS
FORM_KEYS = [c[3] for c in FORM_COLUMNS]


REDUCING = ("allreduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")


def human_size(n):
    """8 -> '8 B', 1048576 -> '1 MiB', 1536 -> '1.5 KiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _cells(values):
    out = []
    for (_, _, width, _, _), v in zip(COLUMNS, values):
        out.append(f"{v:<{-width}}" if width < 0 else f"{v:>{width}}")
    return "  ".join(out)


def _group_title(title):
    width = sum(abs(c[2]) + 2 for c in FORM_COLUMNS) - 2
    return f"{title:^{width}}"


def table_header(coll):
    names = _cells([c[0] for c in COLUMNS])
    units = _cells([c[1] for c in COLUMNS])
    lead = sum(abs(c[2]) + 2 for c in CASE_COLUMNS) - 1
    groups = ("#" + " " * lead + _group_title("out-of-place") + "  "
              + _group_title("in-place")).rstrip()
    lines = ["#", groups, "#" + names[1:], ("#" + units[1:]).rstrip()]
    if coll == "pingpong":
        lines.insert(1, "# pingpong: time = one-way latency (half the round trip), "
                        "algbw = busbw = size / time")
    return "\n".join(lines)


def pair_name(impl):
    """The table row a variant belongs to: an `-oop` variant beside its in-place sibling."""
    return impl[:-len("-oop")] if impl.endswith("-oop") else impl


def pairs(records):
    """[(row name, out-of-place record or None, in-place record or None)] in order."""
    rows = {}
    for r in records:
        row = rows.setdefault(pair_name(r["impl"]), [None, None])
        row[1 if r.get("in_place") else 0] = r
    return [(name, oop, ip) for name, (oop, ip) in rows.items()]


def table_row(oop, ip=None, name=None):
    """One line: the case, then the out-of-place and in-place results ("n/a" for a form the
    impl lacks). A single in-place record goes to the in-place group."""
    if ip is None and oop is not None and oop.get("in_place"):
        oop, ip = None, oop
    first = oop or ip
    case = dict(first, impl=name or first["impl"], backend=row_backend(oop, ip))
    cells = [_cell(case.get(key), fmt) for _, _, _, key, fmt in CASE_COLUMNS]
    for rec in (oop, ip):
        cells += [("n/a" if rec is None else _cell(rec.get(key), fmt))
                  for _, _, _, key, fmt in FORM_COLUMNS]
    return _cells(cells)


def row_backend(oop, ip):
    """The backend cell of a row: the forms' resolved backend ("-" where the impl has no
    choice), both as out-of-place/in-place where they differ."""
    names = list(dict.fromkeys((r.get("backend") or "-") for r in (oop, ip) if r is not None))
    return "/".join(names)


def table_rows(records):
    """The lines of one size: a row per impl, its two forms side by side."""
    return "\n".join(table_row(oop, ip, name) for name, oop, ip in pairs(records))


def _cell(value, fmt):
    """A formatted value; N/A for one not measured (#wrong under -c 0)."""
    return "N/A" if value is None else format(value, fmt)


def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summary(records, names, base):
    """Per size, each impl's busbw relative to `base` (for one collective and size the busbw
    factor is common, so this is base time / impl time; > 1 is faster than base)."""
    if not records or base is None:
        return "# no results"
    by = {(_case(r), r["impl"]): r for r in records}
    cases = list(dict.fromkeys(_case(r) for r in records))
    several = len({c[1:] for c in cases}) > 1   # -d all / -o all: name the dtype and op
    others = [n for n in names if n != base]
    if not others:
        return "#\n" + _avg_busbw(records, names)
    lines = ["#", f"# busbw relative to {base} (= {base} time / impl time; > 1: faster than "
                  f"{base})", "#" + _row("size(B)", others)[1:]]
    ratios = {n: [] for n in others}
    for s in cases:
        cells = []
        for n in others:
            b, r = by.get((s, base)), by.get((s, n))
            if b and r and r["time_us"] > 0:
                ratios[n].append(b["time_us"] / r["time_us"])
                cells.append(f"{ratios[n][-1]:.2f}")
            else:
                cells.append("-")
        lines.append(_row(" ".join(map(str, s)) if several else str(s[0]), cells))
    lines.append("#" + _row("geomean", [f"{geomean(ratios[n]):.2f}" for n in others])[1:])
    lines += ["#", _avg_busbw(records, names)]
    return "\n".join(lines)


def _case(rec):
    """(bytes, dtype, op): the summary's rows."""
    return rec["bytes"], rec.get("dtype", ""), rec.get("op", "")


def _avg_busbw(records, names):
    avg = "  ".join(f"{n} {_mean([r['busbw'] for r in records if r['impl'] == n]):.3f}"
                    for n in names)
    return f"# Avg bus bandwidth (GB/s): {avg}"


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _row(first, cells):
    return f"{first:>12}" + "".join(f"  {c:>16}" for c in cells)


def preamble(args, nranks, sizes, variants, host):
    """The '#' lines that open a run: what, where, which impls."""
    libs = "; ".join(x for x in (host.get("mpi_library"), _opt("mlfabric", host),
                                 _opt("torch", host)) if x)
    return "\n".join([
        f"# mlfabric.bench {args.coll}: {nranks} ranks on {host['nodes']} host(s), "
        f"dtype {args.dtype}" + (f", op {args.op}" if args.coll in REDUCING
                                 else "") + (f", root {args.root}" if args.coll in ROOTED
                                             else "")
        + f", iters {args.iters}, warmup {args.warmup}",
        f"# sizes {human_size(sizes[0])} .. {human_size(sizes[-1])} {_step(args)} "
        f"({len(sizes)}); impls {', '.join(v for _, v in variants)}; "
        f"mlfabric allreduce algorithm {args.algorithm} (the backend column: what it resolves "
        f"to)",
        f"# host {host['hostname']} ({host['cpu_count']} cpus); {libs}",
    ] + ([f"# device cuda: {host.get('gpu')}"
          + (", ranks share it over NCCL's socket transport" if host.get("gpus_shared")
             else "") + (f"; NCCL {host['nccl_version']}" if host.get("nccl_version") else "")]
         if getattr(args, "device", "cpu") == "cuda" else []))


def _step(args):
    inc = getattr(args, "stepbytes", None)
    return f"+{human_size(inc)}" if isinstance(inc, int) else f"x{args.stepfactor}"


def _opt(name, host):
    v = host.get(f"{name}_version")
    return f"{name} {v}" if v else None


def write_json(path, records):
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def plot_unavailable():
    """None when matplotlib imports, else the error to print."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib, which is not installed (pip install matplotlib)"
    return None


def plot_title(records):
    if not records:
        return "no results"
    r = records[0]
    op = f" {r['op']}" if r["op"] != "none" else ""
    return (f"{r['coll']} {r['dtype']}{op}, {r['ranks']} ranks, {r.get('hostname', '')}"
            f" ({r.get('timestamp', '')[:16]})")


def plot(path, records, names, title):
    """busbw vs size (log-x) and time vs size (log-log), one line per impl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        rs = sorted((r for r in records if r["impl"] == name), key=lambda r: r["bytes"])
        if not rs:
            continue
        xs = [r["bytes"] for r in rs]
        ax_bw.plot(xs, [r["busbw"] for r in rs], marker="o", ms=3, label=name)
        ax_t.plot(xs, [r["time_us"] for r in rs], marker="o", ms=3, label=name)
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        if records:
            ax.legend()
    ax_t.set_yscale("log")
    ax_bw.set_ylabel("busbw (GB/s)")
    ax_t.set_ylabel("time (us)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _version(module):
    m = sys.modules.get(module)
    return str(getattr(m, "__version__", "")) or None if m is not None else None


def _dist_version(name):
    """An installed distribution's version without importing it, or None."""
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def mlfabric_version():
    return _version("mlfabric") or _dist_version("mlfabric")


def gpu_info(comm, device, shared):
    """What every record of a GPU run carries about the GPUs: rank 0's GPU name, whether ranks
    share GPUs (NCCL's socket transport), torch's NCCL version (collective: a bcast)."""
    import torch
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a torch without NCCL: torch-nccl says so itself
        nccl = None
    info = {"gpu": torch.cuda.get_device_name(device), "gpus_shared": bool(shared),
            "nccl_version": nccl}
    return comm.bcast(info, root=0)


def host_info(comm):
    """What every record carries about where it ran (collective: gathers hostnames)."""
    from mpi4py import MPI
    import mpi4py
    import numpy
    hosts = comm.allgather(socket.gethostname())
    return {
        "hostname": hosts[0],
        "nodes": len(set(hosts)),
        "cpu_count": os.cpu_count(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0].split(", package")[0],
        "mpi4py_version": mpi4py.__version__,
        "numpy_version": numpy.__version__,
        "torch_version": _dist_version("torch"),
        "python_version": platform.python_version(),
        "mlfabric_version": mlfabric_version(),
    }
