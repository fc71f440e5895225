"""The pure parts of checkpoints of several ranks: which file of a round-robin (version 2)
checkpoint holds which chunk, per-file size checks, how one rank reports a failure to the
others, and that the kinds a checkpoint expects are the kinds the engine registers. (Sliced
version-3 pieces: test_checkpoint_pieces.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import offload
from offload.checkpoint.format import check_kind_file_size, entry_file, entry_rank, kind_files
from offload.checkpoint.model_state import model_kinds
from offload.checkpoint.ranks import PeerFailed, Ranks, peer_error, report, shard_dir
from offload.errors import ChecksumError, ConfigError, OffloadError


def sharded_info(world: int, chunks: int, chunk_bytes: int = 16) -> dict:
    entries, offsets = [], [0] * world
    for c in range(chunks):
        r = c % world
        entries.append({"offset": offsets[r], "crc32c": 0, "rank": r})
        offsets[r] += chunk_bytes
    return {"files": [f"{shard_dir(r)}/param.bin" for r in range(world)], "dtype": "float32",
            "chunk_bytes": chunk_bytes, "chunks": entries}


def test_entry_file_names_the_saving_ranks_file():
    info = sharded_info(3, 7)
    assert [entry_file(info, e) for e in info["chunks"]] == [
        f"rank-0000{c % 3}/param.bin" for c in range(7)]
    assert [entry_rank(e) for e in info["chunks"]] == [c % 3 for c in range(7)]
    assert kind_files(info) == ["rank-00000/param.bin", "rank-00001/param.bin", "rank-00002/param.bin"]


def test_single_process_entries_use_the_kinds_one_file():
    info = {"file": "param.bin", "dtype": "float32", "chunk_bytes": 16, "chunks": [{"offset": 0, "crc32c": 1}, None]}
    assert entry_file(info, info["chunks"][0]) == "param.bin"
    assert entry_rank(info["chunks"][0]) == 0
    assert kind_files(info) == ["param.bin"]


def _write_files(root: Path, info: dict, chunk_bytes: int = 16) -> None:
    for name in kind_files(info):
        count = sum(1 for e in info["chunks"] if e is not None and entry_file(info, e) == name)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"\0" * count * chunk_bytes)


def test_each_ranks_file_is_checked_against_its_own_chunks(tmp_path):
    info = sharded_info(2, 5)            # rank 0: chunks 0, 2, 4; rank 1: chunks 1, 3
    _write_files(tmp_path, info)
    check_kind_file_size(tmp_path, "param", info)
    short = tmp_path / "rank-00001" / "param.bin"
    short.write_bytes(b"\0" * 16)
    with pytest.raises(ChecksumError, match="rank-00001/param.bin.*holds 16 bytes.*2 chunks of 32 bytes"):
        check_kind_file_size(tmp_path, "param", info)
    check_kind_file_size(tmp_path, "param", info, ["rank-00000/param.bin"])   # only the files asked for
    short.unlink()
    with pytest.raises(OffloadError, match="rank-00001/param.bin is missing"):
        check_kind_file_size(tmp_path, "param", info, ["rank-00001/param.bin"])


def test_one_rank_needs_no_process_group():
    ranks = Ranks(None)
    assert not ranks.sharded and ranks.lead
    assert ranks.gather("x") == ["x"]
    assert ranks.broadcast(3) == 3
    assert ranks.settle(None, "anything", value=7) == [7]
    with pytest.raises(ValueError, match="boom"):
        ranks.settle(ValueError("boom"), "anything")


def test_a_peers_failure_names_its_rank_and_keeps_a_config_errors_type():
    err = peer_error(2, report(ChecksumError("/x/rank-00002/param.bin", 64, 16, "crc32c mismatch in chunk param[5]")),
                     "loading checkpoint /x")
    assert isinstance(err, PeerFailed) and "rank 2" in str(err) and "param[5]" in str(err)
    cfg = peer_error(1, report(ConfigError("dtype", "bf16", "the checkpoint /x was saved with dtype 'fp32'")), "loading")
    assert isinstance(cfg, ConfigError) and cfg.field == "dtype" and "rank 1" in str(cfg)


@pytest.mark.parametrize("dtype,frozen", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_model_kinds_are_the_kinds_the_engine_registers(dtype, frozen):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    if frozen:
        model[0].requires_grad_(False)
    wrapped = offload.wrap(model, offload.OffloadConfig(device="cpu", dtype=dtype, cpu_budget="1MiB", chunk_size=2048))
    engine = wrapped.offload_engine
    try:
        registered = {}
        for (kind, c), rec in engine.store.records.items():
            if kind != "grad":
                registered.setdefault(kind, rec.dtype)
        assert model_kinds(engine.chunks) == registered
    finally:
        engine.close()
