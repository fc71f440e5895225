"""Reading saved pieces back: one piece whole with its checksum verified (``read_piece``), and a
rank's span of a chunk filled from the pieces that overlap it (``fill_span``) -- the one way
loading and verifying read chunk data, whatever version and world size wrote it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from ..errors import ChecksumError, NvmeIOError, OffloadError
from .format import checksum
from .pieces import Copy, Piece


class OpenFiles:
    """A checkpoint's chunk files, opened read-only on first use and closed together (dropping
    what they put in the page cache: a resume should not push the training state out of RAM)."""

    def __init__(self, ckpt: Path):
        self.ckpt = ckpt
        self.fds: dict[str, int] = {}

    def fd(self, name: str) -> int:
        if name not in self.fds:
            try:
                self.fds[name] = os.open(self.ckpt / name, os.O_RDONLY)
            except OSError as exc:
                raise OffloadError(f"checkpoint file {self.ckpt / name} cannot be read: {exc}") from exc
        return self.fds[name]

    def close(self) -> None:
        for fd in self.fds.values():
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _what(kind: str, c: int, piece: Piece, whole: bool) -> str:
    return f"chunk {kind}[{c}]" if whole else f"chunk {kind}[{c}] (rank {piece.rank}'s piece, elements " \
                                              f"[{piece.lo}, {piece.hi}))"


def read_piece(fd: int, path: Path, kind: str, c: int, piece: Piece, buf: torch.Tensor, algorithm: str,
               *, whole: bool = False) -> torch.Tensor:
    """Read ``piece`` of chunk ``kind[c]`` (``piece.nbytes`` at ``piece.offset`` of open file
    ``fd``, named ``path``) into uint8 ``buf`` and verify its checksum; returns the filled view
    ``buf[:nbytes]``. ``whole``: the piece is the whole chunk (errors then name just the chunk).
    ``ChecksumError`` names the file, the chunk and the offset; ``NvmeIOError`` an I/O error."""
    nbytes = piece.nbytes
    if buf.numel() < nbytes:
        raise OffloadError(f"a buffer of {buf.numel()} bytes for {nbytes} bytes of {_what(kind, c, piece, whole)}")
    view = buf[:nbytes]
    mv = memoryview(view.numpy()).cast("B")
    got = 0
    while got < nbytes:
        try:
            n = os.preadv(fd, [mv[got:]], piece.offset + got)
        except OSError as exc:
            raise NvmeIOError(exc.errno or 5, str(path), piece.offset + got, nbytes - got,
                              f"reading {_what(kind, c, piece, whole)}") from exc
        if not n:
            raise ChecksumError(str(path), piece.offset + got, nbytes - got,
                                f"short read (end of file) of {_what(kind, c, piece, whole)}")
        got += n
    crc = checksum(algorithm, view)
    if crc != piece.crc:
        raise ChecksumError(str(path), piece.offset, nbytes,
                            f"checksum mismatch ({algorithm}: expected {piece.crc:#010x}, got {crc:#010x}) "
                            f"of {_what(kind, c, piece, whole)}")
    return view


def fill_span(files: OpenFiles, kind: str, c: int, pieces: Sequence[Piece], copies: Sequence[Copy], out: torch.Tensor,
              stored: int, itemsize: int, scratch: torch.Tensor | None, algorithm: str) -> torch.Tensor:
    """Fill uint8 ``out`` (a span of chunk ``kind[c]``: ``out.numel() // itemsize`` elements, the
    first ``stored`` of them inside the chunk) from the saved ``pieces`` by ``copies``
    (``pieces.copies``): a piece that lies wholly in the span is read straight into place, one
    that lies across its edge into ``scratch`` first; every piece is read whole and verified.
    The span's padding past the chunk's end and its part of a zeros piece are zeroed. Returns ``out``."""
    out[stored * itemsize:].zero_()
    spans = [(p.lo, p.hi) for p in pieces]
    for cp in copies:
        piece = pieces[cp.piece]
        if not piece.stored:
            out[cp.dst * itemsize:(cp.dst + cp.numel) * itemsize].zero_()
            continue
        path = files.ckpt / piece.file
        whole_chunk = len(pieces) == 1
        if cp.whole(spans):
            read_piece(files.fd(piece.file), path, kind, c, piece, out[cp.dst * itemsize:], algorithm,
                       whole=whole_chunk)
            continue
        if scratch is None:
            raise OffloadError(f"no scratch buffer to read {_what(kind, c, piece, whole_chunk)} across a span's edge")
        data = read_piece(files.fd(piece.file), path, kind, c, piece, scratch, algorithm, whole=whole_chunk)
        out[cp.dst * itemsize:(cp.dst + cp.numel) * itemsize] = data[cp.src * itemsize:(cp.src + cp.numel) * itemsize]
    return out
