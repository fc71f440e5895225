"""Swap files that cannot outlive their process, and what older runs left behind.

The NVMe tier's files are created without a name (``StripedFile(unlinked=True)``): the kernel
frees their blocks when the last descriptor closes, which a ``kill -9`` does too. They are
made inside a private directory ``offload-<pid>-XXXXXXXX`` (mode 0700, created with
``mkdtemp``'s O_EXCL safety, files 0600), which is removed as soon as the files exist; so the
only thing a crash can leave is that directory, empty or holding a named file when the
filesystem lacks ``O_TMPFILE`` and the process died in the instant between create and unlink.
``reclaim_stale`` (run at every tier start) removes those of dead processes.

A run closed with ``keep_files=True`` (``finetune_100b.py --keep-nvme``) gives its files a name
as it closes (``keep``): ``<nvme dir>/<prefix>-<group>.swp``, one member per directory, the
layout ``StripedFile(dirs, name, size, create=False)`` describes. Versions before this one named
their files the same way and deleted them only at a clean exit. ``find_leftovers`` reports both
(``offload doctor --path``) with the space they hold and whether a live process has them open.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

PRIVATE_PREFIX = "offload-"
_PRIVATE = re.compile(r"^offload-(\d+)-[A-Za-z0-9_]+$")
_OLD_SWAP = re.compile(r"^offload-.*\.swp$")


@dataclass(frozen=True, slots=True)
class Leftover:
    """A swap file or private directory found in an NVMe directory."""

    path: str
    kind: str            # "swap file" (named, from an older version) or "private dir"
    nbytes: int          # bytes of disk it holds (allocated blocks, not apparent size)
    pid: int | None      # the owning process (private dirs only)
    in_use: bool         # its process is alive / a live process has the file open


def private_dir(parent: str | os.PathLike) -> str:
    """A new directory ``parent/offload-<pid>-XXXXXXXX`` only this user can enter (0700)."""
    return tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=os.fspath(parent))


def keep(file, dirs) -> list[str]:
    """Give each nameless member of the striped ``file`` the name ``file.name`` in its directory
    of ``dirs`` (the NVMe directories its private directories were made in); returns the paths.

    Only a file made with ``O_TMPFILE`` can get a name back (``linkat`` of ``/proc/self/fd``);
    one made by name and unlinked at once (filesystems without it) cannot: ``NvmeIOError``
    (``ENOENT``). So does a name already taken (``EEXIST``): nothing is overwritten."""
    from .. import native

    paths = []
    # linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc entry: os.link uses linkat only when
    # given a directory descriptor (plain link() would link the /proc symlink itself).
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for fd, d in zip(file.fds or (), dirs):
            path = os.path.join(os.fspath(d), file.name)
            try:
                os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
            except OSError as exc:
                raise native.io_error(exc.errno or errno.EIO, path, 0, 0, "keeping a swap file"
                                      + (" (made without O_TMPFILE: it cannot get a name back)"
                                         if exc.errno == errno.ENOENT else "")) from None
            paths.append(path)
    finally:
        os.close(proc)
    return paths


def remove_private_dir(path: str) -> None:
    """Remove a private directory once its (unlinked) files exist; whatever is in it goes too."""
    shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _allocated(path: Path) -> int:
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(_allocated(p) for p in path.iterdir())
        return path.lstat().st_blocks * 512
    except OSError:
        return 0


def _open_elsewhere(paths: set[str]) -> set[str]:
    """Which of ``paths`` a live process (other than this one) holds open, from ``/proc/*/fd``."""
    found: set[str] = set()
    if not paths:
        return found
    me = str(os.getpid())
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit() and p != me]
    except OSError:
        return found
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in paths:
                found.add(target)
    return found


def find_leftovers(directory: str | os.PathLike) -> list[Leftover]:
    """Old-style named swap files and private directories in ``directory``, by name."""
    root = Path(directory)
    out: list[Leftover] = []
    old: list[Path] = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return out
    for entry in entries:
        m = _PRIVATE.match(entry.name)
        if m and entry.is_dir() and not entry.is_symlink():
            pid = int(m.group(1))
            out.append(Leftover(str(entry), "private dir", _allocated(entry), pid, pid_alive(pid)))
        elif _OLD_SWAP.match(entry.name) and entry.is_file() and not entry.is_symlink():
            old.append(entry)
    busy = _open_elsewhere({str(p.resolve()) for p in old})
    for p in old:
        out.append(Leftover(str(p), "swap file", _allocated(p), None, str(p.resolve()) in busy))
    return out


def reclaim_stale(directory: str | os.PathLike, *, old_swap_files: bool = False) -> list[Leftover]:
    """Remove private directories of dead processes (and, with ``old_swap_files``, named swap
    files no live process has open); returns what was removed."""
    removed = []
    for item in find_leftovers(directory):
        if item.in_use or (item.kind == "swap file" and not old_swap_files):
            continue
        try:
            if item.kind == "private dir":
                shutil.rmtree(item.path)
            else:
                os.unlink(item.path)
        except FileNotFoundError:
            pass
        except OSError:
            continue                 # not ours to remove (another user): doctor still reports it
        removed.append(item)
    return removed
