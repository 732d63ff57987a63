"""mlfabric's logging: the standard `logging` module's `mlfabric` logger and its children
(`mlfabric.comm`: the path each kind of collective takes; `mlfabric.runtime`: the parameter
server's control messages and failures).

Owns configuring that logger, once per process: its level from MLFABRIC_LOG_LEVEL (default
warning; MLFABRIC_DEBUG=1, the older on/off form, means debug for `mlfabric.runtime`) and a
handler on stderr whose lines name the rank, e.g.
    [mlfabric rank 3] INFO comm: allreduce 4.0 MiB float32 on 4 ranks -> shm (staged)
Only where the application has not configured the `mlfabric` logger itself (a handler or a
level on it): then its configuration stands untouched. The root logger is never touched.

Also: the warning about misspelled MLFABRIC_* variables, and the once-per-size-class record of
which paths were already logged (the collectives' cost when logging is off is one module
attribute read, `paths`, set here at init).
"""
import difflib
import logging
import os
import sys

from . import config as _config

LOGGER = logging.getLogger("mlfabric")
# Whether the collectives log the path they take (INFO on mlfabric.comm): read once per init(),
# not per call, so that the hot path pays one attribute read.
paths = False
_COMM = logging.getLogger("mlfabric.comm")
_handler = None      # ours, when this module configured the logger
_seen = set()        # (collective, backend, path, size class, dtype) already logged
_checked = False     # the MLFABRIC_* names were checked in this process


class _RankFormatter(logging.Formatter):
    """'[mlfabric rank R] LEVEL child: message' (child: the logger's name below mlfabric)."""

    def __init__(self, rank):
        super().__init__("%(message)s")
        self.prefix = f"[mlfabric rank {rank}] "

    def format(self, record):
        name = record.name
        child = name[len("mlfabric."):] if name.startswith("mlfabric.") else name
        return f"{self.prefix}{record.levelname} {child}: {super().format(record)}"


def user_configured():
    """Whether the application configured the `mlfabric` logger (a handler or a level on it)."""
    return _handler is None and bool(LOGGER.handlers or LOGGER.level != logging.NOTSET)


def configure(rank):
    """Configure the `mlfabric` logger for this process (see the module docstring); later calls
    only update the rank the lines name. MlfabricError for a bad MLFABRIC_LOG_LEVEL or
    MLFABRIC_DEBUG. Returns the logger."""
    global _handler, paths
    level = _config.log_level()
    runtime_debug = _config.debug_enabled()
    if _handler is None and not user_configured():
        _handler = logging.StreamHandler(sys.stderr)
        LOGGER.addHandler(_handler)
        LOGGER.setLevel(level)
        LOGGER.propagate = False  # the application's root handlers would print it twice
        runtime = logging.getLogger("mlfabric.runtime")
        if runtime_debug and runtime.level == logging.NOTSET:
            runtime.setLevel(logging.DEBUG)
    if _handler is not None:
        _handler.setFormatter(_RankFormatter(rank))
    paths = _COMM.isEnabledFor(logging.INFO)
    return LOGGER


def unknown_settings(environ=None):
    """[(name, closest known name or None)] for each MLFABRIC_* variable that mlfabric does not
    read (config.KNOWN), in name order."""
    environ = os.environ if environ is None else environ
    out = []
    for name in sorted(environ):
        if not name.startswith("MLFABRIC_") or name in _config.KNOWN or \
                name.startswith(_config.UNCHECKED_PREFIXES):
            continue
        close = difflib.get_close_matches(name, sorted(_config.KNOWN), n=1, cutoff=0.6)
        out.append((name, close[0] if close else None))
    return out


def warn_unknown_settings(environ=None):
    """Warn (logger `mlfabric`) about each MLFABRIC_* variable mlfabric does not read, naming
    the closest known one."""
    for name, close in unknown_settings(environ):
        hint = f"; did you mean {close}?" if close else ""
        LOGGER.warning("%s is not an mlfabric setting (ignored)%s", name, hint)


def init(rank):
    """What init() does for logging: configure the logger, warn about unknown MLFABRIC_*
    variables (once per process: init() may run again after finalize())."""
    global _checked
    configure(rank)
    if not _checked:
        _checked = True
        warn_unknown_settings()


def size_class(nbytes):
    """The power-of-two bucket of a size in bytes: k for 2**(k-1) <= nbytes < 2**k (0 for 0)."""
    return int(nbytes).bit_length()


def first(key):
    """True the first time key (collective, backend, path, size class, dtype) is seen in this
    process: the caller logs it then."""
    if key in _seen:
        return False
    _seen.add(key)
    return True


def human(nbytes):
    """A byte count as people read it: 512 B, 4.0 KiB, 4.0 MiB, 1.5 GiB."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def path_chosen(collective, backend, nbytes, dtype, nranks, path=None):
    """Log (INFO, mlfabric.comm) the backend and path a collective takes, once per (collective,
    backend, size class, dtype) in this process, and again where a call of those takes another
    path (a shared buffer's zero-copy, say). Callers check `paths` first."""
    if not first((collective, backend, path, size_class(nbytes), dtype)):
        return
    how = f"{backend} ({path})" if path else backend
    _COMM.info("%s %s %s on %d ranks -> %s", collective, human(nbytes), dtype, nranks, how)
