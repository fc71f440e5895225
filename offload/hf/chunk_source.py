"""Chunk values for an export (``export_safetensors``), gathered from the ranks' pieces.

In a single process ``read(c)`` is the chunk interface's ``read``. Under data parallelism every rank
exports together and only rank 0 writes: the ranks walk the same sequence of chunks (the
export's plan does not depend on the rank), and for each one every rank reads its piece
(``ChunkInfo.span``) and sends it to rank 0, which lays the pieces end to end -- one chunk in
flight, not the whole model; the other ranks never hold more than their piece. Each chunk first
passes a small all-gather of failure flags: a failed read of a piece on any rank, or a failed
write on rank 0 (``fail``), makes every rank raise at the same point instead of leaving the others
waiting. (``chunks.read_full`` would all-gather the whole chunk onto every rank, and a rank whose
read failed would leave the others waiting in it.)
"""

from __future__ import annotations

import torch

from ..checkpoint.ranks import PeerFailed, Ranks, peer_error, report
from ..chunks.access import ChunkAccess
from ..errors import StateError
from .chunk_fill import piece_staging


class ChunkSource:
    """``read(c)``: chunk ``c`` of kind ``source`` (a frozen chunk's parameters when it has no
    master) as a CPU tensor of its ``numel`` elements, on rank 0; None on the other ranks, which
    only send their pieces."""

    def __init__(self, chunks: ChunkAccess, source: str):
        self.chunks = chunks
        self.info = chunks.chunks()
        self.source = source
        self.ranks = Ranks(chunks.sharding)
        # The largest piece (the whole chunk in one process), the same size on every rank.
        piece = max((i.piece_nbytes(self.kind(i.index)) for i in self.info), default=0)
        self.staging = piece_staging(chunks, piece)
        self.whole = torch.empty(self.ranks.world * piece, dtype=torch.uint8) \
            if self.ranks.sharded and self.ranks.lead else None
        self.stopped = False        # every rank raised at the same agreement: no collective follows

    def kind(self, c: int) -> str:
        return self.source if self.source in self.info[c].kinds else "param"

    def read(self, c: int) -> torch.Tensor | None:
        kind = self.kind(c)
        if not self.ranks.sharded:
            return self._read(kind, c)
        piece, error = None, None
        try:
            piece = self._read(kind, c)
        except Exception as exc:
            error = exc
        self._agree(error, f"exporting chunk {kind}[{c}]")
        info = self.info[c]
        dtype = info.kinds[kind]
        nbytes = piece.numel() * dtype.itemsize
        out = None if self.whole is None else self.whole[: self.ranks.world * nbytes]
        _gather(piece.reshape(-1).view(torch.uint8), out, self.ranks)
        # Pieces past the chunk's end are padding: dropped.
        return None if out is None else out.view(dtype)[: info.numel]

    def follow(self, order: list[int]) -> None:
        """A rank other than 0: serve the chunks of ``order`` (the order rank 0 reads them), then ``finish``."""
        for c in order:
            self.read(c)
        self.finish()

    def fail(self, error: BaseException) -> None:
        """Rank 0 failed outside ``read`` (writing a file): stop every rank, raise ``error``.
        (An error that ``read`` raised on every rank together has stopped them already.)"""
        if self.ranks.sharded and not self.stopped:
            self._agree(error, "writing the export")
        raise error

    def finish(self) -> None:
        """The last step every rank takes: rank 0's files are complete (or it failed)."""
        if self.ranks.sharded:
            self._agree(None, "writing the export")

    def _read(self, kind: str, c: int) -> torch.Tensor:
        """This rank's piece of chunk ``c`` (the whole chunk in one process)."""
        values = self.chunks.read(kind, c, self.staging)
        if values is None:
            raise StateError(f"chunk {(kind, c)} holds no data")
        return values

    def _agree(self, error: BaseException | None, what: str) -> None:
        import torch.distributed as dist

        flags = [torch.zeros(1, dtype=torch.int32) for _ in range(self.ranks.world)]
        mine = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        device = _device(self.ranks.group)
        if device is not None:
            flags, mine = [f.to(device) for f in flags], mine.to(device)
        dist.all_gather(flags, mine, group=self.ranks.group)
        if not any(int(f.item()) for f in flags):
            return
        self.stopped = True
        reports = self.ranks.gather(None if error is None else report(error))
        if error is not None:
            raise error
        r = next(r for r, rep in enumerate(reports) if rep is not None)
        raise peer_error(r, reports[r], what)


def _device(group):
    """The device a collective of ``group`` needs its tensors on (None: the CPU, as for gloo)."""
    from ..distributed.comms import collective_device

    device = collective_device(group)
    return None if device.type == "cpu" else device


def _gather(piece: torch.Tensor, out: torch.Tensor | None, ranks: Ranks) -> None:
    """Every rank's ``piece`` (bytes, the same size on every rank) into rank 0's ``out``, in rank order."""
    import torch.distributed as dist

    device = _device(ranks.group)
    n = piece.numel()
    send = piece if device is None else piece.to(device)
    into = None
    if ranks.lead:
        into = out if device is None else torch.empty_like(out, device=device)
    parts = None if into is None else [into[r * n:(r + 1) * n] for r in range(ranks.world)]
    dist.gather(send, parts, dst=_global(0, ranks.group), group=ranks.group)
    if into is not None and device is not None:
        out.copy_(into)


def _global(rank: int, group) -> int:
    """torch.distributed's rooted calls (``gather``'s ``dst``) take global ranks, even with a ``group``."""
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


__all__ = ["ChunkSource", "PeerFailed"]
