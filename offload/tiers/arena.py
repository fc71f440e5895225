"""Extents of one preallocated region: first fit from either end, coalescing free.

A host tier that feeds O_DIRECT I/O keeps all its chunk buffers in one huge-page-advised
mapping (``MemoryTier`` with ``aligned``): nothing is mapped, faulted in, zeroed or unmapped
while training runs, bf16 and fp32 chunks share the space, and 1 MiB requests land on 2 MiB
pages (on the virtio disk measured, reads into huge pages ran ~1.8x faster and cost ~3x less
CPU than into 4 KiB pages). This class is only the bookkeeping: offsets and lengths.
"""

from __future__ import annotations

import bisect


class Extents:
    """Free byte ranges of a region of ``size`` bytes; every length a multiple of ``align``."""

    def __init__(self, size: int, align: int = 4096):
        self.size = size
        self.align = align
        self._starts: list[int] = [0] if size else []    # free extents, sorted by start
        self._lengths: dict[int, int] = {0: size} if size else {}

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def largest(self) -> int:
        return max(self._lengths.values(), default=0)

    def free_total(self) -> int:
        return sum(self._lengths.values())

    def allocate(self, nbytes: int, *, top: bool = False) -> int | None:
        """Start of a range of ``nbytes`` (rounded up to ``align``), or None if none is free.

        From the bottom of the region (the lowest free extent that holds it), or with ``top``
        from the top (the highest, at its end). Chunks come in two sizes (compute-precision and
        fp32); each size growing from its own end keeps freed ranges usable by the same size,
        where mixing them would leave holes too small for the big ones."""
        n = self._round(nbytes)
        order = range(len(self._starts) - 1, -1, -1) if top else range(len(self._starts))
        i = next((i for i in order if self._lengths[self._starts[i]] >= n), None)
        if i is None:
            return None
        start = self._starts[i]
        length = self._lengths[start]
        if top:
            if length == n:
                del self._starts[i]
                del self._lengths[start]
            else:
                self._lengths[start] = length - n
            return start + length - n
        del self._lengths[start]
        if length == n:
            del self._starts[i]
        else:
            self._starts[i] = start + n
            self._lengths[start + n] = length - n
        return start

    def free(self, start: int, nbytes: int) -> None:
        """Give back a range ``allocate`` returned, merging it with free neighbours."""
        n = self._round(nbytes)
        if start < 0 or start + n > self.size or start % self.align:
            raise ValueError(f"range [{start}, {start + n}) is not one this region handed out")
        i = bisect.bisect_left(self._starts, start)
        prev_end = self._starts[i - 1] + self._lengths[self._starts[i - 1]] if i else None
        nxt = self._starts[i] if i < len(self._starts) else None
        if (prev_end is not None and prev_end > start) or (nxt is not None and start + n > nxt):
            raise ValueError(f"range [{start}, {start + n}) overlaps free space: freed twice?")
        if nxt is not None and start + n == nxt:          # merge with the next extent
            n += self._lengths.pop(nxt)
            del self._starts[i]
        if prev_end == start:                             # merge into the previous extent
            self._lengths[self._starts[i - 1]] += n
        else:
            self._starts.insert(i, start)
            self._lengths[start] = n
