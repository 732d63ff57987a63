"""Multi-rank cases for the control channel (mlfabric.runtime.control); run by
tests/mpi/test_control.py under mpirun. Each case makes its own channel on a fresh Dup of COMM_WORLD.

What is pinned down: messages carry their number on their (sender, receiver) pair, a gap is a
clear error, and close() takes every message still on the way so that none is left when the
communicator is freed. Open MPI hands a message that reaches a freed communicator to the next
communicator given the same context id, which is how a late monitor report once took the place of
a job's ledger (the job then waited MLFABRIC_TIMEOUT for a message it had already been given).
"""
import time

from mpi4py import MPI

from mlfabric.errors import MlfabricError
from mlfabric.ps.driver import run_job
from mlfabric.runtime.control import TAG, Channel

world = MPI.COMM_WORLD
N, RANK = world.Get_size(), world.Get_rank()


def _take(ch, count, limit=10.0):
    """Receive through ch until `count` messages came; returns them."""
    got, end = [], time.monotonic() + limit
    while len(got) < count:
        got += ch.receive()
        assert time.monotonic() < end, f"rank {RANK}: {len(got)} of {count} messages in {limit}s"
        time.sleep(0.001)
    return got


def case_messages_arrive_in_order_and_counted():
    comm = world.Dup()
    ch = Channel(comm)
    for dst in range(N):
        if dst != RANK:
            for i in range(RANK + 2):
                ch.send(dst, "m", (RANK, i))
    got = _take(ch, sum(r + 2 for r in range(N) if r != RANK))
    assert ch.flush(10.0)
    for src in range(N):
        mine = [b for s, k, b in got if s == src]
        assert mine == ([] if src == RANK else [(src, i) for i in range(src + 2)]), (src, mine)
    assert ch.received.tolist() == [0 if r == RANK else r + 2 for r in range(N)]
    assert ch.sent.tolist() == [0 if r == RANK else RANK + 2 for r in range(N)]
    assert ch.close(10.0)
    comm.Free()


def case_close_takes_what_was_never_received():
    """Every rank sends each peer a few messages nobody receives, and some that are received;
    close() takes the rest, leaves nothing on the communicator, and the next communicator (Open
    MPI may give it the same context id) starts clean."""
    comm = world.Dup()
    ch = Channel(comm)
    for dst in range(N):
        if dst != RANK:
            for i in range(3):
                ch.send(dst, "early", i)
    _take(ch, 3 * (N - 1))
    late = 1 + RANK % 3
    for dst in range(N):
        if dst != RANK:
            for i in range(late):
                ch.send(dst, "late", i)
    assert ch.flush(10.0)
    assert ch.close(10.0)
    assert ch.received.tolist() == [0 if r == RANK else 3 + 1 + r % 3 for r in range(N)]
    assert not comm.Iprobe(MPI.ANY_SOURCE, TAG)
    comm.Free()
    # a peer that frees its communicator first cannot leave anything behind for the next one
    comm2 = world.Dup()
    ch2 = Channel(comm2)
    if N > 1:
        ch2.send((RANK + 1) % N, "next job", RANK)
        got = _take(ch2, 1)
        assert got == [((RANK - 1) % N, "next job", (RANK - 1) % N)], got
    assert ch2.flush(10.0) and ch2.close(10.0)
    comm2.Free()


def case_a_gap_is_an_error_naming_the_message():
    comm = world.Dup()
    ch = Channel(comm)
    if N > 1:
        if RANK == 1:  # message number 5 where number 0 is due: as if 0-4 were lost
            comm.send((5, "ledger", None), 0, TAG)
        elif RANK == 0:
            end = time.monotonic() + 10
            while True:
                try:
                    ch.receive()
                except MlfabricError as e:
                    text = str(e)
                    break
                assert time.monotonic() < end, "no error for a message out of sequence"
                time.sleep(0.001)
            assert "'ledger' from rank 1 is number 5" in text and "expected number 0" in text, text
    world.Barrier()
    comm.Free()


def case_close_gives_up_when_a_peer_never_comes():
    """A rank that never reaches close(): the others give up after the timeout (False: keep the
    communicator) instead of hanging."""
    comm = world.Dup()
    ch = Channel(comm)
    if N > 1:
        if RANK == N - 1:
            result = None
        else:
            t0 = time.monotonic()
            result = ch.close(0.3)
            assert 0.25 < time.monotonic() - t0 < 5.0
        assert result in (None, False), result
    world.Barrier()  # comm is left unfreed, by design (an Ialltoall is pending on it)


def case_jobs_back_to_back_under_a_flood_of_reports():
    """Several short jobs in a row with a monitor report every millisecond: reports sent after a
    rank's ledger must never reach the next job (each job ends with every count matched)."""
    if N < 3:
        return  # a job needs a scheduler, a server and a worker
    for k in range(4):
        res = run_job("mlfabric-A", size=64, iterations=3, t_lag=0.001, batch_interval=0.005,
                      seed=k)
        s = res.summary
        assert s.balanced and s.pushed == s.applied + sum(s.dropped.values()), (k, s)
        assert s.pushed == 3 * (N - 2), (k, s)  # every worker's 3 pushes, nothing more
