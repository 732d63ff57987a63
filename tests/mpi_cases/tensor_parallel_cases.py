"""Multi-rank cases for mlfabric/pipeline/tensor_parallel.py (Megatron tensor parallelism and the
§4.4.1 scatter/gather), run by tests/mpi/test_tensor_parallel.py under real mpirun.

Tensor-parallel layers run on groups of t = world size (2 or 3 ranks) or, on 4 ranks, on two
groups of 2 side by side. Every rank builds the same float64 serial layer from a fixed seed, so
it can check its parallel layer against it locally: outputs, the input gradient and every
parameter gradient (a shard against its block of the serial gradient) to 1e-12, and the number
of allreduces on the group's counters. Scatter/gather runs along a chain of stages (on 4 ranks two
stages of 2, on 2 and 3 ranks stages of 1), forward and backward, checking the bytes that cross.
"""
import zlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mlfabric.errors import MismatchError
from mlfabric.pipeline.tensor_parallel import (ColumnParallelLinear, ParallelMLP,
                                               ParallelSelfAttention, ParallelTransformerLayer,
                                               RowParallelLinear, SerialMLP, SerialSelfAttention,
                                               SerialTransformerLayer, TPGroup, gather_from_prev,
                                               scatter_to_next)

WORLD = MPI.COMM_WORLD
F64 = torch.float64
TOL = 1e-12
_state = {}


def setup():
    n = WORLD.Get_size()
    _state["tp"] = TPGroup.split(WORLD, 2 if n == 4 else n)
    # Scatter/gather needs at least two stages of equal t: 2 + 2 on four ranks, else stages of 1.
    _state["sg"] = TPGroup.split(WORLD, 2 if n % 2 == 0 and n >= 4 else 1)


def _tp():
    g = _state["tp"]
    g.reset_counters()
    return g


def _close(got, want, what):
    err = (got.detach() - want.detach()).abs().max().item() if want.numel() else 0.0
    scale = max(1.0, want.detach().abs().max().item() if want.numel() else 0.0)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= TOL * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def _same_in_group(x, group, what):
    digest = zlib.crc32(x.detach().contiguous().numpy().tobytes())
    digests = group.comm.allgather(digest)
    assert len(set(digests)) == 1, f"{what}: ranks of the group hold different bits {digests}"


def _inputs(shape, salt):
    gen = torch.Generator().manual_seed(1000 + salt)
    x = torch.randn(*shape, generator=gen, dtype=F64)
    return x.clone().requires_grad_(), x.clone().requires_grad_()


def _compare(serial, parallel, group, shape, salt, what):
    """Run both on the same input with the same loss; compare outputs and all gradients."""
    xs, xp = _inputs(shape, salt)
    ys = serial(xs)
    yp = parallel(xp)
    _close(yp, ys, f"{what}: output")
    _same_in_group(yp, group, f"{what}: output")
    weights = torch.randn(ys.shape, generator=torch.Generator().manual_seed(salt), dtype=F64)
    (ys * weights).sum().backward()
    forward_calls = dict(group.calls)
    (yp * weights).sum().backward()
    _close(xp.grad, xs.grad, f"{what}: input gradient")
    serial_params = dict(serial.named_parameters())
    names = [name for name, _ in parallel.named_parameters()]
    assert sorted(names) == sorted(serial_params), f"{what}: parameters {names}"
    for name, p in parallel.named_parameters():
        want = serial_params[name].grad
        if p.partition_dim is not None:
            want = want.chunk(group.size, p.partition_dim)[group.rank]
        _close(p.grad, want, f"{what}: gradient of {name}")
    return forward_calls, dict(group.calls)


def _serial(cls, *args, seed):
    torch.manual_seed(seed)  # same on every rank: all hold the same serial layer
    layer = cls(*args, dtype=F64)
    with torch.no_grad():    # LayerNorms start at (1, 0); make them count in the comparison
        for name, p in layer.named_parameters():
            if name.startswith("ln"):
                p.add_(0.1 * torch.randn(p.shape, dtype=F64))
    return layer


# --- layers against the serial ones ---------------------------------------------------------------

def case_mlp_equals_serial():
    g = _tp()
    for hidden, ffn, shape, salt in ((6, 12, (2, 3, 6), 1), (5, 18, (4, 5), 2),
                                     (8, 6 * g.size, (1, 7, 8), 3)):
        serial = _serial(SerialMLP, hidden, ffn, seed=salt)
        parallel = ParallelMLP.from_serial(serial, g)
        assert parallel.fc1.weight.shape == (ffn // g.size, hidden)
        assert parallel.fc2.weight.shape == (hidden, ffn // g.size)
        g.reset_counters()
        fwd, total = _compare(serial, parallel, g, shape, salt, f"MLP h={hidden} ffn={ffn}")
        assert fwd == {"allreduce": 1} and total == {"allreduce": 2}, (fwd, total)


def case_mlp_without_bias():
    g = _tp()
    serial = _serial(SerialMLP, 4, 6, False, seed=4)
    _compare(serial, ParallelMLP.from_serial(serial, g), g, (3, 4), 4, "MLP without bias")


def case_column_gather_output_and_row_full_input():
    g = _tp()
    torch.manual_seed(5)
    lin = torch.nn.Linear(7, 3 * g.size, dtype=F64)
    col = ColumnParallelLinear.from_serial(lin, g, gather_output=True)
    fwd, total = _compare(lin, col, g, (2, 4, 7), 5, "ColumnParallelLinear gather_output")
    # forward: one all-gather of the column blocks; backward: f's allreduce of the input grad
    assert fwd == {"allgather": 1} and total == {"allgather": 1, "allreduce": 1}, (fwd, total)

    lin = torch.nn.Linear(2 * g.size, 5, dtype=F64)
    row = RowParallelLinear.from_serial(lin, g, input_is_parallel=False)
    g.reset_counters()
    fwd, total = _compare(lin, row, g, (3, 2 * g.size), 6, "RowParallelLinear full input")
    # forward: g's allreduce; backward: the all-gather of the input gradient's blocks
    assert fwd == {"allreduce": 1} and total == {"allreduce": 1, "allgather": 1}, (fwd, total)


def case_attention_equals_serial():
    g = _tp()
    for causal in (True, False):
        serial = _serial(SerialSelfAttention, 12, 6, causal, seed=7)   # 6 heads of width 2
        parallel = ParallelSelfAttention.from_serial(serial, g)
        assert parallel.local_heads == 6 // g.size
        g.reset_counters()
        fwd, total = _compare(serial, parallel, g, (2, 5, 12), 8, f"attention causal={causal}")
        assert fwd == {"allreduce": 1} and total == {"allreduce": 2}, (fwd, total)


def case_transformer_layers_two_allreduces_each_way():
    g = _tp()
    b, s, h, layers = 2, 5, 12, 2
    serial = torch.nn.Sequential(*[_serial(SerialTransformerLayer, h, 6, 24, seed=10 + i)
                                   for i in range(layers)])
    parallel = torch.nn.Sequential(*[ParallelTransformerLayer.from_serial(lay, g)
                                     for lay in serial])
    g.reset_counters()
    fwd, total = _compare(serial, parallel, g, (b, s, h), 9, "2 transformer layers")
    # Per layer: g after attention and after the MLP forward; f before each backward.
    assert fwd == {"allreduce": 2 * layers}, fwd
    assert total == {"allreduce": 4 * layers}, total
    # Every allreduce carries one (b, s, h) float64 tensor: 4 bsh per layer (a ring moves
    # 2 (t-1)/t of that per device: the thesis's 8 bsh (t-1)/t).
    assert g.bytes["allreduce"] == 4 * layers * b * s * h * 8, dict(g.bytes)
    # A seeded layer (no serial one): same counts, output replicated over the group.
    layer = ParallelTransformerLayer(h, 6, 24, g, dtype=F64, seed=5)
    x = _inputs((b, s, h), 14)[0]
    g.reset_counters()
    y = layer(x)
    y.sum().backward()
    assert dict(g.calls) == {"allreduce": 4}, dict(g.calls)
    _same_in_group(y, g, "seeded transformer layer output")
    _same_in_group(x.grad, g, "seeded transformer layer input gradient")


def case_seeded_layers_do_not_depend_on_t():
    g = _tp()
    one = TPGroup(MPI.COMM_SELF)
    col = ColumnParallelLinear(5, 4 * g.size, g, seed=3, dtype=F64)
    ref = ColumnParallelLinear(5, 4 * g.size, one, seed=3, dtype=F64)
    assert torch.equal(g.allgather(col.weight.detach(), dim=0), ref.weight.detach())
    assert torch.equal(g.allgather(col.bias.detach(), dim=0), ref.bias.detach())
    row = RowParallelLinear(2 * g.size, 3, g, seed=4, dtype=F64)
    ref = RowParallelLinear(2 * g.size, 3, one, seed=4, dtype=F64)
    assert torch.equal(g.allgather(row.weight.detach(), dim=1), ref.weight.detach())
    assert torch.equal(row.bias.detach(), ref.bias.detach())
    # and a seeded parallel MLP computes what its own gathered weights compute
    mlp = ParallelMLP(4, 2 * g.size, g, seed=11, dtype=F64)
    serial = SerialMLP(4, 2 * g.size, dtype=F64)
    with torch.no_grad():
        serial.fc1.weight.copy_(g.allgather(mlp.fc1.weight.detach(), dim=0))
        serial.fc1.bias.copy_(g.allgather(mlp.fc1.bias.detach(), dim=0))
        serial.fc2.weight.copy_(g.allgather(mlp.fc2.weight.detach(), dim=1))
        serial.fc2.bias.copy_(mlp.fc2.bias)
    _compare(serial, mlp, g, (3, 4), 12, "seeded ParallelMLP")


# --- errors: raised on every rank, and the group stays usable -------------------------------------

def _raises(exc, fn, *needles):
    with pytest.raises(exc) as info:
        fn()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


def _group_still_works(g):
    x = torch.full((3,), float(g.rank + 1), dtype=F64)
    assert torch.equal(g.allreduce(x), torch.full((3,), g.size * (g.size + 1) / 2, dtype=F64))


def case_bad_sizes_raise_on_every_rank():
    g = _tp()
    t = g.size
    _raises(ValueError, lambda: ColumnParallelLinear(4, 3 * t + 1, g), f"out_features={3 * t + 1}",
            f"t={t}")
    _raises(ValueError, lambda: RowParallelLinear(2 * t + 1, 4, g), f"in_features={2 * t + 1}",
            f"t={t}")
    _raises(ValueError, lambda: ParallelMLP(4, t + 1, g), f"out_features={t + 1}")
    heads = 3 if t == 2 else 4                          # divides hidden=12, not t
    _raises(ValueError, lambda: ParallelSelfAttention(12, heads, g), f"heads={heads}", f"t={t}")
    _raises(ValueError, lambda: ParallelSelfAttention(12, 5, g), "hidden=12", "heads=5")
    _raises(ValueError, lambda: ParallelSelfAttention.from_serial(
        SerialSelfAttention(12, heads, dtype=F64), g), f"heads={heads}")
    _raises(ValueError, lambda: ParallelSelfAttention(12, 2 * t, g)(torch.zeros(5, 12)),
            "(batch, seq, hidden)")
    _raises(TypeError, lambda: TPGroup("world"), "intracommunicator")
    _raises(TypeError, lambda: ColumnParallelLinear(4, 4, WORLD), "TPGroup")
    _group_still_works(g)


def case_ranks_that_disagree_fail_together():
    g = _tp()
    t = g.size
    # Same divisible sizes but different on rank 0: a MismatchError everywhere, naming them.
    out = 2 * t if g.rank == 0 else t
    _raises(MismatchError, lambda: ColumnParallelLinear(4, out, g), "out_features",
            f"rank 0: {2 * t}", f"rank 1: {t}")
    # A size only rank 0 gets wrong: its own ValueError there, MismatchError on its peers.
    out = t + 1 if g.rank == 0 else t
    if g.rank == 0:
        _raises(ValueError, lambda: RowParallelLinear(out, 4, g), f"in_features={t + 1}")
    else:
        _raises(MismatchError, lambda: RowParallelLinear(out, 4, g), "rank(s) [0] rejected")
    # Inputs of different shapes reach g's allreduce: refused before any data moves.
    torch.manual_seed(13)
    mlp = ParallelMLP.from_serial(SerialMLP(4, 2 * t, dtype=F64), g)
    x = torch.randn(2 + (g.rank == 0), 4, dtype=F64)
    _raises(MismatchError, lambda: mlp(x), "TPGroup.allreduce", "shape")
    _raises(MismatchError, lambda: g.allreduce(torch.zeros(2, dtype=F64 if g.rank else
                                                           torch.float32)), "dtype")
    _group_still_works(g)


# --- scatter/gather between stages ----------------------------------------------------------------

def _stages():
    """(group, stage, number of stages, ranks of the previous / next stage's group or None)."""
    sg = _state["sg"]
    sg.reset_counters()
    t = sg.size
    stage, stages = WORLD.Get_rank() // t, WORLD.Get_size() // t
    prev = [(stage - 1) * t + i for i in range(t)] if stage > 0 else None
    nxt = [(stage + 1) * t + i for i in range(t)] if stage < stages - 1 else None
    return sg, stage, stages, prev, nxt


def _stage_output(shape, stage, salt):
    gen = torch.Generator().manual_seed(100 * salt + stage)
    return torch.randn(*shape, generator=gen, dtype=F64)


def case_scatter_gather_delivers_full_output():
    sg, stage, stages, prev, nxt = _stages()
    assert sg.ranks_in(WORLD) == [stage * sg.size + i for i in range(sg.size)]
    t = sg.size
    # the last shape is cut into two segments per chunk (> p2p.SEGMENT_BYTES)
    for salt, shape in enumerate(((2, 3, 4 * t), (4, 128, 160), (6 * t,))):
        numel = int(np.prod(shape))
        # forward: each stage hands the next one its (replicated) output
        if prev is not None:
            got = gather_from_prev(shape, F64, sg, prev, tag=1)
            assert torch.equal(got, _stage_output(shape, stage - 1, salt)), "forward transfer"
            _same_in_group(got, sg, "gathered stage output")
        if nxt is not None:
            sent = scatter_to_next(_stage_output(shape, stage, salt), sg, nxt, tag=1)
            assert sent == numel * 8 // t, (sent, numel, t)
        # backward: gradients go the other way, same mechanism
        if nxt is not None:
            got = gather_from_prev(shape, F64, sg, nxt, tag=2)
            assert torch.equal(got, _stage_output(shape, stage + 1, salt + 50)), "backward transfer"
        if prev is not None:
            scatter_to_next(_stage_output(shape, stage, salt + 50), sg, prev, tag=2)
        # bsh / t payload bytes cross between stages per rank, each way
        links = (prev is not None) + (nxt is not None)
        assert sg.bytes["send"] == sg.bytes["recv"] == links * numel * 8 // t, dict(sg.bytes)
        assert sg.calls["send"] == sg.calls["recv"] == links, dict(sg.calls)
        assert sg.calls["allgather"] == links and sg.calls["allreduce"] == 0, dict(sg.calls)
        sg.reset_counters()


def case_without_scatter_gather_sends_t_times_more():
    sg, stage, stages, prev, nxt = _stages()
    shape = (3, 4, 2 * sg.size)
    numel = int(np.prod(shape))
    if prev is not None:
        got = gather_from_prev(shape, F64, sg, prev, scatter_gather=False)
        assert torch.equal(got, _stage_output(shape, stage - 1, 7))
        assert sg.bytes["recv"] == numel * 8 and sg.calls["allgather"] == 0
    if nxt is not None:
        assert scatter_to_next(_stage_output(shape, stage, 7), sg, nxt,
                               scatter_gather=False) == numel * 8


def case_scatter_gather_errors_on_every_rank():
    sg, stage, stages, prev, nxt = _stages()
    t = sg.size
    if t > 1:
        # numel not divisible by t: the sender and the receivers refuse it, naming the sizes
        shape = (3, 5, 7)
        if prev is not None:
            _raises(ValueError, lambda: gather_from_prev(shape, F64, sg, prev), "numel=105",
                    f"t={t}")
        if nxt is not None:
            _raises(ValueError, lambda: scatter_to_next(_stage_output(shape, stage, 0), sg, nxt),
                    "numel=105", f"t={t}")
    # the receivers expect another shape: they refuse it (the sender has done its part)
    if prev is not None:
        _raises(MismatchError, lambda: gather_from_prev((2, 5, 4 * t), F64, sg, prev),
                f"sent shape (2, 4, {5 * t})", f"expects shape (2, 5, {4 * t})")
    if nxt is not None:
        scatter_to_next(_stage_output((2, 4, 5 * t), stage, 0), sg, nxt)
    # groups that do not pair up: wrong length, overlapping this stage's own group
    own = sg.ranks_in(WORLD)
    _raises(ValueError, lambda: scatter_to_next(torch.zeros(t, dtype=F64), sg, own + [0]),
            f"has {t + 1} ranks but this tensor-parallel group has {t}")
    _raises(ValueError, lambda: gather_from_prev((t,), F64, sg, own), "overlaps")
    # nothing was left in flight: a good transfer still goes through
    case_without_scatter_gather_sends_t_times_more()


def case_mismatched_stage_groups():
    """Three ranks as a stage of one rank feeding a stage of two: every rank refuses at once."""
    if WORLD.Get_size() != 3:
        return
    rank = WORLD.Get_rank()
    group = TPGroup(WORLD.Split(0 if rank == 0 else 1, rank))
    if rank == 0:
        _raises(ValueError, lambda: scatter_to_next(torch.zeros(4, dtype=F64), group, [1, 2]),
                "dest_group has 2 ranks but this tensor-parallel group has 1")
    else:
        _raises(ValueError, lambda: gather_from_prev((4,), F64, group, [0]),
                "src_group has 1 ranks but this tensor-parallel group has 2")
    group.comm.Free()


def case_collective_argument_errors():
    g = _tp()
    # a tensor too long to describe in the check: refused on every rank, nothing exchanged
    _raises(ValueError, lambda: g.allreduce(torch.zeros((1,) * 13, dtype=F64)), "too long")
    # more dimensions on one rank only: that rank refuses, its peers name it
    dims = 13 if g.rank == 0 else 2
    if g.rank == 0:
        _raises(ValueError, lambda: g.allreduce(torch.zeros((1,) * dims, dtype=F64)), "too long")
    else:
        _raises(MismatchError, lambda: g.allreduce(torch.zeros((1,) * dims, dtype=F64)),
                "rank(s) [0] rejected")
    _raises(ValueError, lambda: g.allgather(torch.zeros(2, 3, dtype=F64), dim=2), "dim=2")
    x = torch.arange(6, dtype=F64).reshape(2, 3) + 10 * g.rank
    assert torch.equal(g.allgather(x, dim=1),
                       torch.cat([torch.arange(6, dtype=F64).reshape(2, 3) + 10 * r
                                  for r in range(g.size)], dim=1))
    _group_still_works(g)
