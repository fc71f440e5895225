"""Giving a device buffer back never makes the host wait for the GPU under the store's lock.

Three places used to: the device tier, releasing pooled buffers of one size to make room for
another (every fp32 gradient chunk under accumulation), synchronized on their fences; the store,
evicting a dirty chunk from the device (gradients, when updates wait for backward), waited for
its download before dropping the device copy; and dropping a host copy that an upload still read
(the host copy of a gradient accumulated on the device goes stale) waited for that upload. All
three drained the GPU's queue. Here the copies run on ``GatedStreams`` (``tests/helpers/sim_streams.py``):
a copy runs only when the test says so or when something waits for it, and each host wait
records whether the store's lock was held. What comes out must be bit-identical to what went in.
"""

from __future__ import annotations


import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.chunks import ChunkStore
from offload.scheduler import LRUPolicy
from offload.tiers import MemoryTier
from tests.helpers.sim_streams import GatedStreams

KIB = 1024
N = 512                 # elements of a bulk fp32 chunk (2 KiB)
CHUNK = N * 4


def reading(streams: GatedStreams, buf: torch.Tensor):
    """A fence after a download still to run that reads ``buf`` (as a D2H copy would)."""
    return streams.copy(torch.empty_like(buf), buf, [], upload=False, name="reader")


# ---- the device tier --------------------------------------------------------------------------
def test_releasing_a_pooled_buffer_of_another_size_does_not_wait_for_its_fences():
    streams = GatedStreams()
    tier = MemoryTier("device", 16 * KIB)       # a CPU device: the device tier's pool, no arena
    old = tier.allocate(8 * KIB)
    old.fill_(7)
    landed = torch.zeros(8 * KIB, dtype=torch.uint8)
    fence = streams.copy(landed, old, [], upload=False, name="download")
    tier.free(old, [fence])
    del old
    new = tier.allocate(12 * KIB)               # no pooled size serves it: the 8 KiB buffer goes
    assert streams.host_waits == []
    assert not fence.query()
    assert tier.reserved <= tier.budget and tier.in_use == 12 * KIB
    new.fill_(1)
    streams.run()                               # the download reads the old bytes, not new ones
    assert bool((landed == 7).all())


sizes = st.sampled_from([2 * KIB, 3 * KIB, 4 * KIB, 6 * KIB, 8 * KIB])


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 3), st.integers(0, 2)),
                    min_size=1, max_size=40))
def test_device_pool_never_waits_keeps_its_budget_and_hands_fences_to_the_next_user(ops):
    """Random allocations of chunk sizes and frees with pending fences: no fence is ever waited
    for, the budget holds, live buffers never overlap, and a reused buffer comes with exactly
    the fences it was freed with (a released one takes them along)."""
    streams = GatedStreams()
    tier = MemoryTier("device", 16 * KIB)
    held: list[torch.Tensor] = []
    freed: dict[int, tuple[torch.Tensor, list]] = {}    # address -> (buffer kept alive, its fences)
    for allocate, size, pick, fences in ops:
        if allocate or not held:
            if not tier.can_allocate(size):
                continue
            buf = tier.allocate(size)
            assert buf.numel() >= size
            was_freed = freed.pop(buf.data_ptr(), (None, []))
            assert tier.take_fences(buf) == was_freed[1]
            held.append(buf)
        else:
            buf = held.pop(pick % len(held))
            pending = [reading(streams, buf) for _ in range(fences)]
            tier.free(buf, pending)
            # Kept alive here, so a fresh allocation never lands at a released buffer's address:
            # one seen again at its address is the pooled one, with its fences.
            freed[buf.data_ptr()] = (buf, pending)
        assert streams.host_waits == []
        assert tier.reserved <= tier.budget
        spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in held)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    streams.run()


# ---- the chunk store ----------------------------------------------------------------------------
def gated_store(device_bytes: int, cpu_bytes: int) -> tuple[ChunkStore, GatedStreams]:
    """A device tier (the CPU standing in) over a CPU tier, copies between them on gated streams."""
    streams = GatedStreams()
    store = ChunkStore([MemoryTier("device", device_bytes), MemoryTier("cpu", cpu_bytes)], LRUPolicy(),
                       streams=streams)
    streams.lock = store.lock       # host waits are checked against the store's lock
    return store, streams


def write(store: ChunkStore, key, values: torch.Tensor, *, accumulate: bool = False) -> None:
    """What backward does to a gradient chunk: pin it on the device, write it, release it dirty."""
    view = store.access(key, "device", overwrite=not accumulate)
    if accumulate:
        view.add_(values)
    else:
        view.copy_(values)
    store.release(key, "device", dirty=True)


def values(seed: int, numel: int = N) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def test_evicting_a_dirty_device_chunk_queues_its_download_and_does_not_wait():
    store, streams = gated_store(2 * CHUNK, 4 * CHUNK)
    key = store.register("grad", 1, N, torch.float32)[0]
    v = values(0)
    write(store, key, v)
    store.evict(key, "device")
    assert streams.host_waits == []
    assert streams.copies["d2h"] == 1 and streams.pending() == 1
    rec = store.records[key]
    assert not rec.has("device") and store.tiers["device"].in_use == 0
    assert rec.busy                             # the move holds its only copy until it is finished
    got = store.access(key, "cpu")              # the reader waits for the download, not under the lock
    try:
        assert streams.host_waits == [(False, "grad0")]
        assert torch.equal(got, v)
    finally:
        store.release(key, "cpu")


def test_a_device_buffer_freed_by_an_eviction_is_reused_only_after_its_download():
    store, streams = gated_store(CHUNK, 4 * CHUNK)
    a, b = store.register("grad", 2, N, torch.float32)
    va, vb = values(1), values(2)
    write(store, a, va)
    write(store, b, vb)                         # evicts a: its buffer is b's, once a's download ran
    assert streams.host_waits_under_lock == 0
    assert streams.compute_waits >= 1 and streams.pending() == 0
    assert torch.equal(store.read(a), va) and torch.equal(store.read(b), vb)


def test_a_buffer_released_for_another_size_outlives_the_download_that_reads_it():
    store, streams = gated_store(2 * CHUNK, 8 * CHUNK)
    small, big = store.register_chunks("grad", {0: N, 1: 3 * N // 2}, torch.float32)
    vs, vb = values(3), values(4, 3 * N // 2)
    write(store, small, vs)
    store.evict(small, "device")               # its buffer is pooled, its download not yet run
    write(store, big, vb)                       # another size: the pooled buffer is released
    assert streams.host_waits == []
    assert torch.equal(store.read(small), vs) and torch.equal(store.read(big), vb)


def upload_then_rewrite(store: ChunkStore, key, old: torch.Tensor, new: torch.Tensor) -> None:
    """A chunk written on the host goes up to the device (compute waits for the upload; the host
    does not see it finish) and is rewritten there: its host copy is stale while the upload may
    still read it."""
    store.initialize(key, "cpu", lambda v: v.copy_(old))
    view = store.access(key, "device")
    assert torch.equal(view, old)
    view.copy_(new)
    store.release(key, "device", dirty=True)


def test_a_stale_host_copy_an_upload_still_reads_is_held_back_not_waited_for():
    store, streams = gated_store(2 * CHUNK, 2 * CHUNK)
    key = store.register("grad", 1, N, torch.float32)[0]
    cpu = store.tiers["cpu"]
    upload_then_rewrite(store, key, values(5), values(6))
    assert streams.host_waits == []
    assert not store.records[key].has("cpu") and cpu.in_use == CHUNK     # held back, not reused
    streams.run()                                                          # the upload is done
    store.wait_idle()
    assert cpu.in_use == 0 and streams.host_waits == []
    assert torch.equal(store.read(key), values(6))


def test_a_full_host_tier_waits_for_its_held_back_buffers_as_the_last_resort():
    store, streams = gated_store(2 * CHUNK, CHUNK)
    a, b = store.register("grad", 2, N, torch.float32)
    upload_then_rewrite(store, a, values(7), values(8))
    store.initialize(b, "cpu", lambda v: v.copy_(values(9)))      # only a's held-back buffer is in the way
    assert streams.host_waits_under_lock == 1
    assert torch.equal(store.read(a), values(8)) and torch.equal(store.read(b), values(9))


@settings(max_examples=40, deadline=None)
@given(numels=st.lists(st.sampled_from([N // 2, 3 * N // 4, N]), min_size=2, max_size=6),
       room=st.integers(1, 3), micro_batches=st.integers(1, 3), data=st.data())
def test_backward_with_a_small_device_budget_never_waits_under_the_lock(numels, room, micro_batches, data):
    """Gradient chunks of mixed sizes written (then accumulated into) on a device that holds only
    ``room`` of them, the GPU progressing by a drawn number of copies after each chunk: every
    eviction and every pool release goes on without the host waiting under the store's lock,
    and the CPU Adam reads what backward wrote, bit for bit."""
    largest = max(numels) * 4
    # Room on the host for every chunk even where a pooled buffer up to twice its size serves it.
    store, streams = gated_store(room * largest, 2 * sum(numels) * 4)
    keys = store.register_chunks("grad", dict(enumerate(numels)), torch.float32)
    shadow: dict = {}
    for m in range(micro_batches):
        order = data.draw(st.permutations(keys), label=f"order {m}")
        for key in order:
            delta = values(m * 100 + key[1], numels[key[1]])
            write(store, key, delta, accumulate=m > 0)
            shadow[key] = delta if m == 0 else shadow[key] + delta
            streams.run(data.draw(st.integers(0, 2), label="copies the GPU finishes"))
            assert streams.host_waits_under_lock == 0, streams.host_waits
            for tier in store.tiers.values():
                assert tier.reserved <= tier.budget, tier.name
    for key in keys:                            # the optimizer: reads each on the host
        got = store.access(key, "cpu")
        try:
            assert torch.equal(got, shadow[key]), key
        finally:
            store.release(key, "cpu")
    assert streams.host_waits_under_lock == 0, streams.host_waits
