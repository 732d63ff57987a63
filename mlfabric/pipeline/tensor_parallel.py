"""Megatron-style tensor model parallelism (thesis §4.2.3) and the scatter/gather of stage outputs
between pipeline stages (§4.4.1), on CPU torch tensors over any mpi4py communicator.

Owns:
  TPGroup                 the ranks of one tensor-parallel group: allreduce / allgather of tensors
                          over it (mlfabric.comm.algorithms: bit-identical results on every rank),
                          per-call argument agreement, and counters of calls and bytes
  copy_to_tensor_parallel / reduce_from_tensor_parallel (also named f and g, as in Fig. 4.5)
                          the conjugate operators f (identity forward, allreduce backward) and g
                          (allreduce forward, identity backward); also the gather / scatter of the
                          last dimension that ColumnParallelLinear(gather_output=True) and
                          RowParallelLinear(input_is_parallel=False) need
  ColumnParallelLinear, RowParallelLinear, ParallelMLP, ParallelSelfAttention,
  ParallelTransformerLayer
                          the partitioned layers, each with from_serial(serial, group) taking its
                          slice of a full serial layer's weights (Serial* below), so a run can be
                          compared with one process exactly
  SerialMLP, SerialSelfAttention, SerialTransformerLayer
                          the one-process layers the parallel ones split
  scatter_to_next / gather_from_prev
                          §4.4.1: rank i of a stage's group sends 1/t of the (replicated) stage
                          output to rank i of the next stage's group, which all-gathers it

Sharded parameters carry `partition_dim` (the dimension of the serial tensor they are a block of,
rank order); replicated ones have partition_dim None. Nothing here needs mlfabric.init(): every
call runs on the communicators it is given. Every wait on a peer is comm.p2p's bounded wait
(comm/wait.py): at most MLFABRIC_TIMEOUT seconds, then PeerTimeoutError naming the operation
and the late ranks. Importing this module imports torch and mpi4py.
"""
import collections
import copy
import math
import zlib

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from .._core import buffers as _buffers, dtypes as _dtypes
from ..comm import algorithms, p2p
from ..errors import MismatchError, MlfabricError

# --- the group ------------------------------------------------------------------------------------

_AGREE_WORDS = 16   # int64 words each rank contributes to an argument check
_OK, _REJECTED = 1, -1


def _crc(text):
    return zlib.crc32(text.encode())


def _pack(fields):
    """Values of (name, int or tuple of ints) fields as a flat list of ints."""
    out = []
    for _, v in fields:
        if isinstance(v, tuple):
            out += [len(v), *v]
        else:
            out.append(int(v))
    return out


def _unpack(fields, words):
    """Inverse of _pack, reading another rank's words with this rank's field layout."""
    vals, i = {}, 0
    for name, v in fields:
        if isinstance(v, tuple):
            k = int(words[i])
            vals[name] = tuple(int(w) for w in words[i + 1:i + 1 + k])
            i += 1 + k
        else:
            vals[name] = int(words[i])
            i += 1
    return vals


def _show(name, v):
    return _dtypes.DTYPE_NAMES[v] if name == "dtype" and 0 <= v < len(_dtypes.DTYPE_NAMES) else v


class TPGroup:
    """The ranks of one tensor-parallel group: `comm` (an mpi4py intracommunicator, e.g. a Split of
    the world), `size` (t) and `rank` (this rank's position, which selects its weight shards).

    allreduce / allgather are collective over comm. With check=True (default) every call first
    agrees on its arguments (a few int64 words, bounded wait), so ranks that disagree on shape or
    dtype get a MismatchError on every rank instead of a wrong result or a hang; check=False
    saves that round. `calls` and `bytes` (collections.Counter) count data operations by kind:
    "allreduce", "allgather" (bytes: this rank's input), "send", "recv" (scatter/gather payload
    bytes that crossed to or from another stage). Argument checks are not counted."""

    def __init__(self, comm, check=True):
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"TPGroup needs an mpi4py intracommunicator, got {comm!r}")
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.check = bool(check)
        self.calls = collections.Counter()
        self.bytes = collections.Counter()

    @classmethod
    def split(cls, comm, t, check=True):
        """This rank's group when comm is cut into groups of t consecutive ranks (Megatron's
        layout: ranks [k t, (k+1) t) share layers). Collective over comm; every rank must pass
        the same t (checked: a difference is an error on every rank)."""
        mine = np.array([t if isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                         else -1], np.int64)
        every = np.empty(comm.Get_size(), np.int64)
        p2p.wait([comm.Iallgather(mine, every)], p2p.others(comm),
                 "TPGroup.split (agreeing on t)")
        if mine[0] < 1:
            raise ValueError(f"tensor-parallel size t must be a positive int, got {t!r}")
        if len(set(every.tolist())) != 1:
            raise MismatchError(f"TPGroup.split: ranks disagree on t: {every.tolist()} "
                                "(index = rank)")
        if comm.Get_size() % t:
            raise ValueError(f"TPGroup.split: {comm.Get_size()} ranks cannot be cut into "
                             f"tensor-parallel groups of t={t}")
        return cls(comm.Split(comm.Get_rank() // t, comm.Get_rank()), check)

    def ranks_in(self, comm):
        """The group's ranks (in group order) as numbered in comm; ValueError if one is not in
        comm. Use it to name a neighbouring stage's group (see scatter_to_next)."""
        mine, theirs = self.comm.Get_group(), comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(mine, list(range(self.size)), theirs)
        finally:
            mine.Free()
            theirs.Free()
        if MPI.UNDEFINED in ranks:
            raise ValueError("the tensor-parallel group is not contained in the given communicator")
        return list(ranks)

    def reset_counters(self):
        self.calls.clear()
        self.bytes.clear()

    def __repr__(self):
        return f"TPGroup(rank {self.rank} of {self.size})"

    # -- argument agreement

    def agree(self, what, fields):
        """Collective check that every rank passed the same fields, a list of (name, int or tuple
        of ints); fields=None says this rank rejected its own arguments (its peers then fail at
        once, naming it). Raises MismatchError on every rank when they differ."""
        words = [] if fields is None else _pack(fields)
        too_long = len(words) > _AGREE_WORDS - 2   # e.g. a tensor of more than 12 dimensions
        mine = np.zeros(_AGREE_WORDS, np.int64)
        mine[0] = _REJECTED if fields is None or too_long else _OK
        mine[1] = _crc(what)
        if not too_long:
            mine[2:2 + len(words)] = words
        every = np.empty(self.size * _AGREE_WORDS, np.int64)
        p2p.wait([self.comm.Iallgather(mine, every)], p2p.others(self.comm),
                 f"{what} (argument check over the tensor-parallel group)")
        if too_long:
            raise ValueError(f"{what}: arguments too long to check ({len(words)} values; "
                             f"tensors of at most {_AGREE_WORDS - 4} dimensions)")
        rows = every.reshape(self.size, _AGREE_WORDS)
        if (rows == mine).all():
            return
        rejected = [r for r in range(self.size) if rows[r, 0] == _REJECTED]
        if rejected:
            raise MismatchError(f"{what}: tensor-parallel rank(s) {rejected} rejected their "
                                "arguments (see the error on those ranks); nothing was exchanged")
        other = [r for r in range(self.size) if rows[r, 1] != mine[1]]
        if other:
            raise MismatchError(f"{what}: tensor-parallel rank(s) {other} are in a different call "
                                "(ranks must call the group's operations in the same order)")
        seen = [_unpack(fields, row[2:]) for row in rows]
        for name, _ in fields:
            if len({s[name] for s in seen}) > 1:
                each = ", ".join(f"rank {r}: {_show(name, s[name])}" for r, s in enumerate(seen))
                raise MismatchError(f"{what}: tensor-parallel ranks disagree on {name} ({each})")
        raise MismatchError(f"{what}: tensor-parallel ranks disagree on their arguments")

    def _checked(self, what, prepare, always=False):
        """Run prepare() (local argument checks; returns (fields, result)), agree on the fields
        over the group when self.check or `always`, return result. A rank whose prepare() raises
        still joins the agreement as 'rejected', so its peers raise too instead of waiting."""
        agree = self.check or always
        try:
            fields, result = prepare()
        except (TypeError, ValueError, MlfabricError) as exc:
            if agree:
                try:
                    self.agree(what, None)
                except MlfabricError:
                    pass  # the peers' view; this rank's own error is the one to raise
            raise exc
        if agree:
            self.agree(what, fields)
        return result

    # -- collectives

    def allreduce(self, x):
        """Elementwise sum of x over the group, as a new tensor (or array) of x's kind; x is left
        as it is. Every rank gets bitwise the same result."""
        def prepare():
            xb = _buffers.wrap(x)
            return [("dtype", xb.code), ("shape", tuple(xb.shape))], xb
        xb = self._checked("TPGroup.allreduce", prepare)
        out, ob = _buffers.empty_like(xb)
        ob.arr[...] = xb.arr
        algorithms.allreduce(self.comm, ob.arr, ob.code, "sum")
        self.calls["allreduce"] += 1
        self.bytes["allreduce"] += xb.nbytes
        return out

    def allgather(self, x, dim=0):
        """Every rank's x (all the same shape) concatenated along dim in rank order, as a new
        tensor (or array) of x's kind."""
        def prepare():
            xb = _buffers.wrap(x)
            nd = len(xb.shape)
            if not -nd <= dim < nd:
                raise ValueError(f"TPGroup.allgather: dim={dim} is out of range for shape "
                                 f"{tuple(xb.shape)}")
            return [("dtype", xb.code), ("shape", tuple(xb.shape)), ("dim", dim % nd)], xb
        return self._allgather(self._checked("TPGroup.allgather", prepare), dim)

    def _allgather(self, xb, dim):
        """allgather of a wrapped (checked) buffer."""
        out, ob = _buffers.empty_like(xb, (self.size, *xb.shape))
        algorithms.ring_allgather(self.comm, xb.arr, ob.arr)
        self.calls["allgather"] += 1
        self.bytes["allgather"] += xb.nbytes
        d = dim % len(xb.shape)
        if d == 0:
            return out.reshape(self.size * xb.shape[0], *xb.shape[1:])
        if isinstance(out, torch.Tensor):
            return torch.cat(out.unbind(0), dim=d)
        return np.concatenate(list(out), axis=d)


def _check_group(group, who):
    if not isinstance(group, TPGroup):
        raise TypeError(f"{who}: group must be a TPGroup, got {type(group).__name__}")


def _split_size(total, group, what, who):
    """total / t, or a ValueError naming both when t does not divide total."""
    if total % group.size:
        raise ValueError(f"{who}: {what}={total} is not divisible by the tensor-parallel size "
                         f"t={group.size}")
    return total // group.size


# --- the conjugate operators f and g, and the last-dimension gather / scatter ---------------------

class _CopyToTP(torch.autograd.Function):
    """f: identity forward; the backward sums the input gradient over the group (each rank holds
    only its shards' contribution to it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.allreduce(grad.contiguous()), None


class _ReduceFromTP(torch.autograd.Function):
    """g: sums the partial outputs over the group forward; the gradient of a replicated output is
    already complete on every rank, so the backward is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        return group.allreduce(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """Concatenate the ranks' column blocks (forward); keep this rank's block of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.allgather(x.contiguous(), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.group
        return grad.chunk(g.size, dim=-1)[g.rank].contiguous(), None


class _ScatterLastDim(torch.autograd.Function):
    """Keep this rank's block of the last dimension (forward); concatenate the blocks' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        _split_size(x.shape[-1], group, "last dimension", "scatter_to_tensor_parallel")
        return x.chunk(group.size, dim=-1)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.allgather(grad.contiguous(), dim=-1), None


def copy_to_tensor_parallel(x, group):
    """Megatron's f: identity forward, allreduce of the gradient backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel(x, group):
    """Megatron's g: allreduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tensor_parallel(x, group):
    """All-gather of the last dimension (rank order); backward keeps this rank's block."""
    return _GatherLastDim.apply(x, group)


def scatter_to_tensor_parallel(x, group):
    """This rank's block of the last dimension; backward all-gathers the gradient."""
    return _ScatterLastDim.apply(x, group)


f = copy_to_tensor_parallel     # the thesis's names (Fig. 4.5)
g = reduce_from_tensor_parallel


# --- layers ---------------------------------------------------------------------------------------

def _mark(param, dim):
    param.partition_dim = dim
    return param


def _master_linear(in_features, out_features, bias, dtype, seed):
    """Weights of nn.Linear's default initialisation drawn from a generator seeded with seed:
    identical on every rank, so each rank's slice is a block of one serial layer whatever t is."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        b = torch.empty(out_features, dtype=dtype).uniform_(-bound, bound, generator=gen)
    return w, b


def _check_linear(linear, who):
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{who}.from_serial: expected a torch.nn.Linear, "
                        f"got {type(linear).__name__}")


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A (out_features x in_features) split by output columns: rank r holds
    rows [r o/t, (r+1) o/t) of A and of b, and computes its block of Y's last dimension from the
    full X (through f, whose backward sums the input gradient). gather_output=True all-gathers
    the blocks into the full Y; by default Y stays split, ready for a RowParallelLinear.

    Weights: nn.Linear's default initialisation of the full layer from a generator seeded with
    `seed` (same on every rank), sliced; or from_serial(linear, group) for given weights."""

    def __init__(self, in_features, out_features, group, gather_output=False, bias=True, *,
                 dtype=None, seed=0):
        super().__init__()
        _check_group(group, "ColumnParallelLinear")

        def prepare():
            local = _split_size(out_features, group, "out_features", "ColumnParallelLinear")
            return [("in_features", in_features), ("out_features", out_features),
                    ("gather_output", bool(gather_output)), ("bias", bool(bias))], local
        local = group._checked("ColumnParallelLinear", prepare, always=True)
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.gather_output = bool(gather_output)
        dtype = dtype or torch.get_default_dtype()
        w, b = _master_linear(in_features, out_features, bias, dtype, seed)
        r = group.rank
        self.weight = _mark(nn.Parameter(w[r * local:(r + 1) * local].clone()), 0)
        self.bias = _mark(nn.Parameter(b[r * local:(r + 1) * local].clone()), 0) if bias else None

    @classmethod
    def from_serial(cls, linear, group, gather_output=False):
        """This rank's column block of a full nn.Linear (which every rank must hold alike)."""
        _check_linear(linear, cls.__name__)
        layer = cls(linear.in_features, linear.out_features, group, gather_output,
                    linear.bias is not None, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(group.size, 0)[group.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(group.size, 0)[group.rank])
        return layer

    def forward(self, x):
        y = F.linear(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank {self.weight.shape[0]}), t={self.group.size}, "
                f"gather_output={self.gather_output}, bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A (out_features x in_features) split by input rows: rank r holds
    columns [r i/t, (r+1) i/t) of A, multiplies its block of X's last dimension, and the partial
    products are summed over the group (g: one allreduce). b is whole on every rank and added
    once, after the sum. input_is_parallel=False takes the full X and keeps this rank's block.

    Weights: as ColumnParallelLinear (seeded full layer, sliced), or from_serial."""

    def __init__(self, in_features, out_features, group, input_is_parallel=True, bias=True, *,
                 dtype=None, seed=0):
        super().__init__()
        _check_group(group, "RowParallelLinear")

        def prepare():
            local = _split_size(in_features, group, "in_features", "RowParallelLinear")
            return [("in_features", in_features), ("out_features", out_features),
                    ("input_is_parallel", bool(input_is_parallel)), ("bias", bool(bias))], local
        local = group._checked("RowParallelLinear", prepare, always=True)
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.input_is_parallel = bool(input_is_parallel)
        dtype = dtype or torch.get_default_dtype()
        w, b = _master_linear(in_features, out_features, bias, dtype, seed)
        r = group.rank
        self.weight = _mark(nn.Parameter(w[:, r * local:(r + 1) * local].clone()), 1)
        self.bias = _mark(nn.Parameter(b.clone()), None) if bias else None

    @classmethod
    def from_serial(cls, linear, group, input_is_parallel=True):
        """This rank's row block of a full nn.Linear (which every rank must hold alike)."""
        _check_linear(linear, cls.__name__)
        layer = cls(linear.in_features, linear.out_features, group, input_is_parallel,
                    linear.bias is not None, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(group.size, 1)[group.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in_features={self.in_features} (this rank {self.weight.shape[1]}), "
                f"out_features={self.out_features}, t={self.group.size}, "
                f"input_is_parallel={self.input_is_parallel}, bias={self.bias is not None}")


class SerialMLP(nn.Module):
    """The transformer MLP block on one process: Z = GeLU(X A) B (fc1: h -> ffn, fc2: ffn -> h).
    Dropout is left out, so parallel and serial runs can be compared exactly."""

    def __init__(self, hidden, ffn, bias=True, *, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=bias, dtype=dtype)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelMLP(nn.Module):
    """Megatron's MLP (Fig. 4.5a): ColumnParallelLinear (h -> ffn, output left split) -> GeLU on
    each rank's columns -> RowParallelLinear (ffn -> h): one allreduce forward (g), one backward
    (f). Parameter names match SerialMLP's."""

    def __init__(self, hidden, ffn, group, bias=True, *, dtype=None, seed=0):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn, group, gather_output=False, bias=bias,
                                        dtype=dtype, seed=seed)
        self.fc2 = RowParallelLinear(ffn, hidden, group, input_is_parallel=True, bias=bias,
                                     dtype=dtype, seed=seed + 1)

    @classmethod
    def from_serial(cls, mlp, group):
        """Shards of a serial MLP: any module with nn.Linear attributes fc1 and fc2 (SerialMLP)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.fc1 = ColumnParallelLinear.from_serial(mlp.fc1, group)
        layer.fc2 = RowParallelLinear.from_serial(mlp.fc2, group)
        return layer

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _attention(qkv, heads, causal):
    """Scaled dot-product attention of a fused projection laid out (..., heads, 3, head_dim) in
    its last dimension (Megatron's layout: a contiguous column block is whole heads)."""
    if qkv.dim() != 3:
        raise ValueError(f"self-attention takes inputs (batch, seq, hidden); the QKV projection "
                         f"has shape {tuple(qkv.shape)}")
    b, s, width = qkv.shape
    d = width // (3 * heads)
    q, k, v = qkv.view(b, s, heads, 3, d).permute(3, 0, 2, 1, 4).unbind(0)  # each (b, heads, s, d)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v                                   # (b, heads, s, d)
    return out.transpose(1, 2).reshape(b, s, heads * d)


def _check_heads(hidden, heads, who):
    if heads < 1 or hidden % heads:
        raise ValueError(f"{who}: hidden={hidden} is not divisible by heads={heads}")


class SerialSelfAttention(nn.Module):
    """Multi-head self-attention on one process, on inputs (batch, seq, hidden): a fused QKV
    projection qkv (hidden -> 3 hidden, output laid out (heads, 3, head_dim)), softmax attention
    per head (causal by default), output projection proj (hidden -> hidden). No dropout."""

    def __init__(self, hidden, heads, causal=True, bias=True, *, dtype=None):
        super().__init__()
        _check_heads(hidden, heads, "SerialSelfAttention")
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.proj(_attention(self.qkv(x), self.heads, self.causal))


class ParallelSelfAttention(nn.Module):
    """Megatron's self-attention (Fig. 4.5b): the fused QKV projection column-parallel (rank r
    gets heads [r heads/t, (r+1) heads/t)), attention on those heads with no communication, the
    output projection row-parallel: one allreduce forward, one backward. Parameter names match
    SerialSelfAttention's."""

    def __init__(self, hidden, heads, group, causal=True, bias=True, *, dtype=None, seed=0):
        super().__init__()
        self._setup(hidden, heads, group, causal)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group, bias=bias, dtype=dtype,
                                        seed=seed)
        self.proj = RowParallelLinear(hidden, hidden, group, bias=bias, dtype=dtype, seed=seed + 1)

    def _setup(self, hidden, heads, group, causal):
        _check_group(group, "ParallelSelfAttention")

        def prepare():
            _check_heads(hidden, heads, "ParallelSelfAttention")
            local = _split_size(heads, group, "heads", "ParallelSelfAttention")
            return [("hidden", hidden), ("heads", heads), ("causal", bool(causal))], local
        self.local_heads = group._checked("ParallelSelfAttention", prepare, always=True)
        self.heads, self.causal = heads, bool(causal)

    @classmethod
    def from_serial(cls, attn, group):
        """Shards of a SerialSelfAttention (heads, causal, qkv and proj are read from it)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(attn.proj.in_features, attn.heads, group, attn.causal)
        layer.qkv = ColumnParallelLinear.from_serial(attn.qkv, group)
        layer.proj = RowParallelLinear.from_serial(attn.proj, group)
        return layer

    def forward(self, x):
        return self.proj(_attention(self.qkv(x), self.local_heads, self.causal))


class SerialTransformerLayer(nn.Module):
    """A pre-LayerNorm transformer layer on one process:
    x + attn(ln1(x)), then + mlp(ln2(.)). No dropout."""

    def __init__(self, hidden, heads, ffn, causal=True, *, dtype=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype)
        self.attn = SerialSelfAttention(hidden, heads, causal, dtype=dtype)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype)
        self.mlp = SerialMLP(hidden, ffn, dtype=dtype)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelTransformerLayer(nn.Module):
    """SerialTransformerLayer split Megatron's way: LayerNorms and residuals replicated on every
    rank, attention and MLP tensor-parallel. Exactly two allreduces forward (the g after each
    block) and two backward (the f before each block) per layer; outputs are replicated."""

    def __init__(self, hidden, heads, ffn, group, causal=True, *, dtype=None, seed=0):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype)
        self.attn = ParallelSelfAttention(hidden, heads, group, causal, dtype=dtype, seed=seed)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype)
        self.mlp = ParallelMLP(hidden, ffn, group, dtype=dtype, seed=seed + 2)
        for p in (*self.ln1.parameters(), *self.ln2.parameters()):
            _mark(p, None)

    @classmethod
    def from_serial(cls, layer, group):
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.ln1 = _copy_module(layer.ln1)
        out.attn = ParallelSelfAttention.from_serial(layer.attn, group)
        out.ln2 = _copy_module(layer.ln2)
        out.mlp = ParallelMLP.from_serial(layer.mlp, group)
        return out

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _copy_module(m):
    """A replicated module's own copy of m's parameters (marked unpartitioned)."""
    c = copy.deepcopy(m)
    for p in c.parameters():
        _mark(p, None)
    return c


# --- scatter/gather between pipeline stages (§4.4.1) ---------------------------------------------

_STAGE_TAG = 0x7000     # tags [0x7000, 0x7400): clear of mlfabric's send/recv and algorithm tags
_MAX_TAG = 0x400
_META_WORDS = 12        # [status, scatter_gather, dtype, numel, chunk, ndim, dims (<= 6)]
_MAX_DIMS = 6


def _pipeline_peers(group, peers, comm, who, name):
    """Check the neighbouring group: as many ranks as this group (rank i pairs with rank i),
    distinct, in comm and outside this group. Returns (comm, peer of this rank)."""
    _check_group(group, who)
    comm = MPI.COMM_WORLD if comm is None else comm
    try:
        peers = [int(r) for r in peers]
    except (TypeError, ValueError):
        raise TypeError(f"{who}: {name} must be a sequence of ranks, got {peers!r}") from None
    if len(peers) != group.size:
        raise ValueError(f"{who}: {name} has {len(peers)} ranks but this tensor-parallel group has "
                         f"{group.size}; scatter/gather pairs rank i of one stage's group with "
                         f"rank i of the next, so both groups need the same t")
    if len(set(peers)) != len(peers) or not all(0 <= r < comm.Get_size() for r in peers):
        raise ValueError(f"{who}: {name}={peers} must be distinct ranks of the communicator "
                         f"(size {comm.Get_size()})")
    own = group.ranks_in(comm)
    if set(own) & set(peers):
        raise ValueError(f"{who}: {name}={peers} overlaps this stage's own group {own}")
    return comm, peers[group.rank]


def _tag(tag, who):
    if not isinstance(tag, (int, np.integer)) or not 0 <= tag < _MAX_TAG:
        raise ValueError(f"{who}: tag must be an int in [0, {_MAX_TAG}), got {tag!r}")
    return _STAGE_TAG + int(tag)


def _meta(status, scatter_gather=False, code=0, shape=(), chunk=0):
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"stage outputs of at most {_MAX_DIMS} dimensions, got shape {shape}")
    m = np.full(_META_WORDS, -1, np.int64)
    m[:6] = [status, int(scatter_gather), code, math.prod(shape), chunk, len(shape)]
    m[6:6 + len(shape)] = shape
    return m


def _send(comm, peer, tag, arrays, what):
    reqs = [comm.Isend([p2p.as_bytes(a), MPI.BYTE], peer, tag) for a in arrays]
    p2p.wait(reqs, [peer] * len(reqs), what, [False] * len(reqs))


def _recv(comm, peer, tag, buf, what):
    p2p.wait([comm.Irecv([p2p.as_bytes(buf), MPI.BYTE], peer, tag)], [peer], what, [True])


def scatter_to_next(tensor, group, dest_group, *, comm=None, tag=0, scatter_gather=True):
    """Send a stage output (or, backward, an input gradient), replicated on every rank of this
    tensor-parallel group, to the neighbouring stage's group: rank i sends the i-th of t equal
    chunks of the flattened tensor to dest_group[i], whose group re-assembles it with
    gather_from_prev (§4.4.1, Fig. 4.9b). dest_group: that group's ranks in comm (default
    MPI.COMM_WORLD), in its own rank order. scatter_gather=False sends the whole tensor from
    every rank instead (Fig. 4.9a, for comparison). tag (0..1023) tells apart transfers that
    may be in flight together between the same ranks. Returns the payload bytes this rank sent
    (numel * itemsize / t); also counted in group.calls / group.bytes["send"]. Blocks until the
    tensor may be reused. A bad tensor (numel not divisible by t) raises here and, through a
    'rejected' message, at the receiving rank."""
    who = "scatter_to_next"
    comm, peer = _pipeline_peers(group, dest_group, comm, who, "dest_group")
    wire_tag = _tag(tag, who)
    what = f"{who} to rank {peer}"
    try:
        xb = _buffers.wrap(tensor, "tensor")
        shape = tuple(xb.shape)
        meta = _meta(_OK, scatter_gather, xb.code, shape)
        chunk = _split_size(xb.count, group, "numel", who) if scatter_gather else xb.count
    except (TypeError, ValueError, MlfabricError):
        _send(comm, peer, wire_tag, [_meta(_REJECTED)], what)  # the receiver fails at once
        raise
    meta[4] = chunk
    lo = group.rank * chunk if scatter_gather else 0
    payload = xb.arr[lo:lo + chunk]
    # Large payloads go in segments: MPI counts are 32-bit, and both ends cut the same way.
    _send(comm, peer, wire_tag,
          [meta] + [p2p.as_bytes(payload)[s:e] for s, e in p2p.segments(payload.nbytes)], what)
    group.calls["send"] += 1
    group.bytes["send"] += payload.nbytes
    return payload.nbytes


def gather_from_prev(shape, dtype, group, src_group, *, comm=None, tag=0, scatter_gather=True):
    """Receive what the neighbouring group's scatter_to_next sent: this rank's chunk from
    src_group[group.rank], then an all-gather over this group; returns the full tensor (shape,
    dtype), identical on every rank. Collective over the group (when scatter_gather). Counts
    group.calls / group.bytes["recv"] (the bytes that crossed between the stages) and the
    all-gather. A sender's rejection, or a shape / dtype / mode differing from the sender's,
    raises MismatchError here, and the group's other ranks fail in the all-gather's check."""
    who = "gather_from_prev"
    comm, peer = _pipeline_peers(group, src_group, comm, who, "src_group")
    wire_tag = _tag(tag, who)
    what = f"{who} from rank {peer}"

    def expected():
        """This rank's view of the transfer as a meta record (raises on bad arguments)."""
        if dtype not in _buffers.torch_codes():
            raise TypeError(f"{who}: unsupported dtype {dtype!r}; expected a torch dtype among "
                            f"{', '.join(_dtypes.DTYPE_NAMES)}")
        shp = tuple(int(d) for d in shape)
        mine = _meta(_OK, scatter_gather, _buffers.torch_codes()[dtype], shp)
        mine[4] = _split_size(mine[3], group, "numel", who) if scatter_gather else mine[3]
        return shp, mine

    def receive():
        meta = np.empty(_META_WORDS, np.int64)
        _recv(comm, peer, wire_tag, meta, what)
        if meta[0] == _REJECTED:
            expected()  # this rank's own argument error, if it has one, is the clearer message
            raise MismatchError(f"{what}: the sender rejected its arguments (see the error on "
                                f"rank {peer}); nothing was sent")
        nbytes = int(meta[4]) * _dtypes.ITEMSIZE[int(meta[2])]
        error = None
        try:
            shp, mine = expected()
            if not (meta == mine).all():
                def desc(m):
                    return (f"shape {tuple(int(d) for d in m[6:6 + m[5]])}, "
                            f"{_dtypes.DTYPE_NAMES[m[2]]}, scatter_gather={bool(m[1])}")
                raise MismatchError(f"{what}: the sender sent {desc(meta)}; this rank expects "
                                    f"{desc(mine)}")
            out = torch.empty(int(mine[4]), dtype=dtype)
            buf = _buffers.wrap(out, writable=True).arr
        except (TypeError, ValueError, MlfabricError) as exc:
            error = exc
            buf = np.empty(nbytes, np.uint8)  # drain the payload: the channel stays usable
        raw = p2p.as_bytes(buf)
        for s, e in p2p.segments(nbytes):
            _recv(comm, peer, wire_tag, raw[s:e], what)
        group.calls["recv"] += 1
        group.bytes["recv"] += nbytes
        if error is not None:
            raise error
        return shp, out

    if not scatter_gather:
        shp, full = receive()
        return full.reshape(shp)

    def prepare():
        shp, part = receive()
        return [("dtype", _buffers.torch_codes()[dtype]), ("shape", shp)], (shp, part)
    # Always checked: one rank's receive can fail while its peers' succeed.
    shp, part = group._checked(f"{who} (all-gather)", prepare, always=True)
    return group._allgather(_buffers.wrap(part), 0).reshape(shp)


__all__ = ["TPGroup", "copy_to_tensor_parallel", "reduce_from_tensor_parallel",
           "gather_from_tensor_parallel", "scatter_to_tensor_parallel", "ColumnParallelLinear",
           "RowParallelLinear", "SerialMLP", "ParallelMLP", "SerialSelfAttention",
           "ParallelSelfAttention", "SerialTransformerLayer", "ParallelTransformerLayer",
           "scatter_to_next", "gather_from_prev"]
