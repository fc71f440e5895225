"""The "auto" activation area comes from the same measurement of available RAM as the other "auto"
budgets, taken once at start: what the chunk budgets take is not counted twice (once by a later
measurement that already misses the filled arena, once more by subtracting the budgets), each of
``local_world`` ranks on a box takes its share only, and the planner's figure is the engine's."""

from __future__ import annotations

import types

import psutil
import pytest
import torch
from torch import nn

import offload
from offload.plan import Hardware
from offload.plan.activations import area_budget
from offload.tiers.budgets import AUTO_AREA_MIN, resolve_budgets

GiB = 1 << 30


class FakeRam:
    """``psutil.virtual_memory`` of a box whose available RAM is ``first`` bytes when a process
    starts and ``later`` bytes afterwards (what the engine has allocated since is gone from it)."""

    def __init__(self, first: int, later: int):
        self.first, self.later, self.calls = first, later, 0

    def __call__(self):
        self.calls += 1
        available = self.first if self.calls == 1 else self.later
        return types.SimpleNamespace(available=available, total=4 * self.first, percent=0.0)


def shares(available: int, cpu_compute: bool, device_budget: int | None = None) -> tuple[int, int, int]:
    """The budgets "auto" should give: device a quarter (CPU compute), CPU half of what that leaves,
    the area half of what both leave."""
    device = int(available * 0.25) if device_budget is None else device_budget
    cpu = int((available - (device if cpu_compute else 0)) * 0.5)
    area = max(int((available - cpu - (device if cpu_compute else 0)) * 0.5), AUTO_AREA_MIN)
    return device, cpu, area


def test_the_engine_sizes_the_area_from_the_ram_available_at_start(monkeypatch):
    ram = FakeRam(first=2 * GiB, later=1 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", ram)
    torch.manual_seed(0)
    model = offload.wrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                         offload.OffloadConfig(device="cpu", dtype="fp32", activation_offload="cpu"))
    try:
        engine = model.offload_engine
        device, cpu, area = shares(2 * GiB, cpu_compute=True)
        assert (engine.device_budget, engine.cpu_budget) == (device, cpu)
        assert engine.activations.area.budget == area == 384 << 20
    finally:
        model.offload_engine.close()


@pytest.mark.parametrize("local_world", [1, 8])
def test_each_rank_on_a_box_takes_its_share(monkeypatch, local_world):
    monkeypatch.setattr(psutil, "virtual_memory", FakeRam(first=128 * GiB, later=0))
    share = 128 * GiB // local_world
    cfg = offload.OffloadConfig(device="cpu")
    got = resolve_budgets(cfg, torch.device("cpu"), local_world)
    assert tuple(got) == shares(share, cpu_compute=True)
    assert local_world * (got.device + got.cpu + got.activations) < 128 * GiB
    # computing on a GPU the device budget is GPU memory: only the CPU budget is taken from RAM
    monkeypatch.setattr(psutil, "virtual_memory", FakeRam(first=128 * GiB, later=0))
    gpu = resolve_budgets(offload.OffloadConfig(device_budget="1GiB"), torch.device("cuda"), local_world)
    assert tuple(gpu) == shares(share, cpu_compute=False, device_budget=GiB)
    assert local_world * (gpu.cpu + gpu.activations) < 128 * GiB


def test_an_explicit_area_is_taken_as_given(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", FakeRam(first=16 * GiB, later=0))
    got = resolve_budgets(offload.OffloadConfig(device="cpu", activation_budget="3MiB"), torch.device("cpu"), 4)
    assert got.activations == 3 << 20


@pytest.mark.parametrize("gpu_mem", [None, 80 * GiB])
def test_the_planner_expects_the_area_the_engine_makes(monkeypatch, gpu_mem):
    """The planner's ``cpu_mem`` is one rank's share of the available RAM, like the engine's measurement."""
    monkeypatch.setattr(psutil, "virtual_memory", FakeRam(first=512 * GiB, later=0))
    device = torch.device("cpu") if gpu_mem is None else torch.device("cuda")
    cfg = offload.OffloadConfig(device_budget="8GiB", cpu_budget="96GiB")
    engine = resolve_budgets(cfg, device, local_world=4)
    hw = Hardware(gpu_mem=gpu_mem, cpu_mem=512 * GiB // 4, compute_tflops=100.0, adam_params_per_s=1e9)
    assert area_budget(hw, 8 * GiB, 96 * GiB) == engine.activations
