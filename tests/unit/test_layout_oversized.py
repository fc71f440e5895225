"""Chunk layout with oversized and frozen parameters, and the store and NVMe slots under it.

A parameter larger than the chunk size gets a chunk of its own size; frozen and trainable
parameters never share a chunk. The store, its NVMe slots and staging reads must then handle
chunks of different sizes, and kinds registered for some chunks only.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.chunks import ChunkStore
from offload.chunks.layout import CHUNK_QUANTUM, PARAM_ALIGN, ChunkLayout, search_chunk_size, wasted_elements
from offload.scheduler import LRUPolicy
from offload.tiers import MemoryTier, NvmeTier

params = st.lists(st.tuples(st.integers(1, 9000), st.booleans()), min_size=1, max_size=30)


@given(params, st.integers(1, 4))
def test_oversized_and_frozen_packing_invariants(spec, quanta):
    size = quanta * CHUNK_QUANTUM
    named = [(f"p{i}", (n,)) for i, (n, _) in enumerate(spec)]
    frozen = {f"p{i}" for i, (_, train) in enumerate(spec) if not train}
    layout = ChunkLayout.build(named, size, frozen=frozen)
    assert layout.chunk_size == size
    assert all(s % CHUNK_QUANTUM == 0 for s in layout.sizes)
    last = {layout.trainable[c]: c for c in range(layout.num_chunks) if not layout.oversized(c)}
    assert all(s == size for c, s in enumerate(layout.sizes)     # bulk size, but a class's last chunk
               if not layout.oversized(c) and c not in last.values())
    by_chunk: dict[int, list] = {}
    for slot, (n, train) in zip(layout.slots, spec):
        by_chunk.setdefault(slot.chunk, []).append(slot)
        assert slot.offset % PARAM_ALIGN == 0 and slot.end <= layout.chunk_numel(slot.chunk)
        assert layout.trainable[slot.chunk] == train               # frozen and trainable never share
        if n > size:                                                # its own chunk, its own size
            assert slot.offset == 0 and layout.chunk_numel(slot.chunk) == -(-n // CHUNK_QUANTUM) * CHUNK_QUANTUM
            assert layout.oversized(slot.chunk)
    for c, slots in by_chunk.items():
        if layout.oversized(c):
            assert len(slots) == 1
        ends = [(s.offset, s.end) for s in slots]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))    # in order, no overlap
    assert sorted(by_chunk) == list(range(layout.num_chunks))      # no empty chunk
    assert layout.waste == sum(layout.sizes) - sum(n for n, _ in spec)
    assert layout.waste == wasted_elements([n for n, _ in spec], size, trainable=[t for _, t in spec])


def test_an_embedding_no_longer_sets_every_chunks_size():
    # A 100B-like shape list in miniature: a large embedding and lm_head around many small layers.
    layers = [(f"l{i}.{k}", (4096,)) for i in range(40) for k in range(4)]
    named = [("embed", (40000, 4))] + layers + [("head", (40000, 4))]
    numels = [math.prod(s) for _, s in named]
    size = search_chunk_size(numels, max_chunk=8 * CHUNK_QUANTUM)
    layout = ChunkLayout.build(named, size)
    assert size <= 8 * CHUNK_QUANTUM < 160000
    assert layout.largest_chunk == -(-160000 // CHUNK_QUANTUM) * CHUNK_QUANTUM
    assert [c for c in range(layout.num_chunks) if layout.oversized(c)] == \
        [layout.slot("embed").chunk, layout.slot("head").chunk]
    assert layout.waste < 0.05 * layout.total_params


def test_frozen_chunks_follow_the_parameter_order():
    # LoRA-like: a frozen base weight, then its small trainable adapters, layer after layer.
    named, frozen = [], set()
    for i in range(6):
        named += [(f"w{i}", (3000,)), (f"a{i}", (64,)), (f"b{i}", (64,))]
        frozen.add(f"w{i}")
    layout = ChunkLayout.build(named, 4 * CHUNK_QUANTUM, frozen=frozen)
    trainable = layout.trainable_chunks
    assert len(trainable) == 1                                      # every adapter in one chunk
    assert all(layout.slot(f"a{i}").chunk in trainable for i in range(6))
    frozen_chunks = [layout.slot(f"w{i}").chunk for i in range(6)]
    assert frozen_chunks == sorted(frozen_chunks)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.booleans()), min_size=1, max_size=6))
def test_store_round_trips_chunks_of_different_sizes_through_nvme(tmp_path_factory, spec):
    """Chunks of several sizes, a kind registered for some chunks only, all evicted to NVMe and read
    back bit for bit; the NVMe tier reserves exactly each slot's (4 KiB-aligned) size."""
    path = tmp_path_factory.mktemp("nvme")
    sizes = {c: q * CHUNK_QUANTUM for c, (q, _) in enumerate(spec)}
    some = {c: n for c, n in sizes.items() if spec[c][1]}
    biggest = max(sizes.values()) * 4
    nvme = NvmeTier([str(path)])
    store = ChunkStore([MemoryTier("cpu", 2 * biggest, "cpu", aligned=True), nvme], LRUPolicy())
    try:
        store.register_chunks("param", sizes, torch.bfloat16)
        store.register_chunks("master", some, torch.float32)
        assert nvme.in_use == sum(-(-n * 2 // 4096) * 4096 for n in sizes.values()) + \
            sum(-(-n * 4 // 4096) * 4096 for n in some.values())
        assert store.largest_bytes("master") == max((n * 4 for n in some.values()), default=0)
        gen = torch.Generator().manual_seed(len(spec))
        want = {}
        for kind, numels, dtype in (("param", sizes, torch.bfloat16), ("master", some, torch.float32)):
            for c, n in numels.items():
                want[(kind, c)] = torch.randn(n, generator=gen).to(dtype)
                store.write((kind, c), want[(kind, c)])
                store.evict((kind, c), "cpu")           # only NVMe holds it now
        buf = store.staging_buffers(max(store.largest_bytes("param"), store.largest_bytes("master")), count=1)[0]
        for key, value in want.items():
            assert torch.equal(store.read_into(key, buf), value)
            view = store.access(key, "cpu")
            assert torch.equal(view, value)
            store.release(key, "cpu")
    finally:
        nvme.close()


def test_device_pool_hands_a_chunk_a_buffer_of_its_own_size():
    """A size with nothing pooled gets a buffer of its size, not a pooled one up to twice as big:
    the bigger one's unused bytes counted against the budget while its chunk was pinned, and four
    pinned 2 KiB chunks in 4 KiB buffers left no room for the 4 KiB one the budget still covers."""
    tier = MemoryTier("device", 4 * 4096, "cpu")
    for buf in [tier.allocate(4096) for _ in range(4)]:
        tier.free(buf)
    held = [tier.allocate(2048) for _ in range(4)]          # pinned, say, all at once
    assert all(b.numel() == 2048 for b in held) and tier.in_use == 8192
    held += [tier.allocate(4096), tier.allocate(4096)]
    assert tier.in_use == tier.budget and tier.reserved <= tier.budget
    for buf in held:
        tier.free(buf)
    assert tier.in_use == 0 and tier.reserved <= tier.budget
