"""Storage tiers: the compute device, (pinned) CPU memory, and NVMe files, behind one protocol.

A tier holds bytes only, never model maths: ``allocate(nbytes)`` / ``free(buffer)`` within a
byte budget it never exceeds, plus the copies between adjacent tiers (``moves``).
"""

from .budgets import resolve_budgets
from .memory import MemoryTier
from .moves import Move, copy_between
from .nvme import NvmeSlot, NvmeTier

__all__ = ["MemoryTier", "Move", "NvmeSlot", "NvmeTier", "copy_between", "resolve_budgets"]
