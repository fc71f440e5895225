"""``ChunkStore.access`` of a chunk already on the tier takes its pin in one step (the path every
module of a model that fits takes): the same view, pins, state and eviction protection as a
first access, and a pin let go by another thread than the one that took it is counted right."""

from __future__ import annotations

import threading

import pytest
import torch

from offload import StateError
from offload.chunks import ChunkState, ChunkStore
from offload.scheduler import LRUPolicy
from offload.tiers import MemoryTier

NUMEL = 2048


def _store() -> ChunkStore:
    tiers = [MemoryTier("device", 2 * NUMEL * 4), MemoryTier("cpu", 4 * NUMEL * 4)]
    store = ChunkStore(tiers, LRUPolicy())
    store.register("param", 2, NUMEL, torch.float32)
    return store


def test_a_second_access_of_a_resident_chunk_pins_the_same_view():
    store = _store()
    key = ("param", 0)
    store.initialize(key, "cpu", lambda v: v.copy_(torch.arange(NUMEL, dtype=torch.float32)))
    first = store.access(key, "device")          # brought up from the CPU tier
    store.release(key, "device")
    assert store.records[key].state is ChunkState.HOLD
    again = store.access(key, "device")          # resident: the one-lock path
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.arange(NUMEL, dtype=torch.float32))
    assert store.records[key].state is ChunkState.COMPUTE and store.records[key].pins["device"] == 1
    with pytest.raises(StateError):              # pinned: not evictable
        store.evict(key, "device")
    store.release(key, "device")
    store.evict(key, "device")
    assert "device" not in store.records[key].buffers


def test_a_pin_released_on_another_thread_leaves_no_thread_count():
    store = _store()
    key = ("param", 1)
    store.initialize(key, "device")
    store.access(key, "device")
    store.access(key, "device")
    other = threading.Thread(target=store.release, args=(key, "device"))
    other.start()
    other.join()
    rec = store.records[key]
    assert rec.pins["device"] == 1 and dict(rec.pin_threads) == {threading.get_ident(): 2}
    store.release(key, "device")
    # every pin is gone, whichever thread let which go: no thread counts as holding one any more
    assert rec.state is ChunkState.HOLD and not rec.pins and not rec.pin_threads
