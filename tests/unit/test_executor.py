"""mlfabric/comm/executor.py without MPI: issue order, Handle.wait's semantics (timeouts, several
waiters, errors) and the hand-over of queued calls to a running one (queued / take / finish),
which tensor fusion (mlfabric.torch.ops) builds on."""
import threading
import time

import pytest

from mlfabric.comm.executor import Executor, Handle
from mlfabric.errors import MlfabricError


def test_calls_run_in_issue_order_and_blocking_ones_wait_for_queued_ones():
    ex, seen = Executor(), []
    handles = [ex.submit(f"c{i}", lambda i=i: seen.append(i) or i) for i in range(200)]
    assert ex.run("blocking", lambda: len(seen)) == 200
    assert [h.wait() for h in handles] == list(range(200))
    assert ex.pending == 0
    ex.shutdown()


@pytest.mark.parametrize("timeout", [0, -1, 0.05])
def test_wait_with_a_timeout_on_an_unfinished_call_raises_promptly(timeout):
    h = Handle("allreduce")
    start = time.monotonic()
    with pytest.raises(MlfabricError, match="allreduce: not finished after"):
        h.wait(timeout)
    assert time.monotonic() - start < 2
    assert not h.done()


def test_every_waiter_gets_the_result_and_later_waits_return_at_once():
    h, got = Handle("x"), []
    waiters = [threading.Thread(target=lambda: got.append(h.wait())) for _ in range(6)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    h._finish(result=42)
    for w in waiters:
        w.join(10)
    assert got == [42] * 6
    assert h.done() and h.wait(0) == 42


def test_an_error_is_raised_by_wait():
    ex = Executor()
    h = ex.submit("bad", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        h.wait(10)
    assert h.done()
    ex.shutdown()


def test_a_running_call_takes_the_tagged_calls_queued_behind_it():
    ex, release, seen = Executor(), threading.Event(), {}

    def head():
        release.wait(10)  # the others are queued by now
        seen["tags"] = ex.queued(10)  # up to the first untagged call
        taken = ex.take(2)
        ex.finish(taken, results=["a", "b"])
        return "head"

    first = ex.submit("head", head)
    tagged = [ex.submit(f"t{i}", lambda: "ran itself", tag=i) for i in range(3)]
    untagged = ex.submit("u", lambda: "untagged")
    release.set()
    assert first.wait(10) == "head"
    assert seen["tags"] == [0, 1, 2]
    assert [h.wait(10) for h in tagged] == ["a", "b", "ran itself"]
    assert untagged.wait(10) == "untagged"
    ex.run("sync", lambda: None)
    assert ex.pending == 0
    ex.shutdown()
