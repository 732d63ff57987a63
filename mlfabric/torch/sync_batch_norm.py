"""SyncBatchNorm: Horovod's hvd.SyncBatchNorm, batch normalisation whose training-mode statistics
are those of every rank's batch together.

Owns the synchronised batch norm: its module (a torch.nn.modules.batchnorm._BatchNorm, so its
parameters, buffers and state_dict are those of torch.nn.BatchNorm1d/2d/3d) and its autograd
function. In training mode with more than one rank:
- forward: one allreduce (Sum, float64) of a (3, num_features) tensor per call: each rank's row
  count, per-channel sum and sum of squares. Every rank normalises with the same global mean and
  biased variance, and updates running_mean / running_var with the global mean and the unbiased
  global variance as torch.nn.BatchNorm would on the concatenated batch (momentum=None: the
  cumulative average). Ranks may hold different batch sizes, zero rows included (count 0; a
  rank inside hvd.join() contributes zeros, so the same). The global count is read on the host
  (a device sync for CUDA input), so that a global batch of one value per channel is torch's
  ValueError on every rank alike.
- backward: one allreduce (Sum, float64) of a (2, num_features) tensor: per-channel sum(dy) and
  sum(dy * (x - mean)), which the input gradient needs over the global batch. The weight and
  bias gradients stay local (this rank's rows), as in Horovod: DistributedOptimizer reduces
  them like any other gradient (summed over ranks, they are the gradient of the sum of the
  ranks' losses).
- errors on every rank: an input that does not fit this rank's layer (dimensions, channels,
  dtype, eps <= 0) is a ValueError / TypeError there and a MismatchError naming that rank
  elsewhere; layers that differ between ranks (num_features, eps, momentum, affine,
  track_running_stats) are a MismatchError everywhere. A failed call leaves the module's
  buffers and counter as they were.
In eval mode, or with one rank, it is plain batch norm (torch's own code, no communication): eval
mode needs no init() and ranks may call it any number of times (inference on one rank is fine).

Ranks in different modes (model.train() on some ranks only) are a user error that a rank in eval
mode cannot see: it normalises with its running statistics and goes on. A rank in training mode
meets that rank's next collective in its statistics' allreduce, whose descriptor (a name and a
tag no other call has) cannot agree with any other call's:
- the eval rank issues another collective (an allreduce, a barrier, DistributedOptimizer's
  gradient allreduces, a SyncBatchNorm layer of another num_features...): at once a MismatchError
  on every rank, on the training ranks from this layer, naming it and asking whether it is in
  training mode on every rank; on the eval rank from that other call, with ops' message (what
  the ranks disagree on: e.g. a shape (3, C) against its own, even where the two read the same).
  Each rank has then used up one call; the calls after those pair as before.
- the eval rank issues no further collective (it stopped, or waits outside mlfabric): the
  training ranks raise PeerTimeoutError after MLFABRIC_TIMEOUT seconds, asking the same; the
  communicator is unusable afterwards, as after any timeout (a peer that never comes cannot be
  told from a slow one sooner).
The same holds for the backward allreduce (a peer whose forward ran in eval mode or without
autograd has no backward to run). Not told apart: two SyncBatchNorm layers of the same
num_features (a rank whose first layer is in eval mode and second in training mode pairs the
second with the others' first).

Differences from Horovod: CPU tensors work too (Horovod's needs CUDA); momentum=None is the
cumulative average (as torch's); with track_running_stats=False, eval mode normalises with this
rank's batch alone (as torch.nn.SyncBatchNorm; Horovod synchronises there).

Numerics: each rank's sums are accumulated in float64 (elementwise work in float32 for float16,
bfloat16 and float32 input, float64 for float64), the squares around the rank's own mean, so
float32 data far from 0 lose nothing to cancellation; the global variance is E[x^2] - mean^2 in
float64, to about 1e-16 * (mean / std)^2 relative. The output and the input gradient come back
in the input's dtype.
"""
import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

import mlfabric as _mf

from ..errors import MismatchError, NotInitializedError, PeerTimeoutError
from . import control, dispatch, ops

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Names of the two allreduces: they must agree on every rank, so a rank that issues something
# else at this point (a different layer order, a gradient bucket) fails with a clear message.
_FWD = "SyncBatchNorm statistics"
_BWD = "SyncBatchNorm gradient statistics"
# Part of the allreduces' descriptor (the control round compares it): a peer's unnamed allreduce
# of a float64 (3, C) tensor would otherwise pair with the statistics and exchange data silently.
_LAYOUT = "mlfabric.torch.SyncBatchNorm"
# What most likely happened when a peer is not in the same call (see the module docstring).
_MODES = ("Is SyncBatchNorm in training mode on every rank? In eval mode it communicates "
          "nothing, so a rank in eval mode (model.train() called on some ranks only)")


def _layout(x):
    """(dimensions reduced over, shape of a per-channel tensor broadcast against x, compute
    dtype): channels are dimension 1."""
    dims = [0] + list(range(2, x.dim()))
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return dims, shape, acc


def _centered(x, mean, shape, acc):
    """x - mean in the compute dtype, mean (float64) split into its compute-dtype part and the
    rest: x - hi is exact where x is near the mean, so float32 data far from 0 keep their
    precision (mean rounded to float32 alone would shift every value by up to 2^-24 |mean|)."""
    if acc == torch.float64:
        return x - mean.view(shape)
    hi = mean.to(acc)
    lo = (mean - hi.to(torch.float64)).to(acc)
    return (x - hi.view(shape)) - lo.view(shape)


def _sum_over_ranks(t, name, what, layout):
    """In-place Sum allreduce of t; a MismatchError / PeerTimeoutError that says which layer and
    what most likely went wrong."""
    try:
        return ops.allreduce_call(t, ops.Sum, None, name, 1.0, 1.0, True, False,
                                  layout=layout)
    except MismatchError as exc:
        # (a rank that rejected its input has its own error; the advice is for the others)
        if "rejected their arguments" in str(exc):
            raise MismatchError(f"{what}: {exc}") from exc
        raise MismatchError(
            f"{what} in training mode: {exc}. {_MODES} is already at its next collective, "
            "which met this layer's allreduce here. "
            "Every rank must also run the same SyncBatchNorm layers (same num_features, eps, "
            "momentum, affine, track_running_stats) in the "
            "same order (the statistics travel as a (3, num_features) tensor forward, "
            "(2, num_features) backward)") from exc
    except PeerTimeoutError as exc:
        raise PeerTimeoutError(
            f"{what} in training mode: {exc}. {_MODES} never joins this layer's allreduce (nor "
            "does a rank that stopped)") from exc


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor, what, layout):
        dims, shape, acc = _layout(input)
        channels = input.shape[1]
        rows = input.numel() // channels if channels else 0  # values per channel here
        x = input.to(acc)
        stats = torch.zeros(3, channels, dtype=torch.float64, device=input.device)
        if rows:
            s1 = x.sum(dims, dtype=torch.float64)
            # Sum of squares around this rank's own mean c (rounded to the compute dtype), then
            # moved to 0 exactly: sum x^2 = sum (x - c)^2 + c * (2 * sum x - rows * c). Squaring
            # the raw values in float32 would lose their low bits where |mean| >> std.
            c = (s1 / rows).to(acc)
            m2c = (x - c.view(shape)).square_().sum(dims, dtype=torch.float64)
            c = c.to(torch.float64)
            stats[0] = rows
            stats[1] = s1
            stats[2] = m2c + c * (2 * s1 - rows * c)
        _sum_over_ranks(stats, _FWD, what, layout)
        total = int(stats[0, 0].item()) if channels else 0  # the same on every rank
        if total == 1:
            # torch's error for a batch of one; raised on every rank alike (all know the total).
            raise ValueError("Expected more than 1 value per channel when training, got 1 over "
                             f"all ranks (this rank's input size {tuple(input.shape)})")
        count = max(total, 1)
        mean = stats[1] / count
        m2 = (stats[2] - stats[1] * mean).clamp_(min=0)
        invstd = torch.rsqrt(m2 / count + eps)
        if running_mean is not None and total:
            # torch's update (an empty global batch leaves the running statistics alone, as
            # torch's does): the unbiased variance.
            with torch.no_grad():
                running_mean.copy_(running_mean.to(torch.float64) * (1 - factor) + mean * factor)
                running_var.copy_(running_var.to(torch.float64) * (1 - factor)
                                  + (m2 / (count - 1)) * factor)
        scale = invstd if weight is None else invstd * weight.detach().to(torch.float64)
        out = _centered(x, mean, shape, acc) * scale.to(acc).view(shape)
        if bias is not None:
            out += bias.detach().to(acc).view(shape)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.count, ctx.what, ctx.has_bias = count, what, bias is not None
        ctx.layout = layout
        return out.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        dims, shape, acc = _layout(input)
        dy = grad_output.to(acc)
        xmu = _centered(input.to(acc), mean, shape, acc)
        local = torch.stack([dy.sum(dims, dtype=torch.float64),
                             (dy * xmu).sum(dims, dtype=torch.float64)])
        # The allreduce runs whether or not this rank needs the input gradient, so that ranks
        # which disagree on requires_grad still issue the same calls.
        total = _sum_over_ranks(local.clone(), _BWD, ctx.what, ctx.layout)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            mean_dy = total[0] / ctx.count
            mean_dy_xmu = total[1] / ctx.count
            scale = invstd if weight is None else invstd * weight.to(torch.float64)
            g = dy - mean_dy.to(acc).view(shape)
            g -= xmu * (invstd * invstd * mean_dy_xmu).to(acc).view(shape)
            g *= scale.to(acc).view(shape)
            grad_input = g.to(input.dtype)
        # Local, as Horovod's: this rank's rows only (DistributedOptimizer reduces them).
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (local[1] * invstd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = local[0].to(weight.dtype if weight is not None else input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the batches of all ranks (Horovod's hvd.SyncBatchNorm).

    Input (N, C, ...) with C = num_features, at least 2 dimensions (any N, 0 included). Arguments
    as torch.nn.BatchNorm2d's: eps, momentum (None: cumulative moving average), affine,
    track_running_stats. In training mode with size() > 1 the batch statistics are those of
    every rank's batch together (one allreduce forward, one backward; every rank must call it,
    in the same order as its other collectives, so in the same mode on every rank); in eval
    mode, or with one rank, it is plain batch norm, without communication. The weight and bias
    gradients are this rank's own. Ranks in different modes: see the module docstring.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}): the input has "
                             f"{input.shape[1]} channels (dimension 1 of shape "
                             f"{tuple(input.shape)})")

    def forward(self, input):
        if not self.training:
            return super().forward(input)  # plain batch norm: no communication, no init needed
        try:
            ranks = _mf.size()
        except NotInitializedError as exc:
            raise NotInitializedError(
                "SyncBatchNorm in training mode reduces its batch statistics over the ranks: "
                "call mlfabric.torch.init() first (eval mode needs no init)") from exc
        if ranks == 1:
            return super().forward(input)
        what = f"SyncBatchNorm({self.num_features})"
        try:
            if not isinstance(input, torch.Tensor):
                raise TypeError(f"{what}: input must be a torch.Tensor, got "
                                f"{type(input).__name__}")
            self._check_input_dim(input)
            if input.dtype not in _FLOATS:
                raise TypeError(f"{what}: input dtype {input.dtype} is not floating point")
            if not self.eps > 0:  # torch's own check (its kernels'), here before any NaN
                raise ValueError(f"{what}: batch_norm eps must be positive during training, "
                                 f"got {self.eps}")
        except (TypeError, ValueError):
            # This rank takes part in the statistics' round as 'rejected', so the others fail
            # at once with a MismatchError naming it instead of waiting for it.
            control.reject(dispatch.state(), control.call_name("allreduce", _FWD), False)
            raise
        factor = 0.0
        tracked = self.track_running_stats and self.num_batches_tracked is not None
        if tracked:
            # torch's rule; the counter itself moves only once the call succeeded
            factor = (1.0 / (int(self.num_batches_tracked) + 1) if self.momentum is None
                      else self.momentum)
        out = _SyncBatchNormFn.apply(
            input, self.weight, self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps, factor, what,
            # the layer's settings in the calls' descriptor: layers built otherwise on some rank
            # (eps, momentum, affine, track_running_stats) are a MismatchError everywhere
            (_LAYOUT, float(self.eps), self.momentum, self.affine, self.track_running_stats))
        if tracked:
            self.num_batches_tracked.add_(1)
        return out
