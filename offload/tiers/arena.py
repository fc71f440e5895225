"""The bookkeeping of one preallocated region: ``Extents`` (first fit from either end, coalescing
free) over a whole budget, or ``Slots`` (one slot per buffer a tier can ever hold, and spare
extents) over exactly what the chunks need.

A host tier that feeds O_DIRECT I/O keeps all its chunk buffers in one huge-page-advised
mapping (``MemoryTier`` with ``aligned``): nothing is mapped, faulted in, zeroed or unmapped
while training runs, bf16 and fp32 chunks share the space, and 1 MiB requests land on 2 MiB
pages (on the virtio disk measured, reads into huge pages ran ~1.8x faster and cost ~3x less
CPU than into 4 KiB pages). These classes are only the bookkeeping: offsets and lengths.

``Slots`` serves a pinned tier sized to its chunks rather than its budget (``MemoryTier.fit_to``):
with no room to spare, first fit could leave the free bytes in holes too small for the next
chunk (two sizes at least, bf16 and fp32, and each kind's last chunk), where a slot per chunk
buffer cannot fragment: a request of a size finds a free slot of that size unless more buffers
of it are live than chunks of it exist, and those few (a copy made twice, a buffer an upload
still reads) take the spare extents.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Iterable


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

    def fits(self, nbytes: int) -> bool:
        """Whether ``allocate(nbytes)`` would find a range now."""
        return self.largest() >= self._round(nbytes)

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


class Slots:
    """A region of one slot per entry of ``sizes`` (each rounded up to ``align``), the largest
    first, then ``spare`` bytes of ``Extents``. A request takes a free slot of its rounded size,
    else a range of the spare extents; ``allocate``, ``free`` and ``fits`` as ``Extents``'. It
    never takes a slot of another size: a slot lent to a smaller buffer could then be missing to
    a request of its own size that no other buffer of that size competes with."""

    def __init__(self, sizes: Iterable[int], spare: int, align: int = 4096):
        self.align = align
        counts = Counter(self._round(n) for n in sizes if n > 0)
        self._free: dict[int, list[int]] = {}      # size -> free slot starts, the lowest last (popped first)
        self._size_at: dict[int, int] = {}         # slot start -> its size
        self._taken: set[int] = set()
        end = 0
        for size in sorted(counts, reverse=True):
            starts = [end + i * size for i in range(counts[size])]
            self._free[size] = starts[::-1]
            self._size_at.update(dict.fromkeys(starts, size))
            end += counts[size] * size
        self.slots_end = end
        self.spare = Extents(self._round(spare), align)
        self.size = end + self.spare.size

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def fits(self, nbytes: int) -> bool:
        return bool(self._free.get(self._round(nbytes))) or self.spare.fits(nbytes)

    def free_total(self) -> int:
        return sum(size * len(free) for size, free in self._free.items()) + self.spare.free_total()

    def allocate(self, nbytes: int, *, top: bool = False) -> int | None:
        """Start of a free slot of ``nbytes`` rounded, else of a spare range (``top``: from the
        spare extents' top), or None."""
        free = self._free.get(self._round(nbytes))
        if free:
            start = free.pop()
            self._taken.add(start)
            return start
        start = self.spare.allocate(nbytes, top=top)
        return None if start is None else self.slots_end + start

    def free(self, start: int, nbytes: int) -> None:
        """Give back what ``allocate`` returned."""
        if start >= self.slots_end:
            self.spare.free(start - self.slots_end, nbytes)
            return
        size = self._size_at.get(start)
        if start not in self._taken or size != self._round(nbytes):
            raise ValueError(f"range [{start}, {start + self._round(nbytes)}) is not a slot this region "
                             f"handed out{' (freed twice?)' if size == self._round(nbytes) else ''}")
        self._taken.discard(start)
        self._free[size].append(start)
