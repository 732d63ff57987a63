"""Single-process benchmark of the CPU kernels: for each instruction set and dtype, copy (ours and
numpy.copyto) against reduce with k=2 (dst = src0 + src1) and k=4, in GB/s counting bytes read
plus written, and reduce as a percentage of our copy (the memory-bandwidth ceiling). Best-of-N
timing after warm-ups.

    python -m mlfabric.bench.kernels [--sizes 1M,16M,64M] [--isa all] [--dtypes all]
                                     [--repeats 20] [--json FILE]

Sizes are bytes per buffer (K/M/G = 2**10/2**20/2**30), so every dtype moves the same bytes.
"""
import argparse
import json
import platform
import sys
import time

import numpy as np

from .. import _C
from .._core import dtypes as _dtypes
from .. import kernels as K
from .harness import cpu_model
from .script import byte_size, nonnegative_int, output_path, positive_int

COLUMNS = ("isa", "dtype", "size", "copy", "np.copyto", "reduce k=2", "% copy", "reduce k=4",
           "% copy ")


def parse_sizes(text):
    """argparse type: comma-separated sizes (at least one)."""
    sizes = [byte_size(s) for s in text.split(",") if s.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"no size in {text!r}")
    return sizes


def fmt_size(n):
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def best_time(fn, repeats, warmup):
    """Shortest of `repeats` timed calls (at least 50 ms of calls for tiny sizes), after warm-ups.
    The minimum filters out interference from other processes on a shared machine."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(repeats, min(10 * repeats, int(0.05 / once)))
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def make_buffers(code, nbytes, count):
    dt = _dtypes.storage_dtype(code)
    n = nbytes // dt.itemsize
    fill = 0x3F80 if code == _dtypes.DTYPE_CODES["bfloat16"] else 1  # 1.0 in bfloat16
    return [np.full(n, fill, dtype=dt) for _ in range(count)], n


def bench_one(code, nbytes, repeats, warmup):
    bufs, n = make_buffers(code, nbytes, 5)
    dst, srcs = bufs[0], bufs[1:]
    nb = dst.nbytes
    ptr = [b.ctypes.data for b in srcs]
    gbps = lambda moved, t: moved / t / 1e9  # noqa: E731
    t_copy = best_time(lambda: _C.copy(dst.ctypes.data, ptr[0], nb), repeats, warmup)
    t_np = best_time(lambda: np.copyto(dst, srcs[0]), repeats, warmup)
    t_r2 = best_time(lambda: _C.reduce(dst.ctypes.data, ptr[:2], n, code, 0), repeats, warmup)
    t_r4 = best_time(lambda: _C.reduce(dst.ctypes.data, ptr[:4], n, code, 0), repeats, warmup)
    copy = gbps(2 * nb, t_copy)
    r2, r4 = gbps(3 * nb, t_r2), gbps(5 * nb, t_r4)
    return {"bytes": nb, "count": n, "copy_gbps": copy, "numpy_copy_gbps": gbps(2 * nb, t_np),
            "reduce2_gbps": r2, "reduce2_pct_copy": 100 * r2 / copy,
            "reduce4_gbps": r4, "reduce4_pct_copy": 100 * r4 / copy}


cpu_name = cpu_model  # the CPU's model name (one reader of /proc/cpuinfo, in harness.py)


def print_table(rows, out=sys.stdout):
    cells = [COLUMNS] + [(r["isa"], r["dtype"], fmt_size(r["bytes"]), f"{r['copy_gbps']:.1f}",
                          f"{r['numpy_copy_gbps']:.1f}", f"{r['reduce2_gbps']:.1f}",
                          f"{r['reduce2_pct_copy']:.0f}%", f"{r['reduce4_gbps']:.1f}",
                          f"{r['reduce4_pct_copy']:.0f}%") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for i, c in enumerate(cells):
        print("  ".join(v.ljust(w) if j < 3 else v.rjust(w)
                        for j, (v, w) in enumerate(zip(c, widths))), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlfabric.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=[1 << 20, 16 << 20, 64 << 20],
                   help="comma-separated bytes per buffer (default 1M,16M,64M)")
    p.add_argument("--isa", default="all", help="all, or a comma-separated list of "
                   f"{', '.join(K.ISAS)} (default all this CPU has)")
    p.add_argument("--dtypes", default="all",
                   help=f"all, or a comma-separated list of {', '.join(_dtypes.DTYPE_NAMES)}")
    p.add_argument("--repeats", type=positive_int, default=20,
                   help="timed calls per measurement")
    p.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed calls first")
    p.add_argument("--json", metavar="FILE", type=output_path,
                   help="also write the results as JSON")
    args = p.parse_args(argv)

    sizes = args.sizes
    supported = K.supported_isas()
    isas = supported if args.isa == "all" else [s.strip() for s in args.isa.split(",")]
    for name in isas:
        if name not in supported:
            p.error(f"instruction set {name!r} is not available here (have {', '.join(supported)})")
    dtypes = (list(_dtypes.DTYPE_NAMES) if args.dtypes == "all"
              else [s.strip() for s in args.dtypes.split(",")])
    for name in dtypes:
        if name not in _dtypes.DTYPE_CODES:
            p.error(f"unknown dtype {name!r}")

    before = K.isa()
    rows = []
    try:
        for name in isas:
            K.set_isa(name)
            for dt in dtypes:
                for size in sizes:
                    r = bench_one(_dtypes.DTYPE_CODES[dt], size, args.repeats, args.warmup)
                    rows.append(dict(isa=name, dtype=dt, **r))
    finally:
        K.set_isa(before)
    print(f"mlfabric kernel benchmark: {cpu_name()}, "
          f"ISAs {', '.join(supported)}; GB/s = bytes read + written / best time")
    print_table(rows)
    if args.json:
        meta = {"machine": platform.machine(), "cpu": cpu_name(),
                "isas": supported, "numpy": np.__version__, "repeats": args.repeats}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
