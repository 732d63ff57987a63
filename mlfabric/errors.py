"""Errors raised by mlfabric. Everything mlfabric raises on purpose derives from MlfabricError,
except TypeError for an unsupported dtype or a value that is not an array (Python's convention)."""


class MlfabricError(RuntimeError):
    """Base class of mlfabric's errors."""


class NotInitializedError(MlfabricError):
    """An mlfabric call that needs init() came before it (or after finalize())."""


class MismatchError(MlfabricError):
    """Ranks disagree on a collective's shape, dtype, op, count, root or algorithm.

    Raised on every rank of the call, naming the ranks and what each one passed."""


class PeerTimeoutError(MlfabricError):
    """A peer did not arrive within the timeout (MLFABRIC_TIMEOUT seconds): it died, hung, or is
    running a different collective. The communicator is unusable afterwards."""


class ConcurrentCallError(MlfabricError):
    """A call on a communicator came from one thread while another thread was inside a call on
    it. Calls on one communicator must come from one thread at a time; the communicator is
    unusable afterwards (the ranks may have paired different calls)."""
