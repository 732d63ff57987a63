"""Multi-rank cases for the Horovod contracts of mlfabric.torch's sparse and optimizer helpers:
sparse_allreduce_async's callable handle (globally and within process sets),
DistributedOptimizer(sparse_as_dense=True) giving .grad back sparse (torch.optim.SparseAdam steps
on it), broadcast_optimizer_state creating a fresh optimizer's state (zero gradients, one local
step, the parameters' values kept), and the warning for step() after synchronize() outside
skip_synchronize(). Numbers are checked against float64 references every rank computes from
every rank's (regenerable) input."""
import copy
import warnings

import pytest
import torch

import mlfabric.torch as hvd

from .common import same_everywhere

VOCAB, DIM = 11, 3


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()


def _sparse(q, rows=VOCAB, salt=0):
    """Rank q's sparse (rows, DIM) float64 tensor: q % 3 * 2 + 1 entries, duplicates possible."""
    g = torch.Generator().manual_seed(1000 * salt + q)
    k = q % 3 * 2 + 1
    idx = torch.randint(0, rows, (1, k), generator=g)
    return torch.sparse_coo_tensor(idx, torch.randn(k, DIM, generator=g, dtype=torch.float64),
                                   (rows, DIM), check_invariants=True)


def _reference(members, salt, average):
    total = sum(_sparse(q, salt=salt).to_dense() for q in members)
    return total / len(members) if average else total


def _check_handles(members, process_set=None):
    """Handles of sparse_allreduce_async among members (global ranks): called, they return
    the sum / average; synchronize() and poll() take them too; the result is taken once."""
    r = hvd.rank()
    ops = [hvd.Average, hvd.Sum, hvd.Average]
    handles = [hvd.sparse_allreduce_async(_sparse(r, salt=s), name=f"sp.{s}", op=op,
                                          process_set=process_set)
               for s, op in enumerate(ops)]
    assert all(callable(h) for h in handles)
    assert isinstance(hvd.poll(handles[2]), bool)
    got = [handles[0](), handles[1](), hvd.synchronize(handles[2])]
    for s, (op, out) in enumerate(zip(ops, got)):
        assert out.layout == torch.sparse_coo and out.is_coalesced()
        want = _reference(members, s, op == hvd.Average)
        assert torch.allclose(out.to_dense(), want, rtol=1e-13, atol=1e-15), (s, out, want)
    for h in handles:  # each result was taken: the handle is spent
        with pytest.raises(ValueError, match="unknown handle"):
            h()


def case_sparse_allreduce_handle_is_callable():
    _check_handles(list(range(hvd.size())))


def case_sparse_allreduce_handle_in_process_sets():
    n, r = hvd.size(), hvd.rank()
    if n == 1:  # (no odd set)
        return
    even, odd = list(range(0, n, 2)), list(range(1, n, 2))
    sets = [hvd.add_process_set(even), hvd.add_process_set(odd)]
    try:
        mine = sets[r % 2]
        _check_handles(even if r % 2 == 0 else odd, mine)
    finally:
        for ps in sets:
            hvd.remove_process_set(ps)


# --- DistributedOptimizer(sparse_as_dense=True) ------------------------------------------------

def _indices(q, step):
    """Rank q's embedding lookups at a step (rank 0 takes none at step 2: its gradient is
    absent, the reduced one is not)."""
    if q == 0 and step == 2:
        return None
    g = torch.Generator().manual_seed(100 * step + q)
    return torch.randint(0, VOCAB, (2, q + 2), generator=g)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=True).double()
        self.head = torch.nn.Linear(DIM, 1).double()

    def loss(self, idx, q):
        w = torch.arange(1.0, DIM + 1, dtype=torch.float64) * (q + 1)
        return (self.emb(idx) * w).sum() if self.head is None else \
            self.head(self.emb(idx) * w).pow(2).sum()


def _dense_grads(model, q, step):
    """Rank q's gradients at step (float64, dense), on a copy of model."""
    net = copy.deepcopy(model)
    idx = _indices(q, step)
    if idx is None:
        return [torch.zeros_like(p) for p in net.parameters()]
    net.loss(idx, q).backward()
    return [p.grad.to_dense() for p in net.parameters()]


def case_sparse_as_dense_gives_sparse_gradients():
    """SparseAdam on an embedding through DistributedOptimizer(sparse_as_dense=True): .grad is
    the averaged gradient made sparse again, on every rank (a rank with no lookups too), and
    the steps match SparseAdam stepping on the float64 average of every rank's gradient."""
    n, r = hvd.size(), hvd.rank()
    net, ref = _Net(), _Net()
    net.head = ref.head = None
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(net.parameters()), lr=0.1),
                                   sparse_as_dense=True)
    ropt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        idx = _indices(r, step)
        if idx is not None:
            net.loss(idx, r).backward()
        opt.step()
        grad = net.emb.weight.grad
        want = sum(_dense_grads(ref, q, step)[0] for q in range(n)) / n
        assert grad.layout == torch.sparse_coo, (step, grad.layout)
        assert grad.sparse_dim() == 1
        assert torch.allclose(grad.to_dense(), want, rtol=1e-13, atol=1e-15), step
        # rows holding a non-zero only (the rows no rank looked up are not in it)
        assert set(grad.coalesce().indices()[0].tolist()) == \
            set(torch.nonzero(want.abs().sum(1)).reshape(-1).tolist()), step
        ref.emb.weight.grad = want.to_sparse(1)
        ropt.step()
        assert torch.allclose(net.emb.weight, ref.emb.weight, rtol=1e-12, atol=1e-14), step
    same_everywhere(net.emb.weight.detach(), "SparseAdam parameters")


def case_sparse_as_dense_beside_dense_gradients():
    """A bucket holding a sparse gradient (densified) and dense ones, with SGD: the sparse
    member's .grad comes back sparse, the dense ones stay their bucket's views; the result is
    the same as without sparse_as_dense (reduced as sparse)."""
    n, r = hvd.size(), hvd.rank()
    results = {}
    for dense in (True, False):
        net = _Net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                       named_parameters=net.named_parameters(),
                                       sparse_as_dense=dense)
        ref = _Net()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad()
            idx = _indices(r, step)
            if idx is not None:
                net.loss(idx, r).backward()
            opt.step()
            every = [_dense_grads(ref, q, step) for q in range(n)]
            want = [sum(g[i] for g in every) / n for i in range(3)]
            assert net.emb.weight.grad.layout == torch.sparse_coo, (dense, step)
            for p, w in zip(net.parameters(), want):
                got = p.grad.to_dense() if p.grad.is_sparse else p.grad
                assert torch.allclose(got, w, rtol=1e-12, atol=1e-14), (dense, step)
            for p, w in zip(ref.parameters(), want):
                p.grad = w.clone()
            ropt.step()
            for p, q in zip(net.parameters(), ref.parameters()):
                assert torch.allclose(p, q, rtol=1e-12, atol=1e-14), (dense, step)
        results[dense] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert torch.allclose(results[True], results[False], rtol=1e-12, atol=1e-14)
    same_everywhere(results[True], "sparse_as_dense parameters")


# --- broadcast_optimizer_state of a fresh optimizer ---------------------------------------------

class _NoGrad(torch.nn.Module):
    """A frozen index parameter beside a trained one (Horovod's ModelNoGrad), and a layer."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = torch.nn.Parameter(torch.rand(4, generator=g, dtype=torch.float64))
        self.lin = torch.nn.Linear(4, 2).double()
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(2, 4, generator=g))
            self.lin.bias.copy_(torch.randn(2, generator=g))

    def forward(self, x):
        return self.lin(torch.index_select(self.b, 0, self.a.long()).repeat(2) * x)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def case_broadcast_state_of_a_fresh_optimizer():
    """A fresh SGD (momentum, weight decay) wrapped in DistributedOptimizer: its state is
    created on every rank (zero gradients on the parameters that require one, none on the
    frozen one; the momentum buffers SGD makes from them: weight_decay * p), the parameters
    keep their (broadcast) values, and training then runs alike everywhere."""
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    model = _NoGrad(seed=r)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=0.5, momentum=0.9,
                        nesterov=True), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    before = _params(model)
    assert before[1].equal(_params(_NoGrad(seed=root))[1])
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    assert model.a.grad is None
    for p, b in zip(model.parameters(), before):
        assert p.detach().equal(b)  # no parameter moved (Horovod's step would decay them)
        if p.requires_grad:
            assert p.grad is not None and p.grad.layout == torch.strided
            assert not p.grad.any()
            buf = opt.state[p]["momentum_buffer"]
            assert torch.allclose(buf, 0.5 * b, rtol=1e-15, atol=0)
    assert len(opt.state) == 3
    same_everywhere(torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                               for p in model.parameters() if p.requires_grad]), "buffers")
    x = torch.full((4,), float(r + 1), dtype=torch.float64)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    same_everywhere(torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]),
                    "parameters after a step")


def case_broadcast_state_fresh_adam_sparse_adam_and_stateless():
    """Adam (step 1, zero moments), SGD without momentum (no state: only its hyperparameters
    are broadcast; its weight decay moves nothing), SparseAdam and SGD given the model (zero
    gradients made sparse for its sparse embedding), LBFGS (left empty): none of them moves a
    parameter."""
    n, r = hvd.size(), hvd.rank()
    model = _Net()
    emb = model.emb.weight
    adam = torch.optim.Adam(model.head.parameters(), lr=0.001 * (r + 1))
    plain = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), weight_decay=0.1)
    sparse = torch.optim.SparseAdam([emb], lr=0.1)
    sgd = torch.optim.SGD([emb], lr=0.1, momentum=0.5)
    lbfgs = torch.optim.LBFGS(model.head.parameters())
    before = _params(model)
    for opt, given in ((adam, None), (plain, None), (sparse, None), (sgd, model),
                       (lbfgs, model)):
        if opt is sgd:
            emb.grad = None
        hvd.broadcast_optimizer_state(opt, root_rank=0, model=given)
        for p, b in zip(model.parameters(), before):
            assert p.detach().equal(b), type(opt).__name__
        if opt is plain:
            assert all(not p.grad.is_sparse and not p.grad.any() for p in model.parameters())
        if opt in (sparse, sgd):
            assert emb.grad.is_sparse and emb.grad._nnz() == 0, type(opt).__name__
    assert adam.param_groups[0]["lr"] == 0.001 and plain.param_groups[0]["lr"] == 0.1
    for p in model.head.parameters():
        s = adam.state[p]
        assert float(s["step"]) == 1.0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
    assert int(sparse.state[emb]["step"]) == 1 and "momentum_buffer" in sgd.state[emb]
    assert not plain.state and not lbfgs.state


def case_broadcast_state_root_holds_state_others_fresh():
    """The root has stepped (a checkpoint, say), the others are fresh: every rank ends with the
    root's state, and no rank's parameters moved."""
    n, r = hvd.size(), hvd.rank()
    model = _NoGrad(seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.3)
    if r == 0:
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, 2.0)
        opt.step()
    before = _params(model)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for p, b in zip(model.parameters(), before):
        assert p.detach().equal(b)
    same_everywhere(torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                               for p in model.parameters() if p.requires_grad]), "buffers")


def case_broadcast_state_creation_error_on_one_rank():
    """An optimizer whose creation step fails on one rank: that rank raises its error, the
    others a MismatchError naming it; nothing waits, and the next call works."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return

    class Picky(torch.optim.SGD):
        def step(self, closure=None):
            if hvd.rank() == n - 1:
                raise RuntimeError("this rank cannot step yet")
            return super().step(closure)
    model = _NoGrad(seed=1)
    opt = Picky(model.parameters(), lr=0.1, momentum=0.5)
    if r == n - 1:
        with pytest.raises(RuntimeError, match="cannot step yet"):
            hvd.broadcast_optimizer_state(opt, root_rank=0)
    else:
        with pytest.raises(hvd.MismatchError, match=rf"rank {n - 1} passed invalid input"):
            hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n


# --- step() after synchronize() -----------------------------------------------------------------

def case_step_after_synchronize_warns():
    """Horovod's warning: step() after synchronize() outside skip_synchronize() warns once;
    inside skip_synchronize(), without synchronize(), or with zero_grad() between them, it does
    not; either way the gradients are reduced once (clipped ones are not reduced again)."""
    n, r = hvd.size(), hvd.rank()
    model = torch.nn.Linear(1, 1).double()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.full((1, 1), float(r + 1), dtype=torch.float64)

    def grads():
        opt.zero_grad()
        model(x).sum().backward()

    def ref_step(clip):
        ropt.zero_grad()
        sum(ref(torch.full((1, 1), float(q + 1), dtype=torch.float64)).sum()
            for q in range(n)).div(n).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ropt.step()

    for how in ("plain", "skip", "warned", "plain", "zeroed"):
        if how == "zeroed":  # synchronize() of a step given up: zero_grad() starts the next
            opt.synchronize()
        grads()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how in ("plain", "zeroed"):
                opt.step()
            else:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                if how == "skip":
                    with opt.skip_synchronize():
                        opt.step()
                else:
                    opt.step()
        mine = [w for w in caught if "skip_synchronize" in str(w.message)]
        if how == "warned":
            assert len(mine) == 1, [str(w.message) for w in caught]
            assert str(mine[0].message).startswith(
                "optimizer.step() called without optimizer.skip_synchronize()")
            assert mine[0].filename == __file__  # points at the caller's step()
        else:
            assert not mine, (how, [str(w.message) for w in caught])
        ref_step(how in ("skip", "warned"))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-13, atol=1e-15), how
