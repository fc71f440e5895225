"""Every chunk sliced across the ranks (each keeps one equal piece), ``{rank}`` NVMe paths, and the
collectives' byte accounting and order (a real one-rank gloo group in this process)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.distributed import Sharding, expand_rank
from offload.errors import ConfigError


@settings(max_examples=300, deadline=None)
@given(numel=st.integers(1, 1 << 22), world=st.integers(1, 600))
def test_the_pieces_of_a_chunk_tile_it_padded_to_n_equal_pieces(numel, world):
    """Rank r keeps [r*p, r*p + p) of the chunk padded to N*p, p = ceil(numel / N): the pieces
    cover [0, padded) once each, in rank order, and fewer than N elements are padding."""
    ranks = [Sharding(r, world) for r in range(world)]
    p = -(-numel // world)
    assert all(s.piece_numel(numel) == p and s.padded(numel) == world * p for s in ranks)
    spans = [s.span(numel) for s in ranks]
    assert spans[0][0] == 0 and spans[-1][1] == world * p
    assert all(hi - lo == p for lo, hi in spans)                                  # equal pieces
    assert all(spans[r][1] == spans[r + 1][0] for r in range(world - 1))         # no gap, no overlap
    assert 0 <= world * p - numel < world                                          # padding < N
    # Every element of the chunk itself is in exactly one piece; only the last pieces pass numel.
    assert sum(min(hi, numel) - min(lo, numel) for lo, hi in spans) == numel
    assert [s.span(numel) for s in ranks] == [ranks[0].span(numel, r) for r in range(world)]


@settings(max_examples=100, deadline=None)
@given(numels=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=40), world=st.integers(2, 64))
def test_every_rank_keeps_an_nth_of_every_layout_whatever_its_chunk_sizes(numels, world):
    """What round-robin ownership could not do: an oversized chunk is split like any other, so no
    rank keeps more than the others by more than a padding element per chunk."""
    held = [sum(Sharding(r, world).piece_numel(n) for n in numels) for r in range(world)]
    assert len(set(held)) == 1
    assert 0 <= held[0] - sum(numels) / world < len(numels)


def test_a_chunk_smaller_than_the_world_gives_the_last_ranks_padding_only():
    s = Sharding(0, 4)
    assert s.piece_numel(3) == 1 and s.padded(3) == 4
    assert [s.span(3, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]   # rank 3: padding only
    one = Sharding(0, 1)
    assert one.span(4097) == (0, 4097) and one.padded(4097) == 4097             # one process: the chunk


def test_round_robin_ownership_is_gone():
    """One way to shard: no chunk has an owner any more, so nothing can ask for one."""
    import offload.distributed as distributed

    assert not hasattr(distributed, "owner_of")
    for name in ("owner", "owns", "owned", "group_of", "group_chunks", "num_groups"):
        assert not hasattr(Sharding, name), name


@pytest.mark.parametrize("rank,world", [(-1, 2), (2, 2), (0, 0)])
def test_a_rank_outside_the_world_is_refused(rank, world):
    with pytest.raises(ConfigError, match="rank"):
        Sharding(rank, world)


def test_nvme_paths_get_the_rank_filled_in_or_a_directory_of_their_own():
    s = Sharding(1, 4, local_rank=1)
    assert expand_rank(["/d/{rank}", "/e/x{local_rank}"], s) == ("/d/1", "/e/x1")
    assert expand_rank(["/d"], s) == (os.path.join("/d", "rank1"),)      # never shared by two ranks
    assert expand_rank(["/d/{rank}"], None) == ("/d/0",)                 # a single process is rank 0
    assert expand_rank(["/d"], None) == ("/d",)
    assert expand_rank(None, s) is None
    with pytest.raises(ConfigError, match="nvme_paths.*rank"):
        expand_rank(["/d/{node}"], s)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_collectives_count_bus_bytes_per_rank(one_rank_group):
    """An all-gather into (a reduce-scatter from) a whole chunk of b bytes moves (N-1)/N b per
    rank, counted by the whole chunk, not the piece."""
    from offload.distributed.comms import Collectives

    comms = Collectives(Sharding(0, 1))
    try:
        whole, piece = torch.zeros(1024), torch.ones(1024)      # one rank: the piece is the chunk
        comms.wait(comms.all_gather(whole, piece), "x")
        assert torch.equal(whole, piece)
        comms.wait(comms.submit(lambda: [comms.start_reduce_scatter(piece, torch.full((1024,), 2.0))]), "x")
        assert torch.equal(piece, torch.full((1024,), 2.0))
        comms.all_reduce(torch.ones(4))
        stats = comms.take_stats()
        assert stats["ops"] == 3 and stats["sent_bytes"] == 0      # one rank moves nothing
        comms.world = 4                                            # the arithmetic at four ranks
        comms.wait(comms.all_gather(whole, piece), "x")
        comms.wait(comms.submit(lambda: [comms.start_reduce_scatter(piece, whole)]), "x")
        comms.all_reduce(whole)
        assert comms.take_stats()["by_op"] == {"all_gather": 3072, "reduce_scatter": 3072, "all_reduce": 6144}
        assert comms.take_stats()["ops"] == 0                      # taken: reset
    finally:
        comms.close()


def test_collectives_are_issued_in_submission_order_on_one_thread_with_the_engines_gpu(one_rank_group, monkeypatch):
    """Jobs run one after another in the order submitted, whichever thread submits them (the
    order every rank shares), on the communication thread, which first made the engine's GPU
    current (recorded: there is no GPU here)."""
    import threading

    from offload.distributed.comms import Collectives

    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d)))
    comms = Collectives(Sharding(0, 1), device=torch.device("cuda", 1))
    try:
        gate = threading.Event()

        def job(i):
            def run():
                if i == 0:
                    gate.wait(5)        # the first job waits for its inputs: the others queue behind it
                seen.append((threading.current_thread().name, i))
                return [comms.start_broadcast(torch.full((4,), float(i)), 0)]
            return run

        pending = [comms.submit(job(0))]
        pending += [comms.submit(job(i)) for i in (1, 2)]
        assert not any(p.done() for p in pending)
        gate.set()
        for p in pending:
            comms.wait(p, "x")
    finally:
        comms.close()
    assert seen == [("offload-comm", 1)] + [("offload-comm", i) for i in range(3)]


def test_a_failed_collective_names_this_rank_and_the_collective(one_rank_group):
    from offload.distributed.comms import Collectives
    from offload.errors import DistributedError

    comms = Collectives(Sharding(0, 1))

    class Broken:
        def wait(self):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    try:
        with pytest.raises(DistributedError, match=r"rank 0: reduce-scatter of gradient chunk 4: .*Connection closed"):
            comms.wait(comms.submit(lambda: [Broken()]), "reduce-scatter of gradient chunk 4")
    finally:
        comms.close()


def test_collectives_start_and_are_waited_for_on_the_compute_stream(one_rank_group, monkeypatch):
    """On a GPU, NCCL's stream waits for the stream current where a collective starts, and
    ``work.wait()`` makes the waiting thread's current stream wait for it: both must be the
    engine's compute stream, not whatever stream the issuing or waiting thread is on."""
    import contextlib
    import threading

    from offload.distributed.comms import Collectives

    class ComputeStream:
        """Records which threads are inside ``on_compute`` (the protocol of DeviceStreams)."""

        def __init__(self):
            self.inside: set[int] = set()

        @contextlib.contextmanager
        def on_compute(self):
            self.inside.add(threading.get_ident())
            try:
                yield
            finally:
                self.inside.discard(threading.get_ident())

    streams = ComputeStream()
    seen = []
    real_broadcast = dist.broadcast

    def broadcast(*args, **kwargs):
        seen.append(("start", threading.get_ident() in streams.inside))
        work = real_broadcast(*args, **kwargs)
        real_wait = work.wait

        class Work:
            def wait(self):
                seen.append(("wait", threading.get_ident() in streams.inside))
                return real_wait()
        return Work()

    monkeypatch.setattr(dist, "broadcast", broadcast)
    comms = Collectives(Sharding(0, 1), streams=streams)
    try:
        comms.wait(comms.broadcast(torch.ones(8), 0), "x")
    finally:
        comms.close()
    assert seen == [("start", True), ("wait", True)]
