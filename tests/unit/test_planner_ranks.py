"""The planner under data parallelism (``Policy.world`` / ``local_world``): the plan is one rank's —
a 1/world piece of every chunk's state and Adam work, 1/world of the step's tokens, 1/local_world of
the box's RAM, NVMe and CPU, whole chunks all-gathered and reduce-scattered through its link — and a
world of one is the single-process plan exactly."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.cli import main
from offload.errors import ConfigError
from offload.plan import Hardware, Policy, plan
from offload.plan import cli as plan_cli
from offload.plan.inputs import rank_share
from offload.plan.model import piece_elements
from offload.tiers.budgets import GATHERED_CHUNKS, REDUCING_CHUNKS, min_device_bytes, min_device_bytes_sharded

BOX = dict(gpu_mem=80 << 30, cpu_mem=1 << 40, nvme_capacity=32 << 40, nvme_read_gbps=25.0,
           nvme_write_gbps=25.0, pcie_gbps=25.0, compute_tflops=400.0, adam_params_per_s=4e9,
           nvme_where="/mnt/nvme")


def test_a_world_of_one_is_the_single_process_plan():
    hw = Hardware(**BOX)
    alone = plan("70b", hw, Policy(batch_tokens=16384, seq_len=4096)).to_json_dict()
    one = plan("70b", hw, Policy(batch_tokens=16384, seq_len=4096, world=1, local_world=1)).to_json_dict()
    assert alone == one
    assert alone["breakdown"]["collective_bytes"] == {"all_gather": 0, "reduce_scatter": 0}
    assert alone["step_terms_s"]["interconnect"] == 0.0


def test_a_rank_holds_its_share_of_the_state_and_the_box():
    hw = Hardware(**BOX)
    policy = Policy(batch_tokens=65536, seq_len=4096, cpu_budget=64 << 30, device_budget=40 << 30)
    one = plan("70b", hw, policy)
    eight = plan("70b", hw, dataclasses.replace(policy, world=8, local_world=8))
    b1, b8 = one.breakdown, eight.breakdown
    assert b8["num_chunks"] == b1["num_chunks"] and b8["chunk_size"] == b1["chunk_size"]  # one layout
    # a piece of every chunk: the state, NVMe slots and Adam work are 1/8 of one process's
    # (chunks are multiples of 2048 elements: 8 pieces need no padding)
    assert b8["rank_elements"] * 8 == one.params + b1["padding_elements"]
    assert b8["state_bytes"] * 8 == b1["state_bytes"]
    assert eight.nvme_bytes_needed * 8 == one.nvme_bytes_needed
    # ... each with 1/8 of the CPU's Adam rate: the Adam term stays the same
    assert eight.step_terms_s["adam"] == pytest.approx(one.step_terms_s["adam"])
    # each rank computes 1/8 of the tokens on a GPU of its own
    assert b8["rank_tokens"] == 65536 // 8
    assert eight.step_terms_s["compute"] == pytest.approx(one.step_terms_s["compute"] / 8)
    # parameters cross PCIe as the rank's pieces; the all-gather assembles what one process
    # uploaded, moving 7/8 of it through each rank's link, and the reduce-scatter 7/8 of the
    # gradients per micro-batch: bf16 as autograd made them in one micro-batch, else fp32
    assert eight.bytes_per_step["pcie_h2d"] == one.bytes_per_step["pcie_h2d"] // 8
    k = b8["micro_batches"]
    grads = b1["state_by_kind"]["grads"] * k // (2 if k == 1 else 1)
    assert b8["collective_bytes"] == {"all_gather": one.bytes_per_step["pcie_h2d"] * 7 // 8,
                                      "reduce_scatter": grads * 7 // 8}
    assert eight.step_terms_s["interconnect"] == pytest.approx(
        sum(b8["collective_bytes"].values()) / 25e9)
    assert b8["rank_hardware"]["cpu_mem"] == BOX["cpu_mem"] // 8
    assert eight.hardware["cpu_mem"] == BOX["cpu_mem"]             # the box as described
    assert "one rank of 8, 8 on this box" in eight.reason


@pytest.mark.parametrize("world", [3, 64, 512])
def test_every_rank_stores_and_updates_a_piece_of_every_chunk_the_oversized_embedding_too(world):
    """Adam work, NVMe space and CPU minimum per rank are 1/world of one process's whatever the
    chunk sizes: the 327.68 M-element embedding (and lm_head) are split like the rest, never one
    rank's alone."""
    hw = Hardware(**BOX)
    policy = Policy(batch_tokens=4096 * world, seq_len=4096)
    one, many = plan("100b", hw, policy), plan("100b", hw, dataclasses.replace(policy, world=world, local_world=1))
    n_chunks = one.breakdown["num_chunks"]
    # a piece is ceil(numel / world): at most one element of padding a chunk
    padding = n_chunks * one.breakdown["state_bytes_per_param"]
    assert 0 <= many.breakdown["state_bytes"] * world - one.breakdown["state_bytes"] <= padding * world
    assert many.breakdown["adam_params"] == pytest.approx(one.breakdown["adam_params"] / world, rel=1e-6)
    largest = one.breakdown["largest_chunk"]
    # Adam's set of the largest piece at 18 B an element, and the piece on its way up to the GPU (bf16)
    assert many.breakdown["cpu_min_bytes"] == (18 + 2) * piece_elements(largest, world)
    assert one.breakdown["cpu_min_bytes"] == (18 + 2) * largest


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


def test_the_device_minimum_is_the_same_at_any_number_of_ranks():
    """Under N ranks the device holds whole chunks, all-gathered and being reduce-scattered, never
    a group of N: the engine's minimum device budget (``min_device_bytes_sharded``) is one figure
    for every N > 1, and a device budget below it is refused."""
    hw = Hardware(**BOX)
    policy = Policy(batch_tokens=4096, seq_len=4096)
    plans = {w: plan("70b", hw, dataclasses.replace(policy, batch_tokens=4096 * w, world=w, local_world=min(w, 8)))
             for w in (2, 16, 32, 512)}
    mins = {w: p.breakdown["device_min_bytes"] for w, p in plans.items()}
    b = plans[2].breakdown
    assert set(mins.values()) == {min_device_bytes_sharded(b["chunk_size"], 2, b["largest_chunk"], 2)}
    assert all(p.fits for p in plans.values()), [p.reason for p in plans.values() if not p.fits]
    policy = dataclasses.replace(policy, batch_tokens=32 * 4096, world=32, local_world=8)
    tight = plan("70b", hw, dataclasses.replace(policy, device_budget=mins[32] - 1))
    assert not tight.fits and "device budget" in tight.reason and "under 32 ranks (as under any number)" in tight.reason
    assert plan("70b", hw, dataclasses.replace(policy, device_budget=mins[32])).fits


@settings(max_examples=300, deadline=None)
@given(chunk=st.integers(1, 1 << 14).map(lambda q: q * 2048), extra=st.integers(0, 1 << 20).map(lambda q: q * 2048),
       elem_bytes=st.sampled_from([2, 4]), data=st.data())
def test_the_sliced_minimum_is_one_figure_that_holds_the_working_set_at_every_world(chunk, extra, elem_bytes,
                                                                                    data):
    """For chunks as the layout makes them (multiples of 2048 elements) the minimum is the same at
    every world up to chunk / 16 ranks, and at every world it holds what the engine keeps there."""
    largest = chunk + extra
    world = data.draw(st.one_of(st.integers(2, max(2, chunk // 16)), st.integers(2, 1 << 17)))
    need = min_device_bytes_sharded(chunk, elem_bytes, largest, world)

    def padded(n: int) -> int:
        return world * piece_elements(n, world)
    # at this world: whole chunks padded to world pieces (gathered parameters, gradients being
    # filled and being reduced, one of each the oversized chunk) and the pieces in flight (two
    # gathers' inputs, two reductions' outputs)
    gathered = (padded(largest) + (GATHERED_CHUNKS - 1) * padded(chunk)) * elem_bytes
    filling = (padded(largest) + 2 * padded(chunk)) * 4
    reducing = (padded(largest) + (REDUCING_CHUNKS - 1) * padded(chunk)) * 4
    pieces = (piece_elements(largest, world) + piece_elements(chunk, world)) * (elem_bytes + 4)
    assert gathered + filling + reducing + pieces <= need
    if world <= chunk // 16:
        assert need == min_device_bytes_sharded(chunk, elem_bytes, largest, 2)
    # one process gathers and reduces nothing; what the ranks add is a bounded multiple, not N
    assert min_device_bytes_sharded(chunk, elem_bytes, largest, 1) == min_device_bytes(chunk, elem_bytes, largest)
    assert min_device_bytes_sharded(chunk, elem_bytes, largest, 2) < 2.5 * min_device_bytes(chunk, elem_bytes,
                                                                                            largest)


@settings(max_examples=12, deadline=None)
@given(world=st.integers(2, 4096))
def test_the_planned_device_minimum_does_not_depend_on_the_world(world):
    hw = Hardware(**BOX)
    p = plan("1b", hw, Policy(batch_tokens=256 * world, seq_len=256, world=world, local_world=1))
    two = plan("1b", hw, Policy(batch_tokens=512, seq_len=256, world=2, local_world=1))
    assert p.breakdown["device_min_bytes"] == two.breakdown["device_min_bytes"]
    assert p.breakdown["num_chunks"] == two.breakdown["num_chunks"]     # the layout does not depend on N


ISSUE_BOX = dict(gpu_mem=80 << 30, cpu_mem=512 << 30, nvme_capacity=8 << 40, nvme_read_gbps=25.0,
                 nvme_write_gbps=25.0, pcie_gbps=25.0, compute_tflops=400.0, adam_params_per_s=4e9,
                 nvme_where="/mnt/nvme")


def test_the_100b_plan_fits_at_64_and_512_ranks_bound_by_the_interconnect():
    """The issue's table: llama-100b, 4096 tokens a rank, 80 GB GPUs, boxes of 8 with 512 GB of
    RAM and 8 TiB of NVMe at 25 GB/s. The round-robin scheme needed 139 GB and 1.11 TB of device
    at 64 and 512 ranks; slices need the same few GB at every N, and then each rank's link carries
    the whole model's all-gathers and reduce-scatters: at 25 GB/s that, not compute, bounds the step
    (the NVMe and Adam work shrink with N)."""
    hw = Hardware(**ISSUE_BOX)
    plans = {n: plan("100b", hw, Policy(batch_tokens=4096 * n, seq_len=4096, world=n, local_world=min(n, 8)))
             for n in (1, 8, 64, 512)}
    assert all(p.fits for p in plans.values()), [p.reason for p in plans.values() if not p.fits]
    mins = {n: p.breakdown["device_min_bytes"] for n, p in plans.items()}
    assert mins[8] == mins[64] == mins[512] < 5e9 and mins[1] < mins[8]
    assert plans[1].bottleneck == plans[8].bottleneck == "nvme"
    assert plans[64].bottleneck == plans[512].bottleneck == "interconnect"
    for n in (64, 512):
        coll = plans[n].breakdown["collective_bytes"]
        # forward and backward all-gathers (less what the device keeps) and one bf16 reduce-scatter
        assert 0.75 * 3 * 200e9 < sum(coll.values()) < 3 * 200e9
        assert plans[n].step_terms_s["interconnect"] > 2 * plans[n].step_terms_s["compute"]
    # a faster fabric (NVLink-class, or 4 x 400 Gb/s NICs a GPU) leaves compute the bound
    fast = plan("100b", dataclasses.replace(hw, net_gbps=400.0),
                Policy(batch_tokens=4096 * 64, seq_len=4096, world=64, local_world=8))
    assert fast.fits and fast.bottleneck == "compute"


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
    assert "1/4 piece of each of the" in out
    assert "interconnect     25 GB/s a rank (bus)" in out and "assumed (a 200 Gb/s NIC per GPU)" in out
    assert main(args + ["--world", "4", "--net-gbps", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "interconnect     0.5 GB/s a rank (bus)" in out and "given" in out
    assert "bound by interconnect  <- chosen" in out
    assert main(args + ["--world", "2", "--local-world", "4"]) == 1
    assert "--local-world=4" in capsys.readouterr().err
    assert plan_cli._ranks(type("A", (), {"world": 4, "local_world": None})()) == {"world": 4, "local_world": 4}
