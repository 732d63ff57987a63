"""Multi-rank cases for mlfabric.torch's process sets (Horovod's hvd.ProcessSet,
add_process_set, process_set=): every collective among the even and the odd ranks at once and
among an arbitrary set, against float64 references every rank computes from every rank's inputs;
autograd and DistributedOptimizer inside a set (weights as one process training on the set's
concatenated batch); calls on a set interleaved with global and async calls; the errors (a rank
outside the set, unregistered and removed sets, ranks passing different sets, bad ranks, a root
outside the set, mismatches inside a set, adding while a rank is joined) on the ranks concerned,
and the other ranks unharmed."""
import copy

import numpy as np
import pytest
import torch

import mlfabric.torch as hvd
from mlfabric.torch import dispatch

from .common import same_everywhere


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()


def _inputs(q, shape, salt=0, dtype=torch.float64):
    """Rank q's input: every rank can regenerate it (for the references)."""
    rng = np.random.default_rng(q * 1009 + salt)
    return torch.from_numpy(rng.normal(0, 10, shape)).to(dtype)


def _halves():
    """(the even ranks' set, the odd ranks' set or None at one rank, this rank's set)."""
    n, r = hvd.size(), hvd.rank()
    even = hvd.add_process_set(list(range(0, n, 2)))
    odd = hvd.add_process_set(list(range(1, n, 2))) if n > 1 else None
    return even, odd, (even if r % 2 == 0 else odd)


def _remove(*sets):
    for ps in sets:
        if ps is not None:
            assert hvd.remove_process_set(ps) is True


def _still_works():
    n = hvd.size()
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [n] * 3


def case_queries_and_registration():
    n, r = hvd.size(), hvd.rank()
    assert hvd.global_process_set.process_set_id == 0
    assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == r
    assert hvd.global_process_set.included()
    loose = hvd.ProcessSet(sorted({n - 1, 0}, reverse=True))  # sorted, as Horovod
    assert loose.ranks == sorted({0, n - 1}) and loose.size() is None and loose.rank() is None
    even, odd, mine = _halves()
    assert even.process_set_id >= 1 and even.ranks == list(range(0, n, 2))
    assert mine.included() and mine.rank() == mine.ranks.index(r) and mine.size() == len(mine.ranks)
    if odd is not None:
        other = odd if mine is even else even
        assert other.included() is False and other.rank() == -1
        assert odd.process_set_id != even.process_set_id
    same_everywhere(np.array([even.process_set_id, -1 if odd is None else odd.process_set_id]),
                    "process set ids")
    _remove(even, odd)
    assert even.process_set_id is None and even.size() is None and even.included() is None
    assert hvd.remove_process_set(hvd.global_process_set) is False
    _still_works()


def case_allreduce_in_sets_against_float64():
    r = hvd.rank()
    even, odd, mine = _halves()
    k = len(mine.ranks)
    for op, ref in ((hvd.Sum, np.sum), (hvd.Average, np.mean), (hvd.Min, np.min),
                    (hvd.Max, np.max)):
        for dtype in (torch.float64, torch.float32):
            x = _inputs(r, (5, 3), 1, dtype)
            want = ref(np.stack([_inputs(q, (5, 3), 1, dtype).double().numpy()
                                 for q in mine.ranks]), axis=0)
            got = hvd.allreduce(x, op=op, process_set=mine)
            rtol = 1e-13 if dtype == torch.float64 else 2e-6
            np.testing.assert_allclose(got.double().numpy(), want, rtol=rtol, atol=rtol * 10)
            y = x.clone()
            hvd.allreduce_(y, op=op, process_set=mine)
            assert torch.equal(y, got)
    # prescale / postscale divide by the set's size for Average
    x = _inputs(r, (4,), 2)
    got = hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=3.0,
                        process_set=mine)
    want = 6.0 * np.mean([_inputs(q, (4,), 2).numpy() for q in mine.ranks], axis=0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-13)
    # grouped: a list of dtypes and shapes, fused per dtype
    xs = [_inputs(r, (3,), 3), _inputs(r, (2, 2), 4, torch.float32), _inputs(r, (1,), 5)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, process_set=mine)
    for i, (o, shape, salt, dt) in enumerate(zip(outs, ((3,), (2, 2), (1,)), (3, 4, 5),
                                                 (torch.float64, torch.float32, torch.float64))):
        want = sum(_inputs(q, shape, salt, dt).double().numpy() for q in mine.ranks)
        np.testing.assert_allclose(o.double().numpy(), want, rtol=2e-6, err_msg=f"tensor {i}")
    same_everywhere(hvd.allreduce(torch.tensor([float(k)]), op=hvd.Sum).numpy(), "global after")
    _remove(even, odd)


def case_gather_scatter_broadcast_in_sets():
    r = hvd.rank()
    even, odd, mine = _halves()
    k, me = len(mine.ranks), mine.rank()
    # allgather, uneven rows: the set's rank order
    x = _inputs(r, (r % 3 + 1, 2), 6)
    got = hvd.allgather(x, process_set=mine)
    want = torch.cat([_inputs(q, (q % 3 + 1, 2), 6) for q in mine.ranks])
    assert torch.equal(got, want)
    outs = hvd.grouped_allgather([x, _inputs(r, (1,), 7)], process_set=mine)
    assert torch.equal(outs[0], want)
    assert torch.equal(outs[1], torch.cat([_inputs(q, (1,), 7) for q in mine.ranks]))
    # broadcast from every rank of the set, named by its global rank
    for root in mine.ranks:
        got = hvd.broadcast(_inputs(r, (3,), 8), root_rank=root, process_set=mine)
        assert torch.equal(got, _inputs(root, (3,), 8))
        y = _inputs(r, (2,), 9)
        hvd.broadcast_(y, root, process_set=mine)
        assert torch.equal(y, _inputs(root, (2,), 9))
    # reducescatter: the set's rows split over the set's ranks
    rows = 2 * k + 1
    got = hvd.reducescatter(_inputs(r, (rows, 2), 10), op=hvd.Sum, process_set=mine)
    total = sum(_inputs(q, (rows, 2), 10).numpy() for q in mine.ranks)
    first = sum(rows // k + (j < rows % k) for j in range(me))
    mine_rows = rows // k + (me < rows % k)
    np.testing.assert_allclose(got.numpy(), total[first:first + mine_rows], rtol=1e-13)
    got = hvd.grouped_reducescatter([_inputs(r, (rows, 2), 10)], op=hvd.Sum, process_set=mine)
    np.testing.assert_allclose(got[0].numpy(), total[first:first + mine_rows], rtol=1e-13)
    # alltoall with splits: rank j of the set gets j + 1 rows from everyone
    splits = [j + 1 for j in range(k)]
    out, received = hvd.alltoall(_inputs(r, (sum(splits), 2), 11), splits=splits,
                                 process_set=mine)
    want = torch.cat([_inputs(q, (sum(splits), 2), 11)[sum(splits[:me]):sum(splits[:me + 1])]
                      for q in mine.ranks])
    assert torch.equal(out, want) and received.tolist() == [me + 1] * k
    hvd.barrier(process_set=mine)
    # objects
    assert hvd.allgather_object({"r": r}, process_set=mine) == [{"r": q} for q in mine.ranks]
    assert hvd.broadcast_object(r * 10 if r == mine.ranks[-1] else None,
                                root_rank=mine.ranks[-1], process_set=mine) == mine.ranks[-1] * 10
    # an object the set's last rank cannot pickle: the others' error names its global rank
    import threading
    last = mine.ranks[-1]
    with pytest.raises(TypeError if r == last else hvd.MlfabricError) as info:
        hvd.allgather_object(threading.Lock() if r == last else r, process_set=mine)
    if r != last:
        assert f"rank(s) [{last}] could not pickle" in str(info.value), info.value
    _remove(even, odd)
    _still_works()


def case_arbitrary_set_and_a_rank_outside_it():
    """A set of the last and the first rank (given unsorted); the ranks between call nothing on
    it and get ValueError if they try, without holding anyone up."""
    n, r = hvd.size(), hvd.rank()
    ends = hvd.add_process_set(hvd.ProcessSet(sorted({n - 1, 0}, reverse=True)))
    if ends.included():
        got = hvd.allreduce(_inputs(r, (6,), 12), op=hvd.Sum, process_set=ends)
        want = sum(_inputs(q, (6,), 12).numpy() for q in ends.ranks)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-13)
    else:
        with pytest.raises(ValueError, match="not in the process set"):
            hvd.allreduce(torch.ones(2), process_set=ends)
    with pytest.raises(TypeError, match="ProcessSet"):
        hvd.allreduce(torch.ones(2), process_set=[0])
    _remove(ends)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(2), process_set=ends)
    _still_works()


def case_sets_interleave_with_global_and_async_calls():
    """Handles of set and global calls in one namespace; each set's calls in its own order,
    independent of the global queue's."""
    n, r = hvd.size(), hvd.rank()
    even, odd, mine = _halves()
    handles = []
    for i in range(4):
        handles.append(("set", i, hvd.allreduce_async(_inputs(r, (50,), 20 + i), op=hvd.Sum,
                                                       process_set=mine)))
        handles.append(("all", i, hvd.allreduce_async(_inputs(r, (50,), 30 + i), op=hvd.Sum)))
    blocking = hvd.allreduce(_inputs(r, (7,), 40), op=hvd.Sum, process_set=mine)
    for kind, i, h in reversed(handles):
        got = hvd.synchronize(h)
        ranks = mine.ranks if kind == "set" else range(n)
        salt = (20 if kind == "set" else 30) + i
        want = sum(_inputs(q, (50,), salt).numpy() for q in ranks)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-13, err_msg=f"{kind} {i}")
    np.testing.assert_allclose(blocking.numpy(),
                               sum(_inputs(q, (7,), 40).numpy() for q in mine.ranks), rtol=1e-13)
    _remove(even, odd)


def case_autograd_in_a_set():
    """The gradients of allreduce, allgather and broadcast stay in the set: d/dx of
    sum(w * allreduce_avg(x)) is the set's mean of w (every rank's w differs)."""
    r = hvd.rank()
    even, odd, mine = _halves()
    k, me = len(mine.ranks), mine.rank()
    w = {q: _inputs(q, (4,), 50) for q in mine.ranks}
    x = _inputs(r, (4,), 51).requires_grad_()
    (hvd.allreduce(x, process_set=mine) * w[r]).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), sum(w.values()).numpy() / k, rtol=1e-13)
    x = _inputs(r, (2,), 52).requires_grad_()
    g = {q: _inputs(q, (2 * k,), 53) for q in mine.ranks}
    (hvd.allgather(x, process_set=mine) * g[r]).sum().backward()
    mean = sum(g.values()) / k
    np.testing.assert_allclose(x.grad.numpy(), mean[2 * me:2 * me + 2].numpy(), rtol=1e-13)
    x = _inputs(r, (3,), 54).requires_grad_()
    root = mine.ranks[0]
    (hvd.broadcast(x, root, process_set=mine) * w[r][:3]).sum().backward()
    want = sum(v[:3] for v in w.values()).numpy() / k if r == root else np.zeros(3)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-13)
    _remove(even, odd)


def _train_beside_reference(model, opt, ref, ropt, ranks, salt):
    """Three steps of this rank's batches through opt, and of the concatenated batches of
    `ranks` through the single-process reference; the weights then agree (float64, 1e-10)."""
    r = hvd.rank()
    for step in range(3):
        batch = {q: (_inputs(q, (5, 4), salt + step), _inputs(q, (5, 1), salt + 10 + step))
                 for q in ranks}
        opt.zero_grad()
        xb, yb = batch[r]
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        ropt.zero_grad()
        xs = torch.cat([b[0] for b in batch.values()])
        ys = torch.cat([b[1] for b in batch.values()])
        torch.nn.functional.mse_loss(ref(xs), ys).backward()
        ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p - q).abs().max().item() < 1e-10


def case_distributed_optimizer_on_a_rank_outside_its_set():
    """One script builds the optimizer on every rank with a set of all ranks but the last:
    the set's ranks train as one process on their concatenated batches, the last rank steps on
    its own gradients alone (Horovod's rule), float64 to 1e-10."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    inner = hvd.add_process_set(list(range(n - 1)))
    torch.manual_seed(110)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                torch.nn.Linear(3, 1)).double()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=1, process_set=inner)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    _train_beside_reference(model, opt, ref, ropt, inner.ranks if r in inner.ranks else [r], 80)
    if r not in inner.ranks:
        with pytest.raises(ValueError, match="backward_passes_per_step"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     backward_passes_per_step=0, process_set=inner)
    del opt
    _remove(inner)
    _still_works()


def case_distributed_optimizer_per_set():
    """Two sets train two models at once; each ends with the weights of one process training on
    its set's concatenated batches (float64, 1e-10)."""
    r = hvd.rank()
    even, odd, mine = _halves()
    torch.manual_seed(100 + (r % 2))  # one model per set, the same on its ranks
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                torch.nn.Linear(3, 1)).double()
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                              torch.nn.Linear(3, 1)).double()
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), process_set=mine)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    _train_beside_reference(model, opt, ref, ropt, mine.ranks, 60)
    del opt
    _remove(even, odd)
    _still_works()


def case_mismatches_inside_a_set_fail_on_its_ranks():
    n, r = hvd.size(), hvd.rank()
    even, odd, mine = _halves()
    if len(mine.ranks) > 1:
        last = mine.ranks[-1]
        with pytest.raises(hvd.MismatchError, match=rf"\(4,\) on rank\(s\) \[{mine.rank()}\]"
                           if r == last else "shape"):
            hvd.allreduce(torch.ones(3 + (r == last)), process_set=mine)
        # a root outside the set: ValueError there, MismatchError naming it on the others
        if r == last:
            outside = next((q for q in range(n) if q not in mine.ranks), n)
            with pytest.raises(ValueError, match="not in the process set"):
                hvd.broadcast(torch.ones(2), root_rank=outside, process_set=mine)
        else:
            with pytest.raises(hvd.MismatchError, match="rejected"):
                hvd.broadcast(torch.ones(2), root_rank=mine.ranks[0], process_set=mine)
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=mine)
    assert got.tolist() == [len(mine.ranks)] * 2
    _remove(even, odd)
    _still_works()


def case_add_and_remove_errors_on_every_rank():
    n, r = hvd.size(), hvd.rank()
    with pytest.raises(ValueError, match="distinct ranks"):
        hvd.add_process_set([0, n])
    with pytest.raises(ValueError, match="at least one rank"):
        hvd.add_process_set([])
    with pytest.raises(ValueError, match="already registered"):
        hvd.add_process_set(hvd.global_process_set)
    everyone = hvd.add_process_set(list(range(n)))  # the global ranks: a set of its own
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=everyone).item() == n
    _remove(everyone)
    with pytest.raises(TypeError, match="integer ranks"):
        hvd.ProcessSet([0.5])
    if n > 1:
        # ranks passing different sets: a MismatchError on every rank, naming them
        with pytest.raises(hvd.MismatchError, match="the process set's ranks"):
            hvd.add_process_set([0] if r == 0 else [0, 1])
        ps = hvd.add_process_set([0])
        with pytest.raises(ValueError, match="already registered"):
            hvd.add_process_set(ps)
        with pytest.raises(hvd.MismatchError, match="call"):
            if r == 0:
                hvd.remove_process_set(ps)
            else:
                hvd.allreduce(torch.ones(1))
        _remove(ps)
        with pytest.raises(ValueError, match="not registered"):
            hvd.remove_process_set(ps)
    _still_works()


def case_add_while_a_rank_is_joined():
    """A rank inside join() cannot take part in adding a set: the others get a MismatchError
    naming it, the joined rank stays joined, and join() ends once they join too."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    if r == 0:
        assert hvd.join() == n - 1
    else:
        with pytest.raises(hvd.MismatchError, match=r"rank\(s\) \[0\] are inside join"):
            hvd.add_process_set([1])
        assert hvd.join() == n - 1
    _still_works()


def case_init_with_process_sets():
    """shutdown() frees the sets (a set object from before is then unregistered); init() takes
    process_sets=[...] and registers them, in the order given."""
    n = hvd.size()
    early = hvd.add_process_set([0])
    hvd.shutdown()
    assert early.size() is None
    first, second = hvd.ProcessSet([n - 1]), hvd.ProcessSet([0, 1]) if n > 1 else None
    hvd.init(process_sets=[first] + ([second] if second else []))
    assert first.process_set_id == 1 and first.size() == 1
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=early)
    if second is not None:
        assert second.process_set_id == 2
        if second.included():
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=second).item() == 2
    if first.included():
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=first).item() == 1
    _remove(first, second)
    assert dispatch.state().sets == {}
    _still_works()
