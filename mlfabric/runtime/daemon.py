"""The daemon thread of a rank (paper §4): one loop that takes the training thread's requests,
reads control messages, drives the data plane and gives the role its timed work (the scheduler's
batches, the monitor's reports). Only this thread touches the control channel and the data plane.

It holds the GIL only between MPI calls: waiting (MPI tests, sleeps) and the payload sums (the C++
kernels) release it, so the training thread computes while transfers proceed. When anything fails
here, the error is kept, every waiting call in the training thread gets it, and the other ranks are
told (control message 'error') so they stop with the same message instead of waiting on us.
"""
import logging
import threading
import time
import traceback

from mpi4py import MPI

from .._core import config as _config, exit_guard, log as _mflog
from ..errors import MlfabricError, PeerTimeoutError
from .control import FAILURE_CLASSES
from .monitor import Reporter

# At debug (MLFABRIC_LOG_LEVEL=debug, or MLFABRIC_DEBUG=1 for the runtime alone): every control
# message and failure, one line each (logger mlfabric.runtime, see _core/log.py). A bad
# MLFABRIC_DEBUG is an error as soon as the runtime is imported.
_config.debug_enabled()
_log = logging.getLogger("mlfabric.runtime")
# Longest sleep while nothing is timed: a control message waits at most this. A role may ask for
# less while it expects an answer (poll_s()): the scheduler always (it is the control plane's
# hub, and it has a machine of its own in the paper), a worker while its updates wait for a plan.
IDLE_S = 0.002


class Daemon(threading.Thread):
    def __init__(self, rt, role):
        super().__init__(name="mlfabric-daemon-%d" % rt.rank, daemon=True)
        self.rt, self.role = rt, role
        _mflog.configure(rt.rank)  # mlfabric.ps runs without mlfabric.init()
        self.debug = _log.isEnabledFor(logging.DEBUG)  # read once: the loop checks it per message
        self.stop = False
        self.reporter = Reporter(rt.nic, rt.config.t_lag)
        # liveness of this loop (api._end reads it): the end of the last whole pass, so a loop
        # that keeps meeting an error before its timed work (the scheduler's 'alive' messages,
        # its checks) counts as stopped, not as turning
        self.last_turn = time.monotonic()
        # payloads (and void ones) taken from the data plane whose handling a failure
        # interrupted: handled first at the next pass
        self._data, self._voided = [], []

    def run(self):
        rt = self.rt
        try:
            self._loop()
            rt.channel.flush(5.0)
        except BaseException as e:  # noqa: B902 - everything must reach the training thread
            self._fail(e)

    def _loop(self):
        while not self.stop:
            try:
                self._turn()
            except MPI.Exception as e:
                if e.Get_error_class() not in FAILURE_CLASSES:
                    raise
                if self.debug:
                    _debug(self.rt, "MPI error %d at %s" % (e.Get_error_class(), "".join(
                        traceback.format_tb(e.__traceback__)[-2:]).replace("\n", " | ")))
                self._peers_failed()
                limit = _config.timeout_s()
                if time.monotonic() - self.last_turn > limit:
                    # acknowledged, yet met again at every pass: the timed work (liveness, the
                    # scheduler's batches and end) never runs; an error, not a silent loop
                    raise PeerTimeoutError(
                        "no pass of this rank's daemon completed for %.0f s (MLFABRIC_TIMEOUT="
                        "%g s): each met a peer failure again (MPI error class %d at %s)"
                        % (time.monotonic() - self.last_turn, limit, e.Get_error_class(),
                           _where(e))) from e

    def _peers_failed(self):
        """ULFM told us a peer died: acknowledge it on both communicators (so receives from any
        source work again), forget every transfer with it, and let the role recover (a worker's
        work is dropped with its reason, a server's replica is promoted, ...)."""
        rt = self.rt
        failed = set()
        for comm in (rt.ctrl, rt.data):
            comm.Ack_failed()
            g = comm.Get_failed()
            failed.update(MPI.Group.Translate_ranks(g, list(range(g.Get_size())),
                                                    comm.Get_group()))
        new = sorted(failed - rt.failed)
        if not new:  # a flow with a peer already known dead: drop it too (forget is idempotent)
            for r in rt.failed:
                rt.dp.forget_peer(r)
            return
        rt.failed.update(new)
        exit_guard.peer_failed()  # Open MPI's finalize may now wait on the dead forever
        if self.debug:
            _debug(rt, "ranks %s failed" % new)
        lost = []
        for r in new:
            rt.channel.forget(r)
            lost += rt.dp.forget_peer(r)
        if 0 in new:
            raise MlfabricError("the scheduler (rank 0) died: the job cannot go on without it")
        self.role = self.role.peers_failed(new, lost) or self.role

    def _turn(self):
        """One pass: requests, control, data, timed work, then sleep until something is due.
        self.role is read afresh at each step: a promotion replaces it mid-pass."""
        rt, reporter = self.rt, self.reporter
        channel, dp = rt.channel, rt.dp
        rt.wakeup.clear()
        now = time.monotonic()
        while True:
            try:
                req = rt.requests.get_nowait()
            except Exception:
                break
            self.role.on_request(req)
        _each(channel.receive(), lambda m: self._control(*m), channel.put_back)
        self._failure_met()
        self._data, data = [], self._data + dp.progress(now)
        _each(data, lambda m: self.role.on_data(m), self._data.extend)
        self._failure_met()
        self._voided, voided = [], self._voided + dp.take_voided()   # streams whose source failed
        _each(voided, lambda v: self._on_voided(*v), self._voided.extend)
        self._failure_met()
        self.role.tick(now)
        self._failure_met()
        if reporter.due(now):
            rates = reporter.report(now)
            if rt.rank == 0:
                self.role.caps.update(0, *rates)
            else:
                channel.send(0, "report", rates)
        channel.progress(now)
        self.last_turn = time.monotonic()
        if self.stop:
            return
        poll = getattr(self.role, "poll_s", None)
        wait = min(dp.wake_in(now), IDLE_S if poll is None else poll())
        wake_in = getattr(self.role, "wake_in", None)
        if wake_in is not None:
            wait = min(wait, wake_in(now))
        if wait > 0:
            rt.wakeup.wait(wait)

    def _failure_met(self):
        """A send of this pass was refused because its destination had died (Channel.send):
        acknowledge the failure now, between handlers, as if an MPI call had raised it."""
        e = self.rt.channel.take_failure()
        if e is not None:
            raise e

    def _on_voided(self, src, key, why):
        on_voided = getattr(self.role, "on_voided", None)
        if on_voided is None:
            raise RuntimeError("rank %d (%s): unexpected void payload %r from %d (%s)"
                               % (self.rt.rank, self.rt.role, key, src, why))
        on_voided(src, key, why)

    def _control(self, src, kind, body):
        rt = self.rt
        if self.debug:
            _debug(rt, "from %d: %s %s" % (src, kind, _short(body)))
        if kind == "stop":
            rt.ledger.bytes_out, rt.ledger.bytes_in = rt.nic.bytes_out, rt.nic.bytes_in
            rt.ledger.plan_latency = getattr(self.role, "plan_latency", rt.ledger.plan_latency)
            rt.channel.send(0, "ledger", rt.ledger)
        elif kind == "summary":
            rt.summary.set(body)
            self.stop = True
        elif kind == "alive":
            pass  # the scheduler runs (Channel.heard noted it)
        elif kind == "error":
            raise MlfabricError(body)
        elif kind == "promote":   # the role itself may change (a replica becomes a server)
            self.role = self.role.on_promote(*body) or self.role
        else:
            self.role.on_ctrl(src, kind, body)

    def _fail(self, e):
        rt = self.rt
        # the job ends out of step: a peer may have died (this rank may only have been told, and
        # ULFM's detector may not have told it yet) or still be mid-collective, and Open MPI's
        # MPI_Finalize would wait for it forever: bound this rank's exit
        exit_guard.out_of_step()
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


def _each(items, handle, put_back):
    """handle(item) for each item in turn; when one raises an MPI error (a peer's failure,
    met by a handler's own MPI call), the items after it are put back for the next pass before
    the error goes on to be handled: a failure must not make the daemon forget messages it had
    already taken (a worker's 'done', a replica's 'promoted': the job would wait for them
    forever)."""
    for k, item in enumerate(items):
        try:
            handle(item)
        except MPI.Exception:
            put_back(items[k + 1:])
            raise


def _where(e):
    """Where an exception was raised, in one line."""
    frames = traceback.extract_tb(e.__traceback__)[-2:]
    return " < ".join("%s:%d" % (f.name, f.lineno) for f in reversed(frames))


def _debug(rt, text):
    _log.debug("%.3f %s %s", rt.now(), rt.role, text)


def _short(body):
    text = repr(body)
    return text if len(text) < 200 else text[:200] + "..."
