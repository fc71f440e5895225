"""Writing a checkpoint: chunks streamed from every tier into one file per kind (per kind and
rank under data parallelism), the manifest last, the whole directory renamed into place.

Several ranks (data parallelism): every rank calls ``save_checkpoint``; rank 0 makes the temp
directory, each rank writes its piece of every chunk (``chunks.read``: its span, cut at the
chunk's end) into ``rank-0000r/`` of it and fsyncs them, rank 0 then writes the manifest
(format version 3: each chunk's pieces, ``entries.merge``), the files written once (buffers,
optimizer state, ``extra``), renames the directory into place and moves ``latest`` -- only
after every rank reported its files durable. A failure on any rank makes every rank raise
(``ranks.Ranks.settle``) and leaves the previous checkpoint current. All ranks must see one
shared filesystem at ``directory``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from ..distributed.arrival import arrive
from ..engine.access import engine_of
from ..errors import ConfigError, OffloadError
from .files import KindWriter, clean_stale, fsync_dir, write_file_atomic
from .entries import Empty, RankPieces, Written, merge, saved_bytes
from .format import (FORMAT, LATEST, MANIFEST, PRECISION_VERSION, SLICED_VERSION, VERSION, checksum,
                     checksum_algorithm, checksum_bytes, manifest_bytes, step_name)
from .listing import list_checkpoints
from .model_state import (foreign_optimizer_state, group_hypers, layout_entries, model_kinds, persistent_buffers,
                          pipelined)
from .pieces import clip
from .plain import check_plain
from .ranks import Ranks, shard_dir


def torch_save_checked(obj, path: Path, algorithm: str) -> dict:
    """``torch.save(obj, path)``, fsynced; refused (``ConfigError``) unless a ``weights_only``
    load gives it back (``plain``); returns the manifest's entry for the file."""
    torch.save(obj, path)
    with open(path, "rb+") as f:
        data = f.read()
        os.fsync(f.fileno())
    check_plain(data, obj, path.stem)
    return {"file": path.name, "bytes": len(data), algorithm: checksum_bytes(algorithm, data)}


def save_checkpoint(model, optimizer, directory: str | os.PathLike, *, step: int | None = None,
                    extra: dict | None = None, keep: int | None = None) -> Path:
    """Save ``model``'s chunks and ``optimizer``'s state as ``directory/step-<step>``; returns its path.

    ``step`` defaults to the engine's optimizer step count. ``extra`` (e.g. the data position or
    an LR scheduler's ``state_dict()``) comes back from ``load_checkpoint`` as ``manifest["extra"]``.
    ``keep``: after a successful save, delete all but the newest ``keep`` checkpoints.
    Call it between ``optimizer.step()`` and the next backward; ``optimizer`` may be None (then no
    hyper-parameters are saved; the engine's Adam state still is). Under data parallelism every
    rank calls it with the same arguments (rank 0's ``step``, ``extra`` and ``keep`` are used), on
    a filesystem all ranks share; it returns on every rank once the checkpoint is in place.
    """
    engine = engine_of(model, required=True)
    arrive("save_checkpoint", engine.chunks.sharding)        # every rank, or a one-line error
    ranks = Ranks.of(engine)
    error, plan = None, None
    try:
        step = _check_ready(engine, optimizer, step, keep)
        if ranks.lead:
            plan = (str(_prepare(Path(directory), step_name(step))), checksum_algorithm(), step)
    except Exception as exc:
        error = exc
    try:
        tmp, algorithm, step = ranks.settle(error, f"preparing checkpoint {directory}", plan)[0]
    except BaseException:
        if plan is not None:
            shutil.rmtree(plan[0], ignore_errors=True)
        raise
    tmp, root = Path(tmp), Path(directory)
    t0 = time.perf_counter()
    error, written = None, None
    try:
        where = tmp / shard_dir(ranks.rank) if ranks.sharded else tmp
        where.mkdir(exist_ok=True)
        written = _write_chunks(engine, where, algorithm)
        fsync_dir(where)
    except Exception as exc:
        error = exc
    try:
        shards = ranks.settle(error, f"writing its chunks of checkpoint {root / step_name(step)}", written)
    except BaseException:
        if ranks.lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error, final = None, None
    if ranks.lead:
        try:
            final = _commit(engine, optimizer, root, tmp, step, extra, keep, algorithm, shards, t0)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = exc
    return Path(ranks.settle(error, f"committing checkpoint {root / step_name(step)}",
                             None if final is None else str(final))[0])


def _check_ready(engine, optimizer, step, keep) -> int:
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ConfigError("keep", keep, "must be a positive integer or None")
    engine.chunks.drain()
    state = engine.chunks.step_state()
    if state.window_open:
        raise OffloadError("save_checkpoint came in the middle of an accumulation window (backward ran, "
                           "optimizer.step() did not): call it after optimizer.step()")
    if optimizer is not None and engine.optimizer is not None and optimizer is not engine.optimizer:
        raise ConfigError("optimizer", type(optimizer).__name__, "is not the optimizer attached to this model")
    step = state.step_count if step is None else int(step)
    if step < 0:
        raise ConfigError("step", step, "must be >= 0")
    return step


def _prepare(root: Path, name: str) -> Path:
    """A fresh temp directory for checkpoint ``name`` under ``root`` (rank 0 only)."""
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _commit(engine, optimizer, root: Path, tmp: Path, step: int, extra, keep, algorithm: str,
            shards: list[RankPieces], t0: float) -> Path:
    """Rank 0, every rank's pieces durable in ``tmp`` (``shards[r]``: what rank r wrote): the
    manifest, the files written once, the rename into place, ``latest``, ``keep``."""
    name = step_name(step)
    chunks = engine.chunks
    infos, saved = chunks.chunks(), model_kinds(chunks)
    # Per kind: the per-block scales of 8-bit moments count blocks, not elements.
    per_block = {kind: max((i.blocks.get(kind, 1) for i in infos), default=1) for kind in saved}
    kinds = merge(saved, {kind: [i.kind_numel(kind) for i in infos] for kind in saved},
                  {kind: -(-chunks.layout.chunk_size // per_block[kind]) for kind in saved}, algorithm, shards)
    manifest = _manifest(engine, optimizer, tmp, step, extra, algorithm, kinds)
    manifest["write_s"] = time.perf_counter() - t0
    write_file_atomic(tmp / MANIFEST, manifest_bytes(manifest))
    fsync_dir(tmp)
    final = root / name
    trash = None
    if final.exists():
        trash = root / f".trash-{name}-{os.getpid()}"
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_dir(root)
    write_file_atomic(root / LATEST, (name + "\n").encode())
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _write_chunks(engine, where: Path, algorithm: str) -> RankPieces:
    """Write this rank's piece of every chunk (each whole chunk in one process), one file per kind
    in ``where``; returns what it wrote (``entries.RankPieces``)."""
    chunks = engine.chunks
    kinds = model_kinds(chunks)
    # Frozen chunks have no master or optimizer state. A piece cut at the chunk's end to nothing
    # (a span wholly in the padding) is neither read nor written.
    items = [(kind, info) for kind in kinds for info in chunks.chunks()
             if kind in info.kinds and _stored(info, kind)[0] < _stored(info, kind)[1]]
    written: RankPieces = {kind: {} for kind in kinds}
    # chunks.staging gives whole O_DIRECT blocks: a piece read straight from NVMe brings its tail past
    # the span too (a 1/N piece need not end on a block).
    span_bytes = max((info.piece_nbytes(kind) for kind, info in items), default=0)
    bufs = chunks.staging(span_bytes, count=2)
    writers: dict[str, KindWriter] = {}

    def fetch(i):
        kind, info = items[i]
        data = chunks.read(kind, info.index, bufs[i % 2])
        if data is None:
            return None
        lo, hi = _stored(info, kind)
        span = info.kind_span(kind)
        if data.numel() != span[1] - span[0]:
            raise OffloadError(f"chunk {kind}[{info.index}] read {data.numel()} elements for this rank's span "
                               f"{span}")
        data = data[:hi - lo]         # the padding past the chunk's end is not stored
        return data, checksum(algorithm, data)

    def consume(i, result):
        kind, info = items[i]
        lo, hi = _stored(info, kind)
        if result is None:      # it holds nothing (Adam moments before this piece's first update)
            written[kind][info.index] = Empty(lo=lo, hi=hi)
            return
        data, crc = result
        if data.dtype != kinds[kind]:
            raise OffloadError(f"chunk {kind}[{info.index}] holds {data.dtype}, a checkpoint expects {kinds[kind]}")
        written[kind][info.index] = Written(lo=lo, hi=hi, offset=writers[kind].append(data),
                                            nbytes=data.numel() * data.element_size(), crc=crc)

    try:
        for kind in kinds:     # inside the try: a failed open closes the others
            writers[kind] = KindWriter(where / f"{kind}.bin")
        pipelined(items, fetch, consume, engine.device)     # fetch copies from the GPU
    finally:
        for w in writers.values():
            w.close()
    return written


def _stored(info, kind: str) -> tuple[int, int]:
    """The elements of chunk ``info``'s ``kind`` this rank stores: its span cut at the chunk's end
    (in blocks for a kind of per-block scales)."""
    return clip(info.kind_span(kind), info.kind_numel(kind))


def _manifest(engine, optimizer, tmp: Path, step: int, extra, algorithm: str, kinds: dict) -> dict:
    layout, state = engine.chunks.layout, engine.chunks.step_state()
    total = saved_bytes(kinds)
    world = Ranks.of(engine).world
    # fp32 state keeps the former versions byte for byte; compressed state says what it is.
    precision = engine.chunks.precision if engine.chunks.precision["optimizer_state"] != "fp32" or \
        engine.chunks.precision["master"] != "fp32" else None
    manifest = {
        "format": FORMAT,
        "version": PRECISION_VERSION if precision is not None else SLICED_VERSION if world > 1 else VERSION,
        "step": step,
        "created": time.time(),
        "checksum": algorithm,
        "dtype": engine.config.dtype,
        "engine_step_count": state.step_count,
        "layout": {"chunk_size": layout.chunk_size, "num_chunks": layout.num_chunks,
                   "params": layout_entries(engine.chunks)},
        "kinds": kinds,
        "adam_steps": list(state.adam_steps),
        "scaler": state.scaler,
        "optimizer": None,
        "buffers": None,
        "extra": None,
        "extra_file": None,
    }
    if optimizer is not None:
        manifest["optimizer"] = {"class": type(optimizer).__name__, "param_groups": group_hypers(optimizer),
                                 "max_grad_norm": getattr(optimizer, "max_grad_norm", None), "state": None}
        foreign = foreign_optimizer_state(optimizer, engine.chunks)
        if foreign:
            manifest["optimizer"]["state"] = torch_save_checked(foreign, tmp / "optimizer_state.pt", algorithm)
    buffers = {n: getattr(m, b).detach().cpu() for n, (m, b) in persistent_buffers(engine.model).items()}
    if buffers:
        manifest["buffers"] = torch_save_checked(buffers, tmp / "buffers.pt", algorithm)
    if extra is not None:
        try:
            json.dumps(extra, allow_nan=False)
            manifest["extra"] = extra
        except (TypeError, ValueError):
            manifest["extra_file"] = torch_save_checked(extra, tmp / "extra.pt", algorithm)
    if world > 1:
        manifest["world"] = world
    if precision is not None:
        manifest["precision"] = dict(precision)
    manifest["bytes"] = total
    return manifest
