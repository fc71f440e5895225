"""``engine.close()`` gives the engine's memory back at once, not when the model object goes: a
notebook that keeps ``model`` after closing its engine held every chunk (on a GPU, the device
tier's memory) until it dropped the model too."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import offload
from offload.config import OffloadConfig


def _train(model, steps=2):
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    for _ in range(steps):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("where", ["memory", "nvme"])
def test_close_frees_every_chunk_while_the_model_lives(disk_tmp, where):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    tiers = {} if where == "memory" else dict(cpu_budget=512 << 10, device_budget=256 << 10,
                                              nvme_paths=[str(disk_tmp)])
    model = offload.wrap(net, OffloadConfig(device="cpu", chunk_size=4096, **tiers))
    _train(model)
    engine = model.offload_engine
    report = engine.store.memory_report()
    assert sum(t["in_use"] for t in report["tiers"].values()) > 0
    assert (where == "nvme") == any(rec.nvme_valid for rec in engine.store.records.values())
    # A chunk buffer the parameters view now: it must be gone after close while ``model`` lives.
    viewed = [weakref.ref(p.data.untyped_storage()) for p in model.parameters()]
    engine.close()
    gc.collect()
    report = engine.store.memory_report()
    for name, tier in report["tiers"].items():
        assert (tier["in_use"], tier["reserved"]) == (0, 0), name
    assert set(report["chunk_states"]) == {"FREE"}
    # Parameters no longer view any chunk: a use outside the engine fails loudly, not stale.
    assert all(p.numel() == 0 for p in model.parameters())
    assert all(r() is None or r().nbytes() == 0 for r in viewed)
    with pytest.raises(offload.OffloadError, match="closed"):
        model(torch.randn(1, 128, dtype=torch.bfloat16))
