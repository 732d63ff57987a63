"""GPU arrays as mlfabric's collectives take them: CUDA torch tensors and CuPy arrays. Owns
recognising them, their wire dtype code, address and device, contiguous copies of non-contiguous
inputs, new outputs on the same device, and each library's streams and events (the
`Devices` adapters that comm/nccl.py launches and waits through). Never communicates.

Stream semantics: a call is ordered after the work already queued on the caller's current stream
(an event recorded there when the call is made, on the caller's thread: non-blocking calls run
on another thread, whose current stream is not the caller's), runs on mlfabric's own stream, and
returns once it has finished, so the result is ready for any stream (inside comm/nccl.py's
deferred(), which mlfabric.torch uses, it returns once launched: see there)."""
import math
import sys

from . import dtypes as _dtypes


class TorchDevices:
    name = "torch"

    def __init__(self):
        import torch
        self.torch = torch
        self.codes = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
                      torch.int32: 4, torch.int64: 5}

    def owns(self, x):
        return isinstance(x, self.torch.Tensor) and x.is_cuda

    def on(self, device):
        return self.torch.cuda.device(device)

    def new_stream(self, device):
        return self.torch.cuda.Stream(device=device)

    @staticmethod
    def stream_handle(stream):
        return stream.cuda_stream

    @staticmethod
    def done(event):
        return event.query()

    def current_stream(self, x):
        return self.torch.cuda.current_stream(x.device)

    def using(self, stream):
        """Context: `stream` is the current one (allocations come from its pool)."""
        return self.torch.cuda.stream(stream)

    def record(self, stream):
        ev = self.torch.cuda.Event()
        ev.record(stream)
        return ev

    def follow(self, event):
        """The current stream (of the current device) waits for event."""
        self.torch.cuda.current_stream().wait_event(event)

    def describe(self, x):
        return (x.device.index, self.codes.get(x.dtype), tuple(x.shape), x.is_contiguous(),
                str(x.dtype))

    @staticmethod
    def ptr(x):
        return x.data_ptr()

    @staticmethod
    def contiguous(x):
        return x.detach().contiguous()

    def empty(self, like, shape):
        return self.torch.empty(shape, dtype=like.dtype, device=like.device)

    def copy_on(self, stream, dst, src):
        with self.torch.cuda.stream(stream):
            dst.copy_(src)

    @staticmethod
    def flat(x):
        return x.detach().reshape(-1)


class CupyDevices:
    name = "cupy"

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.codes = {cupy.dtype(n): c for c, n in enumerate(_dtypes.DTYPE_NAMES)
                      if n != "bfloat16"}

    def owns(self, x):
        return isinstance(x, self.cupy.ndarray)

    def on(self, device):
        return self.cupy.cuda.Device(device)

    def new_stream(self, device):
        with self.cupy.cuda.Device(device):
            return self.cupy.cuda.Stream(non_blocking=True)

    @staticmethod
    def stream_handle(stream):
        return stream.ptr

    @staticmethod
    def done(event):
        return event.done

    def current_stream(self, x):
        with self.cupy.cuda.Device(x.device.id):
            return self.cupy.cuda.get_current_stream()

    @staticmethod
    def using(stream):
        return stream

    def record(self, stream):
        ev = self.cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        return ev

    def follow(self, event):
        self.cupy.cuda.get_current_stream().wait_event(event)

    def describe(self, x):
        return (x.device.id, self.codes.get(x.dtype), tuple(x.shape), x.flags.c_contiguous,
                str(x.dtype))

    @staticmethod
    def ptr(x):
        return x.data.ptr

    def contiguous(self, x):
        return self.cupy.ascontiguousarray(x)

    def empty(self, like, shape):
        with self.cupy.cuda.Device(like.device.id):
            return self.cupy.empty(shape, dtype=like.dtype)

    @staticmethod
    def copy_on(stream, dst, src):
        with stream:
            dst[...] = src

    @staticmethod
    def flat(x):
        return x.reshape(-1)


_ADAPTERS = {}


def devices_of(x):
    """The adapter of x's library if x is a GPU array, else None. Never imports torch or cupy:
    an array of theirs can only exist once they are imported."""
    for name, cls in (("torch", TorchDevices), ("cupy", CupyDevices)):
        if name in sys.modules:
            adapter = _ADAPTERS.get(name)
            if adapter is None:
                adapter = _ADAPTERS[name] = cls()
            if adapter.owns(x):
                return adapter
    return None


def is_device(x):
    return devices_of(x) is not None


class DeviceBuf:
    """A contiguous GPU array (`arr`) standing for the user's `obj`: obj itself, or (inputs
    only) a contiguous copy made on the caller's stream when obj is not contiguous."""
    __slots__ = ("obj", "arr", "devices", "device", "code", "shape", "count")

    def __init__(self, obj, arr, devices, device, code, shape):
        self.obj, self.arr, self.devices, self.device = obj, arr, devices, device
        self.code, self.shape, self.count = code, shape, math.prod(shape)

    @property
    def ptr(self):
        return self.devices.ptr(self.arr)


def wrap(x, name="x", output=False):
    """DeviceBuf of a GPU array; TypeError for an unsupported dtype, ValueError for an output
    that is not contiguous (results are written in place, never through a temporary)."""
    devices = devices_of(x)
    device, code, shape, contiguous, dtype = devices.describe(x)
    if code is None:
        raise TypeError(f"unsupported dtype {dtype} for {name}; mlfabric supports "
                        f"{', '.join(_dtypes.DTYPE_NAMES)}")
    if not contiguous and output:
        raise ValueError(f"{name} is a non-contiguous GPU array; mlfabric writes GPU results in "
                         "place only into contiguous arrays")
    arr = devices.contiguous(x) if not contiguous else x
    if devices.name == "torch":
        arr = arr.detach()
    return DeviceBuf(x, arr, devices, device, code, shape)


def ready_event(buf):
    """An event on the caller's current stream: the call's NCCL work waits for it. Recorded on
    the caller's thread when the call is made, after any contiguous copy of the input."""
    devices = buf.devices
    return devices.record(devices.current_stream(buf.arr))


def empty_like(buf, shape=None):
    """A new array of buf's library, dtype and device (from the current stream's pool), and its
    DeviceBuf."""
    shape = buf.shape if shape is None else tuple(shape)
    out = buf.devices.empty(buf.obj, shape)
    return out, wrap(out, "out", output=True)


def check_out(xb, out, what, count):
    """The DeviceBuf of a user's out array for input xb: same library, device, dtype, count."""
    if devices_of(out) is not xb.devices:
        raise TypeError(f"{what}: out must be a GPU array of the same kind as x")
    ob = wrap(out, "out", output=True)
    if ob.device != xb.device:
        raise ValueError(f"{what}: out is on GPU {ob.device}, x on GPU {xb.device}")
    if ob.code != xb.code:
        raise TypeError(f"{what}: out has dtype {_dtypes.DTYPE_NAMES[ob.code]}, x has "
                        f"{_dtypes.DTYPE_NAMES[xb.code]}")
    if ob.count != count:
        raise ValueError(f"{what}: out has {ob.count} elements, expected {count}")
    return ob
