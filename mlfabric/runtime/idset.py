"""A compact set of update ids for the accounting (ledger.py): one byte per id instead of a Python
int in a hash table (~60-70 bytes), so a long job's ledgers stay small in memory and in the
pickles that carry them to the scheduler at the end.

An id is (rank << 32) | index, and each worker numbers its pushes 0, 1, 2, ... (allreduce
contributions set bit 31 of the index), so ids are dense within a block (id >> 31). The set is a
bitmap per block: a bytearray of 0/1, grown by doubling. It takes plain ints and any iterable of
them where a set would, and its algebra (| & - <=) returns IdSets.
"""
import numpy as np

_LO = (1 << 31) - 1


class IdSet:
    __slots__ = ("_blocks", "_n")

    def __init__(self, ids=()):
        self._blocks = {}   # id >> 31 -> bytearray, 1 where index (id & _LO) is in the set
        self._n = 0
        self.update(ids)

    # --- like a set ------------------------------------------------------------------------------
    def add(self, uid):
        hi, lo = uid >> 31, uid & _LO
        b = self._blocks.get(hi)
        if b is None:
            b = self._blocks[hi] = bytearray(max(64, lo + 1))
        elif lo >= len(b):
            b.extend(bytes(max(len(b), lo + 1 - len(b))))
        if not b[lo]:
            b[lo] = 1
            self._n += 1

    def discard(self, uid):
        if uid in self:
            self._blocks[uid >> 31][uid & _LO] = 0
            self._n -= 1

    def update(self, ids):
        if isinstance(ids, IdSet):
            self |= ids
            return
        for uid in ids:
            self.add(uid)

    def __contains__(self, uid):
        b = self._blocks.get(uid >> 31)
        lo = uid & _LO
        return b is not None and lo < len(b) and b[lo] == 1

    def __len__(self):
        return self._n

    def __iter__(self):
        for hi in sorted(self._blocks):
            base = hi << 31
            for lo in np.flatnonzero(np.frombuffer(self._blocks[hi], np.uint8)):
                yield base | int(lo)

    def __repr__(self):
        return "IdSet(%d ids)" % self._n

    def __eq__(self, other):
        other = _idset(other)
        return self._n == other._n and self <= other

    __hash__ = None

    # --- algebra, block by block on numpy views ---------------------------------------------------
    def __ior__(self, other):
        for hi, ob in _idset(other)._blocks.items():
            b = self._blocks.get(hi)
            if b is None:
                self._blocks[hi] = bytearray(ob)
                continue
            if len(b) < len(ob):
                b.extend(bytes(len(ob) - len(b)))
            mine = np.frombuffer(b, np.uint8)
            np.bitwise_or(mine[:len(ob)], np.frombuffer(ob, np.uint8), out=mine[:len(ob)])
        self._recount()
        return self

    def __or__(self, other):
        out = self.copy()
        out |= other
        return out

    def __and__(self, other):
        return self._combine(other, keep_other=True)

    def __sub__(self, other):
        return self._combine(other, keep_other=False)

    def __le__(self, other):
        return len(self - other) == 0

    def copy(self):
        out = IdSet()
        out._blocks = {hi: bytearray(b) for hi, b in self._blocks.items()}
        out._n = self._n
        return out

    def _combine(self, other, keep_other):
        """self & other (keep_other) or self - other."""
        other = _idset(other)
        out = IdSet()
        for hi, b in self._blocks.items():
            mine = np.frombuffer(b, np.uint8)
            theirs = np.zeros(len(b), np.uint8)
            ob = other._blocks.get(hi)
            if ob is not None:
                n = min(len(b), len(ob))
                theirs[:n] = np.frombuffer(ob, np.uint8)[:n]
            kept = mine & theirs if keep_other else mine & (1 - theirs)
            if kept.any():
                out._blocks[hi] = bytearray(kept.tobytes())
        out._recount()
        return out

    def _recount(self):
        self._n = sum(int(np.count_nonzero(np.frombuffer(b, np.uint8)))
                      for b in self._blocks.values())


def _idset(ids):
    return ids if isinstance(ids, IdSet) else IdSet(ids)
