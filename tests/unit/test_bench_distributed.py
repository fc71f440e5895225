"""offload bench step --nproc: ring accounting, the counter's plumbing, the summary and report shape,
and the command's argument errors. Real ranks (the counter in a group of two, a short run) are in
tests/integration/test_bench_step_distributed.py."""

from __future__ import annotations

import warnings

import json
import os

import pytest
import torch
import torch.distributed as dist

from offload.bench import distributed as bench_dp
from offload.bench.distributed_rank import split_rows
from offload.bench.collectives import CollectiveCounter, ring_bytes, zero3_bytes
from offload.errors import ConfigError
from offload.models import llama

# ---- arithmetic ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_bytes_of_each_collective(n):
    b = 1000 * n
    for op in ("all_gather", "reduce_scatter"):
        assert ring_bytes(op, b, n, rank=1) == ((n - 1) * b, (n - 1) * b)
    assert ring_bytes("all_reduce", b, n) == (2 * (n - 1) * b // n,) * 2
    # all-reduce = reduce-scatter + all-gather of the 1/N pieces
    rs = ring_bytes("reduce_scatter", b // n, n)[0]
    ag = ring_bytes("all_gather", b // n, n)[0]
    assert ring_bytes("all_reduce", b, n)[0] == rs + ag
    for op in ("broadcast", "reduce", "gather", "scatter"):
        for root in (0, n - 1):
            per_rank = [ring_bytes(op, b, n, rank=r, root=root) for r in range(n)]
            # whatever the root, the group as a whole moves (N-1) copies of the tensor
            assert sum(s for s, _ in per_rank) == sum(r for _, r in per_rank) == (n - 1) * b, (op, root)
    assert ring_bytes("broadcast", b, n, rank=3 % n, root=3 % n) == (b, 0)      # the root only sends
    assert ring_bytes("reduce", b, n, rank=0, root=0) == (0, b)                  # the root only receives
    assert ring_bytes("send", 7, n) == (7, 0) and ring_bytes("recv", 7, n) == (0, 7)
    assert ring_bytes("barrier", 0, n) == (0, 0)


def test_one_rank_moves_nothing_and_unknown_ops_are_refused():
    assert ring_bytes("all_gather", 10**6, 1) == (0, 0)
    with pytest.raises(ValueError, match="frobnicate"):
        ring_bytes("frobnicate", 1, 2)


def test_zero3_figure():
    # 3 passes (gather for forward, gather for backward, reduce-scatter) of (N-1)/N of the bf16 model
    assert zero3_bytes(1_000_000, 2, 2) == 3_000_000
    assert zero3_bytes(1_000_000, 2, 4) == 4_500_000
    assert zero3_bytes(1_000_000, 2, 1) == 0


# ---- the counter --------------------------------------------------------------------------------


class _FakeGroup:
    def __init__(self, rank, world):
        self._rank, self._world, self.calls = rank, world, []

    def size(self):
        return self._world

    def rank(self):
        return self._rank


def test_counter_wraps_with_ring_accounting_and_snapshots_subtract():
    c = CollectiveCounter()
    g = _FakeGroup(1, 2)
    seen = []
    gather = c._wrap(lambda group, out, inp, opts: seen.append("ag"), "all_gather",
                     lambda a: a[1].numel() * a[1].element_size(), None)
    before = c.snapshot()
    gather(g, torch.empty(8, dtype=torch.bfloat16), torch.empty(4, dtype=torch.bfloat16), None)
    c.record("reduce_scatter", 100, 2, 1)
    d = CollectiveCounter.since(c.snapshot(), before)
    assert seen == ["ag"]
    assert d == {"sent_bytes": 8 + 100, "received_bytes": 8 + 100, "ops": 2,
                 "by_op": {"all_gather": 8, "reduce_scatter": 100},
                 "by_op_received": {"all_gather": 8, "reduce_scatter": 100}}


def test_counter_counts_each_public_call_once_in_a_group_of_one(tmp_path):
    """Every public name of a collective reaches one ProcessGroup method: one op each, whichever
    name was called (torch 2.13's all_gather_single and its deprecated alias
    all_gather_into_tensor; torch 2.11 has only the latter, on another method). World 1: no bytes."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    modern = hasattr(dist, "all_gather_single")
    try:
        with CollectiveCounter() as c, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)      # the alias is deprecated in 2.13
            t = torch.ones(4)
            dist.all_gather_into_tensor(torch.empty(4), t)
            dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4))
            if modern:
                dist.all_gather_single(torch.empty(4), t)
                dist.reduce_scatter_single(torch.empty(4), torch.ones(4))
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            s = c.snapshot()
        assert s["ops"] == (6 if modern else 4) and s["sent_bytes"] == 0
        with pytest.raises(RuntimeError, match="already installed"):
            with CollectiveCounter(), CollectiveCounter():
                pass
        # uninstalled: nothing counted any more, the methods are torch's again
        before = c.snapshot()
        dist.all_reduce(t)
        assert c.snapshot() == before
        assert not hasattr(dist.ProcessGroup.allreduce, "__wrapped__")
    finally:
        dist.destroy_process_group()


# ---- summary and report -------------------------------------------------------------------------


def _rank_result(rank, times, sent, engine=None, error=None):
    if error:
        return {"rank": rank, "ours": {"error": error}, "fsdp2": None}
    coll = [{"sent_bytes": s, "received_bytes": s, "ops": 10,
             "by_op": {"all_gather": 2 * s // 3, "reduce_scatter": s // 3},
             "by_op_received": {"all_gather": 2 * s // 3, "reduce_scatter": s // 3}} for s in sent]
    part = {"step_times_s": times, "collectives": coll, "losses": [5.0 + rank, 4.0 + rank],
            "engine_collectives": [engine] * len(sent) if engine else [], "layout": {"chunks": 4, "chunk_size": 4096}}
    return {"rank": rank, "ours": part, "fsdp2": {**part, "engine_collectives": []}}


def test_summary_takes_the_slowest_rank_per_sample_and_median_bytes():
    engine = {"sent_bytes": 300, "received_bytes": 300, "by_op": {"all_gather": 200, "reduce_scatter": 100}}
    results = [_rank_result(0, [1.0, 3.0, 2.0], [300, 300, 600], engine=engine),
               _rank_result(1, [2.0, 1.0, 2.5], [300, 300, 300], engine=engine)]
    # the engine's own count, sample by sample (rank 0's third sample moved twice as much)
    results[0]["ours"]["engine_collectives"][2] = {"by_op": {"all_gather": 400, "reduce_scatter": 200}}
    s = bench_dp.summarize(results, "ours")
    assert s["step_times_s"] == [2.0, 3.0, 2.5] and s["step_s"] == 2.5
    assert s["sent_bytes_per_rank"] == [300, 300] and s["bytes_steady"] is False
    assert s["losses"] == [5.5, 4.5]                          # the mean over ranks = the global batch's
    assert s["engine_matches_counter"] is True
    assert s["volume_bytes"] == 300
    results[1]["ours"]["engine_collectives"] = [engine, engine, {"sent_bytes": 1, "received_bytes": 300,
                                                                 "by_op": {"all_gather": 1}}]
    assert bench_dp.summarize(results, "ours")["engine_matches_counter"] is False
    assert "engine_collectives_per_rank" not in bench_dp.summarize(results, "fsdp2")


def test_engine_cross_check_is_per_op_and_per_direction():
    ag = {"all_gather": 10}
    # a 4-byte broadcast from rank 0 of 2: the counter follows the chain (rank 0 sends, rank 1
    # receives), the engine may split it evenly; the group's totals agree
    sent = [{"all_gather": 10, "broadcast": 4}, {"all_gather": 10}]
    received = [{"all_gather": 10}, {"all_gather": 10, "broadcast": 4}]
    even = [{"by_op": {"all_gather": 10, "broadcast": 2}}] * 2
    assert bench_dp.engine_agrees(even, sent, received)
    assert not bench_dp.engine_agrees([{"by_op": {"all_gather": 10, "broadcast": 4}}] * 2, sent, received)
    # symmetric ops agree rank by rank
    assert not bench_dp.engine_agrees([{"by_op": {"all_gather": 12}}, {"by_op": ag}], [ag, ag], [ag, ag])
    assert not bench_dp.engine_agrees([{"by_op": ag}] * 2, [{**ag, "reduce": 4}, ag], [ag, {**ag, "reduce": 4}])
    assert not bench_dp.engine_agrees([None, {"by_op": ag}], [ag, ag], [ag, ag])


def test_summary_carries_a_refusal():
    results = [_rank_result(0, None, None, error="UnsupportedError: no"), _rank_result(1, None, None, error="x")]
    assert bench_dp.summarize(results, "ours") == {"error": "UnsupportedError: no"}
    assert bench_dp.summarize(results, "fsdp2") is None


MICRO = llama.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=172, num_layers=1, num_heads=2,
                          num_kv_heads=1, max_seq_len=32, tie_embeddings=True)


def test_report_json_shape_and_ratios(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_spawn(world, spec):
        calls.append((world, spec["threads"], spec["fsdp"]))
        if world == 1:
            return [_rank_result(0, [4.0, 4.0], [0, 0])]
        engine = {"sent_bytes": 900, "received_bytes": 900, "by_op": {"all_gather": 600, "reduce_scatter": 300}}
        return [_rank_result(r, [3.0, 3.0], [900, 900], engine=engine) for r in range(world)]

    monkeypatch.setattr(bench_dp, "_spawn", fake_spawn)
    r = bench_dp.measure(tmp_path, nproc=2, preset=MICRO, steps=2, warmup=1, batch_tokens=64, device="cpu")
    assert [c[0] for c in calls] == [1, 2] and calls[0][2] is False
    assert set(r) == {"device", "nproc", "backend", "params", "compute_dtype", "global_batch_tokens",
                      "threads_per_rank", "threads_single", "zero3_bytes_per_rank", "ours", "fsdp2", "single",
                      "ours_over_zero3", "fsdp2_over_zero3", "ours_over_fsdp2_bytes", "ours_exceeds_fsdp2", "step_n_over_1",
                      "ours_over_fsdp2_time", "run"}
    assert r["backend"] == "gloo" and r["global_batch_tokens"] == 64
    assert r["zero3_bytes_per_rank"] == zero3_bytes(r["params"], 2, 2)
    assert r["ours_over_zero3"] == pytest.approx(900 / r["zero3_bytes_per_rank"])
    assert r["ours_over_fsdp2_bytes"] == 1.0 and r["ours_exceeds_fsdp2"] is False and r["step_n_over_1"] == 0.75
    assert r["run"]["nvme"] is False and os.listdir(tmp_path) == []
    bench_dp.print_report(r)
    out = capsys.readouterr().out
    assert "ZeRO-3" in out and "ours/FSDP2 1.000 (at most FSDP2's" in out and "N/1 0.75" in out and "agrees" in out
    # without FSDP2 (--no-in-memory) the volume line holds ours alone
    bench_dp.print_report({**r, "fsdp2": None, "fsdp2_over_zero3": None, "ours_over_fsdp2_bytes": None,
                           "ours_exceeds_fsdp2": None, "ours_over_fsdp2_time": None})
    out = capsys.readouterr().out
    assert "FSDP2" not in out and "nan" not in out and "ours/ZeRO-3" in out


# ---- arguments ----------------------------------------------------------------------------------


def test_dp_chunk_size_gives_several_chunks_to_overlap_whatever_the_ranks():
    from offload.chunks import ChunkLayout

    model = llama.LlamaForCausalLM(llama.get_preset("tiny"))
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    numels = [p.numel() for _, p in model.named_parameters()]
    size = bench_dp.dp_chunk_size(numels)
    layout = ChunkLayout.build(shapes, size)
    assert layout.num_chunks >= bench_dp.CHUNKS_FOR_OVERLAP
    assert size >= max(numels)


def test_chunk_size_argument():
    assert bench_dp.parse_chunk_size("auto") == "auto" and bench_dp.parse_chunk_size("4096") == 4096


def test_argument_checks():
    assert bench_dp.check_args(2, 512, 256, "cpu") == (2, 256)
    assert split_rows(4, 2, 1) == slice(2, 4)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="--nproc"):
            bench_dp.check_nproc(bad)
    with pytest.raises(ConfigError, match="--batch-tokens.*multiple of 512"):
        bench_dp.check_args(2, 256, 256, "cpu")


@pytest.mark.parametrize("argv, field", [
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "-3"], "--nproc"),
    (["--nproc", "2", "--batch-curve", "64"], "--batch-curve"),
    (["--nproc", "2", "--chunk-size", "1000"], "--chunk-size"),
    (["--nproc", "2", "--chunk-size", "big"], "--chunk-size"),
    (["--nproc", "2", "--batch-tokens", "100", "--preset", "tiny"], "--batch-tokens"),
])
def test_command_errors_are_one_line(argv, field, tmp_path, capsys):
    from offload.cli import main

    rc = main(["bench", "step", "--path", str(tmp_path / "p"), *argv])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("offload: error: " + field) and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "p").exists()


def test_nproc_must_be_a_number(capsys):
    from offload.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--nproc", "two"])
    assert exc.value.code == 2 and "--nproc" in capsys.readouterr().err


def test_command_runs_the_distributed_bench(tmp_path, monkeypatch, capsys):
    from offload.cli import main

    def fake_spawn(world, spec):
        return [_rank_result(r, [1.0, 1.0], [100, 100]) for r in range(world)]

    monkeypatch.setattr(bench_dp, "_spawn", fake_spawn)
    out = tmp_path / "dp.json"
    rc = main(["bench", "step", "--path", str(tmp_path / "p"), "--preset", "tiny", "--nproc", "2",
               "--steps", "2", "--json", str(out)])
    assert rc == 0 and "--nproc 2" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["nproc"] == 2 and r["run"]["preset"] == "tiny" and r["fsdp2"]["step_s"] == 1.0


@pytest.mark.parametrize("nproc", [1, 2, 3, 8])
def test_the_default_batch_splits_over_any_number_of_ranks(nproc):
    """`offload bench step --nproc N` runs on its defaults (it refused N=2: 512 tokens were one
    sequence two ranks cannot share): one sequence of 512 tokens a rank by default."""
    import argparse

    from offload.bench.step import add_arguments, default_tokens
    from offload.models.llama import get_preset

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--nproc", str(nproc)])
    rows, seq = bench_dp.check_args(nproc, default_tokens(args), get_preset("small").max_seq_len, "cpu")
    assert rows == nproc and seq == 512
    assert default_tokens(parser.parse_args(["--nproc", str(nproc), "--batch-tokens", "4096"])) == 4096
