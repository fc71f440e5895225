"""The planner under data parallelism (``Policy.world`` / ``local_world``): the plan is one rank's —
1/world of the chunks' state and Adam, 1/world of the step's tokens, 1/local_world of the box's
RAM, NVMe and CPU — and a world of one is the single-process plan exactly."""

from __future__ import annotations

import dataclasses

import pytest

from offload.cli import main
from offload.errors import ConfigError
from offload.plan import Hardware, Policy, plan
from offload.plan import cli as plan_cli
from offload.plan.inputs import rank_share

BOX = dict(gpu_mem=80 << 30, cpu_mem=1 << 40, nvme_capacity=32 << 40, nvme_read_gbps=25.0,
           nvme_write_gbps=25.0, pcie_gbps=25.0, compute_tflops=400.0, adam_params_per_s=4e9,
           nvme_where="/mnt/nvme")


def test_a_world_of_one_is_the_single_process_plan():
    hw = Hardware(**BOX)
    alone = plan("70b", hw, Policy(batch_tokens=16384, seq_len=4096)).to_json_dict()
    one = plan("70b", hw, Policy(batch_tokens=16384, seq_len=4096, world=1, local_world=1)).to_json_dict()
    assert alone == one
    assert alone["breakdown"]["collective_bytes"] == {"all_gather": 0, "reduce_scatter": 0}


def test_a_rank_holds_its_share_of_the_state_and_the_box():
    hw = Hardware(**BOX)
    policy = Policy(batch_tokens=65536, seq_len=4096, cpu_budget=64 << 30, device_budget=40 << 30)
    one = plan("70b", hw, policy)
    eight = plan("70b", hw, dataclasses.replace(policy, world=8, local_world=8))
    b1, b8 = one.breakdown, eight.breakdown
    assert b8["num_chunks"] == b1["num_chunks"] and b8["chunk_size"] == b1["chunk_size"]  # one layout
    assert b8["owned_chunks"] == -(-b1["num_chunks"] // 8)
    # a rank's state, NVMe slots and Adam work: about 1/8 (the rank owning the most is planned)
    assert 1 / 8 <= b8["state_bytes"] / b1["state_bytes"] < 1 / 8 * 1.15
    assert 1 / 8 <= eight.nvme_bytes_needed / one.nvme_bytes_needed < 1 / 8 * 1.15
    # ... each with 1/8 of the CPU's Adam rate: the Adam term stays about the same
    assert eight.step_terms_s["adam"] == pytest.approx(one.step_terms_s["adam"], rel=0.15)
    # each rank computes 1/8 of the tokens on a GPU of its own
    assert b8["rank_tokens"] == 65536 // 8
    assert eight.step_terms_s["compute"] == pytest.approx(one.step_terms_s["compute"] / 8)
    # parameters cross PCIe only for the owned chunks; the rest arrive by all-gather
    assert eight.bytes_per_step["pcie_h2d"] < one.bytes_per_step["pcie_h2d"] / 7
    assert b8["collective_bytes"]["all_gather"] > 0 and b8["collective_bytes"]["reduce_scatter"] > 0
    assert b8["rank_hardware"]["cpu_mem"] == BOX["cpu_mem"] // 8
    assert eight.hardware["cpu_mem"] == BOX["cpu_mem"]             # the box as described
    assert "one rank of 8, 8 on this box" in eight.reason


def test_ranks_on_one_box_split_its_ram_nvme_and_cpu():
    hw = Hardware(**BOX)
    share = rank_share(hw, 4)
    assert share.cpu_mem == BOX["cpu_mem"] // 4 and share.nvme_capacity == BOX["nvme_capacity"] // 4
    assert share.nvme_read_gbps == 25.0 / 4 and share.adam_params_per_s == 1e9
    assert share.gpu_mem == hw.gpu_mem and share.compute_tflops == 400.0     # a GPU per rank
    cpu_only = rank_share(dataclasses.replace(hw, gpu_mem=None, pcie_gbps=0.0, compute_tflops=0.2), 2)
    assert cpu_only.compute_tflops == 0.1                                    # the cores are shared
    # The "auto" budgets come from the rank's share of the RAM: 8 ranks on one box fit where
    # 8 single-process plans would each take half of it.
    p = plan("tiny", dataclasses.replace(hw, gpu_mem=None, pcie_gbps=0.0, compute_tflops=0.2),
             Policy(batch_tokens=512, seq_len=64, world=8, local_world=8))
    assert p.breakdown["device_budget"] + p.breakdown["cpu_budget"] <= BOX["cpu_mem"] // 8


def test_more_ranks_than_the_nvme_holds_is_refused():
    hw = Hardware(**{**BOX, "nvme_capacity": 1 << 40, "cpu_mem": 256 << 30})
    policy = Policy(batch_tokens=16384, seq_len=4096)
    assert plan("100b", hw, dataclasses.replace(policy, world=4, local_world=2)).fits
    refused = plan("100b", hw, dataclasses.replace(policy, world=2, local_world=2))
    assert not refused.fits and "NVMe needs" in refused.reason and "one rank of 2" in refused.reason


def test_the_device_minimum_grows_with_the_gathered_groups():
    """Under N ranks a chunk in use brings its group of N: the engine's minimum device budget
    (``min_device_bytes_sharded``) holds the gathered and reducing groups, and the plan refuses a
    device budget below it."""
    hw = Hardware(**BOX)
    policy = Policy(batch_tokens=65536, seq_len=4096)
    mins = [plan("70b", hw, dataclasses.replace(policy, world=w, local_world=min(w, 8))).breakdown["device_min_bytes"]
            for w in (1, 2, 16)]
    assert mins[0] < mins[1] < mins[2]
    assert plan("70b", hw, dataclasses.replace(policy, world=16, local_world=8)).fits
    big = plan("70b", hw, dataclasses.replace(policy, batch_tokens=32 * 4096, world=32, local_world=8))
    assert not big.fits and "device budget" in big.reason and "group of 32" in big.reason


@pytest.mark.parametrize("fields, match", [
    ({"world": 0}, "world"),
    ({"world": 2, "local_world": 3}, "local_world.*more than world=2"),
    ({"world": 3, "batch_tokens": 1024}, "batch_tokens.*evenly over world=3"),
    ({"world": True}, "world"),
])
def test_bad_world_is_a_config_error(fields, match):
    with pytest.raises(ConfigError, match=match):
        Policy(**fields)


def test_plan_command_takes_the_world(capsys):
    args = ["plan", "--model", "70b", "--gpu-mem", "80G", "--cpu-mem", "1T", "--nvme-capacity", "32T",
            "--nvme-gbps", "25", "--gpu-tflops", "400", "--batch-tokens", "65536", "--seq-len", "4096"]
    assert main(args + ["--world", "4", "--local-world", "4"]) == 0
    out = capsys.readouterr().out
    assert "data parallel: 4 ranks, 4 on this box" in out and "this rank's" in out
    assert main(args + ["--world", "2", "--local-world", "4"]) == 1
    assert "--local-world=4" in capsys.readouterr().err
    assert plan_cli._ranks(type("A", (), {"world": 4, "local_world": None})()) == {"world": 4, "local_world": 4}
