"""mlfabric.comm.wait in one process (no MPI): the polling schedule (on a fake clock), the
deadline and its bound's name, the peer-abort check, the give-up hook and the messages."""
import types

import pytest

from mlfabric.comm import wait
from mlfabric.errors import PeerTimeoutError


class FakeClock:
    """A clock that moves only when the code under test sleeps, yields or polls (by `tick`),
    recording what the schedule did."""

    def __init__(self, tick=1e-6):
        self.t, self.tick, self.log = 100.0, tick, []

    def perf_counter(self):
        self.t += self.tick
        return self.t

    def sleep(self, s):
        assert s > 0, s
        self.log.append(("sleep", s))
        self.t += s

    def sched_yield(self):
        self.log.append(("yield",))
        self.t += 1e-4


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(wait, "time", types.SimpleNamespace(perf_counter=c.perf_counter,
                                                            sleep=c.sleep))
    monkeypatch.setattr(wait, "os", types.SimpleNamespace(sched_yield=c.sched_yield))
    return c


@pytest.fixture(autouse=True)
def no_watch():
    previous = wait.watch(None)
    yield
    wait.watch(previous)


def counter(n):
    """done() that holds from its n-th call on; .calls counts the calls."""
    def done():
        done.calls += 1
        return done.calls >= n
    done.calls = 0
    return done


def test_done_at_once_costs_one_call():
    done = counter(1)
    assert wait.wait_until(done, "x", [1]) is None
    assert done.calls == 1


def test_returns_when_done_after_polls():
    done = counter(50)
    wait.wait_until(done, "x", [1], timeout=5)
    assert done.calls == 50


def test_schedule_spins_then_yields_then_sleeps_doubling(clock):
    with pytest.raises(PeerTimeoutError):
        wait.wait_until(lambda: clock.log.append(("poll",)), "x", [1], timeout=0.2)
    kinds = [e[0] for e in clock.log]
    first_yield, first_sleep = kinds.index("yield"), kinds.index("sleep")
    assert kinds[:10] == ["poll"] * 10  # the spin: polls only
    assert first_yield < first_sleep  # yields before any sleep
    kinds = [k for k in kinds if k != "poll"]
    first_sleep = kinds.index("sleep")
    assert set(kinds[first_sleep:]) == {"sleep"}
    naps = [e[1] for e in clock.log if e[0] == "sleep"]
    assert naps[0] == pytest.approx(wait.FIRST_NAP_S)
    assert naps[1] == pytest.approx(2 * wait.FIRST_NAP_S)
    assert max(naps) <= wait.MAX_SLEEP_S + 1e-12
    assert naps.count(wait.MAX_SLEEP_S) > 10  # capped, not growing
    assert clock.t - 100.0 < 0.2 + wait.MAX_SLEEP_S + 0.01  # never slept past the deadline


def test_backoff_stops_at_deadline(clock):
    back = wait.Backoff(0.01)
    n = 0
    while back.pause():
        n += 1
    assert n > 0 and back.now >= back.deadline and back.expired()
    assert back.timeout == 0.01


def test_backoff_since_shares_one_bound(clock):
    back = wait.Backoff(1.0, since=clock.perf_counter() - 5.0)
    assert not back.pause()


def test_timeout_names_operation_peers_and_bound():
    with pytest.raises(PeerTimeoutError) as e:
        wait.wait_until(lambda: False, ("allreduce of {} bytes", 8), [3, 1, 3], timeout=0.05,
                        bound="Work.wait's timeout")
    msg = str(e.value)
    assert msg.startswith("allreduce of 8 bytes: no progress from one or more of rank(s) [1, 3] "
                          "within 0.05 s (Work.wait's timeout)"), msg
    assert msg.endswith("The communicator is unusable now."), msg


def test_default_bound_is_mlfabric_timeout(monkeypatch):
    monkeypatch.setenv("MLFABRIC_TIMEOUT", "0.05")
    with pytest.raises(PeerTimeoutError, match=r"^op: no progress from rank\(s\) \[2\] within "
                                               r"0\.05 s \(MLFABRIC_TIMEOUT\)"):
        wait.wait_until(lambda: False, "op", [2])


def test_on_timeout_names_exactly_the_late_ranks():
    calls = []

    def on_timeout(why):
        calls.append(why)
        return [4, 2]
    with pytest.raises(PeerTimeoutError, match=r"no progress from rank\(s\) \[2, 4\] within"):
        wait.wait_until(lambda: False, "op", [1, 2, 4], timeout=0.02, on_timeout=on_timeout)
    assert calls == [None]


def test_on_timeout_may_raise_its_own_error():
    def on_timeout(why):
        raise KeyError("mine")
    with pytest.raises(KeyError, match="mine"):
        wait.wait_until(lambda: False, "op", [1], timeout=0.02, on_timeout=on_timeout)


def test_since_in_the_past_gives_up_after_the_spin():
    import time
    done = counter(10 ** 9)
    with pytest.raises(PeerTimeoutError, match="within 30 s"):
        wait.wait_until(done, "op", [1], timeout=30, since=time.perf_counter() - 60)
    assert done.calls >= 2


def test_watch_reason_ends_the_wait(clock):
    asked = counter(3)  # gives a reason from its 3rd call on

    def check():
        return "rank 1 gave up" if asked() else None
    hooks = []
    assert wait.watch(check) is None
    assert wait.watched() is check
    with pytest.raises(PeerTimeoutError) as e:
        wait.wait_until(lambda: False, "op", [1], timeout=100,
                        on_timeout=lambda why: hooks.append(why))
    assert str(e.value) == ("op: stopped waiting: rank 1 gave up. The communicator is unusable "
                            "now.")
    assert hooks == ["rank 1 gave up"] and asked.calls == 3
    assert clock.t - 100.0 < 1.0  # well before the deadline


def test_watch_is_per_thread_and_restorable():
    import threading
    first = lambda: None  # noqa: E731
    assert wait.watch(first) is None
    seen = []
    t = threading.Thread(target=lambda: seen.append(wait.watched()))
    t.start()
    t.join()
    assert seen == [None]
    assert wait.watch(None) is first


def test_reason_ignored_when_done_meanwhile(clock):
    state = {"reason_given": False}

    def check():
        state["reason_given"] = True
        return "gone"
    wait.wait_until(lambda: state["reason_given"], "op", [1], timeout=100, check=check)


def test_explicit_check_none_ignores_the_watch(clock):
    wait.watch(lambda: "gone")
    with pytest.raises(PeerTimeoutError, match="no progress"):
        wait.wait_until(lambda: False, "op", [1], timeout=0.05, check=None)


def test_check_error_and_done_error_propagate(clock):
    def check():
        raise LookupError("peer aborted")
    with pytest.raises(LookupError, match="peer aborted"):
        wait.wait_until(lambda: False, "op", [1], timeout=100, check=check)

    def done():
        raise ZeroDivisionError
    with pytest.raises(ZeroDivisionError):
        wait.wait_until(done, "op", [1], timeout=100)


def test_check_runs_every_interval_not_every_poll(clock):
    asked = counter(10 ** 9)
    polls = counter(10 ** 9)
    with pytest.raises(PeerTimeoutError):
        wait.wait_until(polls, "op", [1], timeout=0.1, check=lambda: None if asked() else None,
                        every=0.01)
    assert 5 <= asked.calls <= 11 < polls.calls


def test_poll_answers_without_error(clock):
    assert wait.poll(counter(5), timeout=5) is None
    stop = wait.poll(lambda: False, timeout=0.02)
    assert stop.reason is None and stop.timeout == 0.02
    assert str(stop.error("op", [1, 2], "B")).startswith(
        "op: no progress from rank(s) [1, 2] within 0.02 s (B)")
    wait.watch(lambda: "gone")
    stop = wait.poll(lambda: False, timeout=100)
    assert stop.reason == "gone" and "stopped waiting: gone" in str(stop.error("op", [1]))
    assert wait.poll(lambda: False, timeout=0.02, check=None).reason is None


def test_describe_formats_lazily():
    assert wait.describe("plain {}") == "plain {}"
    assert wait.describe(("{} of {}", "a", 2)) == "a of 2"


def test_nan_timeout_is_an_error_not_an_unbounded_wait():
    with pytest.raises(ValueError, match="nan"):
        wait.wait_until(lambda: False, "op", [1], timeout=float("nan"))


def test_zero_timeout_gives_up_after_the_spin():
    with pytest.raises(PeerTimeoutError, match="within 0 s"):
        wait.wait_until(lambda: False, "op", [1], timeout=0)
