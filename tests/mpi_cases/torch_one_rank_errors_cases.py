"""Multi-rank cases: one rank's bad input, and the others' good one, in the same call of
mlfabric.torch. The bad rank raises its own error; every other rank raises promptly, an error
naming that rank (never a wait until MLFABRIC_TIMEOUT: the harness keeps it short, and a
PeerTimeoutError fails the case); then the ranks are still in step (a collective works).

The bad rank is the last one (so the root, rank 0, is not it unless there is one rank); with one
rank only its own error is checked."""
import pytest
import torch

import mlfabric.torch as hvd


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()


def _one_bad(bad_call, good_call, bad_error, others_error=hvd.MismatchError,
             others_match=None):
    """bad_call() on the last rank must raise bad_error; good_call() on the others must raise
    others_error matching others_match (default: naming the last rank as the one that
    rejected its call); then an allreduce works everywhere."""
    n, r = hvd.size(), hvd.rank()
    bad = n - 1
    if others_match is None:
        others_match = rf"rank\(s\) \[{bad}\]"
    if r == bad:
        with pytest.raises(bad_error) as info:
            bad_call()
        assert not isinstance(info.value, hvd.PeerTimeoutError), info.value
    else:
        with pytest.raises(others_error, match=others_match):
            good_call()
    _still_in_step()


def _still_in_step():
    n = hvd.size()
    assert hvd.allreduce(torch.ones(5), op=hvd.Sum).tolist() == [n] * 5


# --- arguments checked before the call had a state to reject on ----------------------------------

def case_process_set_that_is_not_one():
    _one_bad(lambda: hvd.allreduce(torch.ones(3), process_set="x"),
             lambda: hvd.allreduce(torch.ones(3)), TypeError)


def case_prescale_factor_too_large_for_a_float():
    _one_bad(lambda: hvd.allreduce(torch.ones(3), prescale_factor=10 ** 400),
             lambda: hvd.allreduce(torch.ones(3)), (OverflowError, ValueError))


def case_join_with_a_device_that_is_not_one():
    _one_bad(lambda: hvd.join(None), lambda: hvd.allreduce(torch.ones(3)), TypeError)
    assert hvd.join() == hvd.size() - 1  # all join in one round: the highest rank is 'last'


def case_add_process_set_of_names():
    _one_bad(lambda: hvd.add_process_set(["a"]), lambda: hvd.add_process_set([0]), TypeError)


def case_remove_process_set_of_a_list():
    ps = hvd.add_process_set([0])
    _one_bad(lambda: hvd.remove_process_set([0]), lambda: hvd.remove_process_set(ps), TypeError)
    assert hvd.remove_process_set(ps) is True


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def case_distributed_optimizer_of_a_model():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _one_bad(lambda: hvd.DistributedOptimizer(model),
             lambda: hvd.DistributedOptimizer(opt, model.named_parameters()), TypeError,
             others_match=rf"rank\(s\) \[{hvd.size() - 1}\] refused")


def case_distributed_optimizer_predivide_factor_not_a_number():
    model = _model()

    def make(factor):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return hvd.DistributedOptimizer(opt, model.named_parameters(),
                                        gradient_predivide_factor=factor)
    _one_bad(lambda: make("x"), lambda: make(1.0), (TypeError, ValueError),
             others_match=rf"rank\(s\) \[{hvd.size() - 1}\] refused")


def case_broadcast_parameters_with_a_value_that_is_not_a_tensor():
    w = torch.ones(3)
    _one_bad(lambda: hvd.broadcast_parameters({"w": w, "extra": 1.0}, root_rank=0),
             lambda: hvd.broadcast_parameters({"w": w}, root_rank=0), TypeError,
             others_match=rf"rank {hvd.size() - 1} passed invalid input")


def case_adasum_prescale_factor_not_a_number():
    _one_bad(lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum, prescale_factor="abc"),
             lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum), (TypeError, ValueError))


# --- failures that used to come after the first of several collectives ---------------------------

def case_grouped_allreduce_into_an_expanded_tensor():
    """An expanded tensor (stride 0: its elements share memory) cannot take a result in place;
    with two dtypes the call is two collectives, and the copy-back after the first failed."""
    def call(last):
        return hvd.grouped_allreduce_([torch.ones(2, dtype=torch.float64), last], op=hvd.Sum)
    _one_bad(lambda: call(torch.ones(1).expand(4)), lambda: call(torch.ones(4)), ValueError)


def case_allreduce_in_place_into_interleaved_elements():
    """as_strided rows that overlap (no stride 0): an allreduce_ there would keep one of several
    results per element (or fail writing back after its peers moved on): refused up front, in
    the in-place and the fused async path alike."""
    def overlapping():
        return torch.zeros(6).as_strided((3, 3), (1, 1))
    _one_bad(lambda: hvd.allreduce_(overlapping(), op=hvd.Sum),
             lambda: hvd.allreduce_(torch.zeros(3, 3), op=hvd.Sum), ValueError)
    _one_bad(lambda: hvd.synchronize(hvd.allreduce_async_(overlapping(), op=hvd.Sum)),
             lambda: hvd.synchronize(hvd.allreduce_async_(torch.zeros(3, 3), op=hvd.Sum)),
             ValueError)


def case_broadcast_parameters_into_an_expanded_tensor():
    def params(last):
        return [("a", torch.ones(2, dtype=torch.float64)), ("b", last)]
    _one_bad(lambda: hvd.broadcast_parameters(params(torch.ones(1).expand(4)), root_rank=0),
             lambda: hvd.broadcast_parameters(params(torch.ones(4)), root_rank=0), ValueError)


def _load_or_fail(bad):
    if hvd.rank() == bad:
        raise RuntimeError("this rank cannot load it")
    return "loaded"


class _LoadsEverywhereButOn:
    """Pickles anywhere; unpickling raises on rank `bad` only (a class missing there, say)."""

    def __init__(self, bad):
        self.bad = bad

    def __reduce__(self):
        return _load_or_fail, (self.bad,)


def case_broadcast_object_that_one_rank_cannot_unpickle():
    n = hvd.size()
    if n == 1:
        return  # the root's own object comes back without unpickling
    _one_bad(lambda: hvd.broadcast_object(_LoadsEverywhereButOn(n - 1), root_rank=0),
             lambda: hvd.broadcast_object(_LoadsEverywhereButOn(n - 1), root_rank=0),
             RuntimeError, hvd.MlfabricError, rf"rank\(s\) \[{n - 1}\] could not unpickle")


def case_allgather_object_that_one_rank_cannot_unpickle():
    n = hvd.size()
    _one_bad(lambda: hvd.allgather_object(_LoadsEverywhereButOn(n - 1)),
             lambda: hvd.allgather_object(_LoadsEverywhereButOn(n - 1)),
             RuntimeError, hvd.MlfabricError, rf"rank\(s\) \[{n - 1}\] could not unpickle")


def case_optimizer_state_that_one_rank_cannot_unpickle():
    """The skeleton is pickled, its tensors broadcast after it: a rank that cannot load the
    skeleton must not leave the others waiting in the tensors' broadcast."""
    n = hvd.size()
    if n == 1:
        return
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.param_groups[0]["odd"] = _LoadsEverywhereButOn(n - 1)
    _one_bad(lambda: hvd.broadcast_optimizer_state(opt, root_rank=0),
             lambda: hvd.broadcast_optimizer_state(opt, root_rank=0),
             RuntimeError, hvd.MlfabricError, rf"rank\(s\) \[{n - 1}\] could not unpickle")


def case_sparse_allreduce_with_a_process_set_that_is_not_one():
    t = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    _one_bad(lambda: hvd.sparse_allreduce_async(t, process_set="x"),
             lambda: hvd.synchronize(hvd.sparse_allreduce_async(t)), TypeError)


# --- mlfabric.torch.ps_init (and mlfabric.ps.init: they agree before starting) -----------------

def _ps_init_one_bad(bad_args, bad_error):
    """ps_init(**bad_args) on the last rank, ps_init("async") on the others. A job needs a
    scheduler, a server and a worker: with fewer ranks the others refuse the size on their own
    (their own error, not one naming the last rank), and one rank only checks its own error."""
    big_enough = hvd.size() >= 3
    _one_bad(lambda: hvd.ps_init(**bad_args), lambda: hvd.ps_init("async"), bad_error,
             hvd.MismatchError if big_enough else hvd.MlfabricError,
             None if big_enough else "too few")


def case_ps_init_with_a_mode_that_is_not_one():
    """The others used to go on into mlfabric.ps.init's communicator Dup and wait there forever
    (MPI's own collective: no MLFABRIC_TIMEOUT)."""
    _ps_init_one_bad({"mode": "nope"}, ValueError)
    _ps_init_one_bad({"mode": ["async"]}, ValueError)


def case_ps_init_with_settings_it_refuses():
    _ps_init_one_bad({"mode": "async", "slack": -1}, hvd.MlfabricError)
    _ps_init_one_bad({"mode": "async", "tau_max": 4}, TypeError)  # a PSOptimizer argument
    _ps_init_one_bad({"mode": "async", "servers": 0}, hvd.MlfabricError)
    _ps_init_one_bad({"mode": "async", "comm": "world"}, TypeError)


# --- mlfabric.torch.elastic ----------------------------------------------------------------------

def case_elastic_run_with_a_state_that_is_not_one():
    """The others, in the state's sync(), used to wait for the timeout and then take this live
    rank for a dead one (a reset)."""
    @hvd.elastic.run
    def work(state):
        return state.x

    _one_bad(lambda: work(None), lambda: work(hvd.elastic.ObjectState(x=1)), TypeError)
    assert work(hvd.elastic.ObjectState(x=hvd.rank())) == 0  # rank 0's, synced


def _layouts_differ(bad_state, good_state):
    """sync() of states that differ in layout on the last rank: a MismatchError everywhere
    (there used to be none: the difference went unnoticed). One rank has nothing to differ from."""
    if hvd.size() > 1:
        _one_bad(lambda: bad_state().sync(), lambda: good_state().sync(), hvd.MismatchError)


def case_elastic_state_with_an_attribute_rank_0_lacks():
    """The attribute was never synced: the last rank kept its own value."""
    _layouts_differ(lambda: hvd.elastic.ObjectState(epoch=0, batch=hvd.rank()),
                    lambda: hvd.elastic.ObjectState(epoch=0))


def case_elastic_sampler_with_another_seed():
    """Each rank shuffles by its own seed: the ranks' shares overlapped and missed indices."""
    def state(seed):
        return lambda: hvd.elastic.TorchState(
            sampler=hvd.elastic.ElasticSampler(range(10), seed=seed), epoch=0)
    _layouts_differ(state(1), state(0))


def case_elastic_sampler_over_another_dataset():
    def state(size):
        return lambda: hvd.elastic.TorchState(sampler=hvd.elastic.ElasticSampler(range(size)))
    _layouts_differ(state(11), state(10))
