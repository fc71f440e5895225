"""Chunk values for an export (``export_safetensors``), read from whichever rank keeps them.

In a single process ``read(c)`` is the chunk interface's ``read``. Under data parallelism every rank
exports together and only rank 0 writes: the ranks walk the same sequence of chunks (the
export's plan does not depend on the rank), and for each one its owner reads it and sends it
to rank 0 -- one chunk in flight, not the whole model. Each chunk first passes a small
all-gather of failure flags: a failed read on the owner, or a failed write on rank 0
(``fail``), makes every rank raise at the same point instead of leaving the others waiting.
"""

from __future__ import annotations

import torch

from ..checkpoint.ranks import PeerFailed, Ranks, peer_error, report
from ..chunks.access import ChunkAccess
from ..errors import StateError


class ChunkSource:
    """``read(c)``: chunk ``c`` of kind ``source`` (a frozen chunk's parameters when it has no
    master) as a CPU tensor, on rank 0; None on the other ranks, which only serve their chunks."""

    def __init__(self, chunks: ChunkAccess, source: str):
        self.chunks = chunks
        self.info = chunks.chunks()
        self.source = source
        self.ranks = Ranks(chunks.sharding)
        # The same size on every rank (rank 0 receives what the others read).
        nbytes = max((i.nbytes(self.kind(i.index)) for i in self.info), default=0)
        self.staging = chunks.staging(nbytes)[0]

    def kind(self, c: int) -> str:
        return self.source if self.source in self.info[c].kinds else "param"

    def read(self, c: int) -> torch.Tensor | None:
        kind = self.kind(c)
        if not self.ranks.sharded:
            return self._read(kind, c)
        owner = self.info[c].owner
        data, error = None, None
        if self.ranks.rank == owner:
            try:
                data = self._read(kind, c)
            except Exception as exc:
                error = exc
        self._agree(error, f"exporting chunk {kind}[{c}] (owner rank {owner})")
        dtype = self.info[c].kinds[kind]
        numel = self.info[c].numel
        if owner == 0:
            return data if self.ranks.lead else None
        if self.ranks.rank == owner:
            _send(data.reshape(-1).view(torch.uint8), 0, self.ranks.group)
            return None
        if self.ranks.lead:
            buf = self.staging[: numel * dtype.itemsize]
            _recv(buf, owner, self.ranks.group)
            return buf.view(dtype)
        return None

    def follow(self, order: list[int]) -> None:
        """A rank other than 0: serve the chunks of ``order`` (the order rank 0 reads them), then ``finish``."""
        for c in order:
            self.read(c)
        self.finish()

    def fail(self, error: BaseException) -> None:
        """Rank 0 failed outside ``read`` (writing a file): stop every rank, raise ``error``."""
        if self.ranks.sharded:
            self._agree(error, "writing the export")
        raise error

    def finish(self) -> None:
        """The last step every rank takes: rank 0's files are complete (or it failed)."""
        if self.ranks.sharded:
            self._agree(None, "writing the export")

    def _read(self, kind: str, c: int) -> torch.Tensor:
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


def _send(data: torch.Tensor, dst: int, group) -> None:
    import torch.distributed as dist

    device = _device(group)
    dist.send(data if device is None else data.to(device), dst=_global(dst, group), group=group)


def _recv(buf: torch.Tensor, src: int, group) -> None:
    import torch.distributed as dist

    device = _device(group)
    if device is None:
        dist.recv(buf, src=_global(src, group), group=group)
        return
    tmp = torch.empty_like(buf, device=device)
    dist.recv(tmp, src=_global(src, group), group=group)
    buf.copy_(tmp)


def _global(rank: int, group) -> int:
    """torch.distributed's point-to-point calls take global ranks, even with a ``group``."""
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


__all__ = ["ChunkSource", "PeerFailed"]
