"""The manifest's ``kinds`` -- where every chunk of every kind is -- from what each rank wrote.

Each rank reports, per kind, the pieces it wrote (``Written``: elements ``[lo, hi)`` of the chunk,
cut at its ``numel``, at ``offset`` of its file) and the chunks whose piece held nothing (Adam
moments before the first step; under several ranks also a piece no parameter of which had a
gradient yet, as its rank's Adam skips it). A rank whose span of a chunk lies wholly past its end
writes nothing of it and reports nothing. ``merge`` puts them together (on rank 0, before the
manifest is written):

* one process: format version 1 unchanged -- each chunk whole in ``<kind>.bin``. A version-1
  entry is exactly a version-3 chunk of one piece ``[0, numel)`` (``format.chunk_pieces`` reads
  both alike), and tools and tests that read a single process's checkpoint keep working;
* several ranks: version 3 -- every rank's piece of every chunk in ``rank-0000r/<kind>.bin``; a
  chunk that holds nothing on every rank is ``null``, a piece that holds nothing beside pieces
  with values is a zeros piece (torch initializes moments to zeros: the same state).

Pure data in, pure data out: no files, no engine (unit-tested as such).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..errors import OffloadError
from .format import DTYPE_NAMES, chunk_pieces
from .pieces import tiling_error
from .ranks import shard_dir


@dataclass(frozen=True, slots=True)
class Written:
    """One piece a rank wrote: elements ``[lo, hi)`` of a chunk, ``nbytes`` at ``offset`` of its
    file of that kind, with checksum ``crc``."""

    lo: int
    hi: int
    offset: int
    nbytes: int
    crc: int


@dataclass(frozen=True, slots=True)
class Empty:
    """A piece that held nothing (elements ``[lo, hi)``, its span cut at the chunk's end)."""

    lo: int
    hi: int


# {kind: {chunk: Written or Empty}} of one rank (picklable: it goes to rank 0).
RankPieces = dict[str, dict[int, "Written | Empty"]]


def kind_file(kind: str, rank: int, world: int) -> str:
    """The file (relative to the checkpoint) holding rank ``rank``'s pieces of ``kind``."""
    return f"{kind}.bin" if world == 1 else f"{shard_dir(rank)}/{kind}.bin"


def merge(kinds: Mapping[str, torch.dtype], numels: Sequence[int] | Mapping[str, Sequence[int]],
          chunk_size: int | Mapping[str, int], algorithm: str, shards: Sequence[RankPieces]) -> dict:
    """The manifest's ``kinds`` from every rank's ``RankPieces`` (``shards[r]``: rank r's) of a
    model with chunks of ``numels`` elements (per kind where kinds differ: the per-block scales of
    8-bit moments count blocks; ``chunk_size`` too, per kind, for their bulk bytes). ``OffloadError`` when the ranks disagree: a chunk
    whose pieces do not tile a chunk (the ranks disagree on the spans)."""
    world = len(shards)
    out = {}
    for kind, dtype in kinds.items():
        sizes = numels[kind] if isinstance(numels, Mapping) else numels
        if world == 1:
            bulk = chunk_size[kind] if isinstance(chunk_size, Mapping) else chunk_size
            out[kind] = _whole(kind, dtype, sizes, bulk, algorithm, shards[0][kind])
            continue
        files = [kind_file(kind, r, world) for r in range(world)]
        entries: list[dict | None] = []
        for c, numel in enumerate(sizes):
            said = [(r, shard[kind][c]) for r, shard in enumerate(shards) if c in shard[kind]]
            if all(isinstance(w, Empty) for _, w in said):
                entries.append(None)          # no values on any rank (or not a chunk of this kind)
                continue
            why = tiling_error([(w.lo, w.hi) for _, w in said], numel)
            if why is not None:
                raise OffloadError(f"the pieces of chunk {kind}[{c}] ({numel} elements) that ranks "
                                   f"{[r for r, _ in said]} wrote do not tile it: {why}")
            entries.append({"numel": numel, "pieces": [
                {"rank": r, "lo": w.lo, "hi": w.hi, "zeros": True} if isinstance(w, Empty) else
                {"rank": r, "lo": w.lo, "hi": w.hi, "file": files[r], "offset": w.offset, "nbytes": w.nbytes,
                 "crc": w.crc} for r, w in said]})
        out[kind] = {"files": files, "dtype": DTYPE_NAMES[dtype], "chunks": entries}
    return out


def _whole(kind: str, dtype: torch.dtype, numels: Sequence[int], chunk_size: int, algorithm: str,
           written: Mapping[int, Written | Empty]) -> dict:
    """Version 1: each chunk whole, an entry ``{"offset", <algorithm>, "nbytes"?}`` (``nbytes``
    when not the bulk ``chunk_bytes``: an oversized parameter's chunk, a class's last)."""
    bulk = chunk_size * dtype.itemsize
    entries: list[dict | None] = []
    for c, numel in enumerate(numels):
        w = written.get(c)
        if w is None or isinstance(w, Empty):
            entries.append(None)
            continue
        if (w.lo, w.hi) != (0, numel):
            raise OffloadError(f"chunk {kind}[{c}] was written as elements [{w.lo}, {w.hi}) of {numel}: "
                               "a single process writes whole chunks")
        entry = {"offset": w.offset, algorithm: w.crc}
        if w.nbytes != bulk:
            entry["nbytes"] = w.nbytes
        entries.append(entry)
    return {"file": kind_file(kind, 0, 1), "dtype": DTYPE_NAMES[dtype], "chunk_bytes": bulk, "chunks": entries}


def saved_bytes(kinds: dict) -> int:
    """Bytes of chunk data a manifest's ``kinds`` records (every version)."""
    return sum(p.nbytes for info in kinds.values() for e in info["chunks"] if e is not None
               for p in chunk_pieces(info, e))
