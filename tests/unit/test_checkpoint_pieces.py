"""Resharding a checkpoint is arithmetic on element ranges: the pieces N ranks save tile each
chunk, and the copies that fill a span of M ranks take every element of it exactly once from
the piece that holds it -- for any N, M and chunk size. Also: every manifest version reads as
pieces, the per-file size check counts pieces, and the manifest's entries are put together from
what each rank wrote."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.checkpoint.entries import Empty, Written, merge, saved_bytes
from offload.checkpoint.format import chunk_numel, chunk_pieces, check_kind_file_size, kind_files
from offload.checkpoint.pieces import Piece, clip, copies, tiling_error
from offload.errors import ChecksumError, OffloadError


def even_span(numel: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s span of a chunk sliced over ``world`` ranks (the design's rule)."""
    p = -(-numel // world)
    return rank * p, rank * p + p


def saved_pieces(numel: int, world: int) -> list[tuple[int, int]]:
    """What ``world`` ranks store of a chunk: each span cut at ``numel``, the empty ones left out."""
    out = []
    for r in range(world):
        lo, hi = clip(even_span(numel, world, r), numel)
        if lo < hi:
            out.append((lo, hi))
    return out


sizes = st.integers(1, 1 << 22)
worlds = st.integers(1, 600)


@settings(max_examples=400, deadline=None)
@given(numel=sizes, n=worlds, m=worlds)
def test_the_copies_fill_every_span_of_m_ranks_from_the_pieces_of_n_exactly_once(numel, n, m):
    pieces = saved_pieces(numel, n)
    assert tiling_error(pieces, numel) is None
    covered = 0
    for r in range(m):
        lo, hi = even_span(numel, m, r)
        assert hi - lo == -(-numel // m) and m * (hi - lo) - numel < m        # padding < M elements
        want = clip((lo, hi), numel)
        at = 0
        for cp in copies(pieces, want):
            plo, phi = pieces[cp.piece]
            assert cp.dst == at and cp.numel > 0                               # in order, no gap, no overlap
            assert 0 <= cp.src and cp.src + cp.numel <= phi - plo              # inside its piece
            assert want[0] + cp.dst == plo + cp.src                            # the same chunk element
            assert cp.whole(pieces) == (cp.src == 0 and cp.numel == phi - plo)
            at += cp.numel
        assert at == want[1] - want[0]
        covered += at
    assert covered == numel


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(1, 5000), n=st.integers(1, 40), m=st.integers(1, 40))
def test_resliced_values_equal_the_chunk_padded_with_zeros(numel, n, m):
    chunk = torch.arange(1, numel + 1, dtype=torch.float32)
    pieces = saved_pieces(numel, n)
    stored = [chunk[lo:hi] for lo, hi in pieces]
    p = -(-numel // m)
    padded = torch.cat([chunk, torch.zeros(m * p - numel)])
    for r in range(m):
        lo, hi = even_span(numel, m, r)
        out = torch.zeros(hi - lo)
        for cp in copies(pieces, clip((lo, hi), numel)):
            out[cp.dst:cp.dst + cp.numel] = stored[cp.piece][cp.src:cp.src + cp.numel]
        assert torch.equal(out, padded[lo:hi])


@given(numel=sizes, m=worlds)
def test_a_whole_chunk_of_an_old_checkpoint_is_one_piece_each_span_copies_from(numel, m):
    for r in range(m):
        lo, hi = clip(even_span(numel, m, r), numel)
        found = copies([(0, numel)], (lo, hi))
        if lo == hi:
            assert found == []                  # a span wholly past the chunk: only padding
        else:
            assert [(c.piece, c.src, c.dst, c.numel) for c in found] == [(0, lo, 0, hi - lo)]


def test_a_span_wholly_past_the_chunk_is_padding_and_copies_nothing():
    # 5 elements over 8 ranks: ranks 5..7 hold only padding.
    assert [clip(even_span(5, 8, r), 5) for r in range(8)] == [(r, r + 1) for r in range(5)] + [(5, 5), (6, 6), (7, 7)]
    assert copies(saved_pieces(5, 8), (6, 6)) == []
    assert saved_pieces(5, 8) == [(r, r + 1) for r in range(5)]


@pytest.mark.parametrize("pieces,numel,why", [
    ([(0, 4), (5, 10)], 10, "no piece holds elements [4, 5)"),
    ([(0, 6), (5, 10)], 10, "pieces overlap at elements [5, 6)"),
    ([(0, 6), (6, 12)], 10, "ends at element 12, past the chunk's 10"),
    ([(0, 6)], 10, "no piece holds elements [6, 10)"),
    ([(0, 6), (6, 6), (6, 10)], 10, "an empty piece [6, 6)"),
    ([(2, 10)], 10, "no piece holds elements [0, 2)"),
])
def test_pieces_that_do_not_tile_the_chunk_are_named(pieces, numel, why):
    assert why in tiling_error(pieces, numel)


def test_a_span_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match=r"span \(4, 2\)"):
        clip((4, 2), 10)


# ---- the manifest's three versions, read as pieces ---------------------------------------------
def test_each_manifest_version_reads_as_pieces():
    v1 = {"file": "param.bin", "dtype": "float32", "chunk_bytes": 64,
          "chunks": [{"offset": 0, "crc32c": 7}, {"offset": 64, "crc32c": 8, "nbytes": 24}, None]}
    assert chunk_pieces(v1, v1["chunks"][1], "crc32c") == [Piece(rank=0, lo=0, hi=6, file="param.bin", offset=64,
                                                                 nbytes=24, crc=8)]
    assert chunk_numel(v1, v1["chunks"][0]) == 16
    v2 = {"files": ["rank-00000/param.bin", "rank-00001/param.bin"], "dtype": "bfloat16", "chunk_bytes": 64,
          "chunks": [{"offset": 0, "crc32c": 1, "rank": 0}, {"offset": 0, "crc32c": 2, "rank": 1}]}
    assert chunk_pieces(v2, v2["chunks"][1], "crc32c") == [Piece(rank=1, lo=0, hi=32, file="rank-00001/param.bin",
                                                                 offset=0, nbytes=64, crc=2)]
    v3 = {"files": ["rank-00000/param.bin", "rank-00001/param.bin"], "dtype": "float32",
          "chunks": [{"numel": 5, "pieces": [
              {"rank": 0, "lo": 0, "hi": 3, "file": "rank-00000/param.bin", "offset": 0, "nbytes": 12, "crc": 3},
              {"rank": 1, "lo": 3, "hi": 5, "file": "rank-00001/param.bin", "offset": 0, "nbytes": 8, "crc": 4}]}]}
    got = chunk_pieces(v3, v3["chunks"][0], "crc32c")
    assert [(p.rank, p.lo, p.hi, p.nbytes, p.crc) for p in got] == [(0, 0, 3, 12, 3), (1, 3, 5, 8, 4)]
    assert chunk_numel(v3, v3["chunks"][0]) == 5
    assert [p.crc for p in chunk_pieces(v3, v3["chunks"][0])] == [None, None]       # sizes only


def sliced_info(numel: int, world: int, chunks: int) -> dict:
    files = [f"rank-{r:05d}/param.bin" for r in range(world)]
    offsets = [0] * world
    entries = []
    for _ in range(chunks):
        pieces = []
        for r in range(world):
            lo, hi = clip(even_span(numel, world, r), numel)
            if lo < hi:
                pieces.append({"rank": r, "lo": lo, "hi": hi, "file": files[r], "offset": offsets[r],
                               "nbytes": 4 * (hi - lo), "crc": 0})
                offsets[r] += 4 * (hi - lo)
        entries.append({"numel": numel, "pieces": pieces})
    return {"files": files, "dtype": "float32", "chunks": entries}


def test_each_ranks_file_holds_its_pieces_and_nothing_else(tmp_path):
    info = sliced_info(10, 3, 2)                 # pieces of 4, 4 and 2 elements per chunk
    for name, size in zip(kind_files(info), (32, 32, 16)):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"\0" * size)
    check_kind_file_size(tmp_path, "param", info)
    (tmp_path / "rank-00002" / "param.bin").write_bytes(b"\0" * 12)
    with pytest.raises(ChecksumError, match="rank-00002/param.bin.*holds 12 bytes.*2 pieces of 16 bytes"):
        check_kind_file_size(tmp_path, "param", info)
    check_kind_file_size(tmp_path, "param", info, ["rank-00000/param.bin", "rank-00001/param.bin"])
    info["chunks"][1]["pieces"][0]["file"] = "elsewhere.bin"
    with pytest.raises(OffloadError, match="elsewhere.bin, not one of the kind's files"):
        check_kind_file_size(tmp_path, "param", info)


def test_a_rank_whose_spans_are_all_padding_has_an_empty_file(tmp_path):
    info = sliced_info(3, 5, 2)                  # 3 elements over 5 ranks: ranks 3 and 4 store nothing
    assert [len(e["pieces"]) for e in info["chunks"]] == [3, 3]
    for r, name in enumerate(kind_files(info)):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"\0" * (8 if r < 3 else 0))
    check_kind_file_size(tmp_path, "param", info)


# ---- the manifest's entries from what each rank wrote ---------------------------------------------
def rank_pieces(numels, world, rank, *, empty=()) -> dict:
    """What rank ``rank`` of ``world`` reports having written of one ``param`` kind (float32)."""
    out, offset = {}, 0
    for c, numel in enumerate(numels):
        lo, hi = clip(even_span(numel, world, rank), numel)
        if lo == hi:
            continue                              # all padding: nothing written, nothing said
        if c in empty:
            out[c] = Empty(lo=lo, hi=hi)
            continue
        out[c] = Written(lo=lo, hi=hi, offset=offset, nbytes=4 * (hi - lo), crc=100 * rank + c)
        offset += 4 * (hi - lo)
    return {"param": out}


def test_one_process_writes_version_1_entries_of_whole_chunks():
    kinds = merge({"param": torch.float32}, [8, 8, 3], 8, "crc32c", [rank_pieces([8, 8, 3], 1, 0, empty={1})])
    assert kinds == {"param": {"file": "param.bin", "dtype": "float32", "chunk_bytes": 32, "chunks": [
        {"offset": 0, "crc32c": 0}, None, {"offset": 32, "crc32c": 2, "nbytes": 12}]}}
    assert saved_bytes(kinds) == 44


def test_ranks_write_version_3_pieces_that_tile_each_chunk():
    numels = [10, 2]                               # chunk 1: rank 2's span [2, 3) lies wholly in the padding
    kinds = merge({"param": torch.float32}, numels, 8, "crc32c", [rank_pieces(numels, 3, r) for r in range(3)])
    info = kinds["param"]
    assert info["files"] == ["rank-00000/param.bin", "rank-00001/param.bin", "rank-00002/param.bin"]
    assert info["chunks"][0] == {"numel": 10, "pieces": [
        {"rank": 0, "lo": 0, "hi": 4, "file": "rank-00000/param.bin", "offset": 0, "nbytes": 16, "crc": 0},
        {"rank": 1, "lo": 4, "hi": 8, "file": "rank-00001/param.bin", "offset": 0, "nbytes": 16, "crc": 100},
        {"rank": 2, "lo": 8, "hi": 10, "file": "rank-00002/param.bin", "offset": 0, "nbytes": 8, "crc": 200}]}
    assert [(p["rank"], p["lo"], p["hi"]) for p in info["chunks"][1]["pieces"]] == [(0, 0, 1), (1, 1, 2)]
    assert saved_bytes(kinds) == 48
    for c, numel in enumerate(numels):
        assert chunk_numel(info, info["chunks"][c]) == numel
        assert tiling_error([(p.lo, p.hi) for p in chunk_pieces(info, info["chunks"][c])], numel) is None


def test_a_chunk_that_holds_nothing_on_every_rank_is_null_and_on_some_a_zeros_piece(tmp_path):
    numels = [10, 10]
    shards = [rank_pieces(numels, 2, r, empty={1}) for r in range(2)]
    assert merge({"exp_avg": torch.float32}, numels, 8, "crc32c",
                 [{"exp_avg": s["param"]} for s in shards])["exp_avg"]["chunks"][1] is None
    # Rank 0's Adam never ran on its piece (no parameter there had a gradient yet), rank 1's did.
    shards[1] = rank_pieces(numels, 2, 1)
    info = merge({"exp_avg": torch.float32}, numels, 8, "crc32c", [{"exp_avg": s["param"]} for s in shards])["exp_avg"]
    assert info["chunks"][1]["pieces"][0] == {"rank": 0, "lo": 0, "hi": 5, "zeros": True}
    got = chunk_pieces(info, info["chunks"][1], "crc32c")
    assert [(p.lo, p.hi, p.stored, p.nbytes) for p in got] == [(0, 5, False, 0), (5, 10, True, 20)]
    for r, size in enumerate((20, 40)):          # rank 0 stored chunk 0 only, rank 1 both
        (tmp_path / f"rank-0000{r}").mkdir()
        (tmp_path / f"rank-0000{r}" / "exp_avg.bin").write_bytes(b"\0" * size)
    check_kind_file_size(tmp_path, "exp_avg", info)
    assert saved_bytes({"exp_avg": info}) == 60


def test_ranks_that_disagree_on_the_spans_save_nothing():
    shards = [rank_pieces([10], 2, 0), rank_pieces([10], 3, 1)]        # [0, 5) and [4, 8)
    with pytest.raises(OffloadError, match=r"pieces of chunk param\[0\] \(10 elements\).*overlap at elements \[4, 5\)"):
        merge({"param": torch.float32}, [10], 8, "crc32c", shards)
