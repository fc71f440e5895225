"""Filling a chunk from weight files: its fp32 values assembled, then its ``param`` (and fp32
``master``) state written once.

Both loaders of Hugging Face weights (``load.stream_into``, ``safetensors_load``) go through here:
``chunk_values`` gives a chunk's values to overwrite where the loaded tensors lie, the caller
copies each tensor in, and ``write_chunk_values`` writes the chunk. A rank fills only the chunks
it keeps (``ChunkInfo.kept``).
"""

from __future__ import annotations

import torch

from ..chunks.access import ChunkAccess, ChunkInfo
from ..errors import StateError


def chunk_values(chunks: ChunkAccess, info: ChunkInfo, covered: set[str], staging: dict) -> torch.Tensor:
    """Chunk ``info``'s fp32 values (``info.numel`` elements), to be overwritten where the
    parameters named in ``covered`` lie: zeros when they are all of its parameters (padding stays
    zero), else its current values.

    ``staging`` holds buffers reused from chunk to chunk (fresh allocations per chunk leave the
    heap fragmented and the process's RSS growing), sized for the largest chunk."""
    c, n = info.index, info.numel
    compute = chunks.kinds["param"]
    kind = "master" if "master" in info.kinds else "param"       # "param" for a frozen chunk or fp32 compute
    if "master" not in staging:
        largest = chunks.layout.largest_chunk
        staging["master"] = chunks.staging(largest * 4)[0]
        if compute != torch.float32:
            staging["param"] = torch.empty(largest, dtype=compute, device="cpu")
    if all(s.name in covered for s in info.params):
        return staging["master"][: n * 4].view(torch.float32).zero_()
    if kind == "master" or compute == torch.float32:
        return _read(chunks, kind, c, staging["master"])
    current = _read(chunks, "param", c, staging["master"]).float()
    return staging["master"][: n * 4].view(torch.float32).copy_(current)


def write_chunk_values(chunks: ChunkAccess, info: ChunkInfo, master: torch.Tensor, staging: dict) -> None:
    """Write chunk ``info``'s param state (and its fp32 master, when it has one) from ``master``
    (fp32, ``info.numel`` elements; ``staging`` as ``chunk_values`` filled it)."""
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
