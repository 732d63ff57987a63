"""Gradient compression for mlfabric.torch's allreduce and DistributedOptimizer, with Horovod's
interface: a compressor has compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx) -> tensor,
and Compression.none / Compression.fp16 name the two that exist.

Compression.fp16 sends floating tensors as float16 (other dtypes pass unchanged) and casts the
result back. Documented tolerance, for an allreduce over n ranks of values x_r inside float16's
range (|x| <= 65504; larger values become inf):

    |result - exact| <= (n + 2) * 2**-11 * sum_r |x_r|        (op Sum)
    the same divided by n                                      (op Average)

plus 2**-24 per element for values in float16's subnormal range (|x| < 6.1e-5). The terms: each
input is rounded to float16 once (2**-11 relative), the reduction rounds its partial sums at most
n - 1 times (the shared-memory path accumulates in float32 and rounds once), and Average's scaling
once more. mlfabric's float16 reductions are otherwise exact to that rounding.
"""
import torch


class Compressor:
    """Interface: compress(tensor) -> (tensor to send, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating tensors as float16; see the module docstring for the tolerance."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """The compressors, by Horovod's names."""
    none = NoneCompressor
    fp16 = FP16Compressor


def check(compression):
    """compression if it has compress/decompress, else TypeError."""
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must be Compression.none, Compression.fp16 or an object "
                        f"with compress() and decompress(), got {compression!r}")
    return compression
