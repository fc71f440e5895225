"""A memory tier (the compute device, or CPU memory): a budgeted pool of reusable byte buffers.

Buffers are flat ``uint8`` tensors; a chunk views one as its dtype. Freed buffers stay in the
pool for the next chunk of the same size (freshly touched pages cost ~40x more than reused
ones on these machines), and are handed back to the system only when a request of another size
needs their share of the budget. ``reserved`` (pooled + in use) never exceeds ``budget``.

A host tier that feeds O_DIRECT I/O (``aligned``, not pinned) instead carves every buffer out
of one huge-page-advised mapping of ``budget`` bytes (see ``arena``): chunks of every size share
it, and nothing is mapped or unmapped while training runs. Pages are touched only as they are
first used, so resident memory grows to the peak use, never beyond the budget.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from ..errors import TierFullError
from .arena import Extents

HUGEPAGE = 2 << 20


class MemoryTier:
    """A byte budget on one device with a size-keyed buffer pool.

    ``aligned`` asks for 4 KiB-aligned (O_DIRECT-able) host buffers; ``pin`` page-locks them
    for asynchronous CUDA copies.
    """

    def __init__(self, name: str, budget: int, device: torch.device | str = "cpu", *,
                 aligned: bool = False, pin: bool = False):
        self.name = name
        self.budget = int(budget)
        self.device = torch.device(device)
        self.aligned = aligned
        self.pin = pin
        self.in_use = 0                     # bytes handed out
        self._pooled: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._pooled_bytes = 0
        # Aligned unpinned host memory is one arena: its bookkeeping now, its mapping at first use.
        arena = self.device.type == "cpu" and aligned and not pin
        self._extents = Extents(self.budget // 4096 * 4096) if arena else None
        self._mapping: memoryview | None = None
        self._base = 0
        self._largest_request = 0

    @property
    def reserved(self) -> int:
        """Bytes held from the system: in use plus pooled for reuse (always <= budget)."""
        return self.in_use + self._pooled_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes that can still be handed out (pooled buffers count as free)."""
        return self.budget - self.in_use

    def can_allocate(self, nbytes: int) -> bool:
        if self.in_use + nbytes > self.budget:
            return False
        # In an arena the bytes must also be contiguous (evicting more makes them so).
        return self._extents is None or self._extents.largest() >= nbytes

    def shortfall(self, nbytes: int) -> int:
        """Bytes to free before ``nbytes`` can be allocated: the missing budget, or in an arena with
        enough free bytes that are not contiguous, ``nbytes`` (freed victim by victim until it fits)."""
        return nbytes - self.free_bytes if nbytes > self.free_bytes else nbytes

    def allocate(self, nbytes: int, holders: Callable[[], str] = lambda: "") -> torch.Tensor:
        """A buffer of ``nbytes``; raises ``TierFullError`` if the budget cannot cover it."""
        if not self.can_allocate(nbytes):
            raise TierFullError(self.name, self.budget, self.in_use, nbytes, holders())
        if self._extents is not None:
            buf = self._from_arena(nbytes)
            self.in_use += nbytes
            return buf
        pool = self._pooled[nbytes]
        if pool:
            buf = pool.pop()
            self._pooled_bytes -= nbytes
        else:
            self._shrink_pool(self.budget - nbytes - self.in_use)
            buf = self._new_buffer(nbytes)
        self.in_use += nbytes
        return buf

    def free(self, buf: torch.Tensor) -> None:
        """Return a buffer to the pool (it stays reserved for the next chunk of its size)."""
        nbytes = buf.numel()
        self.in_use -= nbytes
        if self._extents is not None:
            self._extents.free(buf.data_ptr() - self._base, nbytes)
            return
        self._pooled[nbytes].append(buf)
        self._pooled_bytes += nbytes

    def _shrink_pool(self, keep: int) -> None:
        # Release pooled buffers (largest first) until at most ``keep`` pooled bytes remain.
        for size in sorted(self._pooled, reverse=True):
            pool = self._pooled[size]
            while pool and self._pooled_bytes > max(keep, 0):
                pool.pop()
                self._pooled_bytes -= size

    def _from_arena(self, nbytes: int) -> torch.Tensor:
        from .. import native

        if self._mapping is None:
            mapping, self._base = native.buffer_alloc(self.budget, hugepage=True, populate=False)
            self._mapping = memoryview(mapping)
        # The largest size seen (fp32 chunks) grows from the bottom, smaller ones from the top.
        self._largest_request = max(self._largest_request, nbytes)
        start = self._extents.allocate(nbytes, top=nbytes < self._largest_request)
        if start is None:        # can_allocate said yes: only a bug gets here
            raise TierFullError(self.name, self.budget, self.in_use, nbytes, "no contiguous free range")
        # A tensor of its own over the range (its storage starts there: the engine tells chunks
        # apart by storage address), keeping the mapping alive as long as it lives.
        return torch.frombuffer(self._mapping[start:start + nbytes], dtype=torch.uint8)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu" and self.pin:      # aligned and unpinned: the arena
            from ..aio import aligned_empty

            # Huge pages let 1 MiB O_DIRECT requests go through whole, but a buffer that is not a
            # whole number of them would hold (and count in RSS) more than its budgeted bytes.
            return aligned_empty(nbytes, torch.uint8, pin=True, hugepage=nbytes % HUGEPAGE == 0)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def describe(self) -> dict:
        return {"budget": self.budget, "in_use": self.in_use, "reserved": self.reserved,
                "device": str(self.device), "pinned": self.pin}
