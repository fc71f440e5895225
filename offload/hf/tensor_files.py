"""Safetensors files: their names in a model directory, and reading tensors from them in blocks.

Shared by the loaders (``load``, ``sources``, ``safetensors_load``) and the export
(``safetensors_export``); it imports none of them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import OffloadError, one_line  # one_line: also what load.py and sources.py import from here

INDEX = "model.safetensors.index.json"
"""The index of a sharded checkpoint: ``{"metadata": {...}, "weight_map": {tensor: file}}``."""
SINGLE = "model.safetensors"
"""The weights file of an unsharded checkpoint."""

FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
"""safetensors' names of the floating-point dtypes a model's weights come in."""

BLOCK_BYTES = 8 << 20
"""Rows of a tensor are read in blocks of about this size, each through its own ``safe_open``: a
shard's pages stay mapped (and count in RSS) only while their block is copied."""


def read_rows(file: Path, name: str, start: int, stop: int | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of tensor ``name`` in ``file`` (a scalar tensor whole), through a
    ``safe_open`` closed before returning."""
    from safetensors import safe_open

    try:
        # On the CPU whatever torch.set_default_device says (slices are made by torch ops).
        with torch.device("cpu"), safe_open(str(file), framework="pt", device="cpu") as f:
            sl = f.get_slice(name)
            if not sl.get_shape():
                return f.get_tensor(name)
            return sl[start:stop]
    except Exception as exc:
        raise OffloadError(f"{file}: tensor {name!r} cannot be read ({one_line(exc)})") from exc


def copy_tensor(dst: torch.Tensor, file: Path, name: str, shape: tuple[int, ...], lo: int = 0,
                hi: int | None = None) -> None:
    """Copy elements ``lo:hi`` (flat, row-major; default all) of checkpoint tensor ``name`` into
    the flat ``dst`` of ``hi - lo`` elements (converting its dtype), ``BLOCK_BYTES`` of rows at a time."""
    copy_rows(dst, shape, lambda r0, r1: read_rows(file, name, r0, r1), lo, hi)


def copy_rows(dst: torch.Tensor, shape: tuple[int, ...], rows, lo: int = 0, hi: int | None = None) -> int:
    """Copy flat elements ``lo:hi`` of a tensor of ``shape`` into ``dst`` (``hi - lo`` elements),
    reading it through ``rows(r0, r1)`` (its rows ``r0:r1``; a scalar tensor whole) in blocks of
    about ``BLOCK_BYTES``: only the rows that hold part of ``lo:hi`` are read (a safetensors slice
    reads just those bytes), so a rank loading its piece of a chunk reads its share of the file,
    plus at most one row at either end. Returns the number of elements read."""
    numel = math.prod(shape)
    hi = numel if hi is None else hi
    if not 0 <= lo <= hi <= numel:
        raise OffloadError(f"elements {lo}:{hi} are outside a tensor of shape {list(shape)} ({numel} elements)")
    if hi == lo:
        return 0
    if not shape:
        dst.copy_(rows(0, None).reshape(-1)[lo:hi])
        return 1
    row = math.prod(shape[1:])
    per = max(1, BLOCK_BYTES // max(4 * row, 1))          # 4 B: fp32, the widest usual dtype
    first, last = lo // row, -(-hi // row)
    for r0 in range(first, last, per):
        r1 = min(last, r0 + per)
        block = rows(r0, r1).reshape(-1)
        a, b = max(lo, r0 * row), min(hi, r1 * row)
        dst[a - lo:b - lo].copy_(block[a - r0 * row:b - r0 * row])
    return (last - first) * row
