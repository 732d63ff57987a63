"""Runs one module of multi-rank test cases inside an mpirun job (started by tests/mpi_util.py).

Every function named case_* in the module runs on every rank, in order. After each case the ranks
agree (an MPI allgather on COMM_WORLD, outside mlfabric) on who failed, so a failure on one rank is
reported by all and the job moves on instead of hanging; a rank stuck inside a collective is freed by
mlfabric's own timeout (MLFABRIC_TIMEOUT, set short by the harness). Exit status 1 if any case failed.

usage: python -m tests.mpi_cases.runner MODULE [SUBSTRING]
"""
import importlib
import sys
import time
import traceback

import pytest
from mpi4py import MPI


def main():
    modname = sys.argv[1]
    pattern = sys.argv[2] if len(sys.argv) > 2 else ""
    world = MPI.COMM_WORLD
    mod = importlib.import_module(f"tests.mpi_cases.{modname}")
    setup = getattr(mod, "setup", None)
    if setup:
        setup()
    cases = [(name, fn) for name, fn in vars(mod).items()
             if name.startswith("case_") and callable(fn) and pattern in name]
    failed = []
    for name, fn in cases:
        t0 = time.perf_counter()
        try:
            fn()
            err = None
        except (Exception, pytest.fail.Exception):  # noqa: BLE001 - every failure is reported,
            err = traceback.format_exc()            # then agreed on (pytest's "DID NOT RAISE"
            #                                         is a BaseException: it would end this rank)
        errs = world.allgather(err)
        bad = [r for r, e in enumerate(errs) if e]
        if world.rank == 0:
            status = "ok" if not bad else f"FAILED on ranks {bad}"
            print(f"[n={world.size}] {modname}.{name}: {status} ({time.perf_counter() - t0:.2f}s)",
                  flush=True)
            for r in bad:
                print(f"--- rank {r} ---\n{errs[r]}", flush=True)
        if bad:
            failed.append(name)
    teardown = getattr(mod, "teardown", None)
    if teardown:
        teardown()
    if world.rank == 0:
        print(f"{modname}: {len(cases) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
