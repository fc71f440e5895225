"""Filling a chunk from weight files: the fp32 values of this rank's piece assembled, then its
``param`` (and fp32 ``master``) state written once.

Both loaders of Hugging Face weights (``load.stream_into``, ``safetensors_load``) go through here:
``chunk_values`` gives the values of this rank's piece of a chunk (``ChunkInfo.span``; the whole
chunk in one process) to overwrite where the loaded tensors lie, ``overlap`` says which elements
of each tensor fall in the piece and where, the caller copies those in, and ``write_chunk_values``
writes the piece. Under N ranks every rank fills its own piece of every chunk and reads only the
rows of the tensors that overlap it: about 1/N of the weights per rank (plus, per chunk, at most
a row at either end of its span), instead of whole chunks.
"""

from __future__ import annotations

import torch

from ..chunks.access import ChunkAccess, ChunkInfo
from ..chunks.layout import ParamSlot
from ..errors import StateError


def overlap(slot: ParamSlot, span: tuple[int, int]) -> tuple[int, int, int] | None:
    """``(lo, hi, at)``: the flat elements ``lo:hi`` of parameter ``slot`` that lie in the chunk
    elements ``span`` (a rank's piece), to be copied to offset ``at`` of the piece; None when none do."""
    a, b = max(slot.offset, span[0]), min(slot.end, span[1])
    if a >= b:
        return None
    return a - slot.offset, b - slot.offset, a - span[0]


def piece_staging(chunks: ChunkAccess, nbytes: int) -> torch.Tensor:
    """A ``chunks.staging`` buffer to ``read`` pieces of up to ``nbytes`` bytes into (staging gives
    whole NVMe blocks: a piece read straight from NVMe fills its whole slot)."""
    return chunks.staging(nbytes)[0]


def chunk_values(chunks: ChunkAccess, info: ChunkInfo, covered: set[str], staging: dict) -> torch.Tensor:
    """The fp32 values of this rank's piece of chunk ``info`` (``info.span``: ``hi - lo``
    elements), to be overwritten where the parameters named in ``covered`` lie: zeros when they
    are all of its parameters that reach into the piece (padding stays zero), else its current values.

    ``staging`` holds buffers reused from chunk to chunk (fresh allocations per chunk leave the
    heap fragmented and the process's RSS growing), sized for the largest piece."""
    c, (lo, hi) = info.index, info.span
    n = hi - lo
    compute = chunks.kinds["param"]
    kind = "master" if "master" in info.kinds else "param"       # "param" for a frozen chunk or fp32 compute
    if "master" not in staging:
        largest = max((i.piece_numel for i in chunks.chunks()), default=0)
        staging["master"] = piece_staging(chunks, largest * 4)
        if compute != torch.float32:
            staging["param"] = torch.empty(largest, dtype=compute, device="cpu")
    if all(s.name in covered for s in info.params if overlap(s, info.span) is not None):
        return staging["master"][: n * 4].view(torch.float32).zero_()
    if compute == torch.float32 or (kind == "master" and info.kinds["master"] == torch.float32):
        return _read(chunks, kind, c, staging["master"])
    current = _read(chunks, kind, c, staging["master"]).float()      # bf16 parameters, or a bf16 master
    return staging["master"][: n * 4].view(torch.float32).copy_(current)


def write_chunk_values(chunks: ChunkAccess, info: ChunkInfo, master: torch.Tensor, staging: dict) -> None:
    """Write this rank's piece of chunk ``info``'s param state (and its fp32 master, when it has
    one) from ``master`` (fp32, the piece's elements; ``staging`` as ``chunk_values`` filled it)."""
    c = info.index
    if "master" in info.kinds:
        chunks.write("master", c, master)
    if chunks.kinds["param"] != torch.float32:
        chunks.write("param", c, staging["param"][:master.numel()].copy_(master))
    else:
        chunks.write("param", c, master)


def _read(chunks: ChunkAccess, kind: str, c: int, buf: torch.Tensor) -> torch.Tensor:
    values = chunks.read(kind, c, buf)
    if values is None:
        raise StateError(f"chunk {(kind, c)} holds no data")
    return values
