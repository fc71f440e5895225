"""The planner's arithmetic and the `offload plan` command (explicit figures: nothing measured)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from offload import planner_cli
from offload.cli import main
from offload.errors import ConfigError
from offload.models import PRESETS, param_count
from offload.planner import Hardware, Policy, plan

N100 = param_count(PRESETS["100b"])
H100_BOX = dict(gpu_mem=80 << 30, cpu_mem=512 << 30, nvme_capacity=8 << 40, nvme_read_gbps=25.0,
                nvme_write_gbps=25.0, pcie_gbps=25.0, compute_tflops=400.0, adam_params_per_s=4e9,
                nvme_where="/mnt/nvme0")
CLI_100B = ["plan", "--model", "llama-100b", "--gpu-mem", "80G", "--cpu-mem", "512G",
            "--nvme-capacity", "8T", "--nvme-gbps", "25", "--gpu-tflops", "400"]


def box(**changes) -> Hardware:
    return Hardware(**{**H100_BOX, **changes})


def test_100b_state_is_about_1_4_tb():
    p = plan("llama-100b", box(cpu_mem=32 << 30))
    assert p.params == N100
    assert p.breakdown["state_bytes"] == 14 * N100
    assert 1.35e12 < p.nvme_bytes_needed < 1.42e12          # nearly all of it, RAM being small
    assert p.fits, p.reason


def test_cpu_keeps_what_fits_in_priority_order():
    p = plan("100b", box())
    cpu, nvme = p.tiers["cpu"], p.tiers["nvme"]
    assert cpu["params"] == 2 * N100 and nvme["params"] == 0       # compute params first
    assert cpu["master"] > 0 and nvme["master"] > 0                # then master, split
    assert cpu["exp_avg"] == 0 and nvme["exp_avg_sq"] == 4 * N100
    assert cpu["bytes"] <= p.breakdown["cpu_budget"]
    assert cpu["bytes"] + nvme["bytes"] + p.tiers["device"]["params"] >= 14 * N100
    for tier in p.tiers.values():
        assert tier["bytes"] == sum(v for k, v in tier.items() if k != "bytes")


def test_bytes_per_step_match_design_numbers():
    """All state on NVMe: read 12 B + 2x2 B, write 14 B per param; PCIe 2x2 B in, 2 B out."""
    staging = plan("100b", box()).tiers["cpu"]["staging"]
    p = plan("100b", box(), Policy(cpu_budget=staging))
    b = p.bytes_per_step
    assert p.tiers["cpu"]["bytes"] == staging
    assert b["nvme_read"] == 12 * N100 + 4 * N100
    assert b["nvme_write"] == 14 * N100
    assert 2.5e12 < 12 * N100 + b["nvme_write"] < 2.7e12             # DESIGN: "about 2.6 TB"
    assert b["pcie_h2d"] == 4 * N100 and b["pcie_d2h"] == 2 * N100
    t = p.step_terms_s
    assert t["nvme"] == pytest.approx(16 * N100 / 25e9 + 14 * N100 / 25e9)
    assert t["pcie"] == pytest.approx(4 * N100 / 25e9)               # full duplex: the larger way
    assert t["adam"] == pytest.approx(N100 / 4e9)
    assert p.predicted_step_s == max(t.values())


def test_small_model_stays_resident_on_the_gpu():
    p = plan("7b", box())
    n = param_count(PRESETS["7b"])
    assert p.breakdown["params_resident_on_device"]
    assert p.tiers["device"]["params"] == 2 * n
    assert p.bytes_per_step["pcie_h2d"] == 2 * n                    # uploaded once after the step
    assert p.bytes_per_step["nvme_read"] == 0 and p.nvme_bytes_needed == 0


@pytest.mark.parametrize("changes,expected", [
    ({}, "nvme"),
    ({"nvme_read_gbps": 1000.0, "nvme_write_gbps": 1000.0, "adam_params_per_s": 1e12}, "compute"),
    ({"nvme_read_gbps": 1000.0, "nvme_write_gbps": 1000.0, "pcie_gbps": 1.0}, "pcie"),
    ({"nvme_read_gbps": 1000.0, "nvme_write_gbps": 1000.0, "adam_params_per_s": 1e8}, "adam"),
])
def test_bottleneck_follows_the_figures(changes, expected):
    assert plan("100b", box(**changes)).bottleneck == expected


def test_gpu_bound_batch_is_where_compute_takes_over():
    hw = box(gpu_mem=1 << 40)                      # room for any activations
    p = plan("100b", hw)
    b = p.gpu_bound_batch_tokens
    assert p.bottleneck == "nvme" and b % 4096 == 0
    assert plan("100b", hw, Policy(batch_tokens=b)).bottleneck == "compute"
    assert plan("100b", hw, Policy(batch_tokens=b - 4096)).bottleneck != "compute"
    assert plan("100b", hw, Policy(batch_tokens=b)).gpu_bound_batch_tokens is None


def test_activations_limit_the_batch():
    p = plan("100b", box())
    assert 0 < p.max_batch_tokens < p.gpu_bound_batch_tokens
    assert p.fits
    refused = plan("100b", box(), Policy(batch_tokens=p.max_batch_tokens + 4096))
    assert not refused.fits and "GPU needs" in refused.reason and "tokens/step fit" in refused.reason
    assert plan("100b", box(), Policy(batch_tokens=p.max_batch_tokens)).fits


def test_refuses_a_small_disk_with_the_numbers():
    p = plan("100b", box(nvme_capacity=500 * 10**9))
    assert not p.fits
    assert "NVMe needs 930 GB, 500 GB free at /mnt/nvme0" == p.reason
    p = plan("100b", box(nvme_capacity=0, nvme_read_gbps=0.0, nvme_write_gbps=0.0))
    assert not p.fits and "no NVMe tier" in p.reason


def test_nvme_bandwidth_is_required_when_used():
    with pytest.raises(ConfigError) as info:
        plan("100b", box(nvme_read_gbps=0.0))
    assert info.value.field == "nvme_gbps"


def test_cpu_only_compute_and_adam_add_up():
    hw = Hardware(gpu_mem=None, cpu_mem=24 << 30, nvme_capacity=100 << 30, nvme_read_gbps=1.5,
                  nvme_write_gbps=2.5, pcie_gbps=0.0, compute_tflops=0.2, adam_params_per_s=1.5e9)
    p = plan("small", hw, Policy(batch_tokens=4096))
    t = p.step_terms_s
    assert p.bytes_per_step["pcie_h2d"] == 0 and t["pcie"] == 0
    assert p.nvme_bytes_needed == 0                                   # 24 GB of RAM holds 24M params
    assert p.predicted_step_s == pytest.approx(t["compute"] + t["adam"])
    # a model whose state is several times the CPU budget spills to NVMe and pays for it
    p = plan("1b", hw, Policy(batch_tokens=2048, cpu_budget=4 << 30))
    assert p.fits, p.reason
    assert p.nvme_bytes_needed > 10e9 and p.bytes_per_step["nvme_read"] > p.nvme_bytes_needed
    assert p.tiers["device"]["bytes"] + p.tiers["cpu"]["bytes"] <= 4 << 30


def test_fp32_state_is_12_bytes_per_param():
    p = plan("1b", box(), Policy(dtype="fp32"))
    assert p.breakdown["state_bytes"] == 12 * param_count(PRESETS["1b"])


def test_defer_step_holds_gradients():
    staging = plan("100b", box()).tiers["cpu"]["staging"]
    p = plan("100b", box(), Policy(defer_step=True, cpu_budget=staging))
    assert p.tiers["nvme"]["grads"] == 2 * N100
    assert p.bytes_per_step["nvme_write"] == 16 * N100


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
                 "NVMe space needed: 930 GB", "NVMe read", "PCIe H2D", "predicted step time",
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
    assert "refused: NVMe needs 930 GB, 500 GB free" in err


@pytest.mark.parametrize("bad", [["--gpu-mem", "80X"], ["--batch-tokens", "-5"], ["--nvme-gbps", "0"],
                                 ["--model", "llama-3b"]])
def test_cli_bad_value_is_one_line(capsys, bad):
    argv = list(CLI_100B)
    i = argv.index(bad[0]) if bad[0] in argv else len(argv)
    argv[i:i + 2] = bad
    assert main(argv) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("offload: error:"), captured.err
    assert "Traceback" not in captured.err


def test_cli_describing_needs_cpu_mem(capsys):
    argv = [a for a in CLI_100B if a not in ("--cpu-mem", "512G")]
    assert main(argv) == 1
    assert "--cpu-mem is needed" in capsys.readouterr().err


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
    monkeypatch.setattr(planner_cli, "_cuda", lambda: None)
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
    monkeypatch.setattr(planner_cli, "_cuda", lambda: None)
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
    monkeypatch.setattr(planner_cli, "_cuda", lambda: None)
    adam = tmp_path / "adam.json"
    adam.write_text(json.dumps({"results": {"offload": {"params_per_s": 1.7e9}}}))
    argv = _local(tmp_path) + ["--nvme-bench", str(_bench_file(tmp_path)), "--adam-bench", str(adam),
                               "--json", "-"]
    assert main(argv) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert (hw["nvme_read_gbps"], hw["nvme_write_gbps"], hw["adam_params_per_s"]) == (1.2, 2.0, 1.7e9)
