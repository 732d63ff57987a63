"""mlfabric.pipeline: pipeline-parallel training after the PipeDream thesis (Narayanan, 2021).

Modules::

  schedules.py  schedules as data: GPipe, PipeDream 1F1B(-RR), 2BW, Flush, interleaved 1F1B
  validate.py   validator (dependencies, deadlock, weight-version policy), weight versions,
                synthetic timing (makespan, bubble, stashed activations, live weight versions)
  timeline.py   text and PNG Gantt charts of a timed schedule
  partition.py  the §2.4.1 partitioner (stages, replication, NOAM) and the 2BW planner
  profile.py    per-layer profiles (time, activation bytes, weight bytes)
  tensor_parallel.py  Megatron-style column/row-parallel layers, f/g, stage scatter/gather
  executor.py   runs one rank's action list over MPI (activations and gradients tagged by
                microbatch, shapes exchanged, weight versions, replicated stages allreduced)
  stage.py      the PyTorch front end: PipelineModel(layers, schedule=..., loss_fn, optimizer)

Importing this package starts no MPI and imports no torch: the tensor-parallel, executor and
front-end names (which need both) are imported on first use.
"""
from .schedules import (GENERATORS, POLICIES, Action, Placement, Schedule, by_name, flush,
                        format_actions, gpipe, interleaved, noam, one_f_one_b, parse_actions,
                        two_bw)
from .timeline import gantt, plot
from .validate import ScheduleError, Stats, Timeline, simulate, validate, weight_versions

_LAZY = {name: "executor" for name in ("PipelineExecutor", "PipelineError", "StageInputError",
                                        "PipelineTimeoutError", "StageDiedError")}
_LAZY.update({name: "stage" for name in ("PipelineModel", "split_layers", "stage_modules",
                                         "make_schedule")})
_LAZY.update({name: "tensor_parallel" for name in (
    "TPGroup", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention",
    "ParallelTransformerLayer", "SerialMLP", "SerialSelfAttention", "SerialTransformerLayer",
    "copy_to_tensor_parallel", "reduce_from_tensor_parallel", "gather_from_tensor_parallel",
    "scatter_to_tensor_parallel", "scatter_to_next", "gather_from_prev")})


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module("." + _LAZY[name], __name__), name)
    raise AttributeError("module 'mlfabric.pipeline' has no attribute %r" % name)


__all__ = list(_LAZY) + ["Action", "Placement", "Schedule", "POLICIES", "GENERATORS", "parse_actions",
           "format_actions", "gpipe", "flush", "one_f_one_b", "two_bw", "interleaved", "noam",
           "by_name", "ScheduleError", "Stats", "Timeline", "validate", "weight_versions",
           "simulate", "gantt", "plot"]
