"""The chunk interface (``engine.chunks``): the metadata agrees with what the engine registered,
values go in and out by kind from any tier, a chunk that holds nothing reads as None, the
counters round-trip. (That nothing outside the engine reaches past it: test_architecture.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.chunks.access import ChunkAccess
from offload.chunks.states import ChunkState
from offload.engine.access import engine_of
from offload.errors import ConfigError


def wrapped(dtype: str, frozen: bool = False, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    if frozen:
        model[0].requires_grad_(False)
    config = dict(device="cpu", dtype=dtype, cpu_budget="1MiB", chunk_size=4096)
    config.update(kw)
    return offload.wrap(model, offload.OffloadConfig(**config))


@pytest.mark.parametrize("dtype,frozen", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_metadata_is_what_the_engine_registered(dtype, frozen):
    model = wrapped(dtype, frozen)
    engine = model.offload_engine
    chunks = engine.chunks
    try:
        assert all(hasattr(chunks, name) for name in dir(ChunkAccess) if not name.startswith("_"))
        infos = chunks.chunks()
        assert [i.index for i in infos] == list(range(chunks.layout.num_chunks))
        for info in infos:
            registered = {k: rec.dtype for (k, c), rec in engine.store.records.items() if c == info.index and k != "grad"}
            assert dict(info.kinds) == registered
            assert info.nbytes("param") == engine.store.records[("param", info.index)].nbytes
            assert info.span == (0, info.numel) and info.piece_numel == info.numel
            assert [s.name for s in info.params] == [s.name for s in chunks.layout.slots if s.chunk == info.index]
            assert info.used == max(s.end for s in info.params) <= info.numel
        assert chunks.kinds["param"] == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        for i, (name, p) in enumerate(model.named_parameters()):
            place = chunks.param(p)
            assert place.index == i and place.name == name and place.slot == chunks.layout.slots[i]
        assert chunks.param(torch.zeros(1)) is None
        assert chunks.sharding is None and chunks.nvme() is None
    finally:
        engine.close()


def test_values_round_trip_by_kind_and_a_chunk_without_state_reads_none():
    model = wrapped("bf16")
    engine = model.offload_engine
    chunks = engine.chunks
    try:
        info = chunks.chunks()[0]
        assert chunks.read("exp_avg", 0) is None            # no step yet: the moments hold nothing
        values = torch.arange(info.numel, dtype=torch.float32)
        chunks.write("master", 0, values)
        buf = chunks.staging(info.nbytes("master"))[0]
        assert torch.equal(chunks.read("master", 0, buf), values)
        assert chunks.read("master", 0).data_ptr() != buf.data_ptr()     # no buffer given: a fresh one
        chunks.write("exp_avg", 0, values)
        assert torch.equal(chunks.read("exp_avg", 0), values)
        chunks.write("exp_avg", 0, None)
        assert chunks.read("exp_avg", 0) is None
        assert engine.store.records[("exp_avg", 0)].state is ChunkState.FREE
        w = model[0].weight
        got = chunks.gather([w])[id(w)]
        place = chunks.param(w)
        assert torch.equal(got.reshape(-1), values[place.slot.offset:place.slot.end])
    finally:
        engine.close()


def test_step_state_round_trips_and_says_when_a_window_is_open():
    model = wrapped("fp32")
    engine = model.offload_engine
    chunks = engine.chunks
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    try:
        state = chunks.step_state()
        assert state.step_count == 0 and set(state.adam_steps) == {0} and state.scaler is None
        assert not state.window_open
        model(torch.randn(2, 64)).sum().backward()
        assert chunks.step_state().window_open
        opt.step()
        opt.zero_grad()
        chunks.drain(moves=True)
        state = chunks.step_state()
        assert state.step_count == 1 and set(state.adam_steps) == {1} and not state.window_open
        chunks.restore_step_state(adam_steps=[7] * len(state.adam_steps), step_count=9)
        assert chunks.step_state().adam_steps == (7,) * len(state.adam_steps)
        assert chunks.step_state().step_count == 9
        with pytest.raises(ConfigError, match="adam_steps"):
            chunks.restore_step_state(adam_steps=[1])
    finally:
        engine.close()


def test_engine_of_finds_a_models_or_parameters_engine():
    model = wrapped("fp32")
    engine = model.offload_engine
    assert engine_of(model) is engine and engine_of(model[0].weight) is engine
    assert engine_of(nn.Linear(2, 2)) is None and engine_of(torch.zeros(1)) is None
    with pytest.raises(ConfigError, match="not wrapped"):
        engine_of(nn.Linear(2, 2), required=True)
    engine.close()
    with pytest.raises(offload.OffloadError, match="closed"):
        engine_of(model, required=True)
