"""The planner's ways to a batch: activations on the GPU, parked activations (RAM, NVMe), gradient
accumulation with parameters re-streamed per micro-batch, and mixes; the fastest that fits wins."""

from __future__ import annotations

import dataclasses
import json

import pytest

from offload.cli import main
from offload.errors import ConfigError
from offload.models import PRESETS
from offload.plan import Hardware, Policy, plan
from offload.plan.activations import ACT_WINDOW_LAYERS
from offload.plan.choice import choose, family_of

H100_BOX = dict(gpu_mem=80 << 30, cpu_mem=512 << 30, nvme_capacity=8 << 40, nvme_read_gbps=25.0,
                nvme_write_gbps=25.0, pcie_gbps=25.0, compute_tflops=400.0, adam_params_per_s=4e9)
CLI_100B = ["plan", "--model", "llama-100b", "--gpu-mem", "80G", "--cpu-mem", "512G",
            "--nvme-capacity", "8T", "--nvme-gbps", "25", "--gpu-tflops", "400"]
CFG = PRESETS["100b"]
TOKENS = 53248        # where compute catches up with the NVMe traffic on that box


def box(**changes) -> Hardware:
    return Hardware(**{**H100_BOX, **changes})


def test_the_100b_batch_that_needs_accumulation_today_fits_with_parked_activations():
    today = plan("100b", box(), Policy(batch_tokens=TOKENS))
    assert not today.fits and "GPU needs" in today.reason
    c = choose("100b", box(), Policy(batch_tokens=TOKENS))
    assert c.best is not None and c.best.fits and c.best.bottleneck in ("compute", "nvme")
    assert c.best.policy["activation_offload"] != "none"
    # faster than every fitting way that keeps the activations on the GPU
    for fam in ("accumulate", "mix"):
        assert c.families[fam].predicted_step_s > c.best.predicted_step_s
    assert c.best.predicted_step_s <= 1.05 * max(c.best.step_terms_s["compute"], c.best.step_terms_s["nvme"])


def test_parking_moves_the_layer_inputs_over_pcie_both_ways():
    hw = box()
    on_gpu = plan("100b", hw, Policy(batch_tokens=8192))
    parked = plan("100b", hw, Policy(batch_tokens=8192, activation_offload="cpu"))
    inputs = CFG.num_layers * CFG.hidden_size * 2 * 8192
    assert parked.bytes_per_step["pcie_h2d"] - on_gpu.bytes_per_step["pcie_h2d"] == inputs
    assert parked.bytes_per_step["pcie_d2h"] - on_gpu.bytes_per_step["pcie_d2h"] == inputs
    window = ACT_WINDOW_LAYERS * CFG.hidden_size * 2 * 8192
    assert on_gpu.tiers["device"]["activations"] - parked.tiers["device"]["activations"] == inputs - window
    assert parked.tiers["cpu"]["activations"] == inputs and parked.tiers["nvme"]["activations"] == 0
    assert parked.bytes_per_step["nvme_read"] == on_gpu.bytes_per_step["nvme_read"]


def test_parking_spills_to_nvme_what_ram_cannot_hold():
    hw = box(cpu_mem=300 << 30)
    cpu = plan("100b", hw, Policy(batch_tokens=TOKENS, activation_offload="cpu"))
    assert not cpu.fits and "activation area" in cpu.reason
    nvme = plan("100b", hw, Policy(batch_tokens=TOKENS, activation_offload="nvme"))
    placed = nvme.breakdown["activation_placement"]
    assert placed["spill_bytes"] > 0 and placed["area_bytes"] + placed["spill_bytes"] == placed["host_bytes"]
    on_gpu = plan("100b", hw, Policy(batch_tokens=TOKENS))
    assert nvme.nvme_bytes_needed == nvme.breakdown["state_bytes"] + placed["spill_bytes"]
    for way in ("nvme_read", "nvme_write"):     # out to the drives and back once per step
        assert nvme.bytes_per_step[way] - on_gpu.bytes_per_step[way] == placed["spill_bytes"]


def test_accumulation_streams_parameters_again_for_every_micro_batch():
    hw = box()
    one = plan("100b", hw, Policy(batch_tokens=16384, seq_len=4096))
    four = plan("100b", hw, Policy(batch_tokens=16384, seq_len=4096, micro_batches=4))
    assert four.breakdown["micro_batch_tokens"] == 4096
    assert four.step_terms_s["compute"] == pytest.approx(one.step_terms_s["compute"])
    h2d_bwd = one.breakdown["device_cpu_copy_bytes"]["h2d"] - one.breakdown["state_by_kind"]["params"]
    grads = one.bytes_per_step["pcie_d2h"]
    assert four.bytes_per_step["pcie_d2h"] == 4 * grads
    assert four.bytes_per_step["pcie_h2d"] == one.bytes_per_step["pcie_h2d"] + 3 * 2 * h2d_bwd + 3 * grads
    # fp32 gradients are held whole between micro-batches: what RAM cannot keep goes to NVMe and back
    assert four.tiers["nvme"]["grads"] > 0
    assert four.bytes_per_step["nvme_write"] > one.bytes_per_step["nvme_write"]
    # the update overlaps only the last micro-batch: the step is longer than its slowest term
    assert four.predicted_step_s > max(four.step_terms_s.values())


def test_one_micro_batch_on_the_gpu_is_todays_plan():
    for tokens in (4096, 8192, 20480):
        a = plan("100b", box(), Policy(batch_tokens=tokens))
        b = plan("100b", box(), Policy(batch_tokens=tokens, micro_batches=1, activation_offload="none"))
        assert a.to_json_dict() == b.to_json_dict()


def test_where_the_gpu_holds_the_batch_nothing_changes():
    c = choose("100b", box(), Policy(batch_tokens=8192))
    assert c.best.to_json_dict() == c.given.to_json_dict()


def test_cpu_only_boxes_keep_activations_in_ram():
    hw = box(gpu_mem=None, compute_tflops=1.0)
    c = choose("small", hw, Policy(batch_tokens=2048, seq_len=256))
    assert {p.policy["activation_offload"] for p in c.families.values()} == {"none"}
    refused = plan("small", hw, Policy(batch_tokens=2048, seq_len=256, activation_offload="cpu"))
    assert not refused.fits and "computes in RAM" in refused.reason


def test_nvme_parking_needs_an_nvme_tier():
    p = plan("7b", box(nvme_capacity=0, nvme_read_gbps=0, nvme_write_gbps=0),
             Policy(batch_tokens=8192, activation_offload="nvme"))
    assert not p.fits and "NVMe tier" in p.reason


@pytest.mark.parametrize("kw, field", [
    ({"micro_batches": 0}, "micro_batches"),
    ({"micro_batches": True}, "micro_batches"),
    ({"micro_batches": 10, "batch_tokens": 8}, "micro_batches"),
    ({"activation_offload": "disk"}, "activation_offload"),
    ({"activation_offload": "cpu", "activation_checkpointing": False}, "activation_offload"),
])
def test_bad_policies_name_the_field(kw, field):
    with pytest.raises(ConfigError) as info:
        Policy(**kw)
    assert info.value.field == field


def test_cli_prints_the_choice_and_the_other_ways(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    assert main(CLI_100B + ["--batch-tokens", str(TOKENS), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for text in ("ways to 53248 tokens/step", "activations on the GPU", "offloaded activations",
                 "gradient accumulation", "<- chosen", "refused: GPU needs", "verdict: fits",
                 "activations parked in RAM"):
        assert text in out, text
    data = json.loads(out_json.read_text())
    assert data["fits"] and data["ways"]["chosen"]["family"] == "offload"
    assert set(data["ways"]["ways"]) == {"gpu", "offload", "accumulate", "mix"}


def test_cli_fixed_way_is_planned_as_given(capsys):
    argv = CLI_100B + ["--batch-tokens", str(TOKENS), "--activation-offload", "none", "--micro-batches", "1"]
    assert main(argv) == 1
    assert "refused: GPU needs" in capsys.readouterr().err
    assert main(CLI_100B + ["--batch-tokens", str(TOKENS), "--activation-offload", "none"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches of" in out and "<- chosen" in out


def test_family_names_follow_the_policy():
    p = plan("7b", box(), Policy(batch_tokens=8192, micro_batches=2, activation_offload="cpu"))
    assert family_of(p) == "mix"
    assert family_of(plan("7b", box(), dataclasses.replace(Policy(batch_tokens=8192), micro_batches=2))) == "accumulate"
