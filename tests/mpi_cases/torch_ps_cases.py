"""mlfabric.torch's parameter-server optimizer under real mpirun (run by tests/mpi/test_torch_ps.py):
PSOptimizer in sync mode is data-parallel SGD (float64 reference on the concatenated batch), in
async mode every pushed change is accounted for and within tau_max, and misuse is refused."""
import numpy as np
import torch
from mpi4py import MPI

import mlfabric.torch as mft
from mlfabric.errors import MlfabricError
from mlfabric.runtime.roles import Roles

WORLD = MPI.COMM_WORLD
STEPS, BATCH, LR = 4, 5, 0.1


def model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).double()


def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(BATCH, 7, generator=g, dtype=torch.float64), \
        torch.randn(BATCH, 3, generator=g, dtype=torch.float64)


def case_sync_equals_sgd_on_the_concatenated_batch():
    roles = Roles(WORLD.size, 2 if WORLD.size >= 5 else 1, 0)
    servers = len(roles.server_ranks)
    role = mft.ps_init("sync", servers=servers, batch_interval=0.01)
    net = model()
    if role != "worker":
        mft.serve_model(net)
        return
    w = roles.worker_index(WORLD.rank)
    opt = mft.PSOptimizer(torch.optim.SGD(net.parameters(), lr=LR), net.parameters())
    # a torch optimizer of the wrapped one's class: a learning-rate scheduler drives it
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, mft.PSOptimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    for step in range(STEPS):
        x, y = batch(w, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        sched.step()
    assert abs(opt.state_dict()["param_groups"][0]["lr"] - LR * 0.7 ** STEPS) < 1e-15
    summary = opt.finish()
    assert summary.balanced and summary.applied == STEPS * len(roles.worker_ranks) * servers
    ref = model()   # one process, the workers' batches concatenated (equal sizes: mean of means)
    sgd = torch.optim.SGD(ref.parameters(), lr=LR)
    rsched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.7)
    for step in range(STEPS):
        xs, ys = zip(*(batch(k, step) for k in range(len(roles.worker_ranks))))
        sgd.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        sgd.step()
        rsched.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=0, atol=1e-10)


def case_async_accounts_for_every_change():
    roles = Roles(WORLD.size, 1, 0)
    role = mft.ps_init("async", batch_interval=0.01)
    net = model()
    if role != "worker":
        summary = mft.serve_model(net)
        if role == "server":
            assert summary.balanced and summary.applied + sum(summary.dropped.values()) \
                == summary.pushed == STEPS * 2 * len(roles.worker_ranks)
        return
    w = roles.worker_index(WORLD.rank)
    opt = mft.PSOptimizer(torch.optim.SGD(net.parameters(), lr=LR), net.parameters(), tau_max=3)
    for step in range(2 * STEPS):
        x, y = batch(w, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    summary = opt.finish()
    assert summary.balanced and summary.max_delay <= 3, summary


def case_misuse_is_refused_with_clear_errors():
    try:
        mft.ps_init("nonsense")
    except ValueError as e:
        assert "mode must be one of" in str(e)
    else:
        raise AssertionError("bad mode accepted")
    role = mft.ps_init("sync", batch_interval=0.01)
    net = model()
    if role == "worker":
        try:
            mft.serve_model(net)
        except MlfabricError as e:
            assert "PSOptimizer" in str(e)
        else:
            raise AssertionError("serve_model accepted on a worker")
        opt = mft.PSOptimizer(torch.optim.SGD(net.parameters(), lr=LR), net.parameters())
        opt.finish()
    else:
        try:
            mft.PSOptimizer(torch.optim.SGD(net.parameters(), lr=LR), net.parameters())
        except MlfabricError as e:
            assert "worker ranks" in str(e)
        else:
            raise AssertionError("PSOptimizer accepted on a %s" % role)
        mft.serve_model(net)
