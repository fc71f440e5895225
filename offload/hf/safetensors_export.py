"""Weights in and out in Hugging Face's safetensors format, streamed chunk by chunk.

``export_safetensors(model, directory)`` writes ``model-0000i-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map": {name: file}}``),
the layout ``transformers``' ``from_pretrained`` reads. The shards are planned from the chunk
layout before any data is read (names, shapes and sizes are known), so each file's header is
written first and the tensor bytes are then streamed in layout order, one chunk in memory at a
time: exporting a 100B model needs about one chunk of extra RAM, not one shard. The files are
plain safetensors (8-byte little-endian header length, JSON header padded with spaces to a
multiple of 8, then the data), checked in the tests by reading them with the ``safetensors``
package. Tied parameters are written once, under the first name ``named_parameters()`` gives.

``load_safetensors(model, path)`` reads such shards (or any safetensors file or directory of
them) with ``safetensors.safe_open`` one tensor at a time and writes them into the chunks
(compute-precision ``param`` and fp32 ``master``), each chunk written once after all of its
tensors are in. It also works on a model that is not wrapped (then it copies into the
parameters). Errors name the file and the tensor.
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
from ..errors import ConfigError, OffloadError
from .chunk_source import ChunkSource

INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = 2 << 30
_SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_ALIASES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                  "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _safetensors():
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise OffloadError("loading safetensors needs the 'safetensors' package: "
                           "pip install 'offload[hf]' (or pip install safetensors)") from exc
    return safe_open


def _dtype(dtype) -> torch.dtype | None:
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
    """Write ``model``'s weights as HF safetensors shards + index in ``directory``; returns the shard paths.

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
    (chunks come to it from their owners one at a time: ``offload.hf.chunk_source``), the others
    return once they are written; an error on any rank raises on all.
    """
    engine = getattr(model, "offload_engine", None)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ConfigError("max_shard_bytes", max_shard_bytes, "must be a positive number of bytes")
    out_dtype = _dtype(dtype)
    root = Path(directory)
    entries: list[_Entry] = []
    if engine is not None:
        engine.adam.drain()
        compute = engine.params.dtype
        out_dtype = out_dtype or compute
        source = "param" if out_dtype == compute or not engine.params.has_master else "master"
        for s in engine.layout.slots:
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
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    chunks = None if engine is None else ChunkSource(engine, source)
    if chunks is not None and not chunks.ranks.lead:
        chunks.follow(_chunk_order(shards))      # rank 0 writes; this rank serves the chunks it keeps
        return [root / f for f in names]
    try:
        root.mkdir(parents=True, exist_ok=True)
        _write_shards(shards, names, root, {"format": "pt", **(metadata or {})}, chunks, transform)
    except Exception as exc:
        if chunks is None:
            raise
        chunks.fail(exc)
    if chunks is not None:
        chunks.finish()
    return [root / f for f in names]


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
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_file_atomic(root / INDEX, json.dumps(index, indent=2).encode())
    for old in root.iterdir():              # shards of an earlier export with another shard count
        if _SHARD.match(old.name) and old.name not in names:
            old.unlink()


# ---- load ------------------------------------------------------------------------------------
def _files(path: Path, safe_open) -> dict[str, Path]:
    """``{tensor name: file}`` for a file, an indexed directory, or a directory of .safetensors files."""
    if path.is_file():
        if path.name.endswith(".json"):
            return _from_index(path)
        files = [path]
    elif (path / INDEX).is_file():
        return _from_index(path / INDEX)
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise OffloadError(f"no safetensors weights at {path} (no file, no {INDEX}, no *.safetensors)")
    out = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    out[name] = file
        except Exception as exc:
            raise OffloadError(f"{file}: not a readable safetensors file: {exc}") from exc
    return out


def _from_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise OffloadError(f"{index}: not a safetensors index (weight_map): {exc}") from exc
    return {name: index.parent / fname for name, fname in weight_map.items()}


def load_safetensors(model, path_or_dir: str | os.PathLike, *, strict: bool = True) -> dict:
    """Load HF safetensors weights into ``model`` (wrapped or not), streaming one tensor at a time.

    Returns ``{"loaded": [...], "missing": [...], "unexpected": [...]}`` (parameter / tensor names).
    With ``strict`` a parameter without a tensor or a tensor without a parameter is an error; a
    tied parameter needs only one of its names in the files. A shape mismatch is always an error
    (``ConfigError`` naming the file and tensor). Values are converted to the model's dtypes; a
    wrapped model's ``param`` and fp32 ``master`` chunks are both written, once per chunk.
    """
    safe_open = _safetensors()
    source = Path(path_or_dir)
    where = _files(source, safe_open)
    engine = getattr(model, "offload_engine", None)
    if engine is not None:
        engine.adam.drain()
    aliases = dict(model.named_parameters(remove_duplicate=False))
    buffers = persistent_buffers(model)
    canonical = {}
    for name, p in model.named_parameters():
        canonical[id(p)] = name
    wanted: dict[int, tuple[str, Path]] = {}       # id(param) -> (tensor name, file)
    buffer_src: dict[str, Path] = {}
    unexpected = []
    for name, file in where.items():
        if name in aliases:
            wanted.setdefault(id(aliases[name]), (name, file))
        elif name in buffers:
            buffer_src[name] = file
        else:
            unexpected.append(name)
    missing = sorted(name for pid, name in canonical.items() if pid not in wanted)
    missing += sorted(n for n in buffers if n not in buffer_src)
    if strict and (missing or unexpected):
        raise OffloadError(f"load_safetensors({source}): missing tensors {missing[:20]}"
                           f"{' ...' if len(missing) > 20 else ''} ({len(missing)}), unexpected tensors "
                           f"{sorted(unexpected)[:20]}{' ...' if len(unexpected) > 20 else ''} ({len(unexpected)})")
    by_id = {id(p): p for p in aliases.values()}
    loaded = []
    handles: dict[Path, object] = {}

    def handle(file: Path):
        if file not in handles:
            try:
                h = safe_open(str(file), framework="pt")
                handles[file] = h.__enter__()
            except Exception as exc:
                raise OffloadError(f"{file}: cannot open as safetensors: {exc}") from exc
        return handles[file]

    def close(file: Path) -> None:
        # Unmaps the file: its pages stop counting in this process's RSS.
        h = handles.pop(file, None)
        if h is not None:
            h.__exit__(None, None, None)

    def shape_of(file: Path, name: str) -> tuple[int, ...]:
        try:
            return tuple(handle(file).get_slice(name).get_shape())
        except OffloadError:
            raise
        except Exception as exc:
            raise OffloadError(f"{file}: tensor {name!r} cannot be read: {exc}") from exc

    def tensor(file: Path, name: str) -> torch.Tensor:
        try:
            return handle(file).get_tensor(name)
        except Exception as exc:
            raise OffloadError(f"{file}: tensor {name!r} cannot be read: {exc}") from exc

    try:
        # Check every shape before writing anything.
        for pid, (name, file) in wanted.items():
            p = by_id[pid]
            want = tuple(engine.params.ref(p).slot.shape) if engine is not None and engine.params.owns(p) \
                else tuple(p.shape)
            got = shape_of(file, name)
            if got != want:
                raise ConfigError(f"{file.name}:{name}", got, f"shape differs from the model's {want} ({file})")
        for name, file in buffer_src.items():
            module, b = buffers[name]
            got, want = shape_of(file, name), tuple(getattr(module, b).shape)
            if got != want:
                raise ConfigError(f"{file.name}:{name}", got, f"shape differs from the model's buffer {want} ({file})")
        for file in list(handles):
            close(file)

        plain, chunked = [], {}
        for pid, (name, file) in wanted.items():
            p = by_id[pid]
            if engine is not None and engine.params.owns(p):
                chunked.setdefault(engine.params.ref(p).slot.chunk, []).append((p, name, file))
            else:
                plain.append((p, name, file))
        # Work in chunk order; a file is closed after the last chunk that reads from it.
        work = [(c, chunked[c]) for c in sorted(chunked)] + [(None, [m]) for m in plain] + \
            [(None, [(None, name, file)]) for name, file in buffer_src.items()]
        last_use = {}
        for i, (_, members) in enumerate(work):
            for _, _, file in members:
                last_use[file] = i
        staging: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i, (c, members) in enumerate(work):
                if c is not None:
                    if engine.params.keeps(c):      # under several ranks, each loads the chunks it owns
                        _load_chunk(engine, c, members, tensor, staging)
                else:
                    p, name, file = members[0]
                    value = tensor(file, name)
                    if p is None:
                        module, b = buffers[name]
                        getattr(module, b).copy_(value)
                    else:
                        p.data.copy_(value.reshape(p.shape))
                loaded += [name for _, name, _ in members]
                for _, _, file in members:
                    if last_use[file] == i:
                        close(file)
    finally:
        for file in list(handles):
            close(file)
    return {"loaded": loaded, "missing": missing, "unexpected": sorted(unexpected)}


def _load_chunk(engine, c: int, members: list, tensor, staging: dict) -> None:
    """Fill chunk ``c``'s fp32 values from ``members`` and write its param (+ master) chunk once."""
    master = chunk_values(engine, c, {id(p) for p, _, _ in members}, staging)
    for p, name, file in members:
        s = engine.params.ref(p).slot
        master[s.offset:s.end].copy_(tensor(file, name).reshape(-1))
    write_chunk_values(engine, c, master, staging)


def chunk_values(engine, c: int, covered: set[int], staging: dict) -> torch.Tensor:
    """Chunk ``c``'s fp32 values, to be overwritten where parameters ``covered`` (their ids) lie:
    zeros when they are all of its parameters (padding stays zero), else its current values.

    ``staging`` holds buffers reused from chunk to chunk (fresh allocations per chunk leave the
    heap fragmented and the process's RSS growing), sized for the largest chunk."""
    params, store = engine.params, engine.store
    n = engine.layout.chunk_numel(c)
    kind = params.master_kind(c)       # "param" for a frozen chunk or fp32 compute
    if "master" not in staging:
        largest = engine.layout.largest_chunk
        staging["master"] = store.staging_buffers(largest * 4, count=1)[0]
        if params.has_master:
            staging["param"] = torch.empty(largest, dtype=params.dtype, device="cpu")
    if all(id(p) in covered for p in params.chunk_members[c]):
        return staging["master"][: n * 4].view(torch.float32).zero_()
    if kind == "master" or params.dtype == torch.float32:
        return store.read_into((kind, c), staging["master"])
    current = store.read_into(("param", c), staging["master"]).float()
    return staging["master"][: n * 4].view(torch.float32).copy_(current)


def write_chunk_values(engine, c: int, master: torch.Tensor, staging: dict) -> None:
    """Write chunk ``c``'s param chunk (and its fp32 master, when it has one) from ``master``."""
    params, store = engine.params, engine.store
    if params.master_kind(c) == "master":
        store.write(("master", c), master)
    if params.has_master:
        store.write(("param", c), staging["param"][:master.numel()].copy_(master))
    else:
        store.write(("param", c), master)
