"""Finding checkpoints under a root: complete ``step-*`` directories, ``latest``, the order in
which a resume tries them, and which one it starts with (``resumable``; ``saved_chunk_size``
reads that one's chunk size before the model is built, so a resume under other budgets lays the
model out as the checkpoint was)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OffloadError
from .format import LATEST, MANIFEST, STEP_NAME, check_kind_file_size, read_manifest, small_files, step_name


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete ``step-*`` checkpoints under ``directory``, oldest first (by step)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_NAME.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def _latest(root: Path) -> Path | None:
    latest = root / LATEST
    try:
        name = latest.read_text().strip() if latest.is_file() else ""
    except OSError:
        return None
    if name and "/" not in name and is_complete(root / name):
        return root / name
    return None


def candidates(directory: str | os.PathLike, step: int | None = None) -> list[Path]:
    """Checkpoints to try for ``load_checkpoint(..., directory, step=step)``, best first.

    ``step`` given, or ``directory`` itself a checkpoint: just that one. Otherwise what
    ``latest`` names, then every other complete ``step-*`` checkpoint, newest first: the
    ones a resume falls back to when a newer one does not verify.
    """
    root = Path(directory)
    if step is None and is_complete(root):
        return [root]
    if step is not None:
        path = root / step_name(step)
        if not is_complete(path):
            raise OffloadError(f"no complete checkpoint for step {step} at {path}")
        return [path]
    found = list_checkpoints(root)[::-1]
    latest = _latest(root)
    if latest is not None:
        found = [latest] + [p for p in found if p != latest]
    if not found:
        raise OffloadError(f"no checkpoint in {root} (no {MANIFEST}, no {LATEST} pointer, no complete step-* directory)")
    return found


def resolve_checkpoint(directory: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint directory that ``load_checkpoint(..., directory, step=step)`` tries first."""
    return candidates(directory, step)[0]


def intact(ckpt: Path) -> dict:
    """The manifest of checkpoint ``ckpt`` once everything but the chunk data checks out: the
    manifest parses and matches its own checksum, every chunk file and small file is there with
    the size the manifest says. ``OffloadError`` (or ``ChecksumError``) says what is wrong. Chunk
    checksums are checked as the chunks stream in (``loading``): reading a 1 TB checkpoint twice
    to choose it would cost more than the fallback it could spare."""
    manifest = read_manifest(ckpt)
    try:
        for kind, info in manifest["kinds"].items():
            check_kind_file_size(ckpt, kind, info)
        for entry in small_files(manifest):
            path = ckpt / entry["file"]
            size = path.stat().st_size if path.is_file() else None
            if size != entry["bytes"]:
                raise OffloadError(f"checkpoint file {path} " + ("is missing" if size is None else
                                   f"holds {size} bytes, the manifest says {entry['bytes']}"))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise OffloadError(f"checkpoint {ckpt} has a malformed manifest ({type(exc).__name__}: {exc})") from exc
    return manifest


def resumable(directory: str | os.PathLike) -> tuple[Path, dict] | None:
    """The checkpoint a resume from ``directory`` starts with, and its manifest: the first of
    ``candidates(directory)`` that is ``intact``. None when ``directory`` holds no checkpoint;
    the newest one's error when none is intact (a resume would raise it too)."""
    try:
        found = candidates(directory)
    except OffloadError:
        return None
    first = None
    for ckpt in found:
        try:
            return ckpt, intact(ckpt)
        except OffloadError as exc:
            first = first or exc
    raise first


def saved_chunk_size(directory: str | os.PathLike) -> int | None:
    """The ``chunk_size`` (elements) of the checkpoint a resume from ``directory`` loads (see
    ``resumable``), or None when there is none. A checkpoint loads only into a model laid out
    with its chunk size; a trainer builds the model with this one, whatever the budgets say now."""
    chosen = resumable(directory)
    if chosen is None:
        return None
    ckpt, manifest = chosen
    try:
        return int(manifest["layout"]["chunk_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise OffloadError(f"checkpoint {ckpt} has a malformed manifest (no layout chunk_size: {exc})") from exc
