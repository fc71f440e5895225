"""The data-parallel prefetch of per-chunk all-gathers never holds up the thread that asked for a chunk.

After ``ensure(c)`` has chunk ``c`` gathered, it starts all-gathering the chunk the trace says
comes next. This rank's piece of that chunk may still be in its Adam update from the last step
(or on NVMe): the demanding thread must not wait for it there, before the current chunk's compute
is even queued. A real engine, a real one-rank gloo group (a piece is the whole chunk there) and
the engine's real Adam worker; the next chunk's update is held by an event until ``ensure`` has
returned.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import offload
from offload.distributed import Sharding
from offload.distributed.comms import Collectives
from offload.distributed.gather import ChunkGather

HELD_S = 5.0        # how long the held update waits for ensure() before giving up


def gather_for(engine, comms) -> ChunkGather:
    """A gather over ``engine``'s chunks, wired as the engine wires its own under several ranks:
    its ``param`` records are the pieces, and each chunk is gathered into a ``gathered`` record of
    the whole chunk, registered as the engine registers it (no NVMe slot). Nothing waits to be
    submitted here, so a collective done with a piece has no update to let go."""
    sizes = {c: engine.layout.chunk_numel(c) for c in range(engine.layout.num_chunks)}
    engine.store.register_chunks("gathered", sizes, engine.chunks.kinds["param"], nvme=False)
    return ChunkGather(comms, engine.store, tier=engine.pins.tier, in_use=engine.pins.pinned,
                       wait_for_update=engine.adam.wait_for, on_sent=lambda c: None)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.fixture
def engine():
    torch.manual_seed(0)
    model = offload.wrap(nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)]),
                         offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="1MiB",
                                               cpu_budget="1MiB", chunk_size=2048))
    engine = model.offload_engine
    assert engine.layout.num_chunks >= 2
    yield engine
    engine.close()


def test_ensure_returns_while_the_next_groups_update_is_still_running(one_rank_group, engine, monkeypatch):
    comms = Collectives(Sharding(0, 1))
    gather = gather_for(engine, comms)
    n = engine.layout.num_chunks
    gather.begin_iteration()
    for c in range(n):          # the first iteration: the trace is recorded
        gather.ensure(c)
    gather.drop_all()
    gather.take_stats()
    gather.begin_iteration()

    events = []
    let_go = threading.Event()
    real_update = engine.adam.update

    def held_update(c, runs, grad_scale):
        if c == 1:
            if not let_go.wait(HELD_S):
                events.append("update held for nothing: ensure() waited for it")
            events.append("update 1 done")
        return real_update(c, runs, grad_scale)

    monkeypatch.setattr(engine.adam, "update", held_update)
    engine.adam.submit(1, [], 1.0)          # chunk 1's update from the last step, still running
    try:
        gather.ensure(0)                    # starts gathering chunk 1 ahead
        events.append("ensure(0) returned")
        assert gather.holds(1)              # its update may not start again while the gather reads it
        let_go.set()
        gather.ensure(1)                    # now it is waited for: after the update
        assert events == ["ensure(0) returned", "update 1 done"]
        assert not engine.adam.pending(1)
        assert gather.take_stats() == {"gather_hits": 1, "gather_misses": 1}
    finally:
        let_go.set()
        engine.adam.drain()
        gather.drop_all()
        comms.close()


def test_a_failed_prefetch_is_reported_to_the_thread_that_needs_the_group(one_rank_group, engine, monkeypatch):
    """The prefetch runs elsewhere; its error (here the optimizer's, met while waiting for the
    update) reaches the thread that asks for the chunk, not a log."""
    comms = Collectives(Sharding(0, 1))
    gather = gather_for(engine, comms)
    gather.begin_iteration()
    for c in range(engine.layout.num_chunks):
        gather.ensure(c)
    gather.drop_all()
    gather.begin_iteration()

    fail = threading.Event()

    def failing_update(c, runs, grad_scale):
        fail.wait(HELD_S)
        raise RuntimeError("the update of chunk 1 failed")

    monkeypatch.setattr(engine.adam, "update", failing_update)
    engine.adam.submit(1, [], 1.0)
    try:
        # Chunk 0's own wait for updates would re-raise the worker's error had it failed already:
        # it fails once chunk 1's prefetch (started by this ensure) is waiting for it.
        gather.ensure(0)
        fail.set()
        with pytest.raises(offload.errors.OffloadError, match="chunk 1 failed"):
            gather.ensure(1)
        assert not gather.holds(1)
    finally:
        gather.drop_all()
        comms.close()


def test_each_chunk_is_all_gathered_from_the_pieces_into_its_own_whole_buffer(one_rank_group, engine):
    """One all-gather per chunk, counted by the whole chunk, into that chunk's ``gathered``
    record: with one rank the gathered chunk is this rank's piece, value for value."""
    comms = Collectives(Sharding(0, 1))
    gather = gather_for(engine, comms)
    try:
        gather.begin_iteration()
        for c in range(engine.layout.num_chunks):
            gather.ensure(c)
            assert torch.equal(engine.store.read(("gathered", c)), engine.store.read(("param", c))), c
        assert comms.take_stats()["ops"] == engine.layout.num_chunks     # no group, no extra collective
    finally:
        gather.drop_all()
        comms.close()
