"""Per-layer profiles for the PipeDream partitioner (thesis §2.4.1, "Profiler"): for each layer l,
T_l (forward + backward time for one input), a_l (output activation bytes) and w_l (parameter
bytes). `profile_layers` measures them with PyTorch, `synthetic_profile` builds them by hand.

Choices, and why:
- Each layer is timed in isolation on the previous layer's (detached) output, as the thesis does:
  the partitioner needs per-layer costs, not the cost of the whole model.
- The input of the layer requires grad, and backward starts from a ones-like output gradient, so
  the backward time includes the input gradient that a real pipeline stage must send back.
- The median of the repeats is reported: one slow repeat (a page fault, another process on the
  core) should not move the profile.
- torch is imported inside the functions: it is an optional dependency of mlfabric.
"""
import math
import time
from dataclasses import dataclass
from numbers import Real


@dataclass(frozen=True)
class LayerProfile:
    name: str
    time_s: float            # T_l: forward + backward seconds for one input (microbatch)
    activation_bytes: float  # a_l: bytes of the layer's output (sent to the next stage, stashed)
    weight_bytes: float      # w_l: bytes of the layer's parameters (all-reduced across replicas)


def check_profiles(profiles):
    """Raise ValueError unless `profiles` is a non-empty list of LayerProfile with finite,
    non-negative numbers. Returns it as a list."""
    profiles = list(profiles)
    if not profiles:
        raise ValueError("the profile is empty: at least one layer is needed")
    for k, p in enumerate(profiles):
        if not isinstance(p, LayerProfile):
            raise ValueError(f"profile entry {k} is {type(p).__name__}, not a LayerProfile")
        for field in ("time_s", "activation_bytes", "weight_bytes"):
            v = getattr(p, field)
            if not isinstance(v, Real) or not math.isfinite(v) or v < 0:
                raise ValueError(f"layer {k} ({p.name!r}): {field} must be a finite number >= 0, "
                                 f"got {v!r}")
    return profiles


def synthetic_profile(times, activation_bytes, weight_bytes, names=None):
    """Profiles built by hand. `times` is a list (one entry per layer); `activation_bytes` and
    `weight_bytes` are lists of the same length or single numbers used for every layer."""
    times = list(times)
    n = len(times)

    def per_layer(v, what):
        if isinstance(v, Real):
            return [v] * n
        v = list(v)
        if len(v) != n:
            raise ValueError(f"{what} has {len(v)} entries for {n} layers")
        return v

    acts = per_layer(activation_bytes, "activation_bytes")
    weights = per_layer(weight_bytes, "weight_bytes")
    names = [f"layer{k}" for k in range(n)] if names is None else per_layer(names, "names")
    return check_profiles(LayerProfile(str(nm), t, a, w)
                          for nm, t, a, w in zip(names, times, acts, weights))


def _tensor_bytes(t):
    return t.numel() * t.element_size()


def profile_layers(layers, sample_input, repeats=5, warmup=1):
    """Profile each layer of `layers` (an nn.Sequential or a list of modules applied in order) on
    `sample_input` (a tensor: one microbatch). Returns one LayerProfile per layer: the median
    forward + backward time over `repeats` runs after `warmup` untimed runs, the output's bytes
    and the parameters' bytes (a parameter shared by several layers is counted in the first).
    Gradients the profiling leaves on the parameters are cleared."""
    import torch

    if isinstance(layers, torch.nn.Sequential):
        named = [(f"{n}:{type(m).__name__}", m) for n, m in layers.named_children()]
    else:
        layers = list(layers)
        for k, m in enumerate(layers):
            if not isinstance(m, torch.nn.Module):
                raise ValueError(f"layer {k} is {type(m).__name__}, not a torch.nn.Module")
        named = [(f"{k}:{type(m).__name__}", m) for k, m in enumerate(layers)]
    if not named:
        raise ValueError("no layers to profile")
    if not isinstance(sample_input, torch.Tensor):
        raise ValueError(f"sample_input must be a torch.Tensor, got {type(sample_input).__name__}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                         f"warmup={warmup}")

    def sync(t):
        # CUDA kernels run asynchronously: without this the timer measures only the launch.
        if t.is_cuda:
            torch.cuda.synchronize(t.device)

    seen = set()  # ids of parameters already counted
    profiles = []
    x = sample_input.detach()
    for name, layer in named:
        params = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        wbytes = sum(_tensor_bytes(p) for p in params)
        times = []
        out = None
        for run in range(warmup + repeats):
            inp = x.detach()
            if inp.is_floating_point():  # integer inputs (token ids) carry no gradient
                inp.requires_grad_(True)
            sync(inp)
            t0 = time.perf_counter()
            out = layer(inp)
            if not isinstance(out, torch.Tensor):
                raise ValueError(f"layer {name} returned {type(out).__name__}, not a tensor")
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            sync(out)
            if run >= warmup:
                times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        times.sort()
        median = times[len(times) // 2] if len(times) % 2 else \
            0.5 * (times[len(times) // 2 - 1] + times[len(times) // 2])
        profiles.append(LayerProfile(name, median, _tensor_bytes(out), wbytes))
        x = out.detach()
    return profiles
