"""Whole-model helpers of mlfabric.torch, as in horovod.torch: broadcast_parameters,
broadcast_optimizer_state, broadcast_object, allgather_object.

Owns the model-consistency check: before broadcasting parameters (or optimizer state) the ranks
compare a summary of what they hold (names, dtypes, shapes), first as one hash each, and in full
only when the hashes differ; a difference is a MismatchError on every rank naming the parameter,
raised before any data moves. broadcast_optimizer_state first creates a fresh optimizer's state
as Horovod does (zero gradients, one local step), keeping its parameters' values. Objects travel
pickled (cloudpickle when installed, as Horovod) in int64 tensors; unpickling trusts the peers
(docs/security.md). broadcast_object and allgather_object also take serializer="plain": plain
data (None, bool, int, float, str, bytes, lists, tuples, dicts) in a format decoded without
running code.
"""
import hashlib
import io
import operator
import pickle
import struct

import numpy as np
import torch

from ..errors import MismatchError, MlfabricError
from . import arguments, dispatch, ops
from .optimizer import _DistributedOptimizer, _OutsideOptimizer

try:  # Horovod pickles with cloudpickle (lambdas, local classes); fall back to pickle
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle


# --- objects ------------------------------------------------------------------------------------
#
# serializer="pickle" (the default, as Horovod): any picklable object; unpickling runs whatever
# code the data names, so the peers must be trusted (as with torch.distributed's object
# collectives). serializer="plain": None, bool, int, float, str, bytes and lists, tuples and
# dicts of them, in a format of mlfabric's own that the receiver decodes without running any
# code; the sender refuses anything else.

SERIALIZERS = ("pickle", "plain")
_PLAIN_MAGIC = b"MLFPLAIN1"  # opens plain data (a pickle opens with b"\x80": no confusion)
_PLAIN_DEPTH = 100           # nesting levels of lists, tuples and dicts, either way
_PLAIN_TYPES = "None, bool, int, float, str, bytes, and lists, tuples and dicts of them"
_LEN = struct.Struct("<Q")
_FLOAT = struct.Struct("<d")


class _NotPlain(TypeError):
    """A part of obj is not plain data: says which (obj[...] as indexed from the top) and why."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason, self.path, self.what = reason, [], "obj"

    def __str__(self):
        path = self.path[::-1]
        if len(path) > 8:
            path = path[:4] + [f"...({len(path) - 8} more)..."] + path[-4:]
        return f"{self.what}: obj{''.join(path)} {self.reason}"


def _plain_encode(obj, out, depth=0):
    kind = type(obj)
    if obj is None or kind is bool:
        out += {None: b"N", True: b"T", False: b"F"}[obj]
    elif kind is int:
        raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        out += b"i" + _LEN.pack(len(raw)) + raw
    elif kind is float:
        out += b"f" + _FLOAT.pack(obj)
    elif kind is str or kind is bytes:
        raw = obj.encode("utf-8", "surrogatepass") if kind is str else obj
        out += (b"s" if kind is str else b"b") + _LEN.pack(len(raw)) + raw
    elif kind is list or kind is tuple or kind is dict:
        if depth >= _PLAIN_DEPTH:
            raise _NotPlain(f"is nested more than {_PLAIN_DEPTH} levels deep (or contains "
                            "itself)")
        out += {list: b"l", tuple: b"t", dict: b"d"}[kind] + _LEN.pack(len(obj))
        at, in_key = None, False
        try:
            if kind is dict:
                for at, value in obj.items():
                    in_key = True
                    _plain_encode(at, out, depth + 1)
                    in_key = False
                    _plain_encode(value, out, depth + 1)
            else:
                for at, value in enumerate(obj):
                    _plain_encode(value, out, depth + 1)
        except _NotPlain as exc:
            if in_key:  # the path goes to the dict; the reason says where in its key
                part = "".join(exc.path[::-1])
                exc.reason = (f"has a key, {at!r:.60}, whose part {part} {exc.reason}" if part
                              else f"has a key that {exc.reason}")
                exc.path = []
            else:
                exc.path.append(f"[{at!r:.60}]")
            raise
    else:
        raise _NotPlain(f"is a {kind.__module__}.{kind.__qualname__}; serializer='plain' takes "
                        f"{_PLAIN_TYPES} (serializer='pickle' takes any object, for trusted "
                        "peers)")
    return out


class _PlainReader:
    """Decodes plain data, checking every length against what is left (a peer's bytes are not
    trusted: a malformed message is an error, never a large allocation or a deep recursion)."""

    def __init__(self, data):
        self.data, self.at = data, len(_PLAIN_MAGIC)

    def take(self, n):
        if n > len(self.data) - self.at:
            raise ValueError(f"plain data truncated at byte {self.at}")
        chunk = self.data[self.at:self.at + n]
        self.at += n
        return chunk

    def length(self):
        return _LEN.unpack(self.take(_LEN.size))[0]

    def value(self, depth=0):
        tag = self.take(1)
        if tag in (b"N", b"T", b"F"):
            return {b"N": None, b"T": True, b"F": False}[tag]
        if tag == b"i":
            return int.from_bytes(self.take(self.length()), "little", signed=True)
        if tag == b"f":
            return _FLOAT.unpack(self.take(_FLOAT.size))[0]
        if tag == b"s":
            return self.take(self.length()).decode("utf-8", "surrogatepass")
        if tag == b"b":
            return bytes(self.take(self.length()))
        if tag in (b"l", b"t", b"d"):
            if depth >= _PLAIN_DEPTH:
                raise ValueError(f"plain data nested more than {_PLAIN_DEPTH} levels deep")
            count = self.length()
            if count > len(self.data) - self.at:  # every item takes a byte at least
                raise ValueError(f"plain data truncated at byte {self.at}")
            if tag != b"d":
                items = [self.value(depth + 1) for _ in range(count)]
                return items if tag == b"l" else tuple(items)
            out = {}
            for _ in range(count):
                key = self.value(depth + 1)
                try:
                    out[key] = self.value(depth + 1)
                except TypeError:
                    raise ValueError("plain data has an unhashable dict key "
                                     f"({type(key).__name__})") from None
            return out
        raise ValueError(f"plain data has an unknown tag {tag!r} at byte {self.at - 1}")


def _plain_decode(data):
    if not data.startswith(_PLAIN_MAGIC):
        raise MismatchError("received data that is not in the plain format (its sender used "
                            "serializer='pickle'?): every rank must pass the same serializer")
    reader = _PlainReader(data)
    obj = reader.value()
    if reader.at != len(data):
        raise ValueError(f"plain data has {len(data) - reader.at} stray bytes at its end")
    return obj


def _check_serializer(serializer):
    if serializer not in SERIALIZERS:
        raise ValueError(f"serializer={serializer!r}: expected one of {SERIALIZERS}")


def _to_words(obj, serializer="pickle", what="object"):
    """obj serialized into a writable int64 tensor (zero-padded to whole words), and its
    length."""
    _check_serializer(serializer)
    if serializer == "plain":
        try:
            data = bytes(_plain_encode(obj, bytearray(_PLAIN_MAGIC)))
        except _NotPlain as exc:
            exc.what = what
            raise
    else:
        buf = io.BytesIO()
        _pickler.dump(obj, buf)
        data = buf.getvalue()
    words = bytearray(data) + bytearray(-len(data) % 8)
    return torch.from_numpy(np.frombuffer(words, dtype=np.int64)), len(data)


def _from_words(words, nbytes, serializer="pickle"):
    _check_serializer(serializer)
    data = words.numpy().tobytes()[:nbytes]
    if serializer == "plain":
        return _plain_decode(data)
    if data.startswith(_PLAIN_MAGIC):
        raise MismatchError("received data in the plain format (its sender used "
                            "serializer='plain'): every rank must pass the same serializer")
    return pickle.loads(data)


def _verb(serializer, done=False):
    if serializer == "plain":
        return "decode" if done else "encode"
    return "unpickle" if done else "pickle"


def _unpickled_everywhere(what, failed, process_set, serializer="pickle"):
    """One allgather of whether each rank could load what it received: raises this rank's own
    error, or an MlfabricError naming the ranks that failed, on every rank alike. Every rank
    takes part, so that no rank goes on to its next call while another, having failed, does
    not (broadcast_optimizer_state's tensors follow its pickled part)."""
    flags = ops.allgather(torch.tensor([failed is not None], dtype=torch.int64),
                          f"{what}.unpickled", process_set)
    if failed is not None:
        raise failed
    bad = flags.nonzero().flatten().tolist()
    if bad:
        ranks = dispatch.state(process_set).ranks
        raise MlfabricError(f"{what}: rank(s) {[ranks[i] for i in bad] if ranks else bad} could "
                            f"not {_verb(serializer, True)} the object (their own errors say "
                            "why)")


def broadcast_object(obj, root_rank=0, name=None, process_set=None, serializer="pickle"):
    """root_rank's obj on every rank (the root gets its own obj back). root_rank is a global
    rank, also with a process_set.

    serializer="pickle" (default, as Horovod) takes any picklable object, and the receivers
    unpickle it: only for trusted peers (unpickling runs code the data names).
    serializer="plain" takes None, bool, int, float, str, bytes and lists, tuples and dicts of
    them, and the receivers decode it without running any code; the root refuses anything else
    (TypeError there, MlfabricError on the others). Every rank must pass the same serializer."""
    name = name or "broadcast_object"
    words, nbytes, error = None, 0, None
    if dispatch.state().ctx.rank == root_rank:
        try:
            words, nbytes = _to_words(obj, serializer, name)
        except Exception as exc:  # noqa: BLE001 - the others hear of it (size -1), then raise
            nbytes, error = -1, exc
    size = ops.broadcast_(torch.tensor([nbytes], dtype=torch.int64), root_rank, f"{name}.size",
                          process_set)
    if error is not None:
        raise error
    nbytes = int(size[0])
    if nbytes < 0:
        raise MlfabricError(f"{name}: the root rank {root_rank} could not "
                            f"{_verb(serializer)} its object (its own error says why)")
    if words is None:
        words = torch.empty((nbytes + 7) // 8, dtype=torch.int64)
    ops.broadcast_(words, root_rank, f"{name}.data", process_set)
    if dispatch.state().ctx.rank == root_rank:
        loaded, error = obj, None
    else:
        loaded, error = _loads(words, nbytes, serializer)
    _unpickled_everywhere(name, error, process_set, serializer)
    return loaded


def _loads(words, nbytes, serializer="pickle"):
    """(the object, None), or (None, the error loading it)."""
    try:
        return _from_words(words, nbytes, serializer), None
    except Exception as exc:  # noqa: BLE001 - raised after the others hear of it
        return None, exc


def allgather_object(obj, name=None, process_set=None, serializer="pickle"):
    """Every rank's obj (of process_set), as a list in rank order. serializer: as in
    broadcast_object ("pickle", the default, only for trusted peers; "plain" for plain data,
    decoded without running any code)."""
    name = name or "allgather_object"
    words, nbytes, error = torch.empty(0, dtype=torch.int64), -1, None
    try:
        words, nbytes = _to_words(obj, serializer, name)
    except Exception as exc:  # noqa: BLE001 - the others hear of it (size -1), then raise
        error = exc
    sizes = ops.allgather(torch.tensor([nbytes], dtype=torch.int64), f"{name}.sizes",
                          process_set)
    if error is not None:
        raise error
    failed = [r for r, n in enumerate(sizes.tolist()) if n < 0]
    if failed:
        if process_set is not None and process_set.ranks and process_set.process_set_id != 0:
            failed = [process_set.ranks[i] for i in failed]  # the set's places -> global ranks
        raise MlfabricError(f"{name}: rank(s) {failed} could not {_verb(serializer)} their "
                            "object (their own errors say why)")
    gathered = ops.allgather(words, f"{name}.data", process_set)
    out, off, error = [], 0, None
    for n in sizes.tolist():
        k = (n + 7) // 8
        obj, error = _loads(gathered[off:off + k], n, serializer)
        if error is not None:
            break
        out.append(obj)
        off += k
    _unpickled_everywhere(name, error, process_set, serializer)
    return out


# --- consistency checks ---------------------------------------------------------------------------

def _same_everywhere(summary, root_rank, what, describe, error=None):
    """Raise MismatchError on every rank when a rank's summary differs from root_rank's.

    summary: a picklable description of what this rank holds (or ('invalid', message) from a
    rank whose input is unusable, error: its exception, raised there instead, after the check);
    describe(root_summary, other_summary) says how they differ."""
    try:
        _compare_summaries(summary, root_rank, what, describe)
    except MismatchError:
        if error is not None:
            raise error from None
        raise
    if error is not None:  # every rank's input was unusable
        raise error


def _compare_summaries(summary, root_rank, what, describe):
    # 56 bits (an int64 with room): a crc32 match between two different models is 1 in 4e9
    h = int.from_bytes(hashlib.blake2b(pickle.dumps(summary), digest_size=7).digest(), "big")
    try:  # an int, or a numpy integer (as ops' root_rank)
        root = -1 if isinstance(root_rank, bool) else operator.index(root_rank)
    except TypeError:
        root = -1
    ctx = dispatch.state().ctx
    # Each row names its rank: a rank inside join() contributes none, so rows are not ranks.
    got = ops.allgather(torch.tensor([[h, root, ctx.rank]], dtype=torch.int64),
                        f"{what}.summary_hash")
    roots, ranks = got[:, 1].tolist(), got[:, 2].tolist()
    if len(set(roots)) > 1 or not 0 <= roots[0] < ctx.size:
        raise ValueError(f"{what}: root_rank must be the same rank in [0, {ctx.size}) on every "
                         f"rank, got {roots} (by rank: {ranks})")
    if root_rank not in ranks:
        raise MlfabricError(f"{what}: the root rank {root_rank} has joined; a joined rank "
                            "cannot broadcast")
    hashes = got[:, 0]
    if (hashes == hashes[ranks.index(root_rank)]).all():
        return
    every = dict(allgather_object((ctx.rank, summary), f"{what}.summary"))
    problems, want = [], every[root_rank]
    for r, s in every.items():
        if r == root_rank or s == want:
            continue
        if isinstance(s, tuple) and s and s[0] == "invalid":
            problems.append(f"rank {r} passed invalid input ({s[1]})")
        elif isinstance(want, tuple) and want[0] == "invalid":
            problems.append(f"the root rank {root_rank} passed invalid input ({want[1]})")
            break
        else:
            problems.append(f"rank {r}: {describe(want, s)}")
    raise MismatchError(f"{what}: ranks hold different models; compared with root rank "
                        f"{root_rank}: " + "; ".join(problems))


def _describe_params(root, other):
    """First difference between two parameter summaries [(name, dtype, shape), ...]."""
    root_by, other_by = {e[0]: e for e in root}, {e[0]: e for e in other}
    for name, dtype, shape in other:
        if name not in root_by:
            return f"parameter {name!r} is not on the root"
        _, rdtype, rshape = root_by[name]
        if (dtype, shape) != (rdtype, rshape):
            return (f"parameter {name!r} is {dtype} {list(shape)} there and {rdtype} "
                    f"{list(rshape)} on the root")
    for name, _, _ in root:
        if name not in other_by:
            return f"parameter {name!r} of the root is missing"
    return "the parameters come in a different order"


def _named(params):
    """[(name, tensor)] from a state_dict (sorted by name, as Horovod) or an iterable of
    (name, tensor) pairs or tensors."""
    if isinstance(params, dict):
        pairs = sorted(params.items())
    elif isinstance(params, torch.Tensor) or not hasattr(params, "__iter__"):
        raise TypeError(f"params must be a state_dict or (name, tensor) pairs such as "
                        f"model.named_parameters(), got {type(params).__name__}")
    else:
        pairs = [p if isinstance(p, tuple) and len(p) == 2 else (f"params[{i}]", p)
                 for i, p in enumerate(params)]
    out = []
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"parameter {name!r} is a {type(t).__name__}, not a tensor")
        out.append((str(name), t))
    return out


def broadcast_parameters(params, root_rank):
    """Copy root_rank's parameters into every rank's, in place. params: model.state_dict() or
    model.named_parameters() (or a list of (name, tensor) pairs). Ranks holding a different
    model (names, dtypes, shapes) get a MismatchError naming the parameter, on every rank."""
    what = "broadcast_parameters"
    try:
        named = _named(params)
        summary = [(n, str(t.dtype).replace("torch.", ""), tuple(t.shape)) for n, t in named]
    except Exception as exc:  # noqa: BLE001 - every rank hears of it in the check below
        named, summary, error = None, ("invalid", str(exc)), exc
    else:
        error = None
    _same_everywhere(summary, root_rank, what, _describe_params, error)
    # In place, fused into buffers per dtype. Tied weights (one tensor under two names) are
    # simply written twice with the same values.
    ops.grouped_broadcast_call([t.detach() for _, t in named], root_rank, what)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Make every rank's optimizer state and hyperparameters root_rank's (its state_dict(),
    loaded with load_state_dict(); its tensors broadcast as tensors, the rest pickled). The
    optimizers must have the same parameter groups (a MismatchError on every rank otherwise).

    An optimizer whose state is still empty (a fresh one) first creates it, as Horovod does:
    every parameter that requires a gradient gets a zero .grad (sparse for SparseAdam, and for
    SGD on the parameters of model's nn.Embedding(sparse=True) modules: model, optional, is
    Horovod's argument for finding them) and the optimizer's own step() runs (a
    DistributedOptimizer's reduces nothing). Unlike Horovod's, that step moves no parameter:
    their values are put back, so weight decay and the like cannot set the ranks' parameters
    apart. The zero gradients stay. An optimizer still stateless after it (SGD without
    momentum) has only its hyperparameters broadcast."""
    what = "broadcast_optimizer_state"
    error = None
    if not isinstance(optimizer, torch.optim.Optimizer):
        error = TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}")
    elif not optimizer.state:
        try:
            _create_state(optimizer, model)
        except Exception as exc:  # noqa: BLE001 - every rank hears of it in the check below
            error = exc
    if error is not None:
        summary = ("invalid", f"{type(error).__name__}: {error}")
    else:
        summary = [type(optimizer).__name__] + [
            [(str(p.dtype).replace("torch.", ""), tuple(p.shape)) for p in g["params"]]
            for g in optimizer.param_groups]
    _same_everywhere(summary, root_rank, what, _describe_groups, error)
    # The state's structure and small values travel pickled; its tensors (Adam's moments: twice
    # the model) travel as tensors, fused per dtype, with no pickling copies (~7x faster for a
    # 4M-parameter model's Adam state, 2 ranks on the 2-core VM: BENCHMARKS.md).
    root = dispatch.state().ctx.rank == root_rank
    skeleton, tensors, error = None, [], None
    if root:
        try:
            skeleton, tensors = _take_tensors(_on_host(optimizer.state_dict()))
        except Exception as exc:  # noqa: BLE001 - the others hear of it, then raise
            skeleton, error = _RootFailed(f"{type(exc).__name__}: {exc}"), exc
    skeleton = broadcast_object(skeleton, root_rank, what)
    if error is not None:
        raise error
    if isinstance(skeleton, _RootFailed):
        raise MlfabricError(f"{what}: the root rank {root_rank} could not read its optimizer's "
                            f"state ({skeleton})")
    if not root:  # with the root's strides: fused optimizers pair state and parameter by memory
        tensors = [torch.empty_strided(slot.shape, slot.stride, dtype=slot.dtype)
                   for slot in _slots(skeleton)]
    if tensors:
        ops.grouped_broadcast_call(tensors, root_rank, f"{what}.tensors")
    if not root:  # load_state_dict moves each state tensor to its parameter's device
        optimizer.load_state_dict(_put_tensors(skeleton, tensors))


def _create_state(optimizer, model):
    """Horovod's creation of a fresh optimizer's state: zero gradients and one step of the
    optimizer itself, here with its parameters' values put back after it. torch.optim.LBFGS is
    left as it is (its step needs a closure; Horovod does not broadcast its state at all)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    with torch.no_grad():
        kept = [p.detach().clone() for p in params]
        for p in params:
            zero = torch.zeros_like(p, memory_format=torch.preserve_format)
            # sparse where the optimizer takes only sparse gradients, and for SGD (which takes
            # either) where the model's embedding gives sparse ones (Horovod's choices)
            p.grad = zero.to_sparse() if all_sparse or (
                isinstance(optimizer, torch.optim.SGD) and id(p) in sparse) else zero
    try:
        _local_step(optimizer)
    finally:  # (a step that failed half way has moved some)
        with torch.no_grad():
            for p, value in zip(params, kept):
                p.copy_(value)


def _local_step(optimizer):
    """optimizer.step() on this rank alone: for a DistributedOptimizer, the wrapped
    optimizer's own step(), with no reduction (the others may not step now)."""
    for mixin in (_DistributedOptimizer, _OutsideOptimizer):
        if isinstance(optimizer, mixin):
            return super(mixin, optimizer).step()
    return optimizer.step()


class _RootFailed(str):
    """What the root sends in place of its state when reading it failed: its error's text."""


class _TensorSlot(tuple):
    """Where a tensor of a broadcast state_dict was: its position in the tensors sent, dtype,
    shape and strides (a tuple subclass so that the helpers below walk it as a leaf, not a
    container)."""
    index = property(lambda self: self[0])
    dtype = property(lambda self: self[1])
    shape = property(lambda self: self[2])
    stride = property(lambda self: self[3])


def _sendable(t):
    """A plain dense host tensor of a dtype the collectives move, its memory one block with no
    gaps or overlaps (then its strides can be made again elsewhere); anything else stays
    pickled."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_nested
            and not t.is_quantized and not t.requires_grad and t.device.type == "cpu"
            and t.dtype in arguments.DTYPE_CODE and _dense(t))


def _dense(t):
    """Whether t's elements fill one block of memory with no gaps or overlaps, in some order of
    its dimensions (contiguous, channels_last, transposed, ...)."""
    if t.numel() == 0:
        return True
    size = 1
    for stride, n in sorted(zip(t.stride(), t.shape)):
        if n != 1 and stride != size:
            return False
        size *= n
    return True


def _rebuild(obj, leaf):
    """obj (a state_dict: dicts, lists, tuples, namedtuples) rebuilt with leaf(x) in place of
    each tensor and _TensorSlot x."""
    if isinstance(obj, torch.Tensor) or type(obj) is _TensorSlot:
        return leaf(obj)
    if isinstance(obj, dict):
        return {k: _rebuild(v, leaf) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_rebuild(v, leaf) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, leaf) for v in obj)
    return obj


def _take_tensors(obj):
    """(obj with each sendable tensor replaced by a _TensorSlot, those tensors in slot order).
    A tensor found twice (the same object) gets one slot, so it stays one tensor, as pickle
    keeps it."""
    tensors, slots = [], {}

    def take(t):
        if not _sendable(t):
            return t
        if id(t) not in slots:
            slots[id(t)] = _TensorSlot((len(tensors), t.dtype, tuple(t.shape), t.stride()))
            tensors.append(t)
        return slots[id(t)]
    return _rebuild(obj, take), tensors


def _slots(obj):
    """The distinct _TensorSlots in obj, in slot order."""
    found = {}

    def note(x):  # (tensors that went pickled are leaves too)
        if type(x) is _TensorSlot:
            found[x.index] = x
        return x
    _rebuild(obj, note)
    return [found[i] for i in range(len(found))]


def _put_tensors(obj, tensors):
    """obj with each _TensorSlot replaced by its tensor."""
    return _rebuild(obj, lambda x: tensors[x.index] if type(x) is _TensorSlot else x)


def _on_host(obj):
    """obj (a state_dict) with host copies of its GPU tensors: pickled as they are, they would
    land on the root's GPU index on every rank, which another rank may not have, or not use."""
    return _rebuild(obj, lambda t: t.cpu() if t.is_cuda else t)


def _describe_groups(root, other):
    if root[0] != other[0]:
        return f"a {other[0]} optimizer there, a {root[0]} on the root"
    if len(root) != len(other):
        return f"{len(other) - 1} parameter group(s) there, {len(root) - 1} on the root"
    for g, (a, b) in enumerate(zip(root[1:], other[1:])):
        if a != b:
            return f"parameter group {g} holds {b} there and {a} on the root"
    return "different parameter groups"  # pragma: no cover - the summaries differ somewhere
