"""Every format version loads, in one process: a single process's checkpoint (version 1), one of
round-robin ranks (version 2, no longer written) and one of sliced ranks (version 3) -- the two
last rewritten by hand from a version-1 checkpoint (tests/helpers/old_checkpoints.py) -- give
back the very state that was saved, in every kind, and training goes on identically. A damaged
piece is named by its rank's file, chunk and elements, and the resume falls back. Reading a
span of M ranks from the files of N (pieces across its edges included) gives the chunk's values."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import offload
from offload.checkpoint import CheckpointSkipped, save_checkpoint, verify_checkpoint
from offload.checkpoint.format import MANIFEST, MANIFEST_CRC, checksum, chunk_pieces, manifest_bytes
from offload.checkpoint.pieces import Piece, clip, copies
from offload.checkpoint.reading import OpenFiles, fill_span
from offload.errors import ChecksumError, OffloadError
from tests.helpers.old_checkpoints import rewrite


def build(dtype: str = "bf16", seed: int = 0):
    torch.manual_seed(seed)
    # 4160-element Linears are oversized for 2048-element chunks (chunks of their own size); the
    # frozen first one has no master or Adam state.
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8),
                              torch.nn.Linear(8, 8))
    net[0].requires_grad_(False)
    model = offload.wrap(net, offload.OffloadConfig(device="cpu", dtype=dtype, chunk_size=2048))
    return model, offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def step(model, opt, seed: int) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))
    model(x.to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def state(model) -> dict[tuple[str, int], torch.Tensor | None]:
    """Every kind of every chunk, as the engine holds it once the queued Adam updates are done."""
    chunks = model.offload_engine.chunks
    chunks.drain()
    return {(kind, info.index): (None if (v := chunks.read(kind, info.index)) is None else v.clone())
            for info in chunks.chunks() for kind in info.kinds}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] is None) == (b[key] is None), key
        if a[key] is not None:      # bytes: the gaps between parameters may hold NaN on purpose
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A bf16 model after 2 steps, its checkpoints at steps 1 and 2 (version 1), its state at 2
    and after a third step."""
    root = tmp_path_factory.mktemp("versions") / "ckpt"
    model, opt = build()
    step(model, opt, 1)
    save_checkpoint(model, opt, root, step=1)
    step(model, opt, 2)
    save_checkpoint(model, opt, root, step=2)
    at2 = state(model)
    step(model, opt, 3)
    after = state(model)
    model.offload_engine.close()
    return root, at2, after


@pytest.mark.parametrize("version,world", [(1, 1), (2, 2), (2, 3), (3, 2), (3, 3), (3, 5)])
def test_every_version_loads_the_saved_state_and_training_goes_on_identically(saved, tmp_path, version, world):
    src, at2, after = saved
    root = tmp_path / "ckpt"
    shutil.copytree(src, root)
    if version > 1:
        rewrite(root / "step-00000002", world, version)
    manifest = json.loads((root / "step-00000002" / MANIFEST).read_text())
    assert manifest["version"] == version and manifest.get("world", 1) == world
    model, opt = build(seed=7)
    loaded = offload.load_checkpoint(model, opt, root)
    assert loaded["step"] == 2 and not loaded["skipped"]
    assert_same_state(state(model), at2)
    step(model, opt, 3)
    assert_same_state(state(model), after)


@pytest.mark.parametrize("version,world", [(2, 3), (3, 3)])
def test_verify_reads_every_piece_of_every_rank(saved, tmp_path, version, world):
    ckpt = tmp_path / "step-00000002"
    shutil.copytree(saved[0] / "step-00000002", ckpt)
    rewrite(ckpt, world, version)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    verdict = verify_checkpoint(ckpt)
    assert verdict.ok, verdict.problems
    entries = [(info, e) for info in manifest["kinds"].values() for e in info["chunks"] if e is not None]
    assert verdict.world == world and verdict.files == world * len(manifest["kinds"])
    assert verdict.chunks == len(entries)
    assert verdict.pieces == sum(len(chunk_pieces(info, e)) for info, e in entries)
    assert (verdict.pieces > verdict.chunks) == (version == 3)


def test_a_damaged_piece_names_its_rank_file_chunk_and_elements_and_the_resume_falls_back(saved, tmp_path):
    src, _, _ = saved
    root = tmp_path / "ckpt"
    shutil.copytree(src, root)
    for s in (1, 2):
        rewrite(root / f"step-0000000{s}", 3, 3)
    newest = root / "step-00000002"
    manifest = json.loads((newest / MANIFEST).read_text())
    piece = manifest["kinds"]["exp_avg"]["chunks"][2]["pieces"][1]
    assert piece["rank"] == 1
    path = newest / piece["file"]
    raw = bytearray(path.read_bytes())
    raw[piece["offset"] + 5] ^= 0x20
    path.write_bytes(bytes(raw))

    verdict = verify_checkpoint(newest)
    assert not verdict.ok and len(verdict.problems) == 1
    assert verdict.problems[0].startswith("rank 1: ") and "rank-00001/exp_avg.bin" in verdict.problems[0]
    model, opt = build(seed=7)
    with pytest.raises(ChecksumError) as info:
        offload.load_checkpoint(model, opt, newest)          # that one only: no fallback
    message = str(info.value)
    assert message.startswith(f"{path}: checksum mismatch")
    assert f"exp_avg[2] (rank 1's piece, elements [{piece['lo']}, {piece['hi']}))" in message
    with pytest.warns(CheckpointSkipped, match="step-00000002.*exp_avg\\[2\\]"):
        loaded = offload.load_checkpoint(model, opt, root)
    assert loaded["step"] == 1 and "rank-00001/exp_avg.bin" in loaded["skipped"][0]["reason"]


def test_pieces_that_do_not_tile_a_chunk_are_damage_not_a_mismatch(saved, tmp_path):
    src, _, _ = saved
    root = tmp_path / "ckpt"
    shutil.copytree(src, root)
    rewrite(root / "step-00000002", 2, 3)
    newest = root / "step-00000002"
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest.pop(MANIFEST_CRC)
    pieces = manifest["kinds"]["param"]["chunks"][1]["pieces"]
    pieces[1]["lo"] += 1                    # a gap in the chunk, the manifest's own checksum valid
    pieces[1]["hi"] += 1
    (newest / MANIFEST).write_bytes(manifest_bytes(manifest))
    assert any("param[1]" in p and "no piece holds elements" in p for p in verify_checkpoint(newest).problems)
    model, opt = build(seed=7)
    with pytest.raises(OffloadError, match=r"pieces of chunk param\[1\] do not tile") as info:
        offload.load_checkpoint(model, opt, newest)
    assert type(info.value) is OffloadError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert offload.load_checkpoint(model, opt, root)["step"] == 1
    assert [w.category for w in caught] == [CheckpointSkipped]


@pytest.mark.parametrize("n,m", [(2, 3), (3, 2), (1, 4), (4, 1), (3, 7), (5, 5)])
def test_a_span_of_m_ranks_is_filled_from_the_files_of_n_and_a_bad_piece_is_caught(tmp_path, n, m):
    numel, itemsize = 1001, 4
    chunk = torch.arange(numel, dtype=torch.float32) * 0.5 - 3
    pieces, p = [], -(-numel // n)
    if n > 1:           # the last rank's piece a zeros piece: its Adam never ran there
        chunk[(n - 1) * p:] = 0
    raw = chunk.view(torch.uint8)
    for r in range(n):
        lo, hi = clip((r * p, r * p + p), numel)
        if lo < hi and r == n - 1 and n > 1:
            pieces.append(Piece(rank=r, lo=lo, hi=hi, file=None, offset=0, nbytes=0, crc=None))
        elif lo < hi:
            part = raw[lo * itemsize:hi * itemsize].clone()
            (tmp_path / f"r{r}.bin").write_bytes(b"\xee" * 12 + bytes(part.numpy()))      # after other data
            pieces.append(Piece(rank=r, lo=lo, hi=hi, file=f"r{r}.bin", offset=12, nbytes=part.numel(),
                                crc=checksum("crc32", part)))
    q = -(-numel // m)
    padded = torch.cat([chunk, torch.zeros(m * q - numel)])
    scratch = torch.empty(max(x.nbytes for x in pieces), dtype=torch.uint8)
    for r in range(m):
        span = (r * q, r * q + q)
        stored = clip(span, numel)
        out = torch.full((q * itemsize,), 0xAB, dtype=torch.uint8)            # stale bytes: all must go
        with OpenFiles(tmp_path) as files:
            fill_span(files, "param", 0, pieces, copies([(x.lo, x.hi) for x in pieces], stored), out,
                      stored[1] - stored[0], itemsize, scratch, "crc32")
        assert torch.equal(out.view(torch.float32), padded[span[0]:span[1]]), r
    bad = tmp_path / "r0.bin"
    data = bytearray(bad.read_bytes())
    data[12 + 7] ^= 1
    bad.write_bytes(bytes(data))
    with OpenFiles(tmp_path) as files, pytest.raises(ChecksumError, match=r"r0.bin: checksum mismatch .* of chunk param\[0\]"):
        fill_span(files, "param", 0, pieces, copies([(x.lo, x.hi) for x in pieces], clip((0, q), numel)),
                  torch.empty(q * itemsize, dtype=torch.uint8), min(q, numel), itemsize, scratch, "crc32")
