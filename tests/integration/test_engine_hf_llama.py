"""The engine on a `transformers` LlamaForCausalLM built from a tiny config (no download)."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from tests.helpers.hf_models import checkpointing, tiny_llama
from tests.helpers.trajectory import assert_run_within_drift, float64_twin, train_in_lockstep

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


def data(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(n)]


def test_hf_llama_fp32_matches_torch(disk_tmp):
    ref = tiny_llama()
    mine, exact = copy.deepcopy(ref), float64_twin(ref)
    for m in (ref, mine, exact):
        checkpointing(m)
        m.train()
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="512KiB", cpu_budget="320KiB",
                                nvme_paths=[str(disk_tmp)], chunk_size=16384)
    model = offload.wrap(mine, cfg)
    runs = [(model, offload.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))]
    runs += [(m, torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)) for m in (ref, exact)]
    losses = train_in_lockstep(runs, data(12), lambda m, ids: m(input_ids=ids, labels=ids).loss)
    assert_run_within_drift((model, losses[0]), (ref, losses[1]), (exact, losses[2]))
    assert model.offload_engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"]
    model.offload_engine.close()
