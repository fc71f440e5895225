"""The arena's extent bookkeeping, against a byte map, under random allocate/free sequences;
and a host tier that carves chunk buffers out of one mapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.tiers import MemoryTier
from offload.tiers.arena import Extents

PAGE = 4096


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1 << 30)),
                                    max_size=80))
def test_extents_match_a_byte_map(pages, ops):
    ext = Extents(pages * PAGE, PAGE)
    used = [False] * pages
    live: list[tuple[int, int]] = []
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            start = ext.allocate(n * PAGE, top=bool(pick % 2))
            runs = [i for i in range(pages - n + 1) if not any(used[i:i + n])]
            if start is None:
                assert not runs                      # refused only when no n free pages in a row
                continue
            first = start // PAGE
            assert start % PAGE == 0 and not any(used[first:first + n])
            used[first:first + n] = [True] * n
            live.append((start, n))
        else:
            start, n = live.pop(pick % len(live))
            ext.free(start, n * PAGE)
            used[start // PAGE:start // PAGE + n] = [False] * n
        assert ext.free_total() == used.count(False) * PAGE
        longest = run = 0
        for u in used:
            run = 0 if u else run + 1
            longest = max(longest, run)
        assert ext.largest() == longest * PAGE       # neighbours always merged


def test_extents_refuse_a_double_free():
    ext = Extents(8 * PAGE, PAGE)
    a = ext.allocate(2 * PAGE)
    ext.free(a, 2 * PAGE)
    with pytest.raises(ValueError, match="freed twice"):
        ext.free(a, 2 * PAGE)


def test_aligned_host_tier_carves_one_mapping():
    unit = PAGE * 64
    tier = MemoryTier("cpu", 6 * unit, aligned=True)
    a = tier.allocate(2 * unit)           # the largest size so far: from the bottom
    b = tier.allocate(unit)               # smaller: from the top
    a.fill_(1)
    b.fill_(2)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()   # chunks stay apart
    assert a.data_ptr() % PAGE == 0 and b.data_ptr() - a.data_ptr() == 5 * unit
    tier.free(a)
    c = tier.allocate(2 * unit)           # the freed range is whole again for the next big one
    assert c.data_ptr() == a.data_ptr() and b.eq(2).all()
    assert tier.in_use == 3 * unit and tier.can_allocate(3 * unit)
    assert not tier.can_allocate(3 * unit + 1)


def test_a_fragmented_arena_with_the_bytes_free_gives_a_buffer_outside_it_within_the_budget():
    """Every chunk pinned (nothing to evict) and the free bytes in two holes: the budget still
    covers the request, so it is served outside the arena instead of failing the step; freeing
    it gives the bytes back to the budget, not to the arena's extents."""
    tier = MemoryTier("cpu", 5 * 4096, aligned=True)
    bufs = [tier.allocate(4096) for _ in range(5)]
    tier.free(bufs[1])
    tier.free(bufs[3])
    assert not tier.can_allocate(8192) and tier.fits_outside_arena(8192)
    big = tier.allocate(8192)
    assert big.numel() == 8192 and big.data_ptr() % 4096 == 0      # O_DIRECT-able all the same
    assert tier.in_use == 5 * 4096 and not tier.fits_outside_arena(1)
    tier.free(big)
    assert tier.in_use == 3 * 4096
    assert tier.allocate(4096) is not None and tier.allocate(4096) is not None    # the holes, from the arena
    assert not tier.fits_outside_arena(1)
