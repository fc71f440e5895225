"""Open files of one engine: path -> descriptor, checked against the inode on every use.

A descriptor is reused while the path still names the same file (device, inode); a file
removed or replaced behind the engine's back is reopened (or reported missing) instead of
silently reading a deleted inode.
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

    def fd(self, path: str, *, direct: bool, create: bool, offset: int, length: int) -> int:
        """Descriptor of ``path`` (O_DIRECT when ``direct``); errors as ``NvmeIOError``."""
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

    def close_path(self, path: str) -> None:
        with self._lock:
            for key in [k for k in self._open if k[0] == path]:
                os.close(self._open.pop(key)[0])

    def close(self) -> None:
        with self._lock:
            for fd, _, _ in self._open.values():
                os.close(fd)
            self._open.clear()
