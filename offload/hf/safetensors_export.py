"""Weights out in Hugging Face's safetensors format, streamed chunk by chunk.

``export_safetensors(model, directory)`` writes ``model-0000i-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map": {name: file}}``),
or ``model.safetensors`` alone when everything fits one shard -- the layouts ``transformers``'
``save_pretrained`` writes and ``from_pretrained`` reads. The shards are planned from the chunk
layout before any data is read (names, shapes and sizes are known), so each file's header is
written first and the tensor bytes are then streamed in layout order, one chunk in memory at a
time: exporting a 100B model needs about one chunk of extra RAM, not one shard. The files are
plain safetensors (8-byte little-endian header length, JSON header padded with spaces to a
multiple of 8, then the data), checked in the tests by reading them with the ``safetensors``
package. Tied parameters are written once, under the first name ``named_parameters()`` gives.
A wrapped model's values come through its chunk interface (``engine.chunks``; under data
parallelism gathered chunk by chunk from every rank's piece: ``chunk_source``). ``safetensors_load`` reads such files back.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import torch

from ..checkpoint import persistent_buffers, write_file_atomic
from ..distributed.arrival import arrive
from ..engine.access import engine_of
from ..errors import ConfigError, OffloadError
from .chunk_source import ChunkSource
from .tensor_files import INDEX, SINGLE

DEFAULT_MAX_SHARD = 2 << 30
_SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_ALIASES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                  "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype) -> torch.dtype | None:
    """A file dtype given as a torch dtype or a name ("bf16", "float32", ...); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower()]
    raise ConfigError("dtype", dtype, f"expected a torch dtype or one of {sorted(_DTYPE_ALIASES)}")


# ---- export ----------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("name", "shape", "dtype", "nbytes", "slot", "buffer", "source", "source_shape", "pick")

    def __init__(self, name, shape, dtype, slot=None, buffer=None):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        self.nbytes = math.prod(self.shape) * dtype.itemsize
        self.slot, self.buffer = slot, buffer
        self.source, self.source_shape, self.pick = name, self.shape, None


def _plan(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def _header(shard: list[_Entry], metadata: dict[str, str]) -> bytes:
    head, offset = {"__metadata__": metadata}, 0
    for e in shard:
        if e.dtype not in _ST_DTYPES:
            raise ConfigError("dtype", e.dtype, f"tensor {e.name!r}: safetensors has no such dtype")
        head[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                        "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_all(f, data: torch.Tensor, path: Path, name: str) -> None:
    if data.numel() == 0:
        return
    try:
        f.write(memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B"))
    except OSError as exc:
        raise OffloadError(f"writing tensor {name!r} to {path} failed: {exc}") from exc


def export_safetensors(model, directory: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD,
                       dtype=None, metadata: dict[str, str] | None = None, rename=None,
                       transform=None, expand=None) -> list[Path]:
    """Write ``model``'s weights as HF safetensors shards + index (one shard: ``model.safetensors``,
    no index) in ``directory``; returns the shard paths.

    ``dtype``: the file dtype (torch dtype or "bf16"/"fp16"/"fp32"); None = the engine's compute
    dtype (those are the exact values the model computes with); another dtype is converted from
    the fp32 master weights. Each shard holds at most ``max_shard_bytes`` (a tensor bigger than
    that gets a shard of its own). Shards are written to temp names and renamed, the index last.
    ``rename(name) -> str | None``: the name written for a parameter or buffer (None: leave it
    out); ``transform(name, value) -> tensor``: a new value for it (``value`` has the tensor's
    shape, in the chunk's dtype; same shape back) — together they write e.g. merged LoRA weights.
    ``expand(name, shape) -> [(name, shape, pick)] | None``: write one tensor (after ``rename``) as
    several (``pick(value)`` gives each from the tensor's value), e.g. a fused expert tensor as one
    tensor per expert; None: as it is.
    Under data parallelism every rank calls it with the same arguments; rank 0 writes the files
    (each chunk gathered to it from the ranks' pieces, one at a time: ``chunk_source``), the others
    return once they are written; an error on any rank raises on all.
    """
    engine = engine_of(model)
    chunks = engine.chunks if engine is not None else None
    arrive("export_safetensors", None if chunks is None else chunks.sharding)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ConfigError("max_shard_bytes", max_shard_bytes, "must be a positive number of bytes")
    out_dtype = parse_dtype(dtype)
    root = Path(directory)
    entries: list[_Entry] = []
    if chunks is not None:
        chunks.drain()
        compute = chunks.kinds["param"]
        out_dtype = out_dtype or compute
        source = "param" if out_dtype == compute or "master" not in chunks.kinds else "master"
        for s in chunks.layout.slots:
            entries.append(_Entry(s.name, s.shape, out_dtype, slot=s))
    else:
        source = None
        seen = set()
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                entries.append(_Entry(name, p.shape, out_dtype or p.dtype, buffer=p))
    for name, (module, b) in persistent_buffers(model).items():
        buf = getattr(module, b)
        bdtype = out_dtype if (out_dtype is not None and buf.is_floating_point()) else buf.dtype
        entries.append(_Entry(name, buf.shape, bdtype, buffer=buf))
    if rename is not None:
        entries = [e for e in entries if rename(e.name) is not None]
        for e in entries:
            e.name = rename(e.name)
    if expand is not None:
        expanded = []
        for e in entries:
            parts = expand(e.name, e.shape)
            if parts is None:
                expanded.append(e)
                continue
            for name, shape, pick in parts:
                part = _Entry(name, shape, e.dtype, slot=e.slot, buffer=e.buffer)
                part.source, part.source_shape, part.pick = e.source, e.shape, pick
                expanded.append(part)
        entries = expanded
    shards = _plan(entries, max_shard_bytes)
    names = shard_names(len(shards))
    values = None if chunks is None else ChunkSource(chunks, source)
    if values is not None and not values.ranks.lead:
        values.follow(_chunk_order(shards))      # rank 0 writes; this rank sends its pieces
        return [root / f for f in names]
    try:
        root.mkdir(parents=True, exist_ok=True)
        _write_shards(shards, names, root, {"format": "pt", **(metadata or {})}, values, transform)
    except Exception as exc:
        if values is None:
            raise
        values.fail(exc)
    if values is not None:
        values.finish()
    return [root / f for f in names]


def shard_names(n: int) -> list[str]:
    """The weight files of an export in ``n`` shards, as ``save_pretrained`` names them: one is
    ``model.safetensors`` (no index), several ``model-0000i-of-0000N.safetensors``."""
    if n == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _chunk_order(shards: list[list[_Entry]]) -> list[int]:
    """The chunks ``_write_shards`` reads, in its order (each run of one chunk's tensors reads it once)."""
    order, last = [], None
    for shard in shards:
        for e in shard:
            if e.slot is not None and e.slot.chunk != last:
                last = e.slot.chunk
                order.append(last)
    return order


def _write_shards(shards, names, root: Path, meta: dict, chunks, transform) -> None:
    weight_map, total = {}, 0
    cache: tuple[int, torch.Tensor] | None = None
    for shard, fname in zip(shards, names):
        path = root / fname
        tmp = root / f".{fname}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(_header(shard, meta))
                for e in shard:
                    if e.slot is not None:
                        c = e.slot.chunk
                        if cache is None or cache[0] != c:
                            # A frozen chunk has no master: its parameters are its values.
                            cache = (c, chunks.read(c))
                        value = cache[1][e.slot.offset:e.slot.end]
                    else:
                        value = e.buffer.detach().to("cpu").reshape(-1)
                    if transform is not None:
                        value = transform(e.source, value.view(e.source_shape)).reshape(-1)
                    if e.pick is not None:
                        value = e.pick(value.view(e.source_shape)).reshape(-1)
                    value = value.to(e.dtype)
                    _write_all(f, value, path, e.name)
                    weight_map[e.name] = fname
                    total += e.nbytes
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_file_atomic(root / INDEX, json.dumps(index, indent=2).encode())
    else:
        (root / INDEX).unlink(missing_ok=True)      # an earlier export's, in several shards
    for old in root.iterdir():              # shards of an earlier export with another shard count
        if (_SHARD.match(old.name) or old.name == SINGLE) and old.name not in names:
            old.unlink()
