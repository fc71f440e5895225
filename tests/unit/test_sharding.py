"""Chunk ownership across ranks, communication groups, ``{rank}`` NVMe paths, and the byte
accounting of collectives (a real one-rank gloo group in this process)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.chunks import ChunkLayout
from offload.distributed import Sharding, expand_rank, owner_of
from offload.errors import ConfigError


@settings(max_examples=200, deadline=None)
@given(num_chunks=st.integers(0, 300), world=st.integers(1, 17))
def test_every_chunk_has_exactly_one_owner_and_groups_hold_one_chunk_per_rank(num_chunks, world):
    ranks = [Sharding(r, world) for r in range(world)]
    owned = [set(s.owned(range(num_chunks))) for s in ranks]
    assert set().union(*owned) == set(range(num_chunks))
    assert sum(len(o) for o in owned) == num_chunks
    assert max(map(len, owned), default=0) - min(map(len, owned), default=0) <= 1     # 1/N each
    s = ranks[0]
    seen = []
    for g in range(s.num_groups(num_chunks)):
        chunks = s.group_chunks(g, num_chunks)
        assert 1 <= len(chunks) <= world
        assert [owner_of(c, world) for c in chunks] == list(range(len(chunks)))   # one per rank, in rank order
        assert all(s.group_of(c) == g for c in chunks)
        seen += chunks
    assert seen == list(range(num_chunks))


def test_every_chunk_has_one_owner_and_ranks_own_about_a_third_each():
    layout = ChunkLayout.build([(f"p{i}", (3000,)) for i in range(10)], 4096)
    owned = [Sharding(r, 3).owned(range(layout.num_chunks)) for r in range(3)]
    assert sorted(sum(owned, [])) == list(range(layout.num_chunks))
    assert max(map(len, owned)) - min(map(len, owned)) <= 1


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
    from offload.distributed.comms import Collectives

    comms = Collectives(Sharding(0, 1))
    try:
        t = torch.ones(1024)
        comms.wait(comms.broadcast(t, 0), "x")
        comms.wait(comms.reduce(t, 0), "x")
        comms.all_reduce(torch.ones(4))
        stats = comms.take_stats()
        assert stats["ops"] == 3 and stats["sent_bytes"] == 0      # one rank moves nothing
        comms.world = 4                                            # the arithmetic at four ranks
        comms.wait(comms.broadcast(t, 0), "x")
        comms.wait(comms.reduce(t, 0), "x")
        comms.all_reduce(t)
        assert comms.take_stats()["by_op"] == {"broadcast": 3072, "reduce": 3072, "all_reduce": 6144}
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
        with pytest.raises(DistributedError, match=r"rank 0: reduce of gradient chunks \[4, 5\]: .*Connection closed"):
            comms.wait(comms.submit(lambda: [Broken()]), "reduce of gradient chunks [4, 5]")
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
