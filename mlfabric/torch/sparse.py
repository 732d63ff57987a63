"""sparse_allreduce_async (Horovod's name and semantics): the allreduce of a sparse COO tensor,
such as the gradient of an nn.Embedding(sparse=True), as two allgathers (its indices, its
values), so only the rows each rank touched travel. DistributedOptimizer reduces sparse
gradients through it (unless sparse_as_dense=True).

Owns the sparse call: its checks, made so that a rank with a bad argument fails its peers too
(it still takes part in both rounds, as rejected); the two allgathers; the result, which is the
sum (op Sum) or the average (op Average: divided by size()) of every rank's tensor, coalesced
(each index once; Horovod leaves duplicates, which every torch consumer accepts). Each rank's
sizes of the sparse dimensions ride as a first row of its indices, so ranks whose tensors differ
in size (embeddings of different vocabularies) fail with a MismatchError on every rank instead
of summing into a silently wrong result; the dense dimensions and the dtype are checked by the
values' allgather. Its handle is callable, as Horovod's (handle() returns the result), and an
integer handle for synchronize() / poll() as well.
"""
import numpy as np
import torch

from ..errors import MismatchError
from . import arguments, control, dispatch, ops


class _SparseCall:
    """A sparse allreduce in flight: the two allgathers' handles, and how to finish."""
    __slots__ = ("indices", "values", "divide", "what")

    def __init__(self, indices, values, divide, what):
        self.indices, self.values, self.divide, self.what = indices, values, divide, what

    def done(self):
        return self.indices.done() and self.values.done()

    def wait(self):
        """The reduced sparse tensor, or the first error of the two allgathers (both waited
        for, so the ranks stay in step whatever failed)."""
        got, error = [], None
        for h in (self.indices, self.values):
            try:
                got.append(h.wait())
            except Exception as exc:  # noqa: BLE001 - raised after both are done
                error = error or exc
        if error is not None:
            raise error
        (idx, rows), values = got
        starts = np.concatenate(([0], np.cumsum(rows)[:-1]))[rows > 0]  # joined ranks: no rows
        heads = idx[torch.as_tensor(starts, device=idx.device)].tolist()
        if any(h != heads[0] for h in heads):
            groups = {}
            for r, h in zip(np.flatnonzero(rows > 0).tolist(), heads):
                groups.setdefault(tuple(h), []).append(r)
            raise MismatchError(f"{self.what}: ranks disagree on the sparse dimensions' sizes: "
                                + "; ".join(f"{list(h)} on rank(s) {rs}"
                                            for h, rs in groups.items()))
        keep = torch.ones(idx.shape[0], dtype=torch.bool, device=idx.device)
        keep[torch.as_tensor(starts, device=idx.device)] = False
        return combine(idx[keep], values, (*heads[0], *values.shape[1:]), self.divide)


def combine(indices, values, size, divide):
    """The coalesced sparse tensor of size holding every rank's entries (indices: one row per
    entry, values: one per entry; duplicates add up), divided by divide. Also the torch
    backend's (backend.py)."""
    # checked: the indices came from other processes (an index out of range is an error, the
    # same on every rank, not a write out of bounds)
    out = torch.sparse_coo_tensor(indices.t(), values, size, check_invariants=True).coalesce()
    return out / divide if divide != 1 else out


def _check(tensor, name, op, what):
    arguments.check_name(name)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        got = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{what}: needs a sparse COO tensor (layout torch.sparse_coo), got "
                        f"{got}; dense tensors go through allreduce")
    if tensor.sparse_dim() < 1:
        raise ValueError(f"{what}: the tensor has no sparse dimension")
    op = arguments.resolve_op(op, None)
    if op not in (ops.Average, ops.Sum):
        raise ValueError(f"{what}: op must be Average or Sum, got {op}")
    arguments.check_tensor(tensor._values(), what, "the tensor's values")
    if op == ops.Average and not tensor.dtype.is_floating_point:
        raise TypeError(f"{what}: op Average needs a floating tensor, got {tensor.dtype}; use "
                        "op=Sum")
    return op


def start(tensor, name=None, op=ops.Average, process_set=None):
    """Issue the sparse allreduce of tensor: its _SparseCall (wait() gives the result)."""
    what = control.call_name("sparse_allreduce", name)
    try:
        st = dispatch.state(process_set)
        op = _check(tensor, name, op, what)
    except Exception:
        for _ in range(2):  # the peers' two allgathers fail with a MismatchError naming this rank
            dispatch.reject_call(process_set, what, True)
        raise
    sparse_dim = tensor.sparse_dim()
    head = torch.tensor([tensor.shape[:sparse_dim]], dtype=torch.int64, device=tensor.device)
    indices = torch.cat([head, tensor._indices().t()])
    calls = [ops.allgather_call(t, _part_name(name, part), True, with_rows=part == "indices",
                                process_set=process_set)
             for t, part in ((indices, "indices"), (tensor._values(), "values"))]
    return _SparseCall(*(st.handles.pop(h) for h in calls),
                       st.ctx.size if op == ops.Average else 1, what)


class SparseHandle(int):
    """sparse_allreduce_async's handle: calling it waits and returns the reduced sparse tensor
    (Horovod's contract: its handle is a function). It is also an integer handle like every
    other *_async call's, so synchronize(handle) and poll(handle) take it too; either way the
    result is taken once."""
    __slots__ = ()

    def __call__(self):
        return ops.synchronize(self)

    def __repr__(self):
        return f"SparseHandle({int(self)})"


def _part_name(name, part):
    """The name of one of the call's allgathers: internal where the call's is (a
    DistributedOptimizer's gradient)."""
    if name is None:
        return None
    out = f"{name}.{part}"
    return control.InternalName(out) if isinstance(name, control.InternalName) else out


def sparse_allreduce_async(tensor, name=None, op=ops.Average, process_set=None):
    """Non-blocking allreduce of a sparse COO tensor (Horovod's): every rank's indices and
    values are gathered, so only the entries present travel. Returns a handle that, called
    (as in Horovod: handle()) or passed to synchronize(handle), waits and returns the sum
    (op=Sum) or average (op=Average) over ranks as a coalesced sparse tensor. Ranks may hold
    different numbers of entries; the tensors' sizes and dtypes must agree."""
    call = start(tensor, name, op, process_set)
    st = dispatch.state(process_set)
    hid = SparseHandle(next(st.ids))
    st.handles[hid] = call
    return hid
