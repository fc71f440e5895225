"""Weights in from Hugging Face's safetensors format, one tensor at a time.

``load_safetensors(model, path)`` reads the shards ``export_safetensors`` writes (or any
safetensors file or directory of them) with ``safetensors.safe_open`` one tensor at a time and
writes them into the chunks (compute-precision ``param`` and fp32 ``master``), each chunk written
once after all of its tensors are in (``chunk_fill``). Under N ranks each rank writes its piece of
every chunk and reads only the rows of the tensors that reach into it. It also works on a model
that is not wrapped (then it copies into the parameters). Errors name the file and the tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..checkpoint import persistent_buffers
from ..engine.access import engine_of
from ..errors import ConfigError, OffloadError
from .chunk_fill import chunk_values, overlap, write_chunk_values
from .tensor_files import INDEX, SINGLE, copy_rows


def _safetensors():
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise OffloadError("loading safetensors needs the 'safetensors' package: "
                           "pip install 'offload[hf]' (or pip install safetensors)") from exc
    return safe_open


def _files(path: Path, safe_open) -> dict[str, Path]:
    """``{tensor name: file}`` for a file, an indexed directory, or a directory of .safetensors files."""
    if path.is_file():
        if path.name.endswith(".json"):
            return _from_index(path)
        files = [path]
    elif (path / INDEX).is_file():
        return _from_index(path / INDEX)
    elif (path / SINGLE).is_file():
        files = [path / SINGLE]
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
    engine = engine_of(model)
    chunks = engine.chunks if engine is not None else None
    if chunks is not None:
        chunks.drain()
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

    def rows(file: Path, name: str):
        """``rows(r0, r1)``: rows ``r0:r1`` of the tensor (read alone, through the open file's map)."""
        def read(r0: int, r1: int | None) -> torch.Tensor:
            try:
                with torch.device("cpu"):   # whatever torch.set_default_device says
                    sl = handle(file).get_slice(name)
                    return sl[r0:r1] if sl.get_shape() else handle(file).get_tensor(name)
            except Exception as exc:
                raise OffloadError(f"{file}: tensor {name!r} cannot be read: {exc}") from exc
        return read

    try:
        # Check every shape before writing anything.
        places = {pid: chunks.param(by_id[pid]) if chunks is not None else None for pid in wanted}
        for pid, (name, file) in wanted.items():
            place = places[pid]
            want = tuple(place.slot.shape) if place is not None else tuple(by_id[pid].shape)
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
            place = places[pid]
            if place is not None:
                chunked.setdefault(place.slot.chunk, []).append((place.slot, name, file))
            else:
                plain.append((by_id[pid], name, file))
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
                    _load_chunk(chunks, chunks.chunks()[c], members, rows, staging)
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


def _load_chunk(chunks, info, members: list, rows, staging: dict) -> None:
    """Fill this rank's piece of chunk ``info`` (the whole chunk in one process) from ``members``
    (``(slot, tensor name, file)``), reading only the rows that reach into it, and write its param
    (+ master) state once."""
    parts = [(slot, name, file, overlap(slot, info.span)) for slot, name, file in members]
    # A piece that none of the tensors reaches (padding at a chunk's end) is written too.
    master = chunk_values(chunks, info, {slot.name for slot, _, _ in members}, staging)
    for slot, name, file, part in parts:
        if part is not None:
            lo, hi, at = part
            copy_rows(master[at:at + hi - lo], slot.shape, rows(file, name), lo, hi)
    write_chunk_values(chunks, info, master, staging)
