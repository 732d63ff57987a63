"""Cut-through relaying at a worker (DESIGN: aggregators and distributors are co-hosted with
workers): what lets an aggregate or a relayed model leave before its inputs have fully arrived.

Owns StreamingSum, the `available` callable of an aggregate sent while its members are still
coming in (DataPlane.send(..., available=)): each call sums the members' newly arrived prefix
into the aggregate's buffer and says how many bytes of it are ready. A member is either a whole
array (already here: the aggregator's own update, or one that came before its plan) or an
inbound dataplane.Stream. If any member's stream fails (its sender died), the sum says VOID
and the data plane marks the aggregate void for its receiver, which drops it with a reason.
"""
import numpy as np

from .. import kernels
from .dataplane import VOID, Stream


class StreamingSum:
    """The elementwise sum of `parts` (same dtype and shape: arrays or Streams), built prefix by
    prefix into `total` as the parts' bytes come in. Call it for the bytes ready so far."""

    __slots__ = ("parts", "total", "_flat", "_done", "_item")

    def __init__(self, parts):
        first = parts[0].data if isinstance(parts[0], Stream) else parts[0]
        for p in parts:
            d = p.data if isinstance(p, Stream) else p
            if d.dtype != first.dtype or d.shape != first.shape:
                raise ValueError("aggregate members disagree: %s %s vs %s %s"
                                 % (d.dtype, d.shape, first.dtype, first.shape))
        self.parts = parts
        self.total = np.empty(first.shape, first.dtype)
        self._flat = [(p.data if isinstance(p, Stream) else p).reshape(-1) for p in parts]
        self._done = 0                    # elements summed so far
        self._item = first.dtype.itemsize

    def __call__(self):
        have = self.total.nbytes
        for p in self.parts:
            if isinstance(p, Stream):
                n = p.available()
                if n == VOID:
                    return VOID
                have = min(have, n)
        upto = have // self._item         # whole elements only
        if upto > self._done:
            lo, out = self._done, self.total.reshape(-1)
            if len(self._flat) == 1:
                out[lo:upto] = self._flat[0][lo:upto]
            else:
                kernels.reduce([f[lo:upto] for f in self._flat], out=out[lo:upto])
            self._done = upto
        return self._done * self._item
