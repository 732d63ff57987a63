"""GPU reduce kernels (mlfabric._C.cuda_reduce, the k-input sum/min/max used for GPU tensors) in
GB/s (bytes read + written), against a device-to-device copy (torch's copy_: the ceiling) and
torch's own elementwise add (torch.add / torch.sum over stacked inputs), on one GPU.

    python benchmarks/cuda_kernels.py [--mib 256] [--repeats 50] [--out FILE.json]
"""
import platform
import subprocess

import torch

from mlfabric import _C
from mlfabric._core import dtypes as _dtypes
from mlfabric.bench import harness
from mlfabric.bench.script import positive_int

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def timed(fn, repeats):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def options(p):
    p.add_argument("--mib", type=positive_int, default=256, help="MiB per input buffer")
    p.add_argument("--repeats", "--iters", dest="repeats", type=positive_int, default=50,
                   help="timed calls per measurement")
    harness.add_out(p)


def run(comm, a):
    assert _C.cuda_built() and torch.cuda.is_available(), "needs a CUDA build and a GPU"
    rows = []
    print("%-9s %2s %10s %10s %10s %8s" % ("dtype", "k", "copy GB/s", "torch GB/s",
                                          "ours GB/s", "ours/copy"))
    for name, tdt in DTYPES.items():
        n = a.mib * 2**20 // torch.empty(0, dtype=tdt).element_size()
        code = _dtypes.DTYPE_CODES[name]
        src = torch.empty(n, dtype=tdt, device="cuda")
        dst = torch.empty_like(src)
        copy_s = timed(lambda: dst.copy_(src), a.repeats)
        copy_gbs = 2 * src.nbytes / copy_s / 1e9
        for k in (2, 4):
            ins = [torch.rand(n, device="cuda").to(tdt) for _ in range(k)]
            out = torch.empty_like(ins[0])
            ptrs = [t.data_ptr() for t in ins]
            ours_s = timed(lambda: _C.cuda_reduce(out.data_ptr(), ptrs, n, code, 0), a.repeats)

            def torch_sum():
                torch.add(ins[0], ins[1], out=out)
                for t in ins[2:]:
                    out.add_(t)
            torch_s = timed(torch_sum, a.repeats)
            moved = (k + 1) * src.nbytes
            ref = ins[0].double()
            for t in ins[1:]:
                ref += t.double()
            err = (out.double() - ref).abs().max().item()
            row = dict(dtype=name, k=k, copy_gbs=copy_gbs, torch_gbs=moved / torch_s / 1e9,
                       ours_gbs=moved / ours_s / 1e9, max_abs_err=err)
            rows.append(row)
            print("%-9s %2d %10.0f %10.0f %10.0f %7.0f%%" % (name, k, copy_gbs,
                                                           row["torch_gbs"], row["ours_gbs"],
                                                           100 * row["ours_gbs"] / copy_gbs))
    gpu = torch.cuda.get_device_name(0)
    print("device:", gpu)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return dict(command="python benchmarks/cuda_kernels.py --mib %d --repeats %d"
                % (a.mib, a.repeats), device=gpu, host=platform.node(), commit=commit,
                rows=rows)


ENTRY = harness.Entry("cuda_kernels", __doc__, options, run,
                      prog="python benchmarks/cuda_kernels.py")

if __name__ == "__main__":
    harness.main(ENTRY)
