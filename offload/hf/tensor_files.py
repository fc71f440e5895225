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
        with safe_open(str(file), framework="pt") as f:
            sl = f.get_slice(name)
            if not sl.get_shape():
                return f.get_tensor(name)
            return sl[start:stop]
    except Exception as exc:
        raise OffloadError(f"{file}: tensor {name!r} cannot be read ({one_line(exc)})") from exc


def copy_tensor(dst: torch.Tensor, file: Path, name: str, shape: tuple[int, ...]) -> None:
    """Copy checkpoint tensor ``name`` into the flat ``dst`` (converting its dtype), ``BLOCK_BYTES``
    of rows at a time."""
    if not shape:
        dst.copy_(read_rows(file, name, 0).reshape(-1))
        return
    row = math.prod(shape[1:])
    per = max(1, BLOCK_BYTES // max(4 * row, 1))          # 4 B: fp32, the widest usual dtype
    for r0 in range(0, shape[0], per):
        r1 = min(shape[0], r0 + per)
        dst[r0 * row:r1 * row].copy_(read_rows(file, name, r0, r1).reshape(-1))
