"""Multi-rank cases of the pipeline's construction check (mlfabric.pipeline.stage.PipelineModel,
executor.PipelineExecutor), run on every rank by tests/mpi_cases/runner.py under real mpirun
(tests/mpi/test_pipeline_errors.py, at 2, 3 and 5 ranks).

Ranks that build different models or schedules (different cuts, as timing-based profiles give;
another layer count; a layer of another shape; another microbatch count) raise MismatchError on
every rank, promptly (well within MLFABRIC_TIMEOUT), with the same message naming what differs
and which ranks passed what; the pipeline's communicator stays usable (a model built alike
afterwards trains).
"""
import time

import torch
from mpi4py import MPI

from mlfabric.errors import MismatchError
from mlfabric.pipeline import flush
from mlfabric.pipeline.stage import PipelineModel

from .pipeline_cases import data, layers, loss_fn, sgd

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
R = WORLD.Get_rank()
LAST = P - 1
OTHERS = list(range(P - 1))


def setup():
    torch.set_num_threads(1)
    # the first optimizer imports torch._dynamo (seconds): not the check's time
    sgd()([torch.nn.Parameter(torch.zeros(1))])


def expect_mismatch(build):
    """build() must raise MismatchError on this rank, within 5 s; the message is the same on
    every rank. Returns it."""
    WORLD.Barrier()
    t0 = time.monotonic()
    try:
        build()
    except MismatchError as e:
        text = str(e)
    else:
        raise AssertionError("rank %d: no MismatchError" % R)
    took = time.monotonic() - t0
    assert took < 5, "rank %d: the MismatchError took %.1f s" % (R, took)
    texts = WORLD.allgather(text)
    assert len(set(texts)) == 1, texts
    return text


def model(mods, **kw):
    kw.setdefault("schedule", flush(P, 2))
    return PipelineModel(mods, loss_fn=loss_fn, optimizer=sgd(), **kw)


def case_different_boundaries_fail_on_every_rank():
    # P + 2 layers; the last rank cuts one layer later everywhere (all cuts valid on each rank)
    cuts = list(range(2, P + 1)) if R == LAST else list(range(1, P))
    text = expect_mismatch(lambda: model(layers(P + 2), boundaries=cuts))
    assert "ranks disagree on the cuts (the first layer of each piece after the first): " \
        "%s on rank(s) %s; %s on rank(s) [%d]" % (list(range(1, P)), OTHERS,
                                                   list(range(2, P + 1)), LAST) in text, text
    assert "number of layers" not in text and "on the schedule" not in text, text
    assert "broadcast" in text, text  # the remedy


def case_different_layer_counts_fail_on_every_rank():
    text = expect_mismatch(lambda: model(layers(P + 1 if R == 0 else P)))
    assert "ranks disagree on the number of layers: %d on rank(s) [0]; %d on rank(s) %s" \
        % (P + 1, P, list(range(1, P))) in text, text


def case_a_layer_of_another_shape_fails_on_every_rank():
    # same count and cuts; the last rank's first layer has 7 outputs (and the next 7 inputs)
    def build():
        mods = layers(P + 1)
        if R == LAST:
            mods[0] = torch.nn.Sequential(torch.nn.Linear(5, 7).double(), torch.nn.Tanh())
            mods[1] = torch.nn.Sequential(torch.nn.Linear(7, 6).double(), torch.nn.Tanh())
        model(mods)
    text = expect_mismatch(build)
    assert "ranks disagree on the layers (first at layer 0): " \
        "Sequential[Linear, Tanh](0.weight 6x5 float64, 0.bias 6 float64) on rank(s) %s; " \
        "Sequential[Linear, Tanh](0.weight 7x5 float64, 0.bias 7 float64) on rank(s) [%d]" \
        % (OTHERS, LAST) in text, text
    assert "the cuts" not in text, text


def case_a_frozen_layer_on_one_rank_fails_on_every_rank():
    def build():
        mods = layers(P)
        if R == 0:
            mods[LAST].weight.requires_grad_(False)
        model(mods)
    text = expect_mismatch(build)
    assert "(first at layer %d)" % LAST in text and "weight 3x6 float64 frozen" in text, text


def case_different_microbatches_by_name_fail_on_every_rank():
    text = expect_mismatch(lambda: model(layers(P), schedule="flush",
                                         microbatches=3 if R == 0 else 2))
    assert "ranks disagree on the schedule: schedule flush p=%d m=3" % P in text, text
    assert "on rank(s) [0]; schedule flush p=%d m=2" % P in text, text


def case_after_a_mismatch_a_model_built_alike_trains():
    try:
        model(layers(P + 1), boundaries=list(range(1, P)) if R else list(range(2, P + 1)))
    except MismatchError:
        pass
    m = model(layers(P + 1), boundaries=list(range(2, P + 1)))
    x, y = data(4)
    loss = m.train_step(x, y)
    assert (loss is not None) == m.is_last and (loss is None or loss > 0), loss
