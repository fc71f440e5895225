"""Durable file writing for checkpoints: whole writes, fsync, atomic replace, stale temp dirs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..errors import NvmeIOError
from ..tiers.swapfiles import pid_alive
from .format import MANIFEST, TEMP_NAME, bytes_view

SYNC_EVERY = 256 << 20


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data, path: Path, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.write(fd, view[done:])
        except OSError as exc:
            raise NvmeIOError(exc.errno or 5, str(path), offset + done, len(view) - done,
                              "writing a checkpoint") from exc
        if n <= 0:
            raise NvmeIOError(5, str(path), offset + done, len(view) - done, "short write")
        done += n


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file, fsync, ``os.replace``, fsync of the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            write_all(fd, data, tmp, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class KindWriter:
    """Appends whole chunks to one file, syncing and dropping written pages every ``SYNC_EVERY``."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.offset = 0
        self.synced = 0

    def append(self, data: torch.Tensor) -> int:
        at = self.offset
        write_chunk(self, data)
        self.offset += data.numel() * data.element_size()
        if self.offset - self.synced >= SYNC_EVERY:
            self._sync()
        return at

    def _sync(self) -> None:
        os.fdatasync(self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.synced, self.offset - self.synced, os.POSIX_FADV_DONTNEED)
        self.synced = self.offset

    def close(self) -> None:
        try:
            os.fsync(self.fd)
            if hasattr(os, "posix_fadvise") and self.offset > self.synced:
                os.posix_fadvise(self.fd, self.synced, self.offset - self.synced, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(self.fd)


def write_chunk(writer: KindWriter, data: torch.Tensor) -> None:
    # A module-level function so that tests can slow it down to kill a save midway.
    write_all(writer.fd, bytes_view(data), writer.path, writer.offset)


def clean_stale(root: Path) -> None:
    """Remove ``.tmp-*`` directories of dead processes; put back a ``.trash-*`` whose rename did not finish."""
    for entry in root.iterdir():
        m = TEMP_NAME.match(entry.name)
        if not m or not entry.is_dir():
            continue
        kind, name, pid = m.group(1), m.group(2), int(m.group(3))
        if pid == os.getpid() or pid_alive(pid):
            continue
        target = root / name
        if kind == "trash" and not target.exists() and (entry / MANIFEST).exists():
            os.rename(entry, target)           # killed between moving the old one aside and the new one in
            fsync_dir(root)
        else:
            shutil.rmtree(entry, ignore_errors=True)
