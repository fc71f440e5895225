"""Which saved pieces of a chunk fill a rank's span of it, and which elements to copy: pure
arithmetic on element ranges, no files and no tensors.

A chunk of ``numel`` elements saved by N ranks is stored as the pieces of those ranks: rank r's
is elements ``[lo, hi)`` of the chunk, its span cut at ``numel`` (the padding past ``numel`` is
zeros and is not stored, so a span wholly past it stores nothing). A piece of Adam moments that
its rank never initialized (no parameter of the piece had a gradient yet, or it is all padding)
while other ranks did is a *zeros* piece: nothing stored, zeros when loaded -- what torch
initializes moments to. A checkpoint of one process
(format version 1) or of round-robin ranks (version 2) stores each chunk whole: one piece
``[0, numel)``. Loading at M ranks, rank r' fills its span ``[lo', hi')`` from every saved piece
that overlaps it (``copies``); the part of its span past ``numel`` stays zero. So resharding
N -> M is only this arithmetic, whatever N, M and ``numel`` are.

All positions are elements of the chunk (or of a piece, or of a span), never bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Piece:
    """One saved piece of one chunk of one kind: where it is and what it holds."""

    rank: int
    """the saving rank whose file holds it (0 in a single process's checkpoint)."""
    lo: int
    """its first element in the chunk."""
    hi: int
    """one past its last element in the chunk (never past the chunk's ``numel``)."""
    file: str | None
    """its file, relative to the checkpoint directory; None for a zeros piece (nothing stored)."""
    offset: int
    """bytes from the start of ``file``."""
    nbytes: int
    """its bytes in ``file``: ``(hi - lo) * itemsize``."""
    crc: int | None
    """its checksum under the manifest's algorithm (None when read without one, for sizes only)."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def stored(self) -> bool:
        """It has bytes in a file (else it is a zeros piece)."""
        return self.file is not None


@dataclass(frozen=True, slots=True)
class Copy:
    """Elements to copy from one saved piece into a rank's span."""

    piece: int
    """index of the piece in the list given to ``copies``."""
    src: int
    """first element to copy, counted from the start of the piece."""
    dst: int
    """where it goes, counted from the start of the span."""
    numel: int
    """elements to copy (> 0)."""

    def whole(self, pieces: Sequence[Span]) -> bool:
        """Whether the copy takes all of its piece (it can then be read straight into the span)."""
        lo, hi = pieces[self.piece]
        return self.src == 0 and self.numel == hi - lo


def clip(span: Span, numel: int) -> Span:
    """``span`` cut at ``numel`` (the rest is padding): an empty ``(lo, lo)`` when it starts past it."""
    lo, hi = span
    if lo < 0 or hi < lo or numel < 0:
        raise ValueError(f"span {span} of a chunk of {numel} elements")
    return (lo, min(hi, numel)) if lo < numel else (lo, lo)


def copies(pieces: Sequence[Span], span: Span) -> list[Copy]:
    """The copies that fill ``span`` (already cut at the chunk's ``numel``: ``clip``) from the saved
    ``pieces`` (their ``(lo, hi)`` in the chunk; any order, disjoint), in order of position in the
    span. Every piece that overlaps the span gives one copy; where no piece lies nothing is copied
    (``tiling_error`` says whether the pieces cover the chunk)."""
    lo, hi = span
    out = []
    for i, (plo, phi) in enumerate(pieces):
        a, b = max(lo, plo), min(hi, phi)
        if a < b:
            out.append(Copy(piece=i, src=a - plo, dst=a - lo, numel=b - a))
    out.sort(key=lambda cp: cp.dst)
    return out


def tiling_error(pieces: Sequence[Span], numel: int) -> str | None:
    """Why ``pieces`` do not tile ``[0, numel)`` exactly -- a gap, an overlap, an empty piece or
    one past the end -- or None when each element is in exactly one piece."""
    at = 0
    for lo, hi in sorted(pieces):
        if hi <= lo:
            return f"an empty piece [{lo}, {hi})"
        if lo > at:
            return f"no piece holds elements [{at}, {lo})"
        if lo < at:
            return f"pieces overlap at elements [{lo}, {min(at, hi)})"
        at = hi
    if at > numel:
        return f"a piece ends at element {at}, past the chunk's {numel}"
    if at < numel:
        return f"no piece holds elements [{at}, {numel})"
    return None
