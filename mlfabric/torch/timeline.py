"""The timeline (Horovod's HOROVOD_TIMELINE / start_timeline): every mlfabric.torch call a rank
makes, written as it finishes to a Chrome trace file (open it in https://ui.perfetto.dev or
chrome://tracing), so a slow or stuck step shows which call waited, and for what.

Owns the trace file of this rank and what goes in it. Per call, on this rank's row (pid = rank):
- QUEUE (its own row): from the call (issue) to when mlfabric's queue starts it: behind earlier
  calls;
- the call itself (named as errors name it: its kind and tensor name, e.g. "allreduce 'fc1'"),
  and inside it
  - NEGOTIATE: each control round (every rank's descriptor of the call gathered: the time
    here is mostly waiting for the slowest rank to make the same call),
  - the rest of the call is the data: staging copies and the collective. For CUDA tensors it is
    the host's side (NCCL work launched, then waited for by the caller).
  A call that ran allreduces names, in its args' "algorithm", the backend each took (the names
  of mlfabric.comm.collectives.BACKENDS: shm, tree, rhd, ring, nccl; several, comma-separated,
  in the order first used, where its allreduces took different ones), as auto resolved them.

Each rank writes its own file (a collective-free design: a rank that stops early, crashes or
hangs still leaves its trace): the path as given with one rank, else with the rank before the
extension (timeline.json -> timeline.0.json, timeline.1.json, ...), or where the path holds
"{rank}", there. `python -m mlfabric.torch.merge_timeline OUT IN...` merges them into one
file. A call's QUEUE span is written when the call starts (so a call that never returns still
shows), the rest when it ends; a thread flushes the file every second, and stop_timeline() /
shutdown complete it. A file cut short by a crash (the last second lost, no closing bracket)
still opens in the viewers and in merge. Each start writes its file anew.
"""
import atexit
import json
import os
import threading
import time

from ..comm import collectives as _coll

ACTIVE = None  # the _Timeline being written, or None: the one check a call pays when off
_LOCK = threading.Lock()
_FLUSH_EVERY = 1.0  # seconds
# Per thread: the backends of the allreduces of the recorded call running on it (a list; None
# outside one). Per thread because process sets' queues run calls at the same time.
_running = threading.local()


def _backend_sink():
    """collectives.backend_sink while recording: where this thread's call notes its backends."""
    return getattr(_running, "backends", None)


def now_us():
    return time.time() * 1e6  # wall clock: rank files from one job line up when merged


class _Timeline:
    def __init__(self, path, rank):
        self.path, self.rank = path, rank
        self.file = open(path, "w")
        self.first = True
        self.lock = threading.Lock()  # calls finish on the caller's and the queue's threads
        self.closed = threading.Event()
        self.current = None  # the call running now (the queue runs one at a time): its rounds
        self._write({"name": "process_name", "ph": "M", "pid": rank,
                     "args": {"name": f"rank {rank}"}})
        for tid, name in ((0, "calls"), (1, "queue")):
            self._write({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                         "args": {"name": name}})
        threading.Thread(target=self._flush_every_second, name="mlfabric-timeline",
                         daemon=True).start()

    def _write(self, event):
        with self.lock:
            if self.file is None:
                return
            self.file.write(("[\n" if self.first else ",\n") + json.dumps(event))
            self.first = False

    def _flush_every_second(self):
        """The flusher thread: what was written reaches the file within a second, also while
        the caller is stuck in a call (which is when the trace is wanted)."""
        while not self.closed.wait(_FLUSH_EVERY):
            with self.lock:
                if self.file is not None:
                    self.file.flush()

    def span(self, name, cat, start, end, tid=0, args=None):
        event = {"name": name, "cat": cat, "ph": "X", "ts": round(start, 3),
                 "dur": round(max(end - start, 0.0), 3), "pid": self.rank, "tid": tid}
        if args:
            event["args"] = args
        self._write(event)

    def wrap(self, what, job):
        """job, recording the call when it runs (its queue wait counted from now)."""
        issued = now_us()
        kind = what.partition(" ")[0]

        def timed(*args):
            start = now_us()
            # written now: a call that never returns (a hung peer) still shows it began
            self.span("QUEUE", kind, issued, start, tid=1, args={"call": what})
            self.current = rounds = []
            outer = getattr(_running, "backends", None)
            _running.backends = backends = []
            try:
                return job(*args)
            finally:
                end = now_us()
                self.current = None
                _running.backends = outer
                self.span(what, kind, start, end,
                          args={"algorithm": ", ".join(dict.fromkeys(backends))}
                          if backends else None)
                for t0, t1 in rounds:
                    self.span("NEGOTIATE", kind, t0, t1, args={"call": what})
        return timed

    def close(self):
        self.closed.set()
        with self.lock:
            if self.file is not None:
                self.file.write("\n]\n" if not self.first else "[]\n")
                self.file.close()
                self.file = None


def negotiating():
    """(start time, the list this call's control rounds go in) or None: timed by
    control.control_round."""
    tl = ACTIVE
    if tl is None or tl.current is None:
        return None
    return now_us(), tl.current


def rank_path(path, rank, size):
    """The file rank writes for the timeline at path (see the module docstring)."""
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if size == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{rank}{ext or '.json'}"


def start(path, rank, size):
    """Start writing this rank's timeline (a running one is closed first); returns its file."""
    global ACTIVE
    target = rank_path(path, rank, size)
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"start_timeline: no directory {parent} for {target}")
    with _LOCK:
        stop()
        ACTIVE = _Timeline(target, rank)
        _coll.backend_sink = _backend_sink
    return target


def stop():
    """Close the timeline, if one is being written (its file then complete JSON)."""
    global ACTIVE
    tl, ACTIVE = ACTIVE, None
    _coll.backend_sink = None  # the allreduces pay one read again
    if tl is not None:
        tl.close()


atexit.register(stop)


def load(path):
    """The events of a timeline file, also of one cut short by a crash (no closing bracket,
    an event cut in two, or nothing at all written)."""
    with open(path) as f:
        text = f.read().strip()
    if text.endswith("]"):
        return json.loads(text)
    events = []
    for line in text.lstrip("[").splitlines():  # one event a line, as _write puts them
        try:
            events.append(json.loads(line.strip().rstrip(",")))
        except ValueError:
            pass  # the last one, cut in two
    return events


def merge(out, paths):
    """Write the events of several ranks' files as one trace file at out."""
    events = [e for p in paths for e in load(p)]
    with open(out, "w") as f:
        json.dump(events, f)
    return len(events)
