"""The planner counts the optimizer state's bytes by its precision (issue 29): 8-bit or bf16 moments
and a bf16 master shrink what sits on NVMe and what a step moves there, the fp32 plan stays what
it was to the byte, and ``offload plan --state/--master`` says what the choice buys."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.cli import main
from offload.errors import ConfigError
from offload.plan import Hardware, Policy, choose, plan
from offload.plan.precision import QUANT_BLOCK, master_bytes, moment_bytes, state_per_elem

BOX_100B = Hardware(gpu_mem=80 << 30, cpu_mem=512 << 30, nvme_capacity=8 << 40, nvme_read_gbps=25,
                    nvme_write_gbps=25, pcie_gbps=25, compute_tflops=400, adam_params_per_s=4e9)
CLI_100B = ["plan", "--model", "llama-100b", "--gpu-mem", "80G", "--cpu-mem", "512G",
            "--nvme-capacity", "8T", "--nvme-gbps", "25", "--gpu-tflops", "400"]


def test_bytes_per_element_are_the_contracts():
    assert moment_bytes("fp32") == 4 and moment_bytes("bf16") == 2
    assert moment_bytes("8bit") == 1 + 4 / 256
    assert master_bytes("fp32", "bf16") == 4 and master_bytes("fp32", "fp32") == 0
    # a bf16 master under bf16 compute is the parameter chunk itself; under fp16 a chunk of its own
    assert master_bytes("bf16", "bf16") == 0 and master_bytes("bf16", "fp16") == 2
    with pytest.raises(ConfigError, match="master"):
        master_bytes("bf16", "fp32")
    assert sum(state_per_elem("bf16", 2, "fp32", "fp32").values()) == 18


def test_quant_block_is_the_kernels():
    from offload.optim.quantized import BLOCK_SIZE

    assert QUANT_BLOCK == BLOCK_SIZE


def test_fp32_plan_of_the_100b_headline_is_unchanged():
    """The figures of issue 29's headline before the precision choice existed (commit 4abf8c0)."""
    p = plan("100b", BOX_100B, Policy(batch_tokens=2048, seq_len=256))
    assert p.bytes_per_step == {"nvme_read": 1146643599360, "nvme_write": 1146643599360,
                                "pcie_h2d": 364371140608, "pcie_d2h": 402778578944}
    assert p.nvme_bytes_needed == 1812503605248
    assert p.tiers["nvme"]["master"] == 341086441472 and p.tiers["nvme"]["exp_avg"] == 402778578944
    assert p.step_terms_s["nvme"] == pytest.approx(91.7314879488, rel=1e-12)
    assert p.predicted_step_s == pytest.approx(91.7314879488, rel=1e-12)
    assert p.breakdown["state_bytes_per_param"] == 18


def test_8bit_moments_halve_the_100b_nvme_term():
    """Issue 29's acceptance: `--state 8bit` predicts an NVMe term at most half the fp32 plan's."""
    base = choose("100b", BOX_100B, Policy(batch_tokens=2048, seq_len=256)).best
    small = choose("100b", BOX_100B, Policy(batch_tokens=2048, seq_len=256, optimizer_state="8bit")).best
    assert base.step_terms_s["nvme"] == pytest.approx(91.73, abs=0.01)
    assert small.fits and small.step_terms_s["nvme"] <= base.step_terms_s["nvme"] / 2
    # each moment: a byte per trainable element on NVMe; its 4-byte scale per 256 elements is held
    # in host memory (the engine keeps the scale kinds there: no NVMe slots, no traffic)
    n = small.breakdown["trainable_params"]
    kinds = small.breakdown["state_by_kind"]
    assert kinds["exp_avg"] >= n and kinds["exp_avg"] < base.breakdown["state_by_kind"]["exp_avg"] / 3.9
    assert kinds["scales"] >= n * 2 * 4 / 256 and small.tiers["cpu"]["scales"] == kinds["scales"]
    assert "scales" not in small.tiers["nvme"]
    assert small.nvme_bytes_needed == small.breakdown["state_bytes"] - kinds["scales"]


def test_8bit_cpu_minimum_counts_every_chunks_scales_held_in_ram():
    """The engine keeps the 8-bit block scales in host memory: the CPU minimum is one chunk's update
    plus every chunk's scales, and a refusal says so."""
    hw = Hardware(gpu_mem=None, cpu_mem=64 << 30, nvme_capacity=1 << 40, nvme_read_gbps=3, nvme_write_gbps=2,
                  compute_tflops=1, adam_params_per_s=1e9)
    pol = dict(batch_tokens=2048, device_budget=32 << 20, chunk_size=1 << 18, optimizer_state="8bit", master="bf16")
    ok = plan("small", hw, Policy(**pol, cpu_budget=64 << 20))
    scales = ok.breakdown["state_by_kind"]["scales"]
    trained = ok.breakdown["state_by_kind"]["grads"] // 4        # trainable chunks' elements, padding included
    assert trained * 8 / QUANT_BLOCK <= scales <= trained * 8 / QUANT_BLOCK + 1
    assert ok.breakdown["cpu_min_bytes"] > scales
    low = plan("small", hw, Policy(**pol, cpu_budget=ok.breakdown["cpu_min_bytes"] - 1))
    assert not low.fits and "8-bit block scales of every chunk, held in RAM" in low.reason


PRECISIONS = [("fp32", "fp32"), ("bf16", "fp32"), ("8bit", "fp32"), ("bf16", "bf16"), ("8bit", "bf16")]


@settings(max_examples=25, deadline=None)
@given(model=st.sampled_from(["tiny", "small", "1b"]), dtype=st.sampled_from(["bf16", "fp16"]),
       cpu_gib=st.integers(1, 64), world=st.sampled_from([1, 2, 4]))
def test_fewer_state_bytes_never_cost_nvme_space_or_traffic(model, dtype, cpu_gib, world):
    hw = Hardware(gpu_mem=24 << 30, cpu_mem=cpu_gib << 30, nvme_capacity=1 << 40, nvme_read_gbps=3,
                  nvme_write_gbps=2, compute_tflops=100, adam_params_per_s=1e9)
    plans = [plan(model, hw, Policy(batch_tokens=1024 * world, seq_len=256, dtype=dtype, world=world,
                                    local_world=world, chunk_size=1 << 20, optimizer_state=s, master=m))
             for s, m in PRECISIONS]
    per = [sum(p.breakdown["bytes_per_elem"].values()) for p in plans]
    for (s, m), p in zip(PRECISIONS, plans):
        n = p.breakdown["rank_elements"]
        expect = 2 * moment_bytes(s) + master_bytes(m, dtype)
        kinds = p.breakdown["state_by_kind"]
        trained = kinds["grads"] // 4
        assert trained <= n
        stored = kinds["exp_avg"] + kinds["exp_avg_sq"] + kinds["master"] + kinds.get("scales", 0)
        assert stored <= expect * trained + 4   # each kind rounded up
        assert stored >= expect * trained
    # each step of the list stores no more per element, and so needs no more NVMe space or traffic
    order = [(0, 1), (1, 2), (1, 3), (2, 4), (3, 4)]
    for a, b in order:
        assert per[b] <= per[a]
        assert plans[b].nvme_bytes_needed <= plans[a].nvme_bytes_needed
        moved = lambda p: p.bytes_per_step["nvme_read"] + p.bytes_per_step["nvme_write"]  # noqa: E731
        assert moved(plans[b]) <= moved(plans[a])


def test_policy_refuses_a_bf16_master_under_fp32_compute():
    with pytest.raises(ConfigError, match="master"):
        Policy(dtype="fp32", master="bf16")
    with pytest.raises(ConfigError, match="optimizer_state"):
        Policy(optimizer_state="4bit")


def test_cli_state_says_what_it_buys_against_fp32(capsys):
    assert main(CLI_100B + ["--state", "8bit", "--master", "bf16", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    vs = data["versus_fp32"]
    assert vs["fp32_nvme_s"] == pytest.approx(91.73, abs=0.01) and vs["nvme_s"] < vs["fp32_nvme_s"] / 2
    assert vs["state_bytes_per_param"] == pytest.approx(2 + 4 + 2 * (1 + 4 / 256))
    assert main(CLI_100B + ["--state", "8bit"]) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("versus fp32 state")]
    assert len(line) == 1 and "instead of 91.73 s" in line[0] and "8-bit moments" in line[0]
    assert main(CLI_100B) == 0
    assert "versus fp32" not in capsys.readouterr().out


def test_cli_errors_name_the_precision_flags(capsys):
    assert main(CLI_100B + ["--dtype", "fp32", "--master", "bf16"]) != 0
    err = capsys.readouterr().err
    assert "--master" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        main(CLI_100B + ["--state", "4bit"])
    assert exit_info.value.code == 2
    assert "argument --state" in capsys.readouterr().err
