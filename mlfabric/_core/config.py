"""Settings read from the environment, in one place. Each is documented in docs/usage.md.

MLFABRIC_TIMEOUT   seconds a rank waits for its peers inside one collective before raising
                   PeerTimeoutError (default 300). Bounded waits are how mlfabric turns a dead or
                   diverged peer into an error instead of a hang.
MLFABRIC_SHM       0 disables the intra-host shared-memory path (default 1).
MLFABRIC_SHM_BLOCK bytes each rank stages per pipeline step in the shared-memory engine.
MLFABRIC_SHM_SLOTS pipeline depth of the shared-memory engine (steps in flight).
MLFABRIC_CMA_MIN, MLFABRIC_CMA_MAX
                   allreduce calls of more than MIN and at most MAX bytes read peers' buffers
                   directly (single copy, process_vm_readv) instead of staging them; MAX=0 turns
                   this off. Defaults: MIN 2 MiB for two ranks, 64 MiB for more; no MAX.
MLFABRIC_NCCL_LIB  the libnccl to load for GPU arrays (default: the loader's, then the
                   nvidia-nccl wheel's).
MLFABRIC_NCCL_SHARE_GPU
                   1 lets several ranks share one GPU through NCCL's socket transport (tests).
MLFABRIC_TORCH_META
                   0 makes mlfabric.torch read its grouped calls' tensors through torch's Python
                   API instead of PyTorch's C shim (default 1; the results are the same).
MLFABRIC_STORE_ADDR
                   the address where rank 0's rendezvous TCPStore (the torch.distributed
                   backend's) listens and the other ranks connect (default: 127.0.0.1 on one
                   host, else the address rank 0 reaches its peers from).
MLFABRIC_LOG_LEVEL debug, info, warning (default) or error: the level of the `mlfabric` logger
                   (see _core/log.py). MLFABRIC_DEBUG=1, its older on/off form, means debug for
                   the parameter-server runtime (`mlfabric.runtime`).

KNOWN holds every MLFABRIC_* name mlfabric or its build reads, so that init() can warn about a
misspelled one (_core/log.py).
"""
import math
import os

from ..errors import MlfabricError

# Settings that shape the collectives' protocol (and mlfabric.torch's fusion, which decides how
# many calls a list of tensors makes): every rank must use the same values. init() compares the
# values as read (unset and the default are the same), so a difference is an error on every rank
# rather than a crash or a hang. Each is read given the communicator's size (CMA's defaults
# depend on it).
_SHAPING_READERS = (
    ("MLFABRIC_SHM", lambda n: shm_enabled()),
    ("MLFABRIC_SHM_BLOCK", lambda n: shm_block_bytes()),
    ("MLFABRIC_SHM_SLOTS", lambda n: shm_slots()),
    ("MLFABRIC_CMA_MIN", lambda n: cma_range(n)[0]),
    ("MLFABRIC_CMA_MAX", lambda n: cma_range(n)[1]),
    ("MLFABRIC_NCCL_SHARE_GPU", lambda n: nccl_share_gpu()),
    ("MLFABRIC_FUSION_THRESHOLD", lambda n: fusion_threshold()))
SHAPING = tuple(name for name, _ in _SHAPING_READERS)


def shaping_settings(nranks):
    """(name, value as read, or the error of a bad one, as text) of each shaping setting (and
    of a bad MLFABRIC_ISA): a rank with a bad value still takes part in init()'s exchange, then
    raises its error, and its peers one naming it."""
    out = []
    for name, read in _SHAPING_READERS:
        try:
            out.append((name, read(nranks)))
        except MlfabricError as exc:
            out.append((name, f"error: {exc}"))
    # not compared (they do not shape the protocol), but a bad one is an error
    for name, check in (("MLFABRIC_ISA", check_isa), ("MLFABRIC_LOG_LEVEL", log_level),
                        ("MLFABRIC_DEBUG", debug_enabled)):
        try:
            check()
        except MlfabricError as exc:
            out.append((name, f"error: {exc}"))
    return tuple(out)


def is_error(value):
    """Whether a value of shaping_settings() is a bad setting's error."""
    return isinstance(value, str) and value.startswith("error: ")


def _number(name, default, cast=float, minimum=None):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise MlfabricError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):  # nan would compare false with every bound: no bound at all
        raise MlfabricError(f"{name}={raw!r} must be a finite number")
    if minimum is not None and value < minimum:
        raise MlfabricError(f"{name}={raw!r} must be at least {minimum}")
    return value


def fusion_threshold():
    """MLFABRIC_FUSION_THRESHOLD (bytes; default 4 MiB, 0 turns fusion off): see
    mlfabric.torch.ops.fusion_threshold."""
    return _number("MLFABRIC_FUSION_THRESHOLD", 4 << 20, int, 0)


def debug_enabled():
    """MLFABRIC_DEBUG=1, the older form of MLFABRIC_LOG_LEVEL=debug for the parameter-server
    runtime (logger mlfabric.runtime: every control message and failure; runtime/daemon.py),
    kept for one release."""
    raw = os.environ.get("MLFABRIC_DEBUG", "0").strip() or "0"
    if raw not in ("0", "1"):
        raise MlfabricError(f"MLFABRIC_DEBUG must be 0 or 1, got {raw!r}")
    return raw == "1"


LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level():
    """MLFABRIC_LOG_LEVEL as a logging level name (upper case: "WARNING" when unset)."""
    raw = os.environ.get("MLFABRIC_LOG_LEVEL", "").strip().lower() or "warning"
    if raw not in LOG_LEVELS:
        raise MlfabricError(f"MLFABRIC_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, "
                            f"got {os.environ['MLFABRIC_LOG_LEVEL']!r}")
    return raw.upper()


ISAS = ("auto", "scalar", "avx2", "avx512")


def check_isa():
    """MLFABRIC_ISA names an instruction set the kernels have (the native core picks it, or the
    best this CPU has when it lacks that one, with a warning: correct on every ISA)."""
    raw = os.environ.get("MLFABRIC_ISA", "").strip()
    if raw and raw not in ISAS:
        raise MlfabricError(f"MLFABRIC_ISA must be one of {', '.join(ISAS)}, got {raw!r}")


def timeout_s():
    return _number("MLFABRIC_TIMEOUT", 300.0, float, 0.001)


def elastic_replace():
    """MLFABRIC_ELASTIC_REPLACE: the most processes an elastic job spawns to replace dead ranks
    over its life (respawn.py); 0, the default, replaces none."""
    return _number("MLFABRIC_ELASTIC_REPLACE", 0, int, 0)


def shm_enabled():
    raw = os.environ.get("MLFABRIC_SHM", "1").strip()
    if raw not in ("0", "1"):
        raise MlfabricError(f"MLFABRIC_SHM must be 0 or 1, got {raw!r}")
    return raw == "1"


def torch_meta_enabled():
    raw = os.environ.get("MLFABRIC_TORCH_META", "1").strip()
    if raw not in ("0", "1"):
        raise MlfabricError(f"MLFABRIC_TORCH_META must be 0 or 1, got {raw!r}")
    return raw == "1"


def shm_block_bytes():
    return _number("MLFABRIC_SHM_BLOCK", 256 * 1024, int, 4096)


def shm_slots():
    return _number("MLFABRIC_SHM_SLOTS", 4, int, 2)


def cma_range(nranks):
    """(min, max] bytes of the allreduce calls that take the single-copy path. Defaults from the
    A/B profile in BENCHMARKS.md (benchmarks/shm_paths.py): with two ranks it matches or beats
    the staged pipeline above 2 MiB (and holds up far better when a core is taken away); with
    more ranks per host the staged pipeline wins up to 64 MiB."""
    lo, hi = (2 << 20 if nranks == 2 else 64 << 20), 1 << 62
    return _number("MLFABRIC_CMA_MIN", lo, int, 0), _number("MLFABRIC_CMA_MAX", hi, int, 0)


def nccl_lib():
    """MLFABRIC_NCCL_LIB, or None."""
    return os.environ.get("MLFABRIC_NCCL_LIB") or None


def nccl_share_gpu():
    raw = os.environ.get("MLFABRIC_NCCL_SHARE_GPU", "0").strip()
    if raw not in ("0", "1"):
        raise MlfabricError(f"MLFABRIC_NCCL_SHARE_GPU must be 0 or 1, got {raw!r}")
    return raw == "1"


# Every MLFABRIC_* name read anywhere: the settings above, the build's (setup.py), the launch's
# and the tools'. An MLFABRIC_* variable outside this set is most likely a misspelling of one
# (init() warns, naming the closest); MLFABRIC_TEST_* belong to the test suite.
KNOWN = frozenset((
    "MLFABRIC_TIMEOUT", "MLFABRIC_SHM", "MLFABRIC_SHM_BLOCK", "MLFABRIC_SHM_SLOTS",
    "MLFABRIC_CMA_MIN", "MLFABRIC_CMA_MAX", "MLFABRIC_NCCL_LIB", "MLFABRIC_NCCL_SHARE_GPU",
    "MLFABRIC_TORCH_META", "MLFABRIC_STORE_ADDR", "MLFABRIC_FUSION_THRESHOLD",
    "MLFABRIC_DEBUG", "MLFABRIC_LOG_LEVEL", "MLFABRIC_ISA", "MLFABRIC_ELASTIC_REPLACE",
    "MLFABRIC_REPLACEMENT", "MLFABRIC_TIMELINE", "MLFABRIC_SCHED_PYTHON",
    "MLFABRIC_BENCH_MASTER_ADDR",
    # build time (setup.py)
    "MLFABRIC_CUDA", "MLFABRIC_BUILD_JOBS", "MLFABRIC_CUDA_ARCHS"))
UNCHECKED_PREFIXES = ("MLFABRIC_TEST_",)
