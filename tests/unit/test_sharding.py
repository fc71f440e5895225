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


def test_ownership_is_the_layouts_shard():
    layout = ChunkLayout.build([(f"p{i}", (3000,)) for i in range(10)], 4096)
    for r in range(3):
        assert Sharding(r, 3).owned(range(layout.num_chunks)) == layout.shard(r, 3)


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
    t = torch.ones(1024)
    comms.wait(comms.all_gather([t], t), "x")
    comms.wait(comms.reduce_scatter(t, [t]), "x")
    comms.all_reduce(torch.ones(4))
    stats = comms.take_stats()
    assert stats["ops"] == 3 and stats["sent_bytes"] == 0      # one rank moves nothing
    comms.world = 4                                            # the arithmetic at four ranks
    comms._count("all_gather", 3 * 4096)
    comms._count("broadcast", 3 * 4096 // 4)
    assert comms.take_stats()["by_op"] == {"all_gather": 12288, "broadcast": 3072}
    assert comms.take_stats()["ops"] == 0                      # taken: reset


def test_a_failed_collective_names_this_rank_and_the_collective(one_rank_group):
    from offload.distributed.comms import Collectives
    from offload.errors import DistributedError

    comms = Collectives(Sharding(0, 1))

    class Broken:
        def wait(self):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    with pytest.raises(DistributedError, match=r"rank 0: reduce-scatter of gradient chunks \[4, 5\]: .*Connection closed"):
        comms.wait(Broken(), "reduce-scatter of gradient chunks [4, 5]")
