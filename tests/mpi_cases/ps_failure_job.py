"""One parameter-server job in which a rank is killed (SIGKILL), run under
`mpirun --with-ft ulfm --mca mpi_ft_detector true` by tests/mpi/test_ps_failures.py.

usage: python -m tests.mpi_cases.ps_failure_job SCENARIO OUTDIR [AT]
  server-replica   mlfabric-A with a replica; the server dies after AT updates applied (default:
                   two per worker): the replica is promoted, training completes, divergence at the
                   failure <= Div_max (exactly)
  server-alone     no replica: the server dies; every survivor gets a clear error, nobody hangs
  worker-async     mlfabric-A; a worker dies mid-run; the others finish, accounts balance
  worker-sync      mlfabric-S; a worker dies mid-run; iterations go on with the others
  relay-sync       mlfabric-S, cut-through: a worker dies while a running sum streams through
Every surviving rank prints 'RESULT ok' or 'RESULT FAIL <why>'.
"""
import json
import os
import signal
import sys
import traceback

import numpy as np
from mpi4py import MPI

import mlfabric.ps as ps
from mlfabric._core import exit_guard
from mlfabric.emulate import Emulation
from mlfabric.errors import MlfabricError
from mlfabric.ps.driver import default_update, run_job
from mlfabric.runtime.roles import Roles

WORLD = MPI.COMM_WORLD
SIZE = 2003
ITERS = 12
EMU = Emulation(base_rate=50e6)  # 16 KB updates: ~0.3 ms each, so a run lasts a moment
DIV_MAX = 1.0                    # about three updates' worth (norms ~ 0.01 * sqrt(SIZE) ~ 0.45)


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def killing_update(victim, at):
    upd = default_update(SIZE, np.float64)

    def update(rank, i, model):
        if rank == victim and i == at:
            die()
        return upd(rank, i, model)
    return update


def server_replica(outdir, at=None):
    roles = Roles(WORLD.size, 1, 1)
    at = 2 * len(roles.worker_ranks) if at is None else int(at)
    role = ps.init("mlfabric-A", replicas=1, emulation=EMU, batch_interval=0.02)
    upd = default_update(SIZE, np.float64)
    if role == "server":
        log = []

        def apply(model, update, ids):  # the dead server's order survives it, for the check
            model += update
            log.extend(ids)
            with open(os.path.join(outdir, "server.json"), "w") as f:
                json.dump(log, f)
            if len(log) >= at:
                die()
        ps.register_as_server(np.zeros(SIZE), on_update=apply)
        ps.serve()
        raise AssertionError("the server outlived its kill")
    if role == "worker":
        ps.register_as_worker(div_max=DIV_MAX)
        for i in range(ITERS):
            model, _ = ps.get(1)
            ps.push(1, upd(WORLD.rank, i, model))
        summary = ps.finish()
    elif role == "replica":
        ps.register_as_replica(1)
        summary = ps.serve()
        applied = {u for ids, *_ in ps.applied_log() for u in ids}
        ref = sum((upd(u >> 32, u & 0xFFFFFFFF, None) for u in applied), np.zeros(SIZE))
        np.testing.assert_allclose(ps.local_model(), ref, rtol=1e-12, atol=1e-14)
        # divergence at the failure, exactly: what the dead server had applied beyond the
        # replica's model when it was promoted
        with open(os.path.join(outdir, "server.json")) as f:
            dead = json.load(f)
        (s, rank, count, _), = summary.failovers
        assert s == 1 and rank == WORLD.rank, summary.failovers
        order = [u for ids, *_ in ps.applied_log() for u in ids]
        common = min(count, len(dead))
        assert order[:common] == dead[:common], ("the replica left the server's order", count,
                                                 order[:count], dead)
        # the work the failure lost: what the dead server had applied beyond the replica's
        # model (the divergence gate bounds it at every instant). The replica can also be ahead
        # of the server (its copies came first): those updates are in the surviving model.
        vec = lambda ids: sum((upd(u >> 32, u & 0xFFFFFFFF, None) for u in ids), np.zeros(SIZE))
        lost, ahead = dead[count:], order[len(dead):count]
        d = float(np.linalg.norm(vec(lost) - vec(ahead)))
        lost_norm = float(np.linalg.norm(vec(lost)))
        print("failure after %d server commits: replica at %d, %d updates lost (norm %.4f), "
              "%d ahead; ||w_server - w_replica|| = %.4f (Div_max %.2f)"
              % (len(dead), count, len(lost), lost_norm, len(ahead), d, DIV_MAX))
        # the gate holds the server's lead within Div_max at every instant (what was lost), the
        # replica bounds its own, and no commit on either side weighs more than Div_max (the
        # scheduler's norm cap): the whole divergence is within the bound, whichever side leads
        assert lost_norm <= DIV_MAX + 1e-12, (lost_norm, DIV_MAX)
        assert d <= DIV_MAX + 1e-12, (d, DIV_MAX)
    else:
        summary = ps.serve()
    assert summary.failed == [1], summary.failed
    assert summary.balanced, summary
    assert summary.pushed == ITERS * len(roles.worker_ranks), summary
    (_, _, count, _), = summary.failovers
    assert summary.applied > count, summary   # training went on from the promoted replica


def server_alone(outdir):
    role = ps.init("mlfabric-A", emulation=EMU, batch_interval=0.02)
    upd = default_update(SIZE, np.float64)
    try:
        if role == "server":
            n = []

            def apply(model, update, ids):
                n.extend(ids)
                if len(n) >= 3:
                    die()
                model += update
            ps.register_as_server(np.zeros(SIZE), on_update=apply)
            ps.serve()
        elif role == "worker":
            ps.register_as_worker()
            for i in range(ITERS):
                model, _ = ps.get(1)
                ps.push(1, upd(WORLD.rank, i, model))
            ps.finish()
        else:
            ps.serve()
    except MlfabricError as e:
        assert "no live replica" in str(e) or "died" in str(e), e
        # a rank only told of the death (by the scheduler's error) bounds its exit too: the
        # detector may not have told it yet, and MPI_Finalize would wait on the dead server
        assert exit_guard._armed, "exit not bounded on rank %d" % WORLD.rank
        print("clear error: %s" % str(e)[:160])
        return
    raise AssertionError("no error after the server died")


def worker_job(mode):
    def job(outdir):
        roles = Roles(WORLD.size)
        victim = roles.worker_ranks[-1]
        bound = {"tau_max": 4} if mode == "mlfabric-A" else {}  # the one mode it bounds
        res = run_job(mode, size=SIZE, iterations=ITERS, emulation=EMU, batch_interval=0.02,
                      update_fn=killing_update(victim, ITERS // 2), **bound)
        s = res.summary
        assert s.failed == [victim], s.failed
        assert s.balanced, "%s; twice %s" % (s, [hex(u) for u in s.twice])
        live = len(roles.worker_ranks) - 1
        assert s.pushed >= ITERS * live, s
        if res.role == "server":
            upd = default_update(SIZE, np.float64)
            applied = {u for ids, *_ in res.applied_log for u in ids}
            ref = sum((upd(u >> 32, u & 0xFFFFFFFF, None) for u in applied), np.zeros(SIZE))
            np.testing.assert_allclose(res.model, ref, rtol=1e-12, atol=1e-14)
            if mode == "mlfabric-S":  # every iteration stepped, with or without the dead one
                assert res.applied_log[-1][1] == ITERS, res.applied_log[-1]
    return job


def relay_dies_mid_stream(outdir):
    """mlfabric-S with cut-through pipelines: the victim is killed 30 ms after computing its
    update of iteration 3, while the batch's running sum streams through the workers (4 MB
    payloads, 80 ms a transfer). Whatever the stream was doing then, the others finish, every
    update is applied or dropped with a reason (a sum voided by the death: 'aggregate-voided'),
    and the server's model is exactly the sum of what it applied."""
    import threading
    size, at = 500_003, 3
    roles = Roles(WORLD.size)
    victim = roles.worker_ranks[len(roles.worker_ranks) // 2]
    upd = default_update(size, np.float64)

    def update(rank, i, model):
        if rank == victim and i == at:
            threading.Timer(0.03, die).start()
        return upd(rank, i, model)
    res = run_job("mlfabric-S", size=size, iterations=6, emulation=EMU, batch_interval=0.02,
                  update_fn=update)
    s = res.summary
    assert s.failed == [victim], s.failed
    assert s.balanced, s
    assert set(s.dropped) <= {"aggregate-voided", "aggregator-failed", "worker-failed"}, s
    if res.role == "server":
        applied = {u for ids, *_ in res.applied_log for u in ids}
        ref = sum((upd(u >> 32, u & 0xFFFFFFFF, None) for u in applied), np.zeros(size))
        np.testing.assert_allclose(res.model, ref, rtol=1e-12, atol=1e-14)
        assert res.applied_log[-1][1] == 6, res.applied_log[-1]
        print("relay-sync: %s" % s, flush=True)


SCENARIOS = {"server-replica": server_replica, "server-alone": server_alone,
             "worker-async": worker_job("mlfabric-A"), "worker-sync": worker_job("mlfabric-S"),
             "relay-sync": relay_dies_mid_stream}


def main():
    scenario, outdir, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    try:
        SCENARIOS[scenario](outdir, *args)
        print("RESULT ok rank %d" % WORLD.rank, flush=True)
    except Exception:  # noqa: BLE001 - reported, the harness fails the test
        print("RESULT FAIL rank %d\n%s" % (WORLD.rank, traceback.format_exc()), flush=True)
    # survivors exit through MPI_Finalize, which a dead peer can hold up: mlfabric bounds it
    # (mlfabric/_core/exit_guard.py)


if __name__ == "__main__":
    main()
