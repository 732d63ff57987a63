"""Calls on CUDA tensors and mlfabric's GPU streams: a call follows the work queued on the
caller's current stream when it is made, and only that (an event), runs its copies and NCCL on
mlfabric's stream on that GPU (on_side_stream), and its result is ready for the caller's current
stream when it returns, or at synchronize() for an async call (on_caller_stream, GpuCall), as in
Horovod. The waits for the NCCL work a call launched are bounded by MLFABRIC_TIMEOUT.
"""
import threading

import torch

from ..comm import nccl as _nccl
from ..errors import MlfabricError

_LOCK = threading.Lock()  # creates a state's stream on a GPU once


def on_side_stream(st, job, device, tensors):
    """job, to run on mlfabric's stream on `device` after the work queued so far on the caller's
    current stream (an event recorded now, on the caller's thread), returning (its result, an
    event after its work, the NCCL work it launched, its error or None). Recorded at the call,
    not when the queue reaches it: by then a gradient hook's caller has queued the rest of
    backward, which the allreduce need not wait for, and would. Its NCCL work is launched, not
    waited for (the caller waits, bounded, in on_caller_stream): the next call's queues behind
    it on the GPU while the host exchanges that call's descriptors. (DDP and Horovod do the
    same.) The call's CUDA tensors are marked in use by mlfabric's stream: freed after the call,
    whichever stream they came from, their memory waits for its work there."""
    produced = torch.cuda.Event()
    produced.record(torch.cuda.current_stream(device))
    side = st.streams.get(device)
    if side is None:
        with _LOCK:  # calls come from the training thread and from autograd's
            side = st.streams.get(device)
            if side is None:
                side = st.streams[device] = torch.cuda.Stream(device)

    def on_side(st, planned):
        for t in tensors:
            if t.is_cuda:
                t.record_stream(side)
        side.wait_event(produced)
        result = error = None
        with torch.cuda.stream(side), _nccl.deferred() as launched:
            try:
                result = job(st, planned)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                error = exc
        done = torch.cuda.Event()
        done.record(side)
        return result, done, launched, error
    return on_side


def _wait_launched(launched):
    """Wait (bounded by MLFABRIC_TIMEOUT; PeerTimeoutError) for NCCL work a call launched."""
    for comm, devices, event, what in launched:
        comm.wait(devices, event, what)


def on_caller_stream(result, done, launched, error, device):
    """A GPU call's result (or its error), once its NCCL work is done, made safe for the
    caller's current stream: its later work there follows mlfabric's (copies out included,
    and on an error whatever the call did before it), and tensors allocated on mlfabric's
    stream are marked in use by it, so the allocator does not hand their memory to mlfabric's
    next call while that work reads them. Where the wait fails (the communicator was aborted)
    the stream is left alone: it would wait for NCCL work that may never finish."""
    try:
        _wait_launched(launched)
    except MlfabricError:
        if error is None:
            raise
        raise error from None  # the call's own error says more
    stream = torch.cuda.current_stream(device)
    stream.wait_event(done)
    if error is not None:
        raise error
    for t in result if isinstance(result, (list, tuple)) else (result,):
        for u in t if isinstance(t, (list, tuple)) else (t,):  # (outputs, rows): grouped
            if isinstance(u, torch.Tensor) and u.is_cuda:
                u.record_stream(stream)
    return result


class GpuCall:
    """An *_async call on CUDA tensors in flight: its queue Handle, and its job, which holds its
    tensors alive until synchronize(): freed earlier, their memory could go to the caller's next
    tensor while mlfabric's stream still reads them."""
    __slots__ = ("handle", "device", "keep")

    def __init__(self, handle, device, keep):
        self.handle, self.device, self.keep = handle, device, keep

    def done(self):
        """True once synchronize() would return at once: the job has run and its GPU work is
        done (or failed)."""
        if not self.handle.done():
            return False
        _, done, launched, error = self.handle.wait()
        if error is not None or any(comm.failed is not None for comm, *_ in launched):
            return True
        return all(devices.done(ev) for _, devices, ev, _ in launched) and done.query()

    def wait(self):
        return on_caller_stream(*self.handle.wait(), self.device)
