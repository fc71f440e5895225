"""The chunk store under random access / release / modify / evict sequences with tiny budgets.

A hypothesis state machine drives the store across every tier (the CPU stands in for the
compute device; the NVMe tier is a temp dir on a real disk) and checks after every step that no
budget is exceeded, no byte is lost or corrupted (contents equal a shadow copy), and states agree
with pins.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offload import AioConfig, ConfigError, StateError, TierFullError
from offload.chunks import ChunkState, ChunkStore
from offload.chunks.states import CHUNK_TRANSITIONS, check_transition
from offload.scheduler import LRUPolicy
from offload.tiers import MemoryTier

ROOT = Path(__file__).resolve().parents[2]
NUMEL = 2048                       # fp32 chunk = 8 KiB; bf16 = 4 KiB
KINDS = {"param": torch.bfloat16, "master": torch.float32}
COUNT = 6


def _nvme_tier(path):
    try:
        from offload.tiers import NvmeTier
        return NvmeTier([str(path)], AioConfig(block_size=4096, queue_depth=8))
    except ImportError:
        return None


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        base = ROOT / ".pytest-tmp"
        base.mkdir(exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(dir=base))
        tiers = [MemoryTier("device", 3 * NUMEL * 4), MemoryTier("cpu", 4 * NUMEL * 4, aligned=True)]
        nvme = _nvme_tier(self.dir)
        if nvme is not None:
            tiers.append(nvme)
        self.has_nvme = nvme is not None
        self.store = ChunkStore(tiers, LRUPolicy())
        self.shadow: dict = {}
        self.pinned: dict = {}          # key -> (tier, view)
        gen = torch.Generator().manual_seed(0)
        for kind, dtype in KINDS.items():
            for key in self.store.register(kind, COUNT, NUMEL, dtype):
                data = torch.randn(NUMEL, generator=gen).to(dtype)
                self.shadow[key] = data
        self.uninitialized = set(self.shadow)

    def teardown(self):
        if self.has_nvme:
            self.store.tiers["nvme"].close()
        shutil.rmtree(self.dir, ignore_errors=True)

    keys = st.sampled_from([(k, i) for k in KINDS for i in range(COUNT)])
    memory_tiers = st.sampled_from(["device", "cpu"])

    @rule(key=keys, tier=memory_tiers)
    def initialize_or_access(self, key, tier):
        if key in self.pinned:
            return
        try:
            if key in self.uninitialized:
                self.store.initialize(key, tier, lambda v: v.copy_(self.shadow[key]))
                self.uninitialized.discard(key)
                return
            view = self.store.access(key, tier)
        except TierFullError:
            return          # legal when pins fill a tier; the store must still be consistent
        assert torch.equal(view, self.shadow[key])
        self.pinned[key] = (tier, view)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data(), modify=st.booleans(), seed=st.integers(0, 2**16))
    def release(self, data, modify, seed):
        key = data.draw(st.sampled_from(sorted(self.pinned)))
        tier, view = self.pinned.pop(key)
        if modify:
            gen = torch.Generator().manual_seed(seed)
            new = torch.randn(NUMEL, generator=gen).to(view.dtype)
            view.copy_(new)
            self.shadow[key] = new
        self.store.release(key, tier, dirty=modify)

    @rule(key=keys, tier=memory_tiers)
    def evict(self, key, tier):
        if key in self.pinned and self.pinned[key][0] == tier:
            with pytest.raises(StateError):
                self.store.evict(key, tier)
            return
        rec = self.store.records[key]
        if not self.has_nvme and tier == "cpu" and rec.valid == {"cpu"}:
            with pytest.raises(StateError, match="no tier below"):
                self.store.evict(key, tier)
            return
        try:
            self.store.evict(key, tier)
        except TierFullError:
            pass

    @rule(key=keys, tier=memory_tiers)
    def prefetch(self, key, tier):
        if key in self.uninitialized:
            return
        try:
            move = self.store.fetch(key, tier)
            if move is not None:
                move.wait()
        except TierFullError:
            pass

    @invariant()
    def budgets_hold(self):
        for tier in self.store.tiers.values():
            assert tier.reserved <= tier.budget, tier.name

    @invariant()
    def contents_match_shadow(self):
        for key, expected in self.shadow.items():
            if key in self.uninitialized:
                continue
            assert torch.equal(self.store.read(key), expected), key

    @invariant()
    def states_agree_with_pins(self):
        for key, rec in self.store.records.items():
            if key in self.uninitialized:
                assert rec.state is ChunkState.FREE
            elif key in self.pinned:
                assert rec.state is ChunkState.COMPUTE and rec.pins[self.pinned[key][0]] >= 1
                assert self.pinned[key][0] in rec.buffers
            else:
                assert rec.state is ChunkState.HOLD and not +rec.pins
                assert rec.valid, key      # some tier always holds the current bytes


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestStoreMachine = StoreMachine.TestCase


def test_illegal_transitions_raise():
    with pytest.raises(StateError, match="FREE -> COMPUTE"):
        check_transition(CHUNK_TRANSITIONS, ChunkState.FREE, ChunkState.COMPUTE, "chunk")
    assert check_transition(CHUNK_TRANSITIONS, ChunkState.HOLD, ChunkState.COMPUTE, "chunk") is ChunkState.COMPUTE


def test_tier_full_names_tier_budget_and_holders():
    store = ChunkStore([MemoryTier("device", 2 * NUMEL * 4), MemoryTier("cpu", 8 * NUMEL * 4)], LRUPolicy())
    keys = store.register("master", 3, NUMEL, torch.float32)
    for k in keys:
        store.initialize(k, "cpu")
    store.access(keys[0], "device")
    store.access(keys[1], "device")
    with pytest.raises(TierFullError) as err:
        store.access(keys[2], "device")
    msg = str(err.value)
    assert "'device'" in msg and str(2 * NUMEL * 4) in msg and "COMPUTE" in msg
    assert err.value.tier == "device" and err.value.budget == 2 * NUMEL * 4
    # the failed access changed nothing: release one and it goes through
    store.release(keys[0], "device")
    store.access(keys[2], "device")


def test_no_nvme_bottom_tier_refuses_with_hint():
    store = ChunkStore([MemoryTier("cpu", 2 * NUMEL * 4)], LRUPolicy())
    keys = store.register("master", 3, NUMEL, torch.float32)
    store.initialize(keys[0], "cpu")
    store.initialize(keys[1], "cpu")
    with pytest.raises(TierFullError, match="nvme_paths"):
        store.initialize(keys[2], "cpu")


def test_clean_eviction_moves_nothing_and_report_counts():
    store = ChunkStore([MemoryTier("device", 4 * NUMEL * 4), MemoryTier("cpu", 8 * NUMEL * 4)], LRUPolicy())
    (key,) = store.register("master", 1, NUMEL, torch.float32)
    store.initialize(key, "cpu", lambda v: v.fill_(3.0))
    store.access(key, "device")
    store.release(key, "device")
    store.evict(key, "device")               # clean: the CPU copy is current
    report = store.memory_report()
    assert report["moved_bytes"] == {"cpu->device": NUMEL * 4}
    view = store.access(key, "device")
    view.add_(1)
    store.release(key, "device", dirty=True)  # the CPU copy is now stale and dropped
    assert store.records[key].valid == {"device"}
    store.evict(key, "device")               # dirty: written back first
    assert store.read(key).eq(4.0).all()
    report = store.memory_report()
    assert report["moved_bytes"]["device->cpu"] == NUMEL * 4
    assert report["tiers"]["cpu"]["bytes_by_kind"] == {"master": NUMEL * 4}
    assert report["chunk_states"] == {"HOLD": 1}


def test_aliases_name_one_tier():
    store = ChunkStore([MemoryTier("cpu", 4 * NUMEL * 4)], LRUPolicy(), aliases={"device": "cpu"})
    (key,) = store.register("master", 1, NUMEL, torch.float32)
    store.initialize(key, "device", lambda v: v.fill_(2.0))
    assert store.tier_name("device") == "cpu" and store.records[key].valid == {"cpu"}
    view = store.access(key, "device")
    assert view.eq(2.0).all() and store.view(key, "cpu").data_ptr() == view.data_ptr()
    store.release(key, "cpu")
    assert store.memory_report()["moved_bytes"] == {}          # nothing copied between "two" tiers
    with pytest.raises(ConfigError, match="aliases"):
        ChunkStore([MemoryTier("cpu", NUMEL * 4)], LRUPolicy(), aliases={"device": "gpu"})


def test_finished_writeback_frees_its_chunk_for_eviction(disk_tmp):
    """A chunk whose write-back to NVMe has landed is evictable without anyone having waited on
    the move: making room finishes completed moves first instead of evicting what is still needed."""
    nvme = _nvme_tier(disk_tmp)
    store = ChunkStore([MemoryTier("cpu", 2 * NUMEL * 4, aligned=True), nvme], LRUPolicy())
    a, b, c = store.register("master", 3, NUMEL, torch.float32)
    store.initialize(a, "cpu", lambda v: v.fill_(1.0))
    store.initialize(b, "cpu", lambda v: v.fill_(2.0))
    move = store.start_writeback(b)       # b was used last: LRU would evict a, whose only copy is here
    move.wait_io()
    assert store.records[b].busy          # nobody finished the move yet
    store.policy.on_access(a)             # a is now the most recently used
    store.initialize(c, "cpu")
    assert store.records[b].valid == {"nvme"} and store.records[a].valid == {"cpu"}
    assert store.memory_report()["moved_bytes"] == {"cpu->nvme": NUMEL * 4}   # a was not written
    assert store.read(b).eq(2.0).all()
    nvme.close()


def test_among_chunks_ranked_alike_a_clean_one_leaves_before_one_that_needs_a_write(disk_tmp):
    """Chunks the trace never uses (a gradient waiting for the optimizer, state already updated and
    written back) rank alike, at infinity. Making room then drops a clean copy, which costs
    nothing, rather than write the other down, whatever order the tier holds them in (CI saw a
    waiting gradient go cpu->nvme when it happened to come first)."""
    from offload.scheduler import AccessTrace, NextUsePolicy

    nvme = _nvme_tier(disk_tmp)
    trace = AccessTrace()
    trace.record(("param", 0))
    store = ChunkStore([MemoryTier("cpu", 2 * NUMEL * 4, aligned=True), nvme],
                       NextUsePolicy(trace, auto_advance=False))
    waiting, written, incoming = store.register("master", 3, NUMEL, torch.float32)
    store.initialize(waiting, "cpu", lambda v: v.fill_(1.0))      # resident first: chosen first on a tie
    store.initialize(written, "cpu", lambda v: v.fill_(2.0))
    store.start_writeback(written).wait()
    assert store.policy.rank(waiting) == store.policy.rank(written) == float("inf")
    store.initialize(incoming, "cpu")
    assert store.records[waiting].valid == {"cpu"} and store.records[written].valid == {"nvme"}
    assert store.memory_report()["moved_bytes"] == {"cpu->nvme": NUMEL * 4}   # the write-back only
    assert store.read(written).eq(2.0).all()
    nvme.close()


def test_wait_idle_finishes_every_move_under_way(disk_tmp):
    nvme = _nvme_tier(disk_tmp)
    store = ChunkStore([MemoryTier("cpu", 4 * NUMEL * 4, aligned=True), nvme], LRUPolicy())
    keys = store.register("master", 3, NUMEL, torch.float32)
    for i, key in enumerate(keys):
        store.initialize(key, "cpu", lambda v, i=i: v.fill_(float(i)))
        store.start_writeback(key)
    store.wait_idle()
    assert not any(store.records[k].busy for k in keys)
    assert all(store.records[k].valid == {"cpu", "nvme"} for k in keys)
    assert store.memory_report()["moved_bytes"] == {"cpu->nvme": 3 * NUMEL * 4}
    store.wait_idle()                     # nothing under way: returns at once
    nvme.close()


def test_initialize_whose_fill_raises_gives_its_buffer_back():
    tier = MemoryTier("cpu", 2 * NUMEL * 4)
    store = ChunkStore([tier], LRUPolicy())
    (key,) = store.register("master", 1, NUMEL, torch.float32)

    def bad_fill(view):
        raise ValueError("bad values")

    with pytest.raises(ValueError, match="bad values"):
        store.initialize(key, "cpu", bad_fill)
    assert tier.in_use == 0 and store.records[key].state.name == "FREE"
    store.initialize(key, "cpu", lambda v: v.fill_(1.0))        # and it can be initialized again
    assert store.read(key).eq(1.0).all()
