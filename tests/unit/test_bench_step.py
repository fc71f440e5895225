"""offload bench step: the bound arithmetic, budgets, and one short run's JSON schema."""

from __future__ import annotations

import json
import math
import os

import pytest

from offload.bench import step as bench_step
from offload.errors import ConfigError, OffloadError
from offload.models import llama

MIB = 1 << 20


def test_bound_is_the_largest_term():
    b = bench_step.step_bound(compute_s=0.5, nvme_read_bytes=2_000_000_000, nvme_write_bytes=1_000_000_000,
                              read_gbps=2.0, write_gbps=4.0, params=100_000_000, adam_params_per_s=1e9)
    assert b["nvme_s"] == pytest.approx(1.0 + 0.25)
    assert b["adam_s"] == pytest.approx(0.1)
    assert b["bound_s"] == pytest.approx(1.25) and b["bottleneck"] == "nvme"
    b = bench_step.step_bound(3.0, 0, 0, None, None, 10, 1e9)
    assert b["nvme_s"] == 0 and b["bound_s"] == 3.0 and b["bottleneck"] == "compute"
    b = bench_step.step_bound(0.01, 0, 0, None, None, 10**9, 1e9)
    assert b["bottleneck"] == "adam" and b["bound_s"] == pytest.approx(1.0)


def test_pcie_term_is_the_slower_direction_not_the_sum():
    b = bench_step.step_bound(0.1, 0, 0, None, None, 10, 1e9, h2d_bytes=20_000_000_000, d2h_bytes=10_000_000_000,
                              h2d_gbps=25.0, d2h_gbps=10.0)
    assert b["pcie_s"] == pytest.approx(1.0)          # max(0.8 up, 1.0 down)
    assert b["bottleneck"] == "pcie" and b["bound_s"] == pytest.approx(1.0)
    assert bench_step.step_bound(0.1, 0, 0, None, None, 10, 1e9)["pcie_s"] == 0   # CPU: no bus
    with pytest.raises(bench_step.BenchStepError, match="host to device"):
        bench_step.step_bound(0.1, 0, 0, None, None, 10, 1e9, h2d_bytes=1)


def test_pcie_bytes_split_by_direction():
    from offload.bench.pcie import pcie_bytes

    moved = {"cpu->device": 300, "nvme->device": 20, "device->cpu": 100, "device->nvme": 5,
             "nvme->cpu": 7000, "cpu->nvme": 9000}
    assert pcie_bytes(moved) == (320, 105)
    assert pcie_bytes({"nvme->cpu": 1}) == (0, 0)


def test_breakdown_carries_pcie_bytes():
    b = bench_step.breakdown_of([{"moved_bytes": {"cpu->device": 10, "device->cpu": 4, "nvme->cpu": 2}}])
    assert (b["h2d_bytes"], b["d2h_bytes"], b["nvme_read_bytes"]) == (10, 4, 2)


def test_batch_curve_parsing():
    assert bench_step.parse_batch_curve("512, 2048,8192") == [512, 2048, 8192]
    assert bench_step.parse_batch_curve(None) is None
    with pytest.raises(ConfigError, match="--batch-curve"):
        bench_step.parse_batch_curve("512,lots")
    with pytest.raises(ConfigError, match="--batch-curve"):
        bench_step.parse_batch_curve("0")


def test_bytes_without_a_bandwidth_is_an_error():
    with pytest.raises(bench_step.BenchStepError):
        bench_step.step_bound(1.0, 1, 0, None, 1.0, 1, 1.0)


def test_default_budgets():
    cpu, dev = bench_step.default_budgets(14 * 23_732_736)
    assert cpu % MIB == 0 and dev % MIB == 0 and 14 * 23_732_736 >= 4 * cpu and dev <= cpu
    assert bench_step.default_budgets(10**9, "64MiB", "32MiB") == (64 * MIB, 32 * MIB)
    with pytest.raises(ConfigError, match="--cpu-budget"):
        bench_step.default_budgets(10**9, "lots")


def test_breakdown_medians_and_directions():
    stats = [{"moved_bytes": {"nvme->cpu": 10, "cpu->nvme": 20, "cpu->device": 5}, "wait_s": 1.0,
              "optimizer_s": 0.5, "optimizer_wait_s": 0.1, "prefetch_hit_rate": 1.0},
             {"moved_bytes": {"nvme->cpu": 30, "cpu->nvme": 40}, "wait_s": 3.0, "optimizer_s": 0.5,
              "optimizer_wait_s": 0.3, "prefetch_hit_rate": None}]
    b = bench_step.breakdown_of(stats)
    assert b["wait_s"] == 2.0 and b["prefetch_hit_rate"] == 1.0
    assert b["moved_bytes"] == {"cpu->device": 2, "cpu->nvme": 30, "nvme->cpu": 20}
    assert b["nvme_read_bytes"] == 20 and b["nvme_write_bytes"] == 30 and b["bytes_per_step"] == 52


def test_bad_arguments_are_offload_errors(tmp_path):
    with pytest.raises(ConfigError, match="steps"):
        bench_step.measure(tmp_path, steps=0)
    with pytest.raises(ConfigError, match="path"):
        bench_step.measure(tmp_path / "missing")
    with pytest.raises(OffloadError, match="unknown preset"):
        bench_step.measure(tmp_path, preset="nope")


def test_disk_space_is_checked_first(tmp_path, monkeypatch):
    import offload.aio

    monkeypatch.setattr(offload.aio, "free_bytes", lambda path: 1000)
    with pytest.raises(bench_step.BenchStepError, match="free"):
        bench_step.measure(tmp_path, preset="tiny")


@pytest.mark.nvme
def test_short_run_json_schema(tmp_path, monkeypatch):
    micro = llama.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_layers=2,
                              num_heads=2, num_kv_heads=1, max_seq_len=128, tie_embeddings=True)
    monkeypatch.setitem(llama.PRESETS, "micro", micro)
    out = tmp_path / "step.json"
    nvme_dir = tmp_path / "nvme"
    from offload.cli import main

    rc = main(["bench", "step", "--path", str(nvme_dir), "--preset", "micro", "--steps", "2", "--warmup", "1",
               "--batch-tokens", "128", "--cpu-budget", "2MiB", "--device-budget", "1MiB",
               "--nvme-size", "4M", "--batch-curve", "64", "--json", str(out)])
    assert rc == 0
    assert not nvme_dir.exists()           # created for the run, removed with its files
    r = json.loads(out.read_text())
    assert set(r) == {"device", "params", "state_bytes", "cpu_budget", "step_s", "bound_s", "bound_ratio",
                      "breakdown", "in_memory", "batch_curve"}
    (point,) = r["batch_curve"]
    assert point["batch_tokens"] == 64 and point["ratio"] == pytest.approx(point["torch_step_s"] / point["offload_step_s"])
    assert r["device"] in ("cpu", "cuda")
    assert r["state_bytes"] == 14 * r["params"] and r["cpu_budget"] == 2 * MIB
    b = r["breakdown"]
    for key in ("wait_s", "optimizer_s", "optimizer_wait_s", "moved_bytes", "prefetch_hit_rate",
                "bytes_per_step", "compute_s", "nvme_s", "adam_s"):
        assert key in b
    assert b["nvme_read_bytes"] > 0 and b["nvme_write_bytes"] > 0   # the state went through NVMe
    assert r["bound_s"] == pytest.approx(max(b["compute_s"], b["pcie_s"], b["nvme_s"], b["adam_s"]))
    if r["device"] == "cpu":
        assert b["pcie_s"] == 0 and b["h2d_bytes"] == b["d2h_bytes"] == 0
    else:
        assert b["h2d_bytes"] > 0 and b["pcie_h2d_gbps"] > 0
    assert r["bound_ratio"] == pytest.approx(r["step_s"] / r["bound_s"])
    assert b["nvme_s"] == pytest.approx(b["nvme_read_bytes"] / (b["nvme_read_gbps"] * 1e9)
                                        + b["nvme_write_bytes"] / (b["nvme_write_gbps"] * 1e9))
    assert b["adam_s"] == pytest.approx(r["params"] / b["adam_roofline_params_per_s"])
    # The replay redid one sample's requests: about a step's NVMe bytes (steps vary a little).
    assert b["nvme_replay_s"] > 0
    replayed = b["nvme_replay_gbps"] * 1e9 * b["nvme_replay_s"]
    assert replayed == pytest.approx(b["nvme_read_bytes"] + b["nvme_write_bytes"], rel=0.5)
    m = r["in_memory"]
    assert set(m) == {"offload_step_s", "torch_step_s", "ratio"}
    assert "torch_optimizer" in b["in_memory"] and b["run"]["preset"] == "micro"
    assert m["ratio"] == pytest.approx(m["torch_step_s"] / m["offload_step_s"])
    assert all(math.isfinite(x) and x > 0 for x in (r["step_s"], m["offload_step_s"], m["torch_step_s"]))


def test_existing_path_keeps_only_its_own_files(tmp_path, monkeypatch):
    micro = llama.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=172, num_layers=1,
                              num_heads=2, num_kv_heads=1, max_seq_len=64, tie_embeddings=True)
    monkeypatch.setitem(llama.PRESETS, "nano", micro)
    (tmp_path / "keep.txt").write_text("x")
    r = bench_step.measure(tmp_path, preset="nano", steps=1, warmup=1, batch_tokens=64,
                           cpu_budget="2MiB", device_budget="1MiB", nvme_size="1M", replay_repeats=1,
                           adam_repeats=1, in_memory=False)
    assert r["in_memory"] is None
    assert os.listdir(tmp_path) == ["keep.txt"]
