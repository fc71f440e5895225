"""Loading a checkpoint into a wrapped model, and falling back to an older one when the newest
does not verify.

A resume (``step=None`` on a checkpoint root) tries what ``latest`` names, then every older
complete checkpoint, newest first. A checkpoint is skipped -- with a ``CheckpointSkipped``
warning naming it and the reason, and an entry in ``manifest["skipped"]`` -- when it fails
verification: an unreadable or malformed manifest, a missing or truncated file, a checksum
mismatch, an I/O error. A checkpoint that is intact but does not fit the model (another
model, dtype or chunk layout: ``ConfigError``) is never skipped: that is the caller's mistake
and falling back would hide it.

Small files (optimizer state, buffers, ``extra``) are read and verified before anything in
the model changes; chunks are verified as they stream in, so a mismatch there leaves the
model partly loaded -- and the next candidate then overwrites every chunk.
"""

from __future__ import annotations

import io
import os
import time
import warnings
from pathlib import Path

import torch

from ..chunks.states import ChunkState
from ..errors import ChecksumError, ConfigError, OffloadError
from .format import DTYPES, MANIFEST, SAVED_KINDS, check_kind_file_size, checksum, entry_bytes, read_checked_file, read_manifest
from .listing import candidates
from .model_state import engine_of, layout_entries, persistent_buffers, pipelined, restore_hypers


class CheckpointSkipped(UserWarning):
    """A checkpoint did not verify and an older one is loaded instead (the message says which and why)."""


class _EngineFailure(Exception):
    """The engine (not the checkpoint) failed while loading, e.g. a swap write: never a reason
    to fall back to an older checkpoint, so it is carried past the fallback and re-raised."""

    def __init__(self, original: Exception):
        super().__init__(str(original))
        self.original = original


def _on_engine(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        raise _EngineFailure(exc) from exc


def load_checkpoint(model, optimizer, directory: str | os.PathLike, *, step: int | None = None) -> dict:
    """Load a checkpoint into a wrapped ``model`` (and ``optimizer``); returns its manifest.

    ``directory`` is a checkpoint root (``latest`` is loaded, or ``step=``) or one checkpoint.
    ``manifest["extra"]`` is what ``save_checkpoint`` got as ``extra``, ``manifest["path"]`` the
    directory read, ``manifest["skipped"]`` a list of ``{"path", "reason"}`` for newer
    checkpoints that did not verify (``step=None`` on a root only; see the module docstring).
    When none verifies, the newest one's error is raised (``ChecksumError`` names file, chunk
    and offset) and the model's state is then partly loaded (load another checkpoint).
    """
    engine = engine_of(model)
    if optimizer is not None and engine.optimizer is not None and optimizer is not engine.optimizer:
        raise ConfigError("optimizer", type(optimizer).__name__, "is not the optimizer attached to this model")
    tried = candidates(directory, step)
    skipped: list[dict] = []
    first_error: BaseException | None = None
    for i, ckpt in enumerate(tried):
        try:
            manifest = _load_one(engine, optimizer, ckpt)
        except _EngineFailure as failure:
            raise failure.original
        except ConfigError:
            raise
        except OffloadError as exc:
            if first_error is None:
                first_error = exc
            skipped.append({"path": str(ckpt), "reason": str(exc)})
            if i + 1 < len(tried):
                warnings.warn(f"checkpoint {ckpt} skipped: {exc}; trying the older {tried[i + 1].name}",
                              CheckpointSkipped, stacklevel=2)
            continue
        manifest["skipped"] = skipped
        return manifest
    raise first_error


def resume(model, optimizer, directory: str | os.PathLike, *, say=None) -> dict:
    """``load_checkpoint(model, optimizer, directory)`` for a script's ``--resume``: each skipped
    checkpoint is reported through ``say`` as one line (instead of a warning); returns the manifest."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointSkipped)
        manifest = load_checkpoint(model, optimizer, directory)
    for item in manifest["skipped"]:
        if say is not None:
            say(f"skipped checkpoint {item['path']}: {item['reason']}")
    return manifest


def _load_one(engine, optimizer, ckpt: Path) -> dict:
    try:
        return _load_verified(engine, optimizer, ckpt)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise OffloadError(f"checkpoint {ckpt} has a malformed manifest ({type(exc).__name__}: {exc})") from exc


def _load_verified(engine, optimizer, ckpt: Path) -> dict:
    manifest = read_manifest(ckpt)
    check_compatible(engine, manifest, ckpt)
    algorithm = manifest["checksum"]

    def small(entry):
        return torch.load(io.BytesIO(read_checked_file(ckpt, entry, algorithm)), weights_only=False,
                          map_location="cpu")

    # Every small file is read and verified before the model changes.
    opt = manifest.get("optimizer")
    foreign = small(opt["state"]) if optimizer is not None and opt is not None and opt.get("state") else None
    buffers = small(manifest["buffers"]) if manifest.get("buffers") else None
    if buffers is not None:
        live = persistent_buffers(engine.model)
        for name in buffers:
            if name not in live:
                raise ConfigError("buffer", name, f"is in the checkpoint {ckpt} but not in the model")
    if manifest.get("extra_file"):
        manifest["extra"] = small(manifest["extra_file"])

    _on_engine(engine.adam.drain)
    _on_engine(engine.zero_grad)             # a clean window: no gradients, nothing applied
    t0 = time.perf_counter()
    _load_chunks(engine, manifest, ckpt, algorithm)
    read_s = time.perf_counter() - t0
    engine.adam.steps[:] = [int(s) for s in manifest["adam_steps"]]
    engine.step_count = int(manifest["engine_step_count"])
    if engine.scaler is not None and manifest.get("scaler"):
        engine.scaler.scale = float(manifest["scaler"]["scale"])
        engine.scaler.good_steps = int(manifest["scaler"]["good_steps"])
        engine.scaler.skipped = int(manifest["scaler"]["skipped"])
    if optimizer is not None and opt is not None:
        restore_hypers(optimizer, opt["param_groups"], ckpt)
        if hasattr(optimizer, "max_grad_norm") and "max_grad_norm" in opt:
            optimizer.max_grad_norm = opt["max_grad_norm"]
        if foreign:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for i, st in foreign.items():
                p = params[i]
                optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() else v)
                                      for k, v in st.items()}
    if buffers is not None:
        live = persistent_buffers(engine.model)
        for name, value in buffers.items():
            module, b = live[name]
            getattr(module, b).copy_(value)
    manifest["path"] = str(ckpt)
    manifest["read_s"] = read_s
    return manifest


def read_chunk(fd: int, path: Path, kind: str, c: int, entry: dict, nbytes: int, buf: torch.Tensor,
               algorithm: str) -> torch.Tensor:
    """Read chunk ``kind[c]`` (``nbytes`` at ``entry["offset"]``) into ``buf`` and verify its
    checksum; returns the filled uint8 view. ``ChecksumError`` names file, chunk and offset."""
    view = buf[:nbytes]
    mv = memoryview(view.numpy()).cast("B")
    got = 0
    while got < nbytes:
        try:
            n = os.preadv(fd, [mv[got:]], entry["offset"] + got)
        except OSError as exc:
            from ..errors import NvmeIOError

            raise NvmeIOError(exc.errno or 5, str(path), entry["offset"] + got, nbytes - got,
                              f"reading chunk {kind}[{c}]") from exc
        if not n:
            raise ChecksumError(str(path), entry["offset"] + got, nbytes - got,
                                f"short read of chunk {kind}[{c}]")
        got += n
    crc = checksum(algorithm, view)
    if crc != entry[algorithm]:
        raise ChecksumError(str(path), entry["offset"], nbytes,
                            f"{algorithm} mismatch in chunk {kind}[{c}] of {path.name} "
                            f"(expected {entry[algorithm]:#010x}, got {crc:#010x})")
    return view


def check_compatible(engine, manifest: dict, ckpt: Path) -> None:
    lay = manifest["layout"]
    if manifest["dtype"] != engine.config.dtype:
        raise ConfigError("dtype", engine.config.dtype, f"the checkpoint {ckpt} was saved with dtype "
                                                        f"{manifest['dtype']!r}")
    saved = {e[0]: e for e in lay["params"]}
    mine = {e[0]: e for e in layout_entries(engine)}
    for name, e in mine.items():
        if name not in saved:
            raise ConfigError("parameter", name, f"is not in the checkpoint {ckpt}")
        s = saved[name]
        if s[4] != e[4]:
            raise ConfigError("parameter", name, f"has shape {tuple(e[4])} but {tuple(s[4])} in the checkpoint {ckpt}")
        if s[1:4] != e[1:4]:
            raise ConfigError("parameter", name, f"sits at chunk {e[1]} offset {e[2]} but at chunk {s[1]} "
                                                 f"offset {s[2]} in the checkpoint {ckpt} (a different chunk "
                                                 f"layout: use the same chunk_size and parameter order)")
    extra = sorted(set(saved) - set(mine))
    if extra:
        raise ConfigError("parameter", extra[0], f"is in the checkpoint {ckpt} but not in the model "
                                                 f"({len(extra)} such)")
    if lay["chunk_size"] != engine.layout.chunk_size or lay["num_chunks"] != engine.layout.num_chunks:
        raise ConfigError("chunk_size", engine.layout.chunk_size,
                          f"the checkpoint {ckpt} has {lay['num_chunks']} chunks of {lay['chunk_size']} elements")
    if len(manifest["adam_steps"]) != len(engine.adam.steps):
        raise OffloadError(f"{ckpt / MANIFEST}: {len(manifest['adam_steps'])} step counts for "
                           f"{len(engine.adam.steps)} parameters")
    store = engine.store
    for kind, info in manifest["kinds"].items():
        recs = {c: r for (k, c), r in store.records.items() if k == kind}
        if not recs:
            raise ConfigError("kind", kind, f"the checkpoint {ckpt} has {kind!r} chunks this model does not")
        rec = next(iter(recs.values()))
        bulk = engine.layout.chunk_size * rec.dtype.itemsize
        if DTYPES.get(info["dtype"]) != rec.dtype or info["chunk_bytes"] != bulk:
            raise ConfigError("kind", kind, f"{info['dtype']} chunks of {info['chunk_bytes']} bytes in the "
                                            f"checkpoint {ckpt}, {rec.dtype} of {bulk} in the model")
        if len(info["chunks"]) != engine.layout.num_chunks:
            raise OffloadError(f"{ckpt / MANIFEST}: {len(info['chunks'])} {kind} chunk entries, expected "
                               f"{engine.layout.num_chunks}")
        for c, entry in enumerate(info["chunks"]):
            if entry is not None and (c not in recs or entry_bytes(info, entry) != recs[c].nbytes):
                raise ConfigError("kind", kind, f"chunk {c} of the checkpoint {ckpt} does not match the "
                                                "model's (a different chunk layout or set of frozen parameters)")
        check_kind_file_size(ckpt, kind, info)
    registered = {k for k, _ in store.records}
    for kind in SAVED_KINDS:
        if kind in registered and kind not in manifest["kinds"]:
            raise ConfigError("kind", kind, f"the model has {kind!r} chunks, the checkpoint {ckpt} none")


def _load_chunks(engine, manifest: dict, ckpt: Path, algorithm: str) -> None:
    store = engine.store
    items: list[tuple[str, int, dict]] = []
    for kind, info in manifest["kinds"].items():
        for c, entry in enumerate(info["chunks"]):
            if entry is None:
                rec = store.records.get((kind, c))
                if rec is not None and rec.state is not ChunkState.FREE:
                    _on_engine(store.release_storage, (kind, c))
            else:
                items.append((kind, c, entry))
    biggest = max((entry_bytes(manifest["kinds"][k], e) for k, _, e in items), default=0)
    bufs = [torch.zeros(biggest, dtype=torch.uint8, device="cpu") for _ in range(2)]
    files = {}

    def fetch(i):
        kind, c, entry = items[i]
        info = manifest["kinds"][kind]
        if kind not in files:
            try:
                files[kind] = open(ckpt / info["file"], "rb", buffering=0)
            except OSError as exc:
                raise OffloadError(f"checkpoint file {ckpt / info['file']} cannot be read: {exc}") from exc
        view = read_chunk(files[kind].fileno(), ckpt / info["file"], kind, c, entry, entry_bytes(info, entry),
                          bufs[i % 2], algorithm)
        return view.view(DTYPES[info["dtype"]])

    def consume(i, data):
        kind, c, _ = items[i]
        _on_engine(store.write, (kind, c), data)

    try:
        pipelined(items, fetch, consume)
    finally:
        for f in files.values():
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            f.close()
