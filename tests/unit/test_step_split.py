"""offload.train.step_split on a real wrapped TinyGPT with NVMe forced: the bytes are the chunk
store's own counters for that step, the hit rate a fraction, and compute + waiting + optimizer add
up to the step as the loop timed it (no part counted twice, nothing from another thread)."""

from __future__ import annotations

import time

import pytest
import torch

import offload
from offload.errors import OffloadError
from offload.train.metrics import Metrics
from offload.train.step_split import step_values
from tests.helpers.tiny_gpt import TinyGPT, batches

# Two perf_counter reads per part; far above their resolution, far below any real step.
CLOCK_S = 1e-3


def _run(disk_tmp, steps=4, *, max_grad_norm=None, checkpointing=False, **cfg):
    """Train ``steps`` steps with every tier in use; per step its values and the store's counters
    read at the step's boundary (just before the engine resets them)."""
    torch.manual_seed(0)
    config = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="512KiB",
                                   nvme_paths=[str(disk_tmp)], chunk_size=8192, merge_host_tiers=False, **cfg)
    model = offload.wrap(TinyGPT(checkpointing=checkpointing), config)
    opt = offload.AdamW(model.parameters(), lr=1e-3, max_grad_norm=max_grad_norm)
    store = model.offload_engine.store
    at_boundary = []
    reset = store.reset_counters

    def spy():
        at_boundary.append(store.moved_by_direction())
        reset()

    store.reset_counters = spy
    rows = []
    try:
        for x, y in batches(steps):
            t0 = time.perf_counter()
            model(x, y).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad()
            step_s = time.perf_counter() - t0
            rows.append((step_s, step_values(model.offload_stats(), step_s=step_s, optimizer_step_s=t2 - t1)))
    finally:
        model.offload_engine.close()
    return rows, at_boundary


@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["adam-beside-backward", "adam-in-step"])
def test_one_steps_values_are_the_stores_counters_and_the_split_adds_up(disk_tmp, max_grad_norm):
    rows, at_boundary = _run(disk_tmp, max_grad_norm=max_grad_norm)
    assert len(at_boundary) == len(rows)
    for (step_s, v), counters in zip(rows, at_boundary):
        moved = {k[len("moved/"):]: n for k, n in v.items() if k.startswith("moved/")}
        assert moved == counters
        assert moved.get("nvme->cpu", 0) > 0 and moved.get("cpu->nvme", 0) > 0, moved   # NVMe really used
        assert 0.0 <= v["prefetch_hit_rate"] <= 1.0 and v["chunk_fetches"] > 0
        parts = v["compute_s"] + v["wait_s"] + v["optimizer_s"]
        assert min(v["compute_s"], v["wait_s"], v["optimizer_s"]) >= 0.0
        # waiting and the optimizer happen inside the step, on the loop's thread, never both at once
        assert v["wait_s"] + v["optimizer_s"] <= step_s + CLOCK_S, v
        assert parts == pytest.approx(step_s, abs=CLOCK_S)
        assert v["adam_s"] > 0.0 and v["optimizer_wait_s"] >= 0.0
        if max_grad_norm is not None:
            # the clip needs every gradient: the whole update, its reads from NVMe included, runs
            # inside optimizer.step() on the loop's thread
            assert v["adam_s"] + v["optimizer_wait_s"] <= v["optimizer_s"] + CLOCK_S, v


def test_parked_activations_are_moved_bytes_and_their_wait_stays_out_of_the_split(disk_tmp):
    rows, _ = _run(disk_tmp, steps=3, checkpointing=True, activation_offload="nvme", activation_budget="64KiB",
                   activation_min_bytes=4096)
    for step_s, v in rows:
        assert v.get("moved/activations/device->cpu", 0) > 0, v
        assert v["activation_wait_s"] >= 0.0
        total = v["compute_s"] + v["wait_s"] + v["optimizer_s"] + v["activation_wait_s"]
        assert total == pytest.approx(step_s, abs=CLOCK_S)


def test_step_values_go_into_metrics_under_their_tags(disk_tmp, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows, _ = _run(disk_tmp, steps=2)
    m = Metrics(tensorboard=tmp_path / "tb", plot_dir=tmp_path)
    for step, (step_s, v) in enumerate(rows, 1):
        m.log(step, {"loss": 1.0, "step_s": step_s, **v})
    m.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"moved/nvme_to_cpu", "moved/cpu_to_nvme", "prefetch/hit_rate", "prefetch/chunk_fetches",
            "time/wait_s", "time/optimizer_s", "time/compute_s", "time/adam_s", "time/optimizer_wait_s"} <= tags
    assert not [t for t in tags if t.startswith("other/")], tags
    assert [e.value for e in acc.Scalars("moved/nvme_to_cpu")] == [float(v["moved/nvme->cpu"]) for _, v in rows]


def test_statistics_before_any_step_or_a_bad_duration_are_refused():
    with pytest.raises(OffloadError, match="no finished optimizer step"):
        step_values({"memory": {}}, step_s=1.0, optimizer_step_s=0.0)
    with pytest.raises(OffloadError, match=r"step_s=nan is not a duration"):
        step_values({"wait_s": 0.0}, step_s=float("nan"), optimizer_step_s=0.0)
    with pytest.raises(OffloadError, match=r"optimizer_step_s=-1 is not a duration"):
        step_values({"wait_s": 0.0}, step_s=1.0, optimizer_step_s=-1)
