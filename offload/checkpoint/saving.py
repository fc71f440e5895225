"""Writing a checkpoint: chunks streamed from every tier into one file per kind, the manifest
last, the whole directory renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from ..chunks.states import ChunkState
from ..errors import ConfigError, OffloadError
from .files import KindWriter, clean_stale, fsync_dir, write_file_atomic
from .format import (DTYPE_NAMES, FORMAT, LATEST, MANIFEST, SAVED_KINDS, VERSION, checksum, checksum_algorithm,
                     checksum_bytes, manifest_bytes, step_name)
from .listing import list_checkpoints
from .model_state import engine_of, foreign_optimizer_state, group_hypers, layout_entries, persistent_buffers, pipelined


def torch_save_checked(obj, path: Path, algorithm: str) -> dict:
    torch.save(obj, path)
    with open(path, "rb+") as f:
        data = f.read()
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": len(data), algorithm: checksum_bytes(algorithm, data)}


def save_checkpoint(model, optimizer, directory: str | os.PathLike, *, step: int | None = None,
                    extra: dict | None = None, keep: int | None = None) -> Path:
    """Save ``model``'s chunks and ``optimizer``'s state as ``directory/step-<step>``; returns its path.

    ``step`` defaults to the engine's optimizer step count. ``extra`` (e.g. the data position or
    an LR scheduler's ``state_dict()``) comes back from ``load_checkpoint`` as ``manifest["extra"]``.
    ``keep``: after a successful save, delete all but the newest ``keep`` checkpoints.
    Call it between ``optimizer.step()`` and the next backward; ``optimizer`` may be None (then no
    hyper-parameters are saved; the engine's Adam state still is).
    """
    engine = engine_of(model)
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ConfigError("keep", keep, "must be a positive integer or None")
    engine.adam.drain()
    if engine.micro_batches or engine.window_applied:
        raise OffloadError("save_checkpoint came in the middle of an accumulation window (backward ran, "
                           "optimizer.step() did not): call it after optimizer.step()")
    if optimizer is not None and engine.optimizer is not None and optimizer is not engine.optimizer:
        raise ConfigError("optimizer", type(optimizer).__name__, "is not the optimizer attached to this model")
    step = engine.step_count if step is None else int(step)
    if step < 0:
        raise ConfigError("step", step, "must be >= 0")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root)
    name = step_name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        manifest = _write_contents(engine, optimizer, tmp, step, extra)
        write_file_atomic(tmp / MANIFEST, manifest_bytes(manifest))
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


def _write_contents(engine, optimizer, tmp: Path, step: int, extra) -> dict:
    store, layout = engine.store, engine.layout
    algorithm = checksum_algorithm()
    t0 = time.perf_counter()
    kinds = {}
    items: list[tuple[str, int]] = []
    for kind in SAVED_KINDS:
        # Frozen chunks have no master or optimizer state; a chunk not of the bulk size (an
        # oversized parameter's, a class's last) says its own ``nbytes`` in its entry.
        recs = {c: store.records[(kind, c)] for c in range(layout.num_chunks) if (kind, c) in store.records}
        if not recs:
            continue
        rec0 = next(iter(recs.values()))
        kinds[kind] = {"file": f"{kind}.bin", "dtype": DTYPE_NAMES[rec0.dtype],
                       "chunk_bytes": layout.chunk_size * rec0.dtype.itemsize,
                       "chunks": [None] * layout.num_chunks}
        items += [(kind, c) for c, rec in recs.items() if rec.state is not ChunkState.FREE]
    bufs = store.staging_buffers(max((store.largest_bytes(kind) for kind in kinds), default=0))
    writers: dict[str, KindWriter] = {}

    def fetch(i):
        data = store.read_into(items[i], bufs[i % 2])
        return data, checksum(algorithm, data)

    def consume(i, result):
        kind, c = items[i]
        data, crc = result
        kinds[kind]["chunks"][c] = {"offset": writers[kind].append(data), algorithm: crc}
        if data.numel() * data.element_size() != kinds[kind]["chunk_bytes"]:
            kinds[kind]["chunks"][c]["nbytes"] = data.numel() * data.element_size()

    try:
        for kind, info in kinds.items():     # inside the try: a failed open closes the others
            writers[kind] = KindWriter(tmp / info["file"])
        pipelined(items, fetch, consume)
    finally:
        for w in writers.values():
            w.close()
    total = sum(w.offset for w in writers.values())
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "created": time.time(),
        "checksum": algorithm,
        "dtype": engine.config.dtype,
        "engine_step_count": engine.step_count,
        "layout": {"chunk_size": layout.chunk_size, "num_chunks": layout.num_chunks,
                   "params": layout_entries(engine)},
        "kinds": kinds,
        "adam_steps": list(engine.adam.steps),
        "scaler": None if engine.scaler is None else {
            "scale": engine.scaler.scale, "good_steps": engine.scaler.good_steps,
            "skipped": engine.scaler.skipped},
        "optimizer": None,
        "buffers": None,
        "extra": None,
        "extra_file": None,
    }
    if optimizer is not None:
        manifest["optimizer"] = {"class": type(optimizer).__name__, "param_groups": group_hypers(optimizer),
                                 "max_grad_norm": getattr(optimizer, "max_grad_norm", None), "state": None}
        foreign = foreign_optimizer_state(optimizer, engine)
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
    manifest["bytes"] = total
    manifest["write_s"] = time.perf_counter() - t0
    return manifest
