"""NVMe space for activations that do not fit the CPU area: striped files that grow on demand.

How much spills depends on the batch and is only known once a step has run, so the space is
not reserved up front the way chunk slots are: it grows by whole segments (each a
``StripedFile`` over the NVMe directories, at least ``SEGMENT_MIN`` bytes and doubling) during
the first steps and is then reused in place — overwriting existing blocks is what these disks do
fastest. Ranges are 4 KiB-aligned (O_DIRECT). Reads and writes go through the engine's
``AsyncIO``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..aio import AsyncIO, StripedFile
from ..errors import TierFullError
from ..tiers.arena import Extents
from ..tiers.nvme import nvme_capacity

SEGMENT_MIN = 64 << 20
ALIGN = 4096


@dataclass(frozen=True, slots=True)
class SpillSlot:
    segment: int
    file: StripedFile
    offset: int
    nbytes: int


class SpillSpace:
    def __init__(self, dirs, aio: AsyncIO, prefix: str, *, segment_min: int = SEGMENT_MIN):
        self.segment_min = segment_min
        self.dirs = list(dirs)
        self.aio = aio
        self.prefix = prefix
        self.segments: list[tuple[StripedFile, Extents]] = []
        self.in_use = 0

    @property
    def size(self) -> int:
        return sum(f.size for f, _ in self.segments)

    def allocate(self, nbytes: int) -> SpillSlot:
        """A range of ``nbytes`` (rounded up to 4 KiB on disk); grows the space when none is free."""
        for i, (file, extents) in enumerate(self.segments):
            start = extents.allocate(nbytes)
            if start is not None:
                self.in_use += nbytes
                return SpillSlot(i, file, start, nbytes)
        rounded = -(-nbytes // ALIGN) * ALIGN
        grow = max(self.segment_min, rounded, self.size)
        grow = -(-grow // (len(self.dirs) * ALIGN)) * len(self.dirs) * ALIGN
        free = nvme_capacity(self.dirs)
        if grow > free:
            grow = rounded
            if grow > free:
                raise TierFullError("nvme (activations)", self.size + free, self.size, rounded,
                                    f"free space on {', '.join(self.dirs)}")
        file = StripedFile(self.dirs, f"{self.prefix}-activations-{len(self.segments)}.swp", grow)
        self.segments.append((file, Extents(grow, ALIGN)))
        return self.allocate(nbytes)

    def free(self, slot: SpillSlot) -> None:
        self.segments[slot.segment][1].free(slot.offset, slot.nbytes)
        self.in_use -= slot.nbytes

    def close(self) -> None:
        """Forget and delete the segment files."""
        for file, _ in self.segments:
            self.aio.forget(file)
            file.remove()
        self.segments.clear()
        self.in_use = 0
