"""Loading a checkpoint into a wrapped model, and falling back to an older one when the newest
does not verify.

A resume (``step=None`` on a checkpoint root) tries what ``latest`` names, then every older
complete checkpoint, newest first. A checkpoint is skipped -- with a ``CheckpointSkipped``
warning naming it and the reason, and an entry in ``manifest["skipped"]`` -- when it fails
verification: an unreadable or malformed manifest, a missing or truncated file, a checksum
mismatch, an I/O error. A checkpoint that is intact but does not fit the model (another
model, dtype or chunk layout: ``ConfigError``) is never skipped: that is the caller's mistake
and falling back would hide it.

Which checkpoint: ``candidates`` gives the order, ``intact`` (manifest, file sizes) the first
test -- the same two ``saved_chunk_size`` chooses by before the model is built.

Small files (optimizer state, buffers, ``extra``) are read and verified before anything in
the model changes, as tensors and plain data only (``plain``: a pickled object is refused);
chunks are verified as they stream in, so a mismatch there leaves the model partly loaded --
and the next candidate then overwrites every chunk.

Several ranks (data parallelism): every rank calls it; rank 0 lists the candidates, each rank
loads the chunks it keeps at the current world size (``Ranks.keeps``), whichever rank's files
of the saving run hold them, so a checkpoint of N ranks loads at any M (1 without a process
group included). After each candidate the ranks compare outcomes: if any rank found it
damaged, every rank skips it; a mismatch or an engine failure on any rank makes every rank
raise. So all ranks always end on the same checkpoint.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch

from ..distributed.arrival import arrive
from ..engine.access import engine_of
from ..errors import ChecksumError, ConfigError, OffloadError
from .compat import check_compatible
from .format import DTYPES, checksum, entry_bytes, entry_file, read_checked_file
from .listing import candidates, intact
from .model_state import persistent_buffers, pipelined, restore_hypers
from .plain import load_plain
from .ranks import PeerFailed, Ranks, peer_error, report


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
    Under data parallelism every rank calls it, at any world size (see the module docstring).
    """
    engine = engine_of(model, required=True)
    arrive("load_checkpoint", engine.chunks.sharding)        # every rank, or a one-line error
    ranks = Ranks.of(engine)
    error, found = None, None
    try:
        if optimizer is not None and engine.optimizer is not None and optimizer is not engine.optimizer:
            raise ConfigError("optimizer", type(optimizer).__name__, "is not the optimizer attached to this model")
        if ranks.lead:
            found = [str(p) for p in candidates(directory, step)]
    except Exception as exc:
        error = exc
    tried = [Path(p) for p in ranks.settle(error, f"finding a checkpoint in {directory}", found)[0]]
    skipped: list[dict] = []
    first_error: BaseException | None = None
    for i, ckpt in enumerate(tried):
        manifest, failure = None, None
        try:
            manifest = _load_one(engine, optimizer, ckpt, ranks)
        except _EngineFailure as exc:
            failure = ("fatal", exc.original)
        except ConfigError as exc:
            failure = ("fatal", exc)
        except OffloadError as exc:
            failure = ("skip", exc)
        except Exception as exc:            # a bug or an unexpected error: every rank stops
            failure = ("fatal", exc)
        outcomes = ranks.gather(None if failure is None else (failure[0], report(failure[1])))
        fatal = [(r, o[1]) for r, o in enumerate(outcomes) if o is not None and o[0] == "fatal"]
        if fatal:
            if failure is not None and failure[0] == "fatal":
                raise failure[1]
            raise peer_error(fatal[0][0], fatal[0][1], f"loading checkpoint {ckpt}")
        bad = [(r, o[1]) for r, o in enumerate(outcomes) if o is not None]
        if not bad:
            manifest["skipped"] = skipped
            return manifest
        reason = bad[0][1][1] if not ranks.sharded else f"{bad[0][1][1]} (rank {bad[0][0]})"
        if first_error is None:
            first_error = failure[1] if failure is not None else PeerFailed(f"checkpoint {ckpt} does not verify on "
                                                                            f"rank {bad[0][0]}: {bad[0][1][1]}")
        skipped.append({"path": str(ckpt), "reason": reason})
        if i + 1 < len(tried):
            warnings.warn(f"checkpoint {ckpt} skipped: {reason}; trying the older {tried[i + 1].name}",
                          CheckpointSkipped, stacklevel=2)
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


def _load_one(engine, optimizer, ckpt: Path, ranks: Ranks) -> dict:
    try:
        return _load_verified(engine, optimizer, ckpt, ranks)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise OffloadError(f"checkpoint {ckpt} has a malformed manifest ({type(exc).__name__}: {exc})") from exc


def _load_verified(engine, optimizer, ckpt: Path, ranks: Ranks) -> dict:
    manifest = intact(ckpt)          # what ``saved_chunk_size`` chose by, too
    check_compatible(engine, manifest, ckpt, ranks)
    algorithm = manifest["checksum"]

    def small(entry):           # tensors and plain data only: nothing in the file runs (``plain``)
        return load_plain(ckpt / entry["file"], read_checked_file(ckpt, entry, algorithm))

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

    _on_engine(engine.chunks.drain)
    _on_engine(engine.zero_grad)             # a clean window: no gradients, nothing applied
    _on_engine(engine.drop_gathered)         # other ranks' chunks gathered here go stale now
    t0 = time.perf_counter()
    _load_chunks(engine, manifest, ckpt, algorithm, ranks)
    read_s = time.perf_counter() - t0
    engine.chunks.restore_step_state(adam_steps=manifest["adam_steps"], step_count=manifest["engine_step_count"],
                                     scaler=manifest.get("scaler") or None)
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
                                f"short read (end of file) of chunk {kind}[{c}]")
        got += n
    crc = checksum(algorithm, view)
    if crc != entry[algorithm]:
        raise ChecksumError(str(path), entry["offset"], nbytes,
                            f"checksum mismatch ({algorithm}: expected {entry[algorithm]:#010x}, got {crc:#010x}) "
                            f"of chunk {kind}[{c}]")
    return view


def _load_chunks(engine, manifest: dict, ckpt: Path, algorithm: str, ranks: Ranks) -> None:
    chunks = engine.chunks
    items: list[tuple[str, int, dict]] = []
    for kind, info in manifest["kinds"].items():
        for c, entry in enumerate(info["chunks"]):
            if not ranks.keeps(c):
                continue            # another rank's (its parameters here are only ever transient)
            if entry is None:       # it held nothing when saved
                _on_engine(chunks.write, kind, c, None)
            else:
                items.append((kind, c, entry))
    biggest = max((entry_bytes(manifest["kinds"][k], e) for k, _, e in items), default=0)
    bufs = [torch.zeros(biggest, dtype=torch.uint8, device="cpu") for _ in range(2)]
    files = {}

    def fetch(i):
        kind, c, entry = items[i]
        info = manifest["kinds"][kind]
        name = entry_file(info, entry)
        if name not in files:
            try:
                files[name] = open(ckpt / name, "rb", buffering=0)
            except OSError as exc:
                raise OffloadError(f"checkpoint file {ckpt / name} cannot be read: {exc}") from exc
        view = read_chunk(files[name].fileno(), ckpt / name, kind, c, entry, entry_bytes(info, entry),
                          bufs[i % 2], algorithm)
        return view.view(DTYPES[info["dtype"]])

    def consume(i, data):
        kind, c, _ = items[i]
        _on_engine(chunks.write, kind, c, data)

    try:
        pipelined(items, fetch, consume)
    finally:
        for f in files.values():
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            f.close()
