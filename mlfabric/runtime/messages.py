"""The parameter-server runtime's update-level control messages as typed records: what a worker
reports ready, and what the scheduler tells each daemon about one batch (lowering.py makes those
from a mlfabric.sched.Plan). Each is a frozen dataclass with a readable one-line form that
parses back (str(m) and parse(text)), so a log line or an error names a message exactly as it
was sent.

  ReadyUpdate   scheduler: a worker's update is ready to be planned (what push() reports)
  SendUpdate    worker: send update `id` to rank `hop`, bound for `dst`, from `not_before`
  SumUpdates    aggregator (a worker): sum `members` as they arrive, send the sum on
  ExpectCommit  server / replica: the next commit, in order, and what it waits for
  DropUpdate    worker / server: update `id` is dropped, for `reason` (scheduler, as 'lost':
                a daemon found that a failure took it)

The readable form is `kind field=value ...`, values as Python literals, with two exceptions that
keep it short: an update id (2**32 and above: worker rank << 32 | its count) is written u<rank>.<n>,
and an infinite number inf. Records travel pickled as they are (control.py).
"""
import ast
import math
import re
from dataclasses import dataclass, fields

from ..errors import MlfabricError

_ID = re.compile(r"\bu(\d+)\.(\d+)\b")
_INF = re.compile(r"(?<![\w.'\"])inf\b")
_FIELD = re.compile(r" (?=[a-z_]+=)")


class Message:
    """The readable form shared by the records (each is a frozen dataclass with a KIND)."""
    __slots__ = ()
    KIND = None

    def __str__(self):
        return " ".join([self.KIND] + ["%s=%s" % (f.name, _literal(getattr(self, f.name)))
                                       for f in fields(self)])

    __repr__ = __str__   # a list of them (a message's body, a debug line) reads the same way


def uid_text(uid):
    """An update id in its short form: u<worker rank>.<its count>."""
    return "u%d.%d" % (uid >> 32, uid & 0xFFFFFFFF)


def _literal(v):
    """v as a Python literal, update ids and infinities in their short forms."""
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, int):
        return uid_text(v) if v >= 1 << 32 else repr(v)
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, tuple):
        inner = ", ".join(_literal(x) for x in v)
        return "(%s,)" % inner if len(v) == 1 else "(%s)" % inner
    if isinstance(v, list):
        return "[%s]" % ", ".join(_literal(x) for x in v)
    return repr(v)


def _value(text):
    """The value a _literal() wrote."""
    text = _ID.sub(lambda m: str(int(m.group(1)) << 32 | int(m.group(2))), text)
    return ast.literal_eval(_INF.sub("1e999", text))


@dataclass(frozen=True, slots=True, repr=False)
class ReadyUpdate(Message):
    """A worker's update `id` for `server` (a logical server id; ('ar', call, root) for an
    allreduce contribution) is ready: `size` bytes, computed from model `version`, with L2 norm
    `norm` (inf: unknown), reported at the worker's job time `sent`."""
    KIND = "ready"
    id: int
    server: object
    size: int
    version: int
    norm: float
    sent: float


@dataclass(frozen=True, slots=True, repr=False)
class SendUpdate(Message):
    """A worker sends its update `id` to rank `hop` (the server, the replica, or an aggregator)
    no earlier than job time `not_before`, at `rate` bytes/s (None: unpaced). `dst` is where it
    is bound: a logical server id, a replica rank, or ('ar', call, root) for an allreduce's root.
    `final`: no later send of it follows (the worker may free it)."""
    KIND = "send"
    id: int
    hop: int
    dst: object
    not_before: float
    rate: float
    final: bool


@dataclass(frozen=True, slots=True, repr=False)
class SumUpdates(Message):
    """An aggregator sums `members` (update ids, in order) as they arrive, then sends the sum to
    `dst` no earlier than `not_before` at `rate`, under data-plane key ('a', key, ids, version).
    In a cut-through pipeline the sum also takes in `upstream`, the running sum of the
    aggregators before it, as (its key, its ids, the rank sending it), and goes to rank `via`
    (the next aggregator) unless it is the last. `ids`: the update ids the sum carries."""
    KIND = "sum"
    key: tuple
    dst: object
    members: tuple
    not_before: float
    rate: float
    version: object
    ids: tuple
    via: object = None
    upstream: tuple = None


@dataclass(frozen=True, slots=True, repr=False)
class ExpectCommit(Message):
    """A server's (or replica's) next commit: the payload under arrival `key` ('u', id) or
    ('a', aggregate key) brings `ids`, computed from `versions`, and is applied once the replica
    has applied `need` updates; `via` is the rank it comes from (a failure of it means it never
    comes). A replica's commits carry the ids' `norms` (its divergence bound)."""
    KIND = "expect"
    key: tuple
    ids: tuple
    versions: tuple
    need: int
    via: int
    norms: tuple = None


@dataclass(frozen=True, slots=True, repr=False)
class DropUpdate(Message):
    """Update `id` is dropped for `reason` (a mlfabric.sched.plan DROP_* or a ledger DROP_*)."""
    KIND = "drop"
    id: int
    reason: str


KINDS = {cls.KIND: cls for cls in (ReadyUpdate, SendUpdate, SumUpdates, ExpectCommit,
                                   DropUpdate)}


def parse(text):
    """The record whose readable form (str) is `text`."""
    kind, _, rest = text.strip().partition(" ")
    cls = KINDS.get(kind)
    if cls is None:
        raise MlfabricError("not a control message: %r (its kind must be one of %s)"
                            % (text, ", ".join(KINDS)))
    values = {}
    for part in _FIELD.split(rest) if rest else []:
        name, eq, value = part.partition("=")
        if not eq:
            raise MlfabricError("control message %r: %r is not field=value" % (text, part))
        try:
            values[name] = _value(value)
        except (ValueError, SyntaxError) as e:
            raise MlfabricError("control message %r: field %s=%s is not a literal (%s)"
                                % (text, name, value, e)) from None
    try:
        return cls(**values)
    except TypeError as e:
        raise MlfabricError("control message %r does not fit %s: %s"
                            % (text, cls.__name__, e)) from None


def handle_each(where, records, handle):
    """handle(record) for each record in turn; an unexpected error (not an MlfabricError, which
    is clear already, nor the MPI library's, a peer's failure the daemon recovers from) is
    raised again as an MlfabricError naming the record in its readable form. `where` names the
    rank, e.g. 'worker rank 3'."""
    for m in records:
        try:
            handle(m)
        except MlfabricError:
            raise   # a clear error of its own (a mismatch, ...): as it is
        except Exception as e:
            if hasattr(e, "Get_error_class"):   # mpi4py's MPI.Exception: the daemon's to handle
                raise
            raise MlfabricError("%s: plan message `%s` failed: %s: %s"
                                % (where, m, type(e).__name__, e)) from e
