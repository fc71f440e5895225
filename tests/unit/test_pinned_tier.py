"""The pinned CPU tier registers its memory once and never again while training runs.

Before, a pinned tier gave every chunk its own mapping and registration and, when a chunk of the
other size (bf16 parameters vs fp32 state) was needed, unregistered and unmapped pooled buffers
to make room: dozens of register/unregister pairs a step. Now the whole budget is one arena,
page-locked at its first use. Counted through the tier's ``pinner`` (mlock here, no GPU;
cudaHostRegister on a GPU box goes through the same calls)."""

from __future__ import annotations

import gc

import torch

import offload
from offload.aio.pinning import MlockPinner
from offload.tiers import MemoryTier
from tests.helpers.tiny_gpt import TinyGPT, batches

PAGE = 4096


class CountingPinner:
    def __init__(self):
        self.inner = MlockPinner()
        self.pins: list[tuple[int, int]] = []
        self.unpins: list[tuple[int, int]] = []

    name = "counting mlock"

    def pin(self, address, nbytes):
        self.pins.append((address, nbytes))
        self.inner.pin(address, nbytes)

    def unpin(self, address, nbytes):
        self.unpins.append((address, nbytes))
        self.inner.unpin(address, nbytes)


def test_pinned_tier_registers_its_arena_once_for_chunks_of_every_size():
    pinner = CountingPinner()
    tier = MemoryTier("cpu", 64 * PAGE, pin=True, pinner=pinner)
    assert pinner.pins == []                       # nothing until first used
    held = []
    for round_ in range(20):                      # bf16- and fp32-sized chunks, freed and reused
        size = (4 if round_ % 2 else 8) * PAGE
        while tier.can_allocate(size):
            held.append(tier.allocate(size))
        for buf in held[::2]:
            tier.free(buf)
        held = held[1::2]
    assert len(pinner.pins) == 1 and pinner.unpins == []
    base, size = pinner.pins[0]
    assert size == 64 * PAGE
    assert all(base <= b.data_ptr() and b.data_ptr() + b.numel() <= base + size for b in held)
    del tier, held
    gc.collect()
    assert pinner.unpins == [(base, size)]         # undone once, when the tier goes


def test_training_with_a_pinned_cpu_tier_registers_nothing_after_the_first_step(disk_tmp, monkeypatch):
    pinner = CountingPinner()
    from offload.engine import build as engine_module

    def tier(name, budget, device="cpu", **kw):
        if name == "cpu":                          # the GPU layout's pinned CPU tier, on this CPU box
            kw.update(pin=True, pinner=pinner)
        return MemoryTier(name, budget, device, **kw)

    monkeypatch.setattr(engine_module, "MemoryTier", tier)
    torch.manual_seed(0)
    cfg = offload.OffloadConfig(device="cpu", dtype="bf16", device_budget="192KiB", cpu_budget="512KiB",
                                nvme_paths=[str(disk_tmp)], chunk_size=8192, merge_host_tiers=False)
    model = offload.wrap(TinyGPT(), cfg)
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    counts = []
    for x, y in batches(6):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        counts.append((len(pinner.pins), len(pinner.unpins)))
    engine = model.offload_engine
    base, size = pinner.pins[0]
    on_cpu = [r.buffers["cpu"] for r in engine.store.records.values() if "cpu" in r.buffers]
    assert on_cpu and all(base <= b.data_ptr() and b.data_ptr() + b.numel() <= base + size for b in on_cpu)
    assert counts == [(1, 0)] * 6, counts
    moved = model.offload_stats()["moved_bytes"]
    assert moved.get("nvme->cpu") and moved.get("cpu->device"), moved     # the tier really churned
    engine.close()


def test_default_pinner_is_mlock_without_cuda():
    from offload.aio.pinning import default_pinner

    assert default_pinner().name == ("cudaHostRegister" if torch.cuda.is_available() else "mlock")


def test_pinning_is_refused_with_a_clear_error_beyond_ram():
    import psutil

    from offload.errors import PinnedMemoryError

    tier = MemoryTier("cpu", psutil.virtual_memory().total * 2, pin=True, pinner=CountingPinner())
    try:
        tier.allocate(PAGE)
    except PinnedMemoryError as exc:
        assert "available RAM" in str(exc)
    else:
        raise AssertionError("a pinned arena larger than RAM was accepted")


