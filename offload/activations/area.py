"""The CPU activation area: one budgeted host mapping, reused step after step.

A ``MemoryTier`` over one arena (``offload.tiers.memory``): 4 KiB-aligned so NVMe spills go
straight out of it with O_DIRECT, page-locked once (``cudaHostRegister``) when the compute device
is a GPU so its copies are asynchronous DMA. ``in_use`` never exceeds ``budget``; ``peak`` is the
most it held at once since the last ``take_peak``.
"""

from __future__ import annotations

import torch

from ..tiers.memory import MemoryTier


class ActivationArea:
    def __init__(self, budget: int, *, pin: bool = False, pinner=None):
        self.tier = MemoryTier("activations", budget, "cpu", aligned=True, pin=pin, pinner=pinner)
        self.peak = 0

    @property
    def budget(self) -> int:
        return self.tier.budget

    @property
    def in_use(self) -> int:
        return self.tier.in_use

    def can_allocate(self, nbytes: int) -> bool:
        return self.tier.can_allocate(nbytes)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` host buffer of ``nbytes`` (raises ``TierFullError`` past the budget)."""
        buf = self.tier.allocate(nbytes, lambda: "activations parked for backward")
        self.peak = max(self.peak, self.tier.in_use)
        return buf

    def free(self, buf: torch.Tensor) -> None:
        self.tier.free(buf)

    def take_peak(self) -> int:
        peak, self.peak = self.peak, self.tier.in_use
        return peak
