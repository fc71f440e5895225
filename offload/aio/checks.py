"""Probes of a directory before the engine trusts it: O_DIRECT support and free space."""

from __future__ import annotations

import errno
import os
import tempfile

from .. import native
from ..config import DIRECT_IO_ALIGNMENT


def supports_o_direct(directory: str | os.PathLike) -> tuple[bool, str]:
    """Whether ``directory`` takes O_DIRECT I/O, found by doing it: ``(ok, reason)``.

    Writes and reads back one 4 KiB aligned block in a temporary file (removed after). The
    reason is one line a user can act on.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return False, f"{directory} is not a directory"
    try:
        fd_tmp, path = tempfile.mkstemp(prefix=".offload-odirect-", dir=directory)
    except OSError as exc:
        return False, f"cannot create a file in {directory}: {exc.strerror}"
    os.close(fd_tmp)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            why = ("the filesystem refuses O_DIRECT" if exc.errno == errno.EINVAL else exc.strerror)
            return False, f"O_DIRECT open in {directory} failed: {why}"
        try:
            buf, address = native.buffer_alloc(DIRECT_IO_ALIGNMENT, hugepage=False, populate=True)
            buf[0:16] = b"offload-o-direct"
            n = DIRECT_IO_ALIGNMENT
            wrote = native.pio(fd, native.IO_WRITE, address, n, 0)
            if wrote != n:
                return False, f"O_DIRECT write in {directory} failed: {_rc_text(wrote, n)}"
            buf[0:16] = bytes(16)
            got = native.pio(fd, native.IO_READ, address, n, 0)
            if got != n or bytes(buf[0:16]) != b"offload-o-direct":
                return False, f"O_DIRECT read-back in {directory} failed: {_rc_text(got, n)}"
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return True, f"a 4 KiB O_DIRECT write and read-back in {directory} worked"


def _rc_text(rc: int, want: int) -> str:
    if rc < 0:
        return os.strerror(-rc)
    return f"moved {rc} of {want} bytes"


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still allocate in ``directory``'s filesystem."""
    st = os.statvfs(os.fspath(directory))
    return st.f_bavail * st.f_frsize
