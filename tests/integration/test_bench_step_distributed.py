"""offload bench step --nproc with real ranks: the collective counter in a gloo group of two, and
one short run of the command (ours at N=1 and N=2, FSDP2 at N=2) with its figures checked."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from offload.bench import distributed as bench_dp
from offload.bench.collectives import CollectiveCounter, zero3_bytes
from offload.models import llama
from tests.helpers.ranks import launch

pytestmark = pytest.mark.slow


def counted_collectives(spec) -> dict:
    """One rank (tests/helpers/ranks.py): a few collectives under the counter; its snapshot."""
    dist.init_process_group("gloo")     # rank, world and rendezvous from the launcher's variables
    try:
        with CollectiveCounter() as c:
            piece = torch.ones(1000, dtype=torch.bfloat16)                # 2000 B per rank
            # The names both torch 2.11 and 2.13 have (2.13 also calls them *_single).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(torch.empty(2000, dtype=torch.bfloat16), piece)
                dist.reduce_scatter_tensor(torch.empty(1000, dtype=torch.bfloat16),
                                           torch.ones(2000, dtype=torch.bfloat16))
            dist.all_reduce(torch.ones(500))                               # 2000 B
            dist.broadcast(torch.ones(250), src=1)                         # 1000 B from rank 1
        return c.snapshot()
    finally:
        dist.destroy_process_group()


def test_counter_in_a_real_group_of_two(tmp_path):
    ranks = launch(f"{__name__}:counted_collectives", None, 2, tmp_path, timeout_s=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.output[-2000:] for r in ranks]
    results = [r.value for r in ranks]
    for rank in (0, 1):
        s = results[rank]
        assert s["by_op"]["all_gather"] == 2000 and s["by_op"]["reduce_scatter"] == 2000
        assert s["by_op"]["all_reduce"] == 2000                            # 2 (N-1)/N of 2000
        assert s["ops"] == 4
    # broadcast from rank 1 over two ranks: rank 1 sends, rank 0 receives
    assert results[1]["sent_bytes"] == 6000 + 1000 and results[1]["received_bytes"] == 6000
    assert results[0]["sent_bytes"] == 6000 and results[0]["received_bytes"] == 6000 + 1000
    assert results[0]["by_op"]["broadcast"] == 0 and results[0]["by_op_received"]["broadcast"] == 1000


MICRO = llama.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_layers=2,
                          num_heads=2, num_kv_heads=1, max_seq_len=128, tie_embeddings=True)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """Two ranks, two samples: ``offload bench step --nproc 2`` at a preset smaller than tiny
    (tiny takes minutes on a loaded 2-core box). One run serves every test below."""
    r = bench_dp.measure(tmp_path_factory.mktemp("dp"), nproc=2, preset=MICRO, steps=2, warmup=1,
                         batch_tokens=256)
    bench_dp.print_report(r)
    return r


def test_short_run_figures_hang_together(short_run):
    """FSDP2's bytes sit just under the ZeRO-3 figure (its root stays gathered from forward into
    backward); the engine's own count is the counter's; one and two ranks train alike."""
    r = short_run
    assert r["nproc"] == 2 and r["backend"] in ("gloo", "nccl") and r["global_batch_tokens"] == 256
    zero3 = zero3_bytes(r["params"], 2, 2)
    assert r["zero3_bytes_per_rank"] == zero3
    f = r["fsdp2"]
    assert f["bytes_steady"] and f["sent_bytes_per_rank"] == f["received_bytes_per_rank"]
    assert 0.9 * zero3 <= max(f["sent_bytes_per_rank"]) <= zero3
    assert set(f["by_op_per_rank"][0]) == {"all_gather", "reduce_scatter"}
    one = r["single"]
    assert one["step_s"] > 0 and len(one["losses"]) == 1 + 2 * 2
    # the same model, data and seed: FSDP2's loss before its first update is ours'
    assert f["losses"][0] == pytest.approx(one["losses"][0], rel=1e-3)
    ours = r["ours"]
    assert not ours.get("error"), ours
    assert ours["bytes_steady"]
    assert ours["engine_matches_counter"], (ours["engine_collectives_per_rank"], ours["sent_bytes_per_rank"])
    assert ours["layout"]["chunk_size"] == r["run"]["chunk_size"]
    assert r["step_n_over_1"] > 0 and r["ours_over_fsdp2_time"] > 0
    # two ranks on halves of the global batch train the model one rank trains on all of it
    assert ours["losses"][0] == pytest.approx(one["losses"][0], rel=1e-3)
    assert ours["losses"][-1] == pytest.approx(one["losses"][-1], rel=2e-2)


def test_ours_moves_no_more_than_fsdp2(short_run):
    r = short_run
    assert r["ours_over_fsdp2_bytes"] <= 1.0, (r["ours"]["sent_bytes_per_rank"], r["fsdp2"]["sent_bytes_per_rank"])
