"""Ordering of mlfabric's calls: blocking ones run on the caller's thread, non-blocking ones on one
background thread, all in the order they were issued (every rank must issue collectives in the
same order, as in MPI). Owns Handle (wait/done) and that ordering; knows nothing of what a call
does. The heavy parts of a call (the C++ engine, MPI) release the GIL, so a call on the
background thread overlaps the caller's Python work.

A call running on the background thread may also do the work of like calls queued right behind it
(tensor fusion: see mlfabric.torch.ops): it reads their tags (queued), takes them out of the queue
(take) and finishes their handles (finish), all on that thread."""
import collections
import itertools
import threading

from ..errors import MlfabricError


# Guards a Handle's finishing against a waiter creating its event: one lock for all handles, held
# for a few bytecodes, where an Event per handle (a Condition and its lock) cost ~3 us to create,
# a third of issuing an async call, though most handles finish before anyone waits on them.
_WAITING = threading.Lock()


class Handle:
    """A non-blocking call in flight. wait() returns its result or raises its error.

    The buffers passed to the call must not be touched until wait() returns."""

    def __init__(self, what):
        self.what = what
        self._finished = False
        self._event = None  # made by the first wait() that comes before the finish
        self._result = None
        self._error = None

    def done(self):
        """True once the call has finished (successfully or not); never blocks."""
        return self._finished

    def wait(self, timeout=None):
        """Block until the call finishes; return its result or raise its exception."""
        if not self._finished:
            with _WAITING:
                if self._event is None and not self._finished:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise MlfabricError(f"{self.what}: not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        with _WAITING:
            self._finished = True
            event = self._event
        if event is not None:
            event.set()


class Executor:
    def __init__(self, thread_init=None):
        self._thread_init = thread_init  # run first on the background thread
        self._cv = threading.Condition()
        self._queue = collections.deque()
        self._thread = None
        self._closed = False
        # Calls submitted and not yet finished. Zero means a blocking call may run at once on the
        # caller's thread (only the issuing thread submits, so it stays zero until it does).
        self.pending = 0

    def submit(self, what, fn, tag=None):
        """Queue fn() behind every call issued before it; return its Handle. tag: what a
        running call may read of this one through queued() (None: nothing to fuse with)."""
        handle = Handle(what)
        with self._cv:
            if self._closed:
                raise MlfabricError(f"{what}: mlfabric was finalized")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mlfabric-comm",
                                                daemon=True)
                self._thread.start()
            self._queue.append((fn, handle, tag))
            self.pending += 1
            self._cv.notify_all()
        return handle

    def run(self, what, fn):
        """Run fn() now, in order after pending non-blocking calls; return its result."""
        if not self.pending:
            return fn()
        return self.submit(what, fn).wait()

    def _loop(self):
        if self._thread_init is not None:
            self._thread_init()
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                fn, handle, _ = self._queue.popleft()
            try:
                handle._finish(result=fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                handle._finish(error=exc)
            with self._cv:
                self.pending -= 1
                self._cv.notify_all()

    def queued(self, limit):
        """The tags of up to `limit` calls queued behind the running one, oldest first, up to
        the first without a tag. For the running call only: the calls stay queued (and in this
        order, as only this thread takes them out) until it takes them."""
        with self._cv:
            tags = [tag for _, _, tag in itertools.islice(self._queue, limit)]
        n = tags.index(None) if None in tags else len(tags)
        return tags[:n]

    def take(self, k):
        """Take the next k queued calls out of the queue, for the running call to do their
        work: their Handles, each to be finished through finish()."""
        with self._cv:
            return [self._queue.popleft()[1] for _ in range(k)]

    def finish(self, handles, results=None, errors=None):
        """Finish handles from take(): with results, or errors (one each)."""
        for i, handle in enumerate(handles):
            handle._finish(result=None if results is None else results[i],
                           error=None if errors is None else errors[i])
        with self._cv:
            self.pending -= len(handles)
            self._cv.notify_all()

    def shutdown(self):
        """Let queued calls finish, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
