"""Finding checkpoints under a root: complete ``step-*`` directories, ``latest``, the order in
which a resume tries them."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OffloadError
from .format import LATEST, MANIFEST, STEP_NAME, step_name


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
