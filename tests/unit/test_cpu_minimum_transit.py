"""The CPU budget's minimum counts one chunk on its way from NVMe to the device beside the largest
update: updates overlap the next forward, whose chunks come up through the CPU tier when the device
tier is a tier of its own. A budget wrap accepted held the update alone, and the optimizer's worker
met a full tier (its own update and a parameter chunk in transit) and failed the run. The planner
counts the same; without a GPU (one host tier) neither does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import offload
from offload.engine.build import build_layout
from offload.engine.precision import StatePrecision
from offload.errors import ConfigError
from offload.plan import Hardware, Policy, plan
from tests.helpers.features8 import batches, loss_of

KW = dict(device="cpu", dtype="fp32", device_budget="72KiB", chunk_size=2048, optimizer_state="8bit")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 64))


def minimum(config: offload.OffloadConfig, staged: bool) -> int:
    """The engine's rule, from the layout and the precision's byte counts."""
    named = list(model().named_parameters())
    layout = build_layout(named, {}, config, torch.float32, 1 << 30, 1 << 30, None)
    q = StatePrecision.of(config, torch.float32)
    trainable = [layout.sizes[c] for c in layout.trainable_chunks]
    update = q.update_bytes(max(trainable))
    return max(update, layout.largest_chunk * 4) + q.resident_bytes(trainable) + \
        (layout.largest_chunk * 4 if staged else 0)


def test_separate_tiers_over_nvme_need_room_for_a_chunk_in_transit(disk_tmp):
    config = offload.OffloadConfig(**KW, nvme_paths=[str(disk_tmp)], merge_host_tiers=False)
    need, alone = minimum(config, staged=True), minimum(config, staged=False)
    assert need > alone
    with pytest.raises(ConfigError, match=r"cpu_budget=.*on its way from NVMe to the device"):
        offload.wrap(model(), replace(config, cpu_budget=need - 1))
    wrapped = offload.wrap(model(), replace(config, cpu_budget=need))
    try:
        opt = offload.AdamW(wrapped.parameters(), lr=1e-2, state="8bit")
        for x, y in batches(4):
            loss = loss_of(wrapped, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert torch.isfinite(loss)
    finally:
        wrapped.offload_engine.close()


def test_one_host_tier_needs_no_room_for_transit(disk_tmp):
    """CPU compute with the host tiers merged (the default): a chunk is read from NVMe straight
    into the tier compute reads, so the update alone is the minimum."""
    merged = offload.OffloadConfig(**KW, nvme_paths=[str(disk_tmp)])
    wrapped = offload.wrap(model(), replace(merged, cpu_budget=minimum(merged, staged=False)))
    wrapped.offload_engine.close()


def test_the_planner_counts_a_chunk_in_transit_for_a_gpu_only():
    policy = Policy(batch_tokens=2048, device_budget=32 << 20, chunk_size=1 << 18)
    gpu = Hardware(gpu_mem=24 << 30, cpu_mem=64 << 30, nvme_capacity=1 << 40, nvme_read_gbps=3, nvme_write_gbps=2,
                   compute_tflops=100, adam_params_per_s=1e9)
    cpu_only = replace(gpu, gpu_mem=None)
    with_gpu, without = plan("small", gpu, policy), plan("small", cpu_only, policy)
    piece = (1 << 18) * 2                                               # a bf16 chunk of 2^18 elements
    assert with_gpu.breakdown["cpu_min_bytes"] >= without.breakdown["cpu_min_bytes"] + piece
    low = plan("small", gpu, replace(policy, cpu_budget=with_gpu.breakdown["cpu_min_bytes"] - 1))
    assert not low.fits and "on its way from NVMe to the GPU" in low.reason
