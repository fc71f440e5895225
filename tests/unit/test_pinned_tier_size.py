"""A pinned CPU tier maps and page-locks what its chunks can take, not its whole budget.

On an H200 box the "auto" CPU budget of a 1B fine-tune was 66.9 GB while its chunks were 16-18 GB:
the arena was the budget, page-locked whole at the first allocation, and 68 GB of RAM went pinned.
Now, once the chunks are registered, the arena is fitted to one slot per chunk buffer plus a spare
(``MemoryTier.fit_to``, ``engine.build.fit_pinned_tier``), and the budget reported is that one.
Pinned through mlock here (no GPU), counted by the tier's pinner as in ``test_pinned_tier``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offload
from offload.engine import build as engine_module
from offload.errors import StateError
from offload.tiers import MemoryTier
from offload.tiers.arena import Slots
from tests.helpers.tiny_gpt import TinyGPT, batches
from tests.unit.test_pinned_tier import CountingPinner

PAGE = 4096


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(0, 3),
       st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 20)), max_size=120))
def test_slots_never_refuse_while_no_size_has_more_buffers_than_chunks(sizes, spare_pages, ops):
    slots = Slots([n * PAGE - 100 for n in sizes], spare_pages * PAGE)     # requests round up to pages
    assert slots.size == (sum(sizes) + spare_pages) * PAGE
    count = {n: sizes.count(n) for n in sizes}
    live: list[tuple[int, int]] = []                   # (start, pages)
    for is_alloc, pick in ops:
        if is_alloc or not live:
            n = sizes[pick % len(sizes)]
            start = slots.allocate(n * PAGE - 100)
            if sum(1 for _, m in live if m == n) < count[n]:
                assert start is not None                 # a slot of its own size is always there
            if start is None:
                assert not slots.fits(n * PAGE)
                continue
            assert 0 <= start and start + n * PAGE <= slots.size and start % PAGE == 0
            assert all(start + n * PAGE <= s or s + m * PAGE <= start for s, m in live)    # no overlap
            live.append((start, n))
        else:
            start, n = live.pop(pick % len(live))
            slots.free(start, n * PAGE - 100)
    for start, n in live:
        slots.free(start, n * PAGE)
    assert slots.free_total() == slots.size
    with pytest.raises(ValueError):
        slots.free(0, sizes[0] * PAGE)                   # freed twice


def test_a_pinned_tier_fitted_to_its_chunks_pins_only_them():
    pinner = CountingPinner()
    tier = MemoryTier("cpu", 64 << 20, pin=True, pinner=pinner)
    sizes = [8 * PAGE] * 3 + [4 * PAGE] * 5 + [PAGE + 1]
    assert tier.fit_to(sizes, spare=2 * 8 * PAGE) == (24 + 20 + 2 + 16) * PAGE
    assert tier.budget == (24 + 20 + 2 + 16) * PAGE and tier.asked_budget == 64 << 20
    held = [tier.allocate(n) for n in sizes]            # all of them at once, and the spare's worth
    held += [tier.allocate(8 * PAGE), tier.allocate(8 * PAGE)]
    assert pinner.pins == [(pinner.pins[0][0], tier.budget)]
    base = pinner.pins[0][0]
    assert all(base <= b.data_ptr() and b.data_ptr() + b.numel() <= base + tier.budget for b in held)
    assert tier.describe()["budget"] == tier.budget and tier.describe()["asked_budget"] == 64 << 20
    with pytest.raises(StateError, match="mapped already"):
        tier.fit_to(sizes, spare=0)                     # registered once: never re-sized
    for buf in held:
        tier.free(buf)
    assert tier.in_use == 0


def test_a_tier_whose_chunks_need_more_than_its_budget_keeps_the_budget():
    tier = MemoryTier("cpu", 40 * PAGE, pin=True, pinner=CountingPinner())
    assert tier.fit_to([8 * PAGE] * 6, spare=16 * PAGE) == 40 * PAGE
    assert tier.budget == tier.asked_budget == 40 * PAGE
    unpinned = MemoryTier("device", 40 * PAGE)          # no arena: nothing is mapped up front
    assert unpinned.fit_to([PAGE], spare=0) == 40 * PAGE


def _run(monkeypatch, cfg, *, pin: bool, steps: int = 3):
    """Train TinyGPT ``steps`` steps with the CPU tier pinned (through a counting mlock pinner)
    or not; returns (model, engine, pinner, the chunks' state after the last step, losses)."""
    pinner = CountingPinner()

    def tier(name, budget, device="cpu", **kw):
        if name == "cpu" and pin:                    # the GPU layout's pinned CPU tier, on this CPU box
            kw.update(pin=True, pinner=pinner)
        return MemoryTier(name, budget, device, **kw)

    monkeypatch.setattr(engine_module, "MemoryTier", tier)
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg)
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in batches(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    engine = model.offload_engine
    engine.chunks.drain()
    state = {(kind, c): engine.chunks.read(kind, c).clone() for kind in ("param", "master", "exp_avg", "exp_avg_sq")
             for c in engine.layout.trainable_chunks}
    return model, engine, pinner, state, losses


def test_engine_pins_what_its_chunks_need_of_a_far_larger_budget(monkeypatch, capsys):
    # 64 MiB asked of a model whose chunks are a few hundred KiB: before, all 64 MiB were locked
    # (mlock beyond a default `ulimit -l` of 8 MiB is refused outright).
    cfg = offload.OffloadConfig(device="cpu", dtype="bf16", device_budget="192KiB", cpu_budget="64MiB",
                                chunk_size=8192, merge_host_tiers=False)
    model, engine, pinner, pinned_state, losses = _run(monkeypatch, cfg, pin=True)
    records = engine.store.records.values()
    rounded = sum(-(-r.nbytes // PAGE) * PAGE for r in records)          # a buffer per chunk of each kind,
    grads = sum(-(-r.nbytes // PAGE) * PAGE for r in records if r.key[0] in engine_module.GRADIENT_KINDS)
    largest = max(-(-r.nbytes // PAGE) * PAGE for r in records)          # one more per gradient chunk, 2 spares
    assert grads and rounded > grads
    bound = rounded + grads + engine_module.SPARE_BUFFERS * largest
    tier = engine.store.tiers["cpu"]
    assert tier.budget == bound < 64 << 20
    assert [size for _, size in pinner.pins] == [bound] and pinner.unpins == []
    report = model.offload_stats()["memory"]["tiers"]["cpu"]
    assert report["budget"] == bound and report["asked_budget"] == 64 << 20 and report["pinned"]
    assert report["reserved"] <= bound
    from offload.train.report import format_size, summary

    summary(model, losses, [0.1] * len(losses), None, 0.0, 64, 0)     # the fine-tuning script's last lines
    line = next(line for line in capsys.readouterr().err.splitlines() if line.strip().startswith("cpu"))
    assert f"budget {format_size(bound)}: pinned, fitted to its chunks, of {format_size(64 << 20)} asked" in line, line
    pinned_losses = losses
    engine.close()
    monkeypatch.undo()
    # The same run unpinned (the tier keeps its whole budget): the same losses and parameters, bit
    # for bit: where a chunk's buffer lies changes no arithmetic.
    _, engine2, _, state, losses2 = _run(monkeypatch, cfg, pin=False)
    assert engine2.store.tiers["cpu"].budget == 64 << 20
    assert losses2 == pinned_losses
    assert state.keys() == pinned_state.keys()
    assert all(torch.equal(state[k], pinned_state[k]) for k in state)
    engine2.close()


def test_engine_whose_chunks_outgrow_the_budget_pins_exactly_the_budget_and_spills(disk_tmp, monkeypatch):
    cfg = offload.OffloadConfig(device="cpu", dtype="bf16", device_budget="192KiB", cpu_budget="512KiB",
                                nvme_paths=[str(disk_tmp)], chunk_size=8192, merge_host_tiers=False)
    model, engine, pinner, _, _ = _run(monkeypatch, cfg, pin=True, steps=4)
    tier = engine.store.tiers["cpu"]
    assert sum(r.nbytes for r in engine.store.records.values()) > 512 << 10      # it does not fit
    assert tier.budget == tier.asked_budget == 512 << 10
    assert [size for _, size in pinner.pins] == [512 << 10]
    moved = model.offload_stats()["moved_bytes"]
    assert moved.get("nvme->cpu") and moved.get("cpu->nvme"), moved              # it spilled, as before
    engine.close()


def test_a_fitted_tier_on_the_gpu_path_moves_what_the_whole_budget_moved(monkeypatch):
    """The GPU path's ordering on simulated streams (``GatedStreams``: a GPU 64 copies behind the
    host), a device budget small enough that gradient chunks leave it mid-backward and, under
    accumulation, come back and are rewritten while their uploads may still read the host copies
    (held back, still counted: the spare's reason). Fitted to its chunks, the pinned tier trains
    as torch does and moves, step by step, exactly the bytes the tier of the whole budget moved,
    with the same host waits: the cap never made it evict or wait, and no buffer missed the
    arena. (With 2 spare buffers and none per gradient chunk it downloaded 40 % more and waited
    under the store's lock 30 times.)"""
    accumulate = 2
    from unittest import mock

    from tests.helpers.reference import LR, WD, Reference, make_models, small_config
    from tests.helpers.sim_streams import GatedStreams

    def train(pin: bool):
        pinner = CountingPinner()

        def tier(name, budget, device="cpu", **kw):
            if name == "cpu" and pin:
                kw.update(pin=True, pinner=pinner)
            return MemoryTier(name, budget, device, **kw)

        _, mine = make_models()
        streams = GatedStreams(lag=64)
        cfg = small_config(None, nvme_paths=None, cpu_budget="32MiB", merge_host_tiers=False,
                           overlap_optimizer=False)
        with mock.patch.object(engine_module, "copy_streams", lambda device: streams), \
                mock.patch.object(engine_module, "MemoryTier", tier):
            model = offload.wrap(mine, cfg)
        streams.lock = model.offload_engine.store.lock
        opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        losses, moved = [], []
        data = iter(batches(4 * accumulate))
        for _ in range(4):
            total = 0.0
            for _ in range(accumulate):
                x, y = next(data)
                loss = model(x, y) / accumulate
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
            moved.append(model.offload_stats()["moved_bytes"])
        return model, streams, pinner, losses, moved

    ref, _ = make_models()
    want = Reference(ref, 4, accumulate=accumulate)
    model, streams, pinner, losses, moved = train(pin=True)
    whole, whole_streams, _, whole_losses, whole_moved = train(pin=False)
    try:
        want.check(model, losses)
        tier = model.offload_engine.store.tiers["cpu"]
        assert tier.budget < tier.asked_budget == 32 << 20
        assert [size for _, size in pinner.pins] == [tier.budget] and tier.outside_arena == 0
        assert moved[-1].get("device->cpu") and moved[-1].get("cpu->device"), moved[-1]
        assert moved == whole_moved and losses == whole_losses
        assert streams.host_waits == whole_streams.host_waits and streams.host_waits_under_lock == 0
    finally:
        for m, s in ((model, streams), (whole, whole_streams)):
            m.offload_engine.close()
            s.close()
