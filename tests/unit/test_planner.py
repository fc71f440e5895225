"""The planner's arithmetic and the `offload plan` command (explicit figures: nothing measured)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from offload.cli import main
from offload.errors import ConfigError
from offload.models import PRESETS, param_count
from offload.plan import Hardware, Policy, plan, probes
from offload.units import format_size

N100 = param_count(PRESETS["100b"])
H100_BOX = dict(gpu_mem=80 << 30, cpu_mem=512 << 30, nvme_capacity=8 << 40, nvme_read_gbps=25.0,
                nvme_write_gbps=25.0, pcie_gbps=25.0, compute_tflops=400.0, adam_params_per_s=4e9,
                nvme_where="/mnt/nvme0")
CLI_100B = ["plan", "--model", "llama-100b", "--gpu-mem", "80G", "--cpu-mem", "512G",
            "--nvme-capacity", "8T", "--nvme-gbps", "25", "--gpu-tflops", "400"]


def box(**changes) -> Hardware:
    return Hardware(**{**H100_BOX, **changes})


def test_100b_state_is_every_chunk_of_every_kind():
    p = plan("llama-100b", box(cpu_mem=32 << 30))
    b = p.breakdown
    assert p.params == N100
    assert b["state_bytes_per_param"] == 18                        # 2 + 4 grad + 4 master + 4 + 4
    # The chunk size is chosen for the bulk (at most 32 Mi elements); the 327.68M-element embedding and
    # lm_head and the larger matrices get chunks of their own size: padding is well under 1 %
    # (it was 17.8 % when the embedding set the size of every chunk).
    assert b["chunk_size"] <= 1 << 25 and b["largest_chunk"] == 32000 * 10240
    assert b["oversized_chunks"] == 2 + 90 * 5        # embedding, lm_head; q, o, gate, up, down per layer
    assert 0 < b["padding_elements"] < 0.01 * p.params
    elems = p.params + b["padding_elements"]
    assert b["state_bytes"] == 18 * elems == p.nvme_bytes_needed   # a slot for each, reserved up front
    assert p.fits, p.reason


def test_chunk_geometry_matches_the_engine():
    """Same chunk size and count as ``OffloadEngine`` builds for the same budgets."""
    from offload.chunks.layout import DEFAULT_MAX_CHUNK, ChunkLayout, auto_max_chunk
    from offload.models.llama import LlamaForCausalLM
    from offload.plan.model import chunk_geometry, param_numels

    cfg = PRESETS["tiny"]
    import torch
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    numels = [p.numel() for _, p in model.named_parameters()]
    assert numels == param_numels(cfg)
    for dev, cpu in ((6 << 20, 8 << 20), (32 << 20, 48 << 20), (1 << 30, 1 << 30)):
        max_chunk = max(2048, min(DEFAULT_MAX_CHUNK, dev // 32, cpu // 48))
        assert max_chunk == auto_max_chunk(dev, cpu)      # the rule the engine and planner share
        layout = ChunkLayout.build([(n, p.shape) for n, p in model.named_parameters()], max_chunk=max_chunk)
        assert chunk_geometry(cfg, dev, cpu) == (layout.chunk_size, layout.num_chunks)


def test_budgets_default_to_the_engines_auto():
    p = plan("100b", box())
    assert p.breakdown["device_budget"] == (80 << 30) // 2
    assert p.breakdown["cpu_budget"] == (512 << 30) // 2
    cpu_box = Hardware(gpu_mem=None, cpu_mem=24 << 30, nvme_capacity=100 << 30, nvme_read_gbps=1.5,
                       nvme_write_gbps=2.5, compute_tflops=0.2, adam_params_per_s=1.5e9)
    p = plan("small", cpu_box, Policy(batch_tokens=2048, seq_len=256))
    assert p.breakdown["device_budget"] == (24 << 30) // 4
    assert p.breakdown["cpu_budget"] == ((24 << 30) - (24 << 30) // 4) // 2


def test_budgets_are_chunk_storage_only():
    p = plan("100b", box())
    b, dev = p.breakdown, p.tiers["device"]
    assert dev["params"] + dev["grads"] <= b["device_budget"]        # activations are beside it
    assert dev["activations"] > 0 and dev["bytes"] == dev["params"] + dev["grads"] + dev["activations"]
    cpu = p.tiers["cpu"]
    assert cpu["bytes"] <= b["cpu_budget"] and cpu["working"] > 0 and "staging" not in cpu
    assert cpu["params"] == b["state_by_kind"]["params"] and p.tiers["nvme"]["params"] == 0   # params first
    assert cpu["master"] > 0 and p.tiers["nvme"]["master"] > 0                                # then master, split
    assert cpu["exp_avg"] == 0 and p.tiers["nvme"]["exp_avg_sq"] == b["state_by_kind"]["exp_avg_sq"]
    for tier in p.tiers.values():
        assert tier["bytes"] == sum(v for k, v in tier.items() if k != "bytes")


def test_bytes_per_step_follow_the_engine():
    """CPU budget at its minimum room: optimizer state read 12 B and written 12 B per element on NVMe,
    parameters written once and read for forward and for what the device could not keep; PCIe carries
    parameters in (forward + backward refetch) and fp32 gradients out."""
    p = plan("100b", box(), Policy(cpu_budget=1 << 30, device_budget=16 << 30))
    b, k, bps = p.breakdown, p.breakdown["state_by_kind"], p.bytes_per_step
    elems = p.params + b["padding_elements"]          # every chunk, the oversized ones at their own size
    assert b["cpu_budget"] < b["cpu_min_bytes"] and not p.fits and "CPU budget" in p.reason
    # Adam's two working sets, no more (the minimum's chunk on its way to the GPU is one of them)
    assert b["cpu_transit_bytes"] > 0
    p = plan("100b", box(), Policy(cpu_budget=(b["cpu_min_bytes"] - b["cpu_transit_bytes"]) * 2,
                                   device_budget=16 << 30))
    b, k, bps = p.breakdown, p.breakdown["state_by_kind"], p.bytes_per_step
    elems = p.params + b["padding_elements"]
    assert p.fits, p.reason
    assert p.tiers["nvme"]["params"] == k["params"] == 2 * elems          # nothing left for state
    refetch = k["params"] - p.tiers["device"]["params"]
    assert bps["nvme_write"] == 12 * elems + 2 * elems
    assert bps["nvme_read"] == 12 * elems + 2 * elems + refetch
    assert bps["pcie_h2d"] == 2 * elems + refetch and bps["pcie_d2h"] == 4 * elems
    t = p.step_terms_s
    assert t["nvme"] == pytest.approx(bps["nvme_read"] / 25e9 + bps["nvme_write"] / 25e9)
    assert t["pcie"] == pytest.approx(bps["pcie_d2h"] / 25e9)            # full duplex: the larger way
    assert t["adam"] == pytest.approx(N100 / 4e9)
    assert p.predicted_step_s == max(t.values())


def test_small_model_stays_resident_on_the_gpu():
    p = plan("7b", box())
    k = p.breakdown["state_by_kind"]
    assert p.breakdown["params_resident_on_device"]
    assert p.tiers["device"]["params"] == k["params"]
    assert p.bytes_per_step["pcie_h2d"] == k["params"]          # once: the update rewrote them on the CPU
    assert p.bytes_per_step["nvme_read"] == 0 and p.tiers["nvme"]["bytes"] == 0


@pytest.mark.parametrize("changes,expected", [
    ({}, "nvme"),
    ({"nvme_read_gbps": 1000.0, "nvme_write_gbps": 1000.0, "adam_params_per_s": 1e12, "pcie_gbps": 1000.0},
     "compute"),
    ({"nvme_read_gbps": 1000.0, "nvme_write_gbps": 1000.0, "pcie_gbps": 1.0}, "pcie"),
    ({"nvme_read_gbps": 1000.0, "nvme_write_gbps": 1000.0, "adam_params_per_s": 1e8}, "adam"),
])
def test_bottleneck_follows_the_figures(changes, expected):
    assert plan("100b", box(**changes)).bottleneck == expected


def test_gpu_bound_batch_is_where_compute_takes_over():
    hw = box(gpu_mem=1 << 40)                      # room for any activations
    pol = dict(device_budget=40 << 30)
    p = plan("100b", hw, Policy(**pol))
    b = p.gpu_bound_batch_tokens
    assert p.bottleneck == "nvme" and b % 4096 == 0
    assert plan("100b", hw, Policy(batch_tokens=b, **pol)).bottleneck == "compute"
    assert plan("100b", hw, Policy(batch_tokens=b - 4096, **pol)).bottleneck != "compute"
    assert plan("100b", hw, Policy(batch_tokens=b, **pol)).gpu_bound_batch_tokens is None


def test_activations_limit_the_batch_beside_the_device_budget():
    p = plan("100b", box())
    assert 0 < p.max_batch_tokens < p.gpu_bound_batch_tokens
    assert p.fits
    refused = plan("100b", box(), Policy(batch_tokens=p.max_batch_tokens + 4096))
    assert not refused.fits and "GPU needs" in refused.reason and "tokens/step fit" in refused.reason
    assert "activations" in refused.reason and "device budget" in refused.reason
    assert plan("100b", box(), Policy(batch_tokens=p.max_batch_tokens)).fits


def test_refuses_a_device_budget_below_the_engines_minimum():
    from offload.tiers.budgets import min_device_bytes

    p = plan("100b", box(), Policy(device_budget=1 << 30))
    chunk, largest = p.breakdown["chunk_size"], 32000 * 10240
    assert not p.fits and p.breakdown["device_min_bytes"] == min_device_bytes(chunk, 2, largest) \
        == 6 * (largest + 2 * chunk)
    assert (f"device budget 1.07 GB is below the largest chunk (327,680,000 elements) and 2 chunks of "
            f"{chunk:,}") in p.reason
    # Before oversized parameters had chunks of their own, every chunk was the embedding's: 5.90 GB.
    assert p.breakdown["device_min_bytes"] < 0.5 * 5.90e9


def test_refuses_a_small_disk_with_the_numbers():
    p = plan("100b", box(nvme_capacity=500 * 10**9))
    assert not p.fits
    assert p.reason == f"NVMe needs {format_size(p.breakdown['state_bytes'])}, 500 GB free at /mnt/nvme0"
    p = plan("100b", box(nvme_capacity=0, nvme_read_gbps=0.0, nvme_write_gbps=0.0))
    assert not p.fits and "no NVMe tier" in p.reason


def test_nvme_bandwidth_is_required_when_used():
    with pytest.raises(ConfigError) as info:
        plan("100b", box(nvme_read_gbps=0.0))
    assert info.value.field == "nvme_gbps"


CPU_BOX = dict(gpu_mem=None, cpu_mem=24 << 30, nvme_capacity=100 << 30, nvme_read_gbps=1.5,
               nvme_write_gbps=2.5, pcie_gbps=0.0, compute_tflops=0.2, adam_params_per_s=1.5e9)


def test_cpu_only_compute_adam_and_disk_add_up():
    hw = Hardware(**CPU_BOX)
    p = plan("small", hw, Policy(batch_tokens=4096))
    t = p.step_terms_s
    assert p.bytes_per_step["pcie_h2d"] == 0 and t["pcie"] == 0
    assert p.bytes_per_step["nvme_read"] == 0 and p.tiers["nvme"]["bytes"] == 0   # auto budgets hold it
    assert p.breakdown["device_cpu_copy_bytes"]["d2h"] > 0                       # memcpy, not timed
    assert p.predicted_step_s == pytest.approx(t["compute"] + t["adam"])
    # a model whose state is several times the CPU budget spills to NVMe and pays for it
    p = plan("1b", hw, Policy(batch_tokens=2048, cpu_budget=4 << 30))
    t = p.step_terms_s
    assert p.fits, p.reason
    assert p.tiers["nvme"]["bytes"] > 10e9 and p.bytes_per_step["nvme_read"] > 10e9
    assert p.tiers["cpu"]["bytes"] <= 4 << 30
    assert p.predicted_step_s == pytest.approx(t["compute"] + t["adam"] + t["nvme"])


def test_the_tiny_run_the_engine_handles_fits():
    """scripts/finetune_100b.py --preset tiny --cpu-budget 8M --device-budget 6M trains: the plan agrees."""
    hw = Hardware(**{**CPU_BOX, "compute_tflops": 0.05, "adam_params_per_s": 4e8})
    p = plan("tiny", hw, Policy(batch_tokens=2048, seq_len=256, device_budget=6 << 20, cpu_budget=8 << 20))
    assert p.fits, p.reason
    assert p.breakdown["chunk_size"] == 176128 and p.breakdown["num_chunks"] == 21   # as the engine lays it out
    # every chunk of every kind, the last one cut to what it holds
    assert p.tiers["nvme"]["bytes"] > 0 and p.nvme_bytes_needed == 18 * (p.params + p.breakdown["padding_elements"])
    assert p.nvme_bytes_needed < 18 * 176128 * 21


def test_cpu_only_refusals_name_ram_and_cpu_minimum():
    hw = Hardware(**{**CPU_BOX, "cpu_mem": 200 << 20})
    p = plan("small", hw, Policy(batch_tokens=4096, seq_len=256, device_budget=64 << 20, cpu_budget=100 << 20))
    assert not p.fits and p.reason.startswith("RAM needs 401 MB (device budget 67.11 MB + CPU budget 105 MB")
    assert "activations for 4096 tokens), 210 MB available; at most 512 tokens/step fit" in p.reason
    p = plan("small", Hardware(**CPU_BOX), Policy(batch_tokens=2048, device_budget=32 << 20, cpu_budget=4 << 20))
    assert not p.fits and "CPU budget 4.19 MB is below one chunk of every kind" in p.reason


def test_fp32_state_is_16_bytes_per_param():
    p = plan("1b", box(), Policy(dtype="fp32"))
    assert p.breakdown["state_bytes_per_param"] == 16                # 4 param (= master) + 4 grad + 4 + 4
    assert p.tiers["cpu"]["master"] == 0 and p.tiers["nvme"].get("master", 0) == 0


def test_defer_step_holds_gradients_and_adds_the_optimizer():
    pol = dict(cpu_budget=20 << 30)
    p = plan("100b", box(), Policy(defer_step=True, **pol))
    k = p.breakdown["state_by_kind"]
    assert p.tiers["nvme"]["grads"] == k["grads"]
    assert p.bytes_per_step["nvme_write"] > plan("100b", box(), Policy(**pol)).bytes_per_step["nvme_write"]
    fast = box(nvme_read_gbps=1000.0, nvme_write_gbps=1000.0)       # disk out of the way
    p, eager = plan("100b", fast, Policy(defer_step=True, **pol)), plan("100b", fast, Policy(**pol))
    t = p.step_terms_s
    assert eager.predicted_step_s == max(eager.step_terms_s.values())   # Adam hidden under backward
    assert p.predicted_step_s == pytest.approx(max(t["compute"], t["pcie"]) + t["adam"])   # Adam after it


def test_json_schema():
    d = plan("llama-100b", box()).to_json_dict()
    for key in ("model", "params", "tiers", "nvme_bytes_needed", "bytes_per_step", "predicted_step_s",
                "bottleneck", "fits", "reason"):
        assert key in d
    assert d["model"] == "llama-100b" and isinstance(d["fits"], bool)
    assert set(d["tiers"]) == {"device", "cpu", "nvme"}
    assert all(isinstance(t["bytes"], int) for t in d["tiers"].values())
    assert set(d["bytes_per_step"]) == {"nvme_read", "nvme_write", "pcie_h2d", "pcie_d2h"}
    assert d["bottleneck"] in {"compute", "pcie", "nvme", "adam"}
    assert json.loads(json.dumps(d, allow_nan=False)) == d


@pytest.mark.parametrize("make,field", [
    (lambda: Hardware(**{**H100_BOX, "cpu_mem": 0}), "cpu_mem"),
    (lambda: Hardware(**{**H100_BOX, "compute_tflops": -1.0}), "compute_tflops"),
    (lambda: Hardware(**{**H100_BOX, "pcie_gbps": 0.0}), "pcie_gbps"),
    (lambda: Policy(batch_tokens=0), "batch_tokens"),
    (lambda: Policy(dtype="int8"), "dtype"),
    (lambda: plan("llama-3b", box()), "model"),
    (lambda: plan("7b", box(), Policy(batch_tokens=1024, seq_len=2048)), "seq_len"),
])
def test_bad_inputs_name_the_field(make, field):
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.field == field


# ------------------------------------------------------------------ the command


def test_cli_100b_prints_a_complete_plan(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    assert main(CLI_100B + ["--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for text in ("llama-100b", "100.69 B parameters", "bytes per tier and kind", "exp_avg_sq",
                 "NVMe space needed: 1.81 TB", "NVMe read", "PCIe H2D", "predicted step time",
                 "<- bottleneck", "compute becomes the bottleneck from", "verdict: fits"):
        assert text in out, text
    data = json.loads(out_json.read_text())
    assert data["fits"] is True and data["params"] == N100 and data["bottleneck"] == "nvme"
    assert data["hardware_sources"]["adam_params_per_s"].startswith("assumed")


def test_cli_json_to_stdout(capsys):
    assert main(CLI_100B + ["--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "llama-100b"


def test_cli_refuses_with_the_numbers(capsys):
    argv = [a if a != "8T" else "500GB" for a in CLI_100B]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "refused: NVMe needs 1.81 TB, 500 GB free" in err


@pytest.mark.parametrize("bad", [["--gpu-mem", "80X"], ["--batch-tokens", "-5"], ["--nvme-gbps", "0"],
                                 ["--model", "llama-3b"]])
def test_cli_bad_value_is_one_line(capsys, bad):
    argv = list(CLI_100B)
    i = argv.index(bad[0]) if bad[0] in argv else len(argv)
    argv[i:i + 2] = bad
    if bad[0] == "--model":                 # known only once the presets are looked at: exit 1
        assert main(argv) == 1
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("offload: error:"), captured.err
    else:                                   # numbers and sizes are checked at parse time: exit 2
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines()[-1].startswith(f"offload plan: error: argument {bad[0]}:")
    assert "Traceback" not in captured.err


def test_cli_describing_needs_cpu_mem(capsys):
    argv = [a for a in CLI_100B if a not in ("--cpu-mem", "512G")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "give --cpu-mem (the RAM for the run)" in err


def _fake_bench(name, measure):
    """A stand-in for offload.bench.<name> (the CLI also wires its `offload bench` command)."""
    mod = types.ModuleType(f"offload.bench.{name}")
    mod.measure, mod.add_arguments, mod.run = measure, lambda parser: None, lambda args: 0
    return mod


def _local(tmp_path):
    """Local mode (nothing describes another box) with the slow probes given as figures."""
    return ["plan", "--model", "1b", "--cpu-mem", "24G", "--cpu-gflops", "200",
            "--cpu-budget", "4G", "--batch-tokens", "2048", "--nvme-path", str(tmp_path)]


def test_cli_uses_the_bench_measurements(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "cuda_or_none", lambda: None)
    nvme = _fake_bench("nvme", lambda path, **kw: {"read_gbps": 1.5, "write_gbps": 2.5, "path": path})
    adam = _fake_bench("adam", lambda **kw: {"results": {"torch": {"params_per_s": 1e9},
                                                         "offload": {"params_per_s": 2e9}}})
    monkeypatch.setitem(sys.modules, "offload.bench.nvme", nvme)
    monkeypatch.setitem(sys.modules, "offload.bench.adam", adam)
    assert main(_local(tmp_path) + ["--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["nvme_read_gbps"] == 1.5 and data["hardware"]["nvme_write_gbps"] == 2.5
    assert data["hardware"]["adam_params_per_s"] == 2e9
    assert data["hardware"]["nvme_capacity"] > 0 and data["hardware"]["gpu_mem"] is None
    assert data["hardware_sources"]["nvme_gbps"].startswith("measured")


def test_cli_failing_bench_asks_for_the_figure(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "cuda_or_none", lambda: None)
    def broken(**kw):
        raise RuntimeError("no SIMD today")
    adam = _fake_bench("adam", broken)
    monkeypatch.setitem(sys.modules, "offload.bench.adam", adam)
    assert main(_local(tmp_path) + ["--nvme-bench", str(_bench_file(tmp_path))]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not measure CPU Adam" in err[0] and "--adam-params-per-s" in err[0]


def _bench_file(tmp_path):
    path = tmp_path / "nvme.json"
    path.write_text(json.dumps({"results": {"fio": {"read_gbps": 9.0, "write_gbps": 9.0},
                                            "offload": {"read_gbps": 1.2, "write_gbps": 2.0}}}))
    return path


def test_cli_reads_saved_bench_files(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "cuda_or_none", lambda: None)
    adam = tmp_path / "adam.json"
    adam.write_text(json.dumps({"results": {"offload": {"params_per_s": 1.7e9}}}))
    argv = _local(tmp_path) + ["--nvme-bench", str(_bench_file(tmp_path)), "--adam-bench", str(adam),
                               "--json", "-"]
    assert main(argv) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert (hw["nvme_read_gbps"], hw["nvme_write_gbps"], hw["adam_params_per_s"]) == (1.2, 2.0, 1.7e9)


def test_lora_plan_costs_frozen_weights_their_parameters_only():
    full = plan("100b", box())
    lora = plan("100b", box(), Policy(lora_rank=16))
    b = lora.breakdown
    # q_proj and v_proj of 90 layers: A (16 x 10240) and B (out x 16) each.
    assert b["trainable_params"] == 90 * 16 * ((10240 + 10240) + (10240 + 1024))
    assert b["frozen_chunks"] > 0 and lora.params == full.params + b["trainable_params"]
    k = b["state_by_kind"]
    assert k["params"] == 2 * (lora.params + b["padding_elements"])         # every chunk's parameters
    assert k["exp_avg"] == k["master"] == 4 * (k["grads"] // 4) < 4 * 10 ** 8   # adapters' chunks only
    assert lora.nvme_bytes_needed < full.nvme_bytes_needed / 7
    assert lora.step_terms_s["adam"] < full.step_terms_s["adam"] / 1000
    assert lora.step_terms_s["compute"] < full.step_terms_s["compute"]      # no weight gradients
    assert lora.bytes_per_step["pcie_d2h"] < full.bytes_per_step["pcie_d2h"] / 1000
    with pytest.raises(ConfigError, match="lora_targets"):
        Policy(lora_rank=8, lora_targets=("qkv",))
    with pytest.raises(ConfigError, match="lora_rank"):
        Policy(lora_rank=0)
