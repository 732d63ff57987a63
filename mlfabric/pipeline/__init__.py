"""mlfabric.pipeline: pipeline-parallel training after the PipeDream thesis (Narayanan, 2021).

  schedules.py  schedules as data: GPipe, PipeDream 1F1B(-RR), 2BW, Flush, interleaved 1F1B
  validate.py   validator (dependencies, deadlock, weight-version policy), weight versions,
                synthetic timing (makespan, bubble, stashed activations, live weight versions)
  timeline.py   text and PNG Gantt charts of a timed schedule

Pure computation: importing this package starts no MPI and imports no torch.
"""
from .schedules import (GENERATORS, POLICIES, Action, Placement, Schedule, by_name, flush,
                        format_actions, gpipe, interleaved, noam, one_f_one_b, parse_actions,
                        two_bw)
from .timeline import gantt, plot
from .validate import ScheduleError, Stats, Timeline, simulate, validate, weight_versions

__all__ = ["Action", "Placement", "Schedule", "POLICIES", "GENERATORS", "parse_actions",
           "format_actions", "gpipe", "flush", "one_f_one_b", "two_bw", "interleaved", "noam",
           "by_name", "ScheduleError", "Stats", "Timeline", "validate", "weight_versions",
           "simulate", "gantt", "plot"]
