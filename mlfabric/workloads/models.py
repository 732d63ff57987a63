"""The image-classifier workloads (the small stand-ins for the paper's ResNets, §7) and the bridge
between a torch model and the one flat numpy vector a parameter server or an allreduce moves.

build() makes "mlp", "convnet" or "logreg" with a seeded, reproducible initialisation.
flat_params / set_flat_params / flat_grads: the first call re-points every parameter (and its
gradient) into one contiguous buffer, so the flat vectors are numpy views of the model's own
memory - no gather or scatter per step. Classifier wraps a model and a dataset into the workload
shape the trainers drive: size, model0(), step(model) -> update (eq. 1: minus the learning rate
times the minibatch gradient, plus weight decay), accuracy().

torch is imported inside the functions, so this module imports without it.
"""
import math

import numpy as np

from .data import batches

MODELS = ("mlp", "convnet", "logreg")
_NUMPY_DTYPES = ("float32", "float64", "float16")


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("mlfabric.workloads.models needs PyTorch: pip install torch") from e
    return torch


def _image_shape(in_shape):
    """(C, H, W) for the convnet: (H, W) gets one channel, a square length n (1, √n, √n)."""
    if len(in_shape) == 3:
        c, h, w = in_shape
    elif len(in_shape) == 2:
        (h, w), c = in_shape, 1
    elif len(in_shape) == 1 and math.isqrt(in_shape[0]) ** 2 == in_shape[0]:
        c, h, w = 1, math.isqrt(in_shape[0]), math.isqrt(in_shape[0])
    else:
        raise ValueError(f"convnet needs an image shape (C, H, W), (H, W) or a square length, "
                         f"got in_shape={tuple(in_shape)}")
    if h < 2 or w < 2:
        raise ValueError(f"convnet needs images of at least 2x2, got {h}x{w}")
    return c, h, w


def _torch_dtype(dtype, torch):
    """float32 or float64, given as a numpy, torch or string dtype."""
    try:
        name = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) \
            else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in ("float32", "float64"):
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    return getattr(torch, name)


def build(name, in_shape, classes, seed=0, dtype="float32"):
    """A fresh model. in_shape: one sample's shape (an int, or e.g. (64,) or (1, 8, 8)); inputs may
    come flat or shaped, each model reshapes them itself. The initialisation depends only on
    `seed` (torch's global RNG is left as it was)."""
    torch = _torch()
    nn = torch.nn
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; the models are {', '.join(MODELS)}")
    in_shape = (int(in_shape),) if np.isscalar(in_shape) else tuple(int(s) for s in in_shape)
    if not in_shape or min(in_shape) < 1:
        raise ValueError(f"in_shape must be positive sizes, got {in_shape}")
    classes = int(classes)
    if classes < 2:
        raise ValueError(f"classes must be >= 2, got {classes}")
    tdtype = _torch_dtype(dtype, torch)
    features = math.prod(in_shape)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "logreg":
            net = nn.Sequential(nn.Flatten(), nn.Linear(features, classes))
        elif name == "mlp":
            net = nn.Sequential(nn.Flatten(), nn.Linear(features, 128), nn.ReLU(),
                                nn.Linear(128, classes))
        else:
            c, h, w = _image_shape(in_shape)
            # Flatten then Unflatten: flat (n, 64) and shaped (n, 8, 8) inputs both work
            net = nn.Sequential(nn.Flatten(), nn.Unflatten(1, (c, h, w)),
                                nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(),
                                nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                nn.MaxPool2d(2), nn.Flatten(),
                                nn.Linear(32 * (h // 2) * (w // 2), classes))
    net = net.to(tdtype)
    _flat_state(net)
    return net


class _FlatState:
    """One model's parameters and gradients as two contiguous buffers (torch and numpy views)."""

    def __init__(self, params, torch):
        self.shapes = [p.shape for p in params]
        self.offsets = np.cumsum([0] + [p.numel() for p in params]).tolist()
        n, dtype = self.offsets[-1], params[0].dtype
        self.buf, self.gbuf = torch.empty(n, dtype=dtype), torch.zeros(n, dtype=dtype)
        self.values, self.grads = self.buf.numpy(), self.gbuf.numpy()
        for k, p in enumerate(params):
            view = self.view(self.buf, k)
            view.copy_(p.detach())
            p.data = view
            g = self.view(self.gbuf, k)
            if p.grad is not None:
                g.copy_(p.grad)
            p.grad = g

    def view(self, flat, k):
        return flat[self.offsets[k]:self.offsets[k + 1]].view(self.shapes[k])

    def holds(self, params):
        """Whether every parameter still lives in the buffer (model.to() or a parameter swap
        would have moved it)."""
        return (len(params) == len(self.shapes) and
                all(p.data_ptr() == self.view(self.buf, k).data_ptr() and p.shape == self.shapes[k]
                    and p.dtype == self.buf.dtype for k, p in enumerate(params)))


def _flat_state(model):
    torch = _torch()
    params = list(model.parameters())
    st = model.__dict__.get("_mlfabric_flat")
    if st is not None and st.holds(params):
        return st
    if not params:
        raise ValueError("the model has no parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or str(params[0].dtype).replace("torch.", "") not in _NUMPY_DTYPES:
        raise ValueError(f"flat parameters need one float32/float64/float16 dtype, "
                         f"got {sorted(map(str, dtypes))}")
    if any(p.device.type != "cpu" for p in params):
        raise ValueError("flat parameters need a CPU model")
    st = _FlatState(params, torch)
    model.__dict__["_mlfabric_flat"] = st   # plain attribute, not a registered buffer
    return st


def flat_params(model):
    """The model's parameters as one 1-D numpy array in model.parameters() order, in the model's
    dtype. It is a view of the model's memory: writes change the model; copy it to keep it."""
    return _flat_state(model).values


def set_flat_params(model, vec):
    """Copy a flat vector into the model's parameters (cast to the model's dtype); returns model."""
    st = _flat_state(model)
    vec = np.asarray(vec)
    if vec.ndim != 1 or vec.size != st.values.size:
        raise ValueError(f"expected a 1-D vector of {st.values.size} parameters, "
                         f"got shape {vec.shape}")
    if not np.issubdtype(vec.dtype, np.floating):
        raise ValueError(f"parameters must be floating point, got {vec.dtype}")
    np.copyto(st.values, vec, casting="same_kind")
    return model


def flat_grads(model):
    """The parameters' gradients as one 1-D numpy view in the flat_params order (zeros where a
    parameter has none). backward() accumulates straight into it; if something replaced a
    gradient tensor (e.g. optimizer.zero_grad() sets them to None) it is copied back in first."""
    st = _flat_state(model)
    for k, p in enumerate(model.parameters()):
        g = st.view(st.gbuf, k)
        if p.grad is None:
            g.zero_()
        elif p.grad.data_ptr() != g.data_ptr():
            g.copy_(p.grad)
        else:
            continue
        p.grad = g
    return st.grads


def zero_grads(model):
    """Zero every gradient in place (keeping them in the flat buffer)."""
    flat_grads(model)[:] = 0
    return model


def _inputs(model, X):
    torch = _torch()
    return torch.as_tensor(np.asarray(X), dtype=_flat_state(model).buf.dtype)


def sgd_update(model, X, y, lr, weight_decay=0.0):
    """(update, loss) at the model's current parameters: update = -lr * (gradient of the mean
    cross-entropy over (X, y) + weight_decay * w), a new array, the delta to add to the model
    (the paper's eq. 1 with lambda(w) = -lr * weight_decay * w)."""
    torch = _torch()
    if len(X) != len(y) or len(X) == 0:
        raise ValueError(f"need a non-empty batch with as many labels as samples, "
                         f"got {len(X)} samples and {len(y)} labels")
    zero_grads(model)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(_inputs(model, X)),
                                             torch.as_tensor(np.asarray(y), dtype=torch.int64))
    loss.backward()
    update = flat_grads(model) * -lr
    if weight_decay:
        update -= lr * weight_decay * flat_params(model)
    return update, loss.item()


def accuracy(model, X, y, batch_size=4096):
    """Fraction of samples whose highest-scoring class is the label."""
    torch = _torch()
    if len(X) != len(y) or len(X) == 0:
        raise ValueError(f"need a non-empty set with as many labels as samples, "
                         f"got {len(X)} samples and {len(y)} labels")
    model.eval()
    right = 0
    p0 = next(model.parameters())   # the model's dtype and device (a GPU model too)
    with torch.no_grad():
        for a in range(0, len(X), batch_size):
            x = torch.as_tensor(np.asarray(X[a:a + batch_size]), dtype=p0.dtype,
                                device=p0.device)
            pred = model(x).argmax(1).cpu().numpy()
            right += int((pred == np.asarray(y[a:a + batch_size])).sum())
    return right / len(X)


class Classifier:
    """A classifier workload for a data-parallel or parameter-server trainer: the model is one
    flat vector of `size` (the torch model's dtype); step(model) takes the worker's next minibatch
    (reshuffled every epoch, fixed by seed) and returns the update to add to the model."""

    def __init__(self, name, X, y, classes=None, batch_size=32, lr=0.1, weight_decay=0.0,
                 seed=0, dtype="float32"):
        if len(X) != len(y) or len(X) == 0:
            raise ValueError(f"need a non-empty dataset with as many labels as samples, "
                             f"got {len(X)} samples and {len(y)} labels")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        classes = int(np.max(y)) + 1 if classes is None else int(classes)
        self.net = build(name, X.shape[1:], classes, seed, dtype)
        self.X, self.y, self.batch_size = X, y, int(batch_size)
        self.lr, self.weight_decay, self.seed = lr, weight_decay, seed
        self._w0 = flat_params(self.net).copy()
        self.size, self.dtype = self._w0.size, self._w0.dtype
        self.epoch, self.last_loss = 0, math.nan
        self._it = batches(X, y, self.batch_size, seed, 0)

    def model0(self):
        """The seeded initial model (a new array)."""
        return self._w0.copy()

    def next_batch(self):
        for batch in self._it:
            return batch
        self.epoch += 1
        self._it = batches(self.X, self.y, self.batch_size, self.seed, self.epoch)
        return next(self._it)

    def update(self, model, X, y):
        """The update from minibatch (X, y) computed at `model`."""
        set_flat_params(self.net, model)
        update, self.last_loss = sgd_update(self.net, X, y, self.lr, self.weight_decay)
        return update

    def step(self, model):
        """The update from this worker's next minibatch, computed at `model`."""
        return self.update(model, *self.next_batch())

    def accuracy(self, model, X, y):
        set_flat_params(self.net, model)
        return accuracy(self.net, X, y)
