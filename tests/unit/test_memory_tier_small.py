"""Buffers under one page of a host tier's arena (the 8-bit moments' block scales of small chunk
pieces) come from the allocator at their own size: in the arena each took a whole page while the
tier counted its bytes, so the budget promised room the arena did not have."""

from __future__ import annotations

import pytest

from offload import TierFullError
from offload.tiers import MemoryTier
from offload.tiers.memory import ARENA_PAGE


def test_small_buffers_leave_the_arena_to_the_chunks():
    tier = MemoryTier("cpu", 2 * ARENA_PAGE, aligned=True)
    small = [tier.allocate(64) for _ in range(2)]
    assert tier.in_use == 128
    # The arena is still whole: a buffer of the rest of the budget lands in it, not outside it.
    big = tier.allocate(2 * ARENA_PAGE - 128)
    assert tier.outside_arena == 0 and big.data_ptr() % ARENA_PAGE == 0
    with pytest.raises(TierFullError):
        tier.allocate(64)
    for buf in small:
        tier.free(buf)
    assert tier.in_use == 2 * ARENA_PAGE - 128 and tier.can_allocate(128) and not tier.can_allocate(129)
    tier.free(big)
    assert tier.in_use == 0


def test_a_fitted_tier_gives_small_buffers_their_bytes_not_pages():
    tier = MemoryTier("cpu", 1 << 20, aligned=True)
    budget = tier.fit_to([3 * ARENA_PAGE, 3 * ARENA_PAGE, 40, 40], spare=0)
    assert budget == 6 * ARENA_PAGE + 80
    bufs = [tier.allocate(n) for n in (3 * ARENA_PAGE, 3 * ARENA_PAGE, 40, 40)]
    assert tier.in_use == budget and tier.outside_arena == 0
    for buf in bufs:
        tier.free(buf)
