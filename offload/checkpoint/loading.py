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
fills its span of every chunk (``ChunkInfo.span``) from the saved pieces that overlap it
(``pieces.copies``), whichever ranks' files of the saving run hold them, each piece read whole
and verified (``reading``); so a checkpoint of N ranks loads at any M (1 without a process group
included), and one of a single process (version 1) or of round-robin ranks (version 2) too: a
whole chunk is one piece. After each candidate the ranks compare outcomes: if any rank found it
damaged, every rank skips it; a mismatch or an engine failure on any rank makes every rank
raise. So all ranks always end on the same checkpoint.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from ..distributed.arrival import arrive
from ..engine.access import engine_of
from ..errors import ConfigError, OffloadError
from .compat import check_compatible
from .format import DTYPES, chunk_pieces, read_checked_file
from .listing import candidates, intact
from .model_state import persistent_buffers, pipelined, restore_hypers
from .pieces import Copy, Piece, clip, copies
from .plain import load_plain
from .reading import OpenFiles, fill_span
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
    _load_chunks(engine, manifest, ckpt, algorithm)
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


class _Fill(NamedTuple):
    """This rank's span of one chunk of one kind, and the saved pieces that fill it."""

    kind: str
    c: int
    pieces: list[Piece]
    copies: list[Copy]
    nbytes: int          # the span's bytes (padding included)
    stored: int          # its elements inside the chunk
    itemsize: int

    def edge_bytes(self) -> int:
        """Bytes of the largest piece that lies across the span's edge (read into scratch first)."""
        spans = [(p.lo, p.hi) for p in self.pieces]
        return max((self.pieces[cp.piece].nbytes for cp in self.copies if not cp.whole(spans)
                    and self.pieces[cp.piece].stored), default=0)


def _load_chunks(engine, manifest: dict, ckpt: Path, algorithm: str) -> None:
    """Fill this rank's span of every chunk of every saved kind from the pieces that overlap it
    (``pieces.copies``); a chunk saved as holding nothing is emptied. Memory: two spans of the
    largest kind, and (another world size) one piece that lies across a span's edge."""
    chunks = engine.chunks
    model = chunks.chunks()
    items: list[_Fill] = []
    for kind, info in manifest["kinds"].items():
        itemsize = DTYPES[info["dtype"]].itemsize
        for c, entry in enumerate(info["chunks"]):
            if entry is None:       # it held nothing when saved
                _on_engine(chunks.write, kind, c, None)
                continue
            pieces = chunk_pieces(info, entry, algorithm)
            lo, hi = model[c].kind_span(kind)        # in blocks for the scales of 8-bit moments
            stored = clip((lo, hi), model[c].kind_numel(kind))
            items.append(_Fill(kind, c, pieces, copies([(p.lo, p.hi) for p in pieces], stored), (hi - lo) * itemsize,
                               stored[1] - stored[0], itemsize))
    bufs = [torch.zeros(max((it.nbytes for it in items), default=0), dtype=torch.uint8, device="cpu")
            for _ in range(2)]
    edge = max((it.edge_bytes() for it in items), default=0)
    scratch = torch.empty(edge, dtype=torch.uint8, device="cpu") if edge else None

    def fetch(i):
        it = items[i]
        out = fill_span(files, it.kind, it.c, it.pieces, it.copies, bufs[i % 2][:it.nbytes], it.stored, it.itemsize,
                        scratch, algorithm)
        return out.view(DTYPES[manifest["kinds"][it.kind]["dtype"]])

    def consume(i, data):
        _on_engine(chunks.write, items[i].kind, items[i].c, data)

    with OpenFiles(ckpt) as files:
        pipelined(items, fetch, consume)
