"""Chunk layout: packing order, alignment, the auto size search, sharding."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import ConfigError
from offload.chunks.layout import CHUNK_QUANTUM, PARAM_ALIGN, ChunkLayout, search_chunk_size, wasted_elements

shapes = st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=3).map(tuple), min_size=1, max_size=40)


@given(shapes, st.integers(1, 64))
def test_packing_invariants(shape_list, quanta):
    named = [(f"p{i}", s) for i, s in enumerate(shape_list)]
    largest = max(math.prod(s) for s in shape_list)
    size = max(quanta, -(-largest // CHUNK_QUANTUM)) * CHUNK_QUANTUM
    layout = ChunkLayout.build(named, size)
    assert [s.name for s in layout.slots] == [n for n, _ in named]          # order kept
    prev_chunk, prev_end = 0, 0
    for slot in layout.slots:
        assert slot.numel == math.prod(slot.shape)
        assert 0 <= slot.offset and slot.end <= layout.chunk_size
        assert slot.offset % PARAM_ALIGN == 0
        assert slot.chunk in (prev_chunk, prev_chunk + 1)                    # chunks fill in order
        if slot.chunk == prev_chunk:
            assert slot.offset >= prev_end                                   # no overlap
        prev_chunk, prev_end = slot.chunk, slot.end
    assert layout.total_params == sum(math.prod(s) for s in shape_list)
    assert layout.waste == wasted_elements([s.numel for s in layout.slots], size)


@settings(max_examples=30)
@given(shapes)
def test_auto_search_is_no_worse_than_any_candidate(shape_list):
    numels = [math.prod(s) for s in shape_list]
    cap = 64 * CHUNK_QUANTUM
    best = search_chunk_size(numels, max_chunk=cap)
    bulk = [n for n in numels if n <= cap]
    assert best % CHUNK_QUANTUM == 0 and best >= max(bulk, default=0) and best <= cap
    lo = -(-max(max(bulk, default=0), CHUNK_QUANTUM) // CHUNK_QUANTUM) * CHUNK_QUANTUM
    for size in range(lo, cap + 1, CHUNK_QUANTUM):
        assert wasted_elements(numels, best) <= wasted_elements(numels, size)


def test_bad_chunk_sizes_and_names():
    with pytest.raises(ConfigError, match="chunk_size"):
        ChunkLayout.build([("a", (10,))], 1000)
    with pytest.raises(ConfigError, match="twice"):
        ChunkLayout.build([("a", (10,)), ("a", (3,))], 2048)
