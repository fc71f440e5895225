"""The engine's side of 8-bit optimizer state, without an engine: precision (kinds, dtypes,
bytes), pieces of whole blocks under N ranks, and the update's grouping of runs into blocks,
whose fallback (runs sharing a block) is held to the fused kernel on the same values."""

from __future__ import annotations

import pytest
import torch

from offload.config import OffloadConfig
from offload.distributed.sharding import Sharding
from offload.engine.precision import StatePrecision
from offload.engine.quant_step import clusters, update_8bit, zero_code
from offload.engine.stepper import Hyper
from offload.errors import ConfigError
from offload.optim.quantized import BLOCK_SIZE, adam_step_8bit, dequantize, quantize


def test_kinds_and_bytes_per_precision():
    fp32 = StatePrecision.of(OffloadConfig(), torch.bfloat16)
    assert fp32.state_kinds() == {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    assert fp32.separate_master and fp32.state_bytes() == 12 and fp32.quantum == 1
    q = StatePrecision.of(OffloadConfig(optimizer_state="8bit", master="bf16"), torch.bfloat16)
    assert list(q.state_kinds()) == ["exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"]
    assert not q.separate_master                      # the bf16 parameters are the master
    assert q.state_bytes() == 2 * (1 + 4 / 256) and q.quantum == BLOCK_SIZE
    fp16 = StatePrecision.of(OffloadConfig(dtype="fp16", optimizer_state="8bit", master="bf16"), torch.float16)
    assert fp16.separate_master and fp16.master_dtype == torch.bfloat16
    # One chunk's update pinned together: at fp32 state exactly what the budgets always counted.
    assert fp32.update_bytes(4096) == 4096 * (4 + 4 + 4 + 4 + 2)
    assert q.update_bytes(4096) == 4096 * (4 + 2 + 1 + 1) + 2 * 16 * 4
    b16 = StatePrecision.of(OffloadConfig(optimizer_state="bf16"), torch.bfloat16)
    assert b16.state_kinds() == {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
    assert b16.state_bytes() == 4 + 4 and b16.quantum == 1
    assert StatePrecision.of(OffloadConfig(master="bf16"), torch.bfloat16).state_bytes() == 8
    with pytest.raises(ConfigError, match="master"):
        StatePrecision.of(OffloadConfig(dtype="fp16", master="bf16"), torch.float32)


@pytest.mark.parametrize("world", [2, 3, 5, 16])
def test_pieces_of_8bit_state_are_whole_blocks_and_tile_the_chunk(world):
    for numel in (2048, 6144, 2048 * 7):
        ranks = [Sharding(r, world, quantum=BLOCK_SIZE) for r in range(world)]
        spans = [s.span(numel) for s in ranks]
        assert all(lo % BLOCK_SIZE == 0 and hi % BLOCK_SIZE == 0 for lo, hi in spans)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] >= numel
    assert Sharding(0, 3).piece_numel(2048) == 683          # fp32 state: unchanged
    assert Sharding(0, 3, quantum=BLOCK_SIZE).piece_numel(2048) == 768


def test_runs_sharing_a_block_form_one_cluster():
    h = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
    runs = [(0, 300, h, 1), (320, 600, h, 2), (1024, 1100, h, 1)]
    assert [(a, b, len(rs)) for a, b, rs in clusters(runs, 2048)] == [(0, 768, 2), (1024, 1280, 1)]


def _state(n, gen):
    m, ma = quantize(torch.randn(n, generator=gen) * 1e-3, True)
    v, va = quantize(torch.rand(n, generator=gen) * 1e-6, False)
    return [m, v, ma, va]


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_fallback_for_a_block_shared_by_two_runs_matches_the_fused_kernel(master_dtype):
    """Two runs with the same hyper-parameters and step sharing blocks go through the fallback
    (dequantise, fp32 kernel, quantise): it must give what one fused call over the blocks gives,
    up to the fp32 kernel's and the 8-bit kernel's own roundings (they evaluate Adam in another
    order): within a few fp32 ulps of the moments, which then quantise to the same codes but
    where a value lies that close to a midpoint between two codes."""
    gen = torch.Generator().manual_seed(0)
    n = 1024
    master = (torch.randn(n, generator=gen) * 0.1).to(master_dtype)
    grad = torch.randn(n, generator=gen) * 1e-2
    h = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    members = [(None, 0, 300), (None, 300, 1024)]
    fused_state, fused_master = _state(n, torch.Generator().manual_seed(1)), master.clone()
    adam_step_8bit(fused_master, grad, fused_state[0], fused_state[2], fused_state[1], fused_state[3], lr=h.lr,
                   beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, step=3)
    split_state, split_master = _state(n, torch.Generator().manual_seed(1)), master.clone()
    # Two runs (different steps would not merge; the same step in two runs forces the fallback).
    update_8bit(split_master, grad, split_state, None, [(0, 300, h, 3), (300, 1024, h, 3)], members,
                index_base=0, grad_scale=1.0, threads=1)
    for got, want, signed in ((split_state[0], fused_state[0], True), (split_state[1], fused_state[1], False)):
        assert (got.int() - want.int()).abs().max() <= 1
        assert (got != want).float().mean() < 0.01
    scale = 2.0 ** -7 if master_dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(split_master.float(), fused_master.float(), rtol=scale, atol=1e-7)
    assert torch.equal(dequantize(split_state[1], split_state[3], False) >= 0, torch.ones(n, dtype=torch.bool))


def test_a_fresh_moment_chunk_holds_the_code_of_zero():
    for signed in (True, False):
        codes, absmax = quantize(torch.zeros(BLOCK_SIZE), signed)
        assert torch.all(codes == zero_code(signed)) and torch.all(absmax == 0)


def test_a_parameter_without_gradient_sharing_a_block_keeps_its_values():
    """One run [0, 300) beside a parameter [300, 1024) that got no gradient: the run's blocks are
    updated in fp32 and quantised again; the other parameter's master is untouched and its
    moments change only by the re-rounding under its blocks' new scales (at most one code step
    of the map: the widest gap, times the scale)."""
    gen = torch.Generator().manual_seed(0)
    n = 1024
    master = torch.randn(n, generator=gen) * 0.1
    grad = torch.randn(n, generator=gen) * 1e-2
    state = _state(n, torch.Generator().manual_seed(1))
    before_m = dequantize(state[0], state[2], True)
    h = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    new = master.clone()
    update_8bit(new, grad, state, None, [(0, 300, h, 1)], [(None, 0, 300), (None, 300, 1024)],
                index_base=0, grad_scale=1.0, threads=1)
    assert torch.equal(new[300:], master[300:])
    assert not torch.equal(new[:300], master[:300])
    after_m = dequantize(state[0], state[2], True)
    from offload.optim.quantized import qmap
    signed = qmap(True)
    gap = float((signed[1:] - signed[:-1]).max())
    scale = float(state[2].max().clamp(min=before_m.abs().max()))
    assert (after_m[512:] == before_m[512:]).all()          # blocks the run never touched: not requantised
    assert (after_m[300:512] - before_m[300:512]).abs().max() <= gap * scale


def test_block_scales_are_resident_and_counted_in_the_cpu_minimum():
    """The 8-bit moments' scale kinds are held in host memory throughout (no NVMe slots): the CPU
    budget must hold every chunk's scales beside one chunk's update, and a budget that holds only
    the update is refused naming the field and the scales."""
    from offload.engine.build import build_layout

    q = StatePrecision.of(OffloadConfig(dtype="bf16", optimizer_state="8bit", master="bf16"), torch.bfloat16)
    assert q.resident_kinds() == {"exp_avg_absmax", "exp_avg_sq_absmax"}
    assert q.resident_bytes([65536, 300]) == 2 * 4 * (256 + 2)
    assert StatePrecision.of(OffloadConfig(), torch.bfloat16).resident_kinds() == frozenset()
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(65536))) for i in range(64)]
    config = OffloadConfig(dtype="bf16", optimizer_state="8bit", master="bf16", chunk_size=65536)
    update, scales = q.update_bytes(65536), q.resident_bytes([65536] * 64)
    build_layout(named, {}, config, torch.bfloat16, 1 << 30, update + scales, None, q)
    with pytest.raises(ConfigError, match=r"cpu_budget.*block scales of every chunk"):
        build_layout(named, {}, config, torch.bfloat16, 1 << 30, update + scales - 1, None, q)


def test_a_chunk_without_an_nvme_slot_is_never_written_down(disk_tmp):
    """What keeps the scales in memory: a chunk registered without a slot is neither evicted to make
    room nor written back ahead of an eviction; the slotted chunks make the room instead."""
    from offload import AioConfig
    from offload.chunks import ChunkStore
    from offload.scheduler import LRUPolicy
    from offload.tiers import MemoryTier, NvmeTier

    n = 1024
    store = ChunkStore([MemoryTier("cpu", 3 * n * 4, aligned=True),
                        NvmeTier([str(disk_tmp)], AioConfig(block_size=4096, queue_depth=8))], LRUPolicy())
    try:
        (scale,) = store.register_chunks("exp_avg_absmax", {0: n}, torch.float32, nvme=False)
        codes = store.register("exp_avg", 4, n * 4, torch.uint8)
        store.initialize(scale, "cpu", lambda v: v.fill_(7.0))
        assert store.start_writeback(scale) is None
        for key in codes:                        # four chunks through a tier that holds three
            store.initialize(key, "cpu", lambda v: v.fill_(3))
        store.wait_idle()
        rec = store.records[scale]
        assert rec.slot is None and "cpu" in rec.buffers and not rec.nvme_valid
        assert torch.equal(store.view(scale, "cpu"), torch.full((n,), 7.0))
        assert sum(1 for k in codes if "cpu" not in store.records[k].buffers) == 2
    finally:
        store.tiers["nvme"].close()
