"""Open files of one engine: path -> descriptor, checked against the inode on every use.

A descriptor is reused while the path still names the same file (device, inode); a file
removed or replaced behind the engine's back is reopened (or reported missing) instead of
silently reading a deleted inode. Unlinked swap files (``StripedFile(unlinked=True)``) have
no path to check: they come with a descriptor of their own, which is reopened through
``/proc/self/fd`` with the flags a backend needs (O_DIRECT or not) — the same inode, whatever
has happened to the directory since.
"""

from __future__ import annotations

import errno
import os
import threading

from .. import native


class FileTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, bool], tuple[int, int, int]] = {}

    def fd(self, path: str, *, direct: bool, create: bool, offset: int, length: int,
           base_fd: int | None = None) -> int:
        """Descriptor of ``path`` (O_DIRECT when ``direct``); errors as ``NvmeIOError``.

        ``base_fd``: ``path`` is an unlinked file held open by this descriptor (``path`` only
        names it in errors)."""
        if base_fd is not None:
            return self._reopen(path, base_fd, direct, offset, length)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
            if not create:
                raise native.io_error(errno.ENOENT, path, offset, length, "file does not exist") from None
        except OSError as exc:
            raise native.io_error(exc.errno or errno.EIO, path, offset, length, "stat failed") from None
        key = (path, direct)
        with self._lock:
            entry = self._open.get(key)
            if entry is not None and st is not None and (entry[1], entry[2]) == (st.st_dev, st.st_ino):
                return entry[0]
            if entry is not None:
                os.close(entry[0])
                del self._open[key]
            flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
            if create:
                flags |= os.O_CREAT
            try:
                fd = os.open(path, flags, 0o600)
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM) and not create:
                    try:   # reads only need read access
                        fd = os.open(path, (flags & ~os.O_RDWR) | os.O_RDONLY)
                    except OSError as exc2:
                        raise native.io_error(exc2.errno or errno.EIO, path, offset, length, "open failed") from None
                else:
                    what = ("the filesystem refuses O_DIRECT" if direct and exc.errno == errno.EINVAL
                            else "open failed")
                    raise native.io_error(exc.errno or errno.EIO, path, offset, length, what) from None
            st = os.fstat(fd)
            self._open[key] = (fd, st.st_dev, st.st_ino)
            return fd

    def _reopen(self, path: str, base_fd: int, direct: bool, offset: int, length: int) -> int:
        key = (path, direct)
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                return entry[0]
            flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
            try:
                fd = os.open(f"/proc/self/fd/{base_fd}", flags)
            except OSError as exc:
                if exc.errno in (errno.EINVAL, errno.ENOENT) and direct:
                    # EINVAL like any O_DIRECT refusal, so callers fall back to buffered I/O.
                    why = ("the filesystem refuses O_DIRECT" if exc.errno == errno.EINVAL
                           else "no /proc to reopen it with O_DIRECT")
                    raise native.io_error(errno.EINVAL, path, offset, length, why) from None
                if exc.errno != errno.ENOENT or direct:
                    raise native.io_error(exc.errno or errno.EIO, path, offset, length,
                                          "reopening an unlinked swap file") from None
                fd = os.dup(base_fd)            # no /proc: share the creator's (buffered) descriptor
            st = os.fstat(fd)
            self._open[key] = (fd, st.st_dev, st.st_ino)
            return fd

    def close_path(self, path: str) -> None:
        with self._lock:
            for key in [k for k in self._open if k[0] == path]:
                os.close(self._open.pop(key)[0])

    def close(self) -> None:
        with self._lock:
            for fd, _, _ in self._open.values():
                os.close(fd)
            self._open.clear()
