"""ActivationStore on its own: saved tensors parked in the CPU area (and on NVMe) come back bit for bit
with their strides, the area never exceeds its budget, bytes are counted per direction, and
entries are released when autograd lets go of them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.activations import ActivationArea, ActivationStore, SpillSpace, offloadable
from offload.aio import AsyncIO
from offload.config import AioConfig
from tests.helpers.sim_streams import SimStreams

CPU = torch.device("cpu")


def make_store(budget=1 << 20, tier="cpu", spill_dir=None, **kw):
    """A store that parks every tensor it is given (``min_bytes=0``): these tests are about parking
    itself; which saved tensors are chosen has its own tests (test_activation_boundaries)."""
    kw.setdefault("min_bytes", 0)
    spill = None
    if tier == "nvme":
        spill = SpillSpace([str(spill_dir)], AsyncIO(AioConfig()), "test", segment_min=1 << 20)
    return ActivationStore(CPU, ActivationArea(budget), tier=tier, spill=spill, **kw)


def strided(shape, perm, dtype):
    """A dense tensor whose dimensions are laid out in ``perm`` order (transposed, permuted)."""
    base = torch.randn([shape[p] for p in perm]).to(dtype)
    inverse = [perm.index(i) for i in range(len(perm))]
    return base.permute(inverse)


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


@settings(max_examples=40, deadline=None)
@given(shape=shapes, data=st.data(), dtype=dtypes)
def test_round_trip_keeps_values_and_strides(shape, data, dtype):
    perm = data.draw(st.permutations(range(len(shape))))
    t = strided(shape, list(perm), dtype)
    store = make_store()
    packed = store.pack(t)
    out = store.unpack(packed)
    assert out.stride() == t.stride() and out.shape == t.shape and out.dtype == t.dtype
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    stats = store.take_stats()
    assert stats["bytes"]["device->cpu"] == stats["bytes"]["cpu->device"] == t.numel() * t.element_size()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 6000), min_size=1, max_size=12), budget_pages=st.integers(2, 6),
       prefetch=st.integers(0, 3), asynchronous=st.booleans())
def test_nvme_spills_stay_within_the_area_budget(disk_tmp, sizes, budget_pages, prefetch, asynchronous):
    """Forward parks tensors in order, backward takes them in reverse: whatever the sizes, the area
    holds at most its budget and the values come back exactly, with synchronous copies or on
    simulated copy streams."""
    budget = budget_pages * 4096
    streams = SimStreams(delay_s=0.001) if asynchronous else None
    store = make_store(budget, "nvme", disk_tmp, prefetch=prefetch, streams=lambda: streams)
    tensors = [torch.randn(n) for n in sizes]
    packed = [store.pack(t) for t in tensors]
    store.end_forward()
    for t, p in zip(reversed(tensors), reversed(packed)):
        assert torch.equal(store.unpack(p), t)
        assert store.area.in_use <= budget
    del t
    stats = store.take_stats()
    assert stats["area_peak"] <= budget
    parked = sum(t.numel() * 4 for t, p in zip(tensors, packed) if p.entry.parked)
    assert stats["bytes"]["device->cpu"] == stats["bytes"]["cpu->device"] == parked
    assert stats["kept_on_device_bytes"] == sum(t.numel() * 4 for t in tensors) - parked
    pages = sum(-(-t.numel() * 4 // 4096) * 4096 for t, p in zip(tensors, packed) if p.entry.parked)
    if pages > budget:      # could not all stay in the area: some went to NVMe (and were read back
        assert stats["bytes"]["cpu->nvme"] > 0      # unless still in the area when needed)
    del packed, p
    gc.collect()
    assert store.area.in_use == 0 and store.spill.in_use == 0 and not store.entries
    store.close()
    assert not list(Path(disk_tmp).iterdir())
    if streams is not None:
        streams.close()


def test_a_full_cpu_area_keeps_the_tensor_on_the_device():
    store = make_store(budget=8192)
    small, big = torch.randn(1000), torch.randn(5000)
    p_small = store.pack(small)
    p_big = store.pack(big)
    assert not p_big.entry.parked and store.unpack(p_big) is big     # 20 KB does not fit beside the 4 KB page
    stats = store.take_stats()
    assert stats["kept_on_device_bytes"] == big.numel() * 4 and stats["area_peak"] <= 8192
    assert torch.equal(store.unpack(p_small), small)


def test_one_tensor_saved_twice_is_parked_once():
    store = make_store()
    x = torch.randn(64, 8)
    a, b = store.pack(x), store.pack(x)
    assert a.entry is b.entry
    x.mul_(2)                                      # modified in place: a new save is a new entry
    c = store.pack(x)
    assert c.entry is not a.entry
    assert torch.equal(store.unpack(a), x / 2) and torch.equal(store.unpack(c), x)
    stats = store.take_stats()
    assert stats["parked"] == 2 and stats["shared"] == 1


def test_entries_are_released_with_their_last_handle():
    store = make_store()
    a = store.pack(torch.randn(100))
    b = store.pack(torch.randn(3000))
    assert store.area.in_use == 4096 + 12288          # whole 4 KiB pages (O_DIRECT-able)
    del a
    assert len(store.entries) == 1
    store.unpack(b)
    del b
    assert store.area.in_use == 0 and not store.entries


def test_asynchronous_copies_are_ordered_by_their_fences():
    """Downloads and uploads on simulated copy streams (a thread per direction, each copy delayed):
    a source freed early, an upload read before it landed, or a buffer reused under a copy would
    change the values."""
    streams = SimStreams(delay_s=0.003)
    try:
        store = ActivationStore(CPU, ActivationArea(256 << 10), streams=lambda: streams, prefetch=2, min_bytes=0)
        tensors = [torch.randn(2000) for _ in range(20)]
        packed = [store.pack(t.clone()) for t in tensors]     # the clones die at once: held as sources
        store.end_forward()
        for t, p in zip(reversed(tensors), reversed(packed)):
            assert torch.equal(store.unpack(p), t)
        assert streams.copies["d2h"] == 20 and streams.copies["h2d"] == 20
        assert streams.compute_waits >= 20
        stats = store.take_stats()
        assert stats["area_peak"] <= 256 << 10 and stats["kept_on_device_bytes"] == 0
    finally:
        streams.close()


def test_only_dense_floating_device_tensors_are_offloadable():
    assert offloadable(torch.randn(4, 4).t(), CPU)
    assert not offloadable(torch.randn(4, 1).expand(4, 4), CPU)          # overlapping
    assert not offloadable(torch.randn(8, 8)[:, :4], CPU)                # gaps
    assert not offloadable(torch.arange(4), CPU)                         # integer
    assert not offloadable(torch.nn.Parameter(torch.randn(4)), CPU)
    assert not offloadable(torch.randn(4), torch.device("meta"))


def test_bad_tier_is_refused():
    with pytest.raises(Exception, match="tier"):
        ActivationStore(CPU, ActivationArea(4096), tier="gpu")
