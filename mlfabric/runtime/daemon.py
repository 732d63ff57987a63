"""The daemon thread of a rank (paper §4): one loop that takes the training thread's requests,
reads control messages, drives the data plane and gives the role its timed work (the scheduler's
batches, the monitor's reports). Only this thread touches the control channel and the data plane.

It holds the GIL only between MPI calls: waiting (MPI tests, sleeps) and the payload sums (the C++
kernels) release it, so the training thread computes while transfers proceed. When anything fails
here, the error is kept, every waiting call in the training thread gets it, and the other ranks are
told (control message 'error') so they stop with the same message instead of waiting on us.
"""
import threading
import time

from ..errors import MlfabricError
from .monitor import Reporter

IDLE_S = 0.002  # longest sleep while nothing is timed: a control message waits at most this


class Daemon(threading.Thread):
    def __init__(self, rt, role):
        super().__init__(name="mlfabric-daemon-%d" % rt.rank, daemon=True)
        self.rt, self.role = rt, role
        self.stop = False
        self.reporter = Reporter(rt.nic, rt.config.t_lag)

    def run(self):
        rt = self.rt
        try:
            self._loop()
            rt.channel.flush(5.0)
        except BaseException as e:  # noqa: B902 - everything must reach the training thread
            self._fail(e)

    def _loop(self):
        rt, role, reporter = self.rt, self.role, self.reporter
        channel, dp = rt.channel, rt.dp
        wake_in = getattr(role, "wake_in", None)
        while not self.stop:
            rt.wakeup.clear()
            now = time.monotonic()
            while True:
                try:
                    req = rt.requests.get_nowait()
                except Exception:
                    break
                role.on_request(req)
            for src, kind, body in channel.receive():
                self._control(src, kind, body)
            for msg in dp.progress(now):
                role.on_data(msg)
            role.tick(now)
            if rt.rank != 0 and reporter.due(now):
                channel.send(0, "report", reporter.report(now))
            elif rt.rank == 0 and reporter.due(now):
                role.caps.update(0, *reporter.report(now))
            channel.progress(now)
            if self.stop:
                break
            wait = min(dp.wake_in(now), IDLE_S)
            if wake_in is not None:
                wait = min(wait, wake_in(now))
            if wait > 0:
                rt.wakeup.wait(wait)

    def _control(self, src, kind, body):
        rt = self.rt
        if kind == "stop":
            rt.ledger.bytes_out, rt.ledger.bytes_in = (rt.nic.bytes_out,
                                                      max(rt.ledger.bytes_in, rt.nic.bytes_in))
            rt.channel.send(0, "ledger", rt.ledger)
        elif kind == "summary":
            rt.summary.set(body)
            self.stop = True
        elif kind == "error":
            raise MlfabricError(body)
        else:
            self.role.on_ctrl(src, kind, body)

    def _fail(self, e):
        rt = self.rt
        if not isinstance(e, MlfabricError) or not str(e).startswith("rank "):
            text = "rank %d (%s) failed: %s: %s" % (rt.rank, rt.role, type(e).__name__, e)
            err = MlfabricError(text)
            err.__cause__ = e
            for r in range(rt.size):
                if r != rt.rank:
                    try:
                        rt.channel.send(r, "error", text)
                    except Exception:
                        pass
            try:
                rt.channel.flush(2.0)
            except Exception:
                pass
        else:
            err = e
        rt.error = err
        rt.summary.fail(err)
        try:
            self.role.stopped(err)
        except Exception:
            pass
