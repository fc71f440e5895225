"""A chunk's record: where its copies live, what is moving it, who pins it, and its version."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..tiers.moves import Move
from ..tiers.nvme import NvmeSlot
from .states import ChunkState

ChunkKey = tuple[str, int]   # (kind, index)


@dataclass(eq=False)
class ChunkRecord:
    key: ChunkKey
    numel: int
    dtype: torch.dtype
    nbytes: int
    state: ChunkState = ChunkState.FREE
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)     # memory tiers with a current copy
    views: dict[str, torch.Tensor] = field(default_factory=dict)       # each copy's typed view, made once
    # Moves under way, by destination: (its buffer there, the move). A chunk evicted from the GPU
    # while its download runs has no copy in ``buffers`` (``valid`` is empty): the move is its
    # only copy until it is finished.
    incoming: dict[str, tuple[torch.Tensor | None, Move]] = field(default_factory=dict)
    slot: NvmeSlot | None = None
    nvme_valid: bool = False
    pins: Counter = field(default_factory=Counter)
    pin_threads: Counter = field(default_factory=Counter)   # thread id -> pins it holds
    version: int = 0        # bumped by every write; a move started on an older version is discarded
    # With CUDA streams (see offload.tiers.streams): per device-tier copy, the fence after which its
    # bytes are complete (the upload that brought it, or the compute that last wrote it) ...
    ready: dict = field(default_factory=dict)
    # ... and per copy, the fences of copies in flight that read it (it must outlive them).
    readers: dict = field(default_factory=dict)

    @property
    def valid(self) -> set[str]:
        return set(self.buffers) | ({"nvme"} if self.nvme_valid else set())

    def has(self, tier: str) -> bool:
        """A current copy lives on ``tier`` (``valid`` without building a set: hot paths ask this)."""
        return tier in self.buffers or (tier == "nvme" and self.nvme_valid)

    def only_on(self, tier: str) -> bool:
        """``tier`` holds the last current copy."""
        return not self.nvme_valid and len(self.buffers) == 1 and tier in self.buffers

    @property
    def busy(self) -> bool:
        return bool(self.incoming)

    def typed(self, buf: torch.Tensor) -> torch.Tensor:
        """This chunk's typed view of ``buf`` (a flat uint8 buffer of at least ``nbytes``)."""
        return buf[: self.nbytes].view(self.dtype)[: self.numel]
