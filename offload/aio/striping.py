"""One logical file laid RAID-0 style over several directories (one member file in each).

Stripe ``k`` (``stripe_unit`` bytes of the logical file) lives in member ``k % n`` at
offset ``(k // n) * stripe_unit``, so a sequential transfer keeps every drive busy. Member
files are created 0600 and preallocated with fallocate.

Two ways to own the members:

* named (the default): files that already exist with the right size are reused as they are
  (writing into existing blocks is much faster than into freshly allocated ones);
* ``unlinked=True`` (the engine's swap files): each member is opened without a name
  (``O_TMPFILE``, or created ``O_EXCL`` and unlinked at once where the filesystem lacks it)
  and lives only as long as its descriptor. The kernel frees the space when the process
  ends, even by ``kill -9``; nothing is left for anyone to clean up. ``paths`` then only
  name the members in error messages; I/O goes through ``fds``.
"""

from __future__ import annotations

import errno
import os
from typing import Iterator, Sequence

from .. import native
from ..config import DIRECT_IO_ALIGNMENT
from ..errors import ConfigError, NvmeIOError


class StripedFile:
    """A logical file of ``size`` bytes striped over ``dirs``; pass it as ``path`` to ``AsyncIO``.

    ``size`` and ``stripe_unit`` are bytes, multiples of 4096. ``create=False`` only
    describes the layout (e.g. to ``remove()`` files left by an earlier run). ``unlinked``:
    members without a name, see the module docstring; ``close()`` (or ``remove()``) frees them.
    """

    __slots__ = ("dirs", "name", "size", "stripe_unit", "paths", "member_sizes", "fds", "_repr")

    def __init__(self, dirs: Sequence[str | os.PathLike] | str | os.PathLike, name: str, size: int,
                 *, stripe_unit: int = 1 << 20, create: bool = True, unlinked: bool = False):
        if isinstance(dirs, (str, os.PathLike)):
            dirs = [dirs]
        dirs = tuple(os.fspath(d) for d in dirs)
        if not dirs:
            raise ConfigError("dirs", dirs, "expected at least one directory")
        if len({os.path.realpath(d) for d in dirs}) != len(dirs):
            raise ConfigError("dirs", dirs, "lists the same directory twice")
        if not name or "/" in name or name in (".", ".."):
            raise ConfigError("name", name, "expected a plain file name")
        for field, value in (("size", size), ("stripe_unit", stripe_unit)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 \
                    or value % DIRECT_IO_ALIGNMENT:
                raise ConfigError(field, value, f"must be a positive multiple of {DIRECT_IO_ALIGNMENT} bytes")
        self.dirs = dirs
        self.name = name
        self.size = size
        self.stripe_unit = stripe_unit
        self.paths = tuple(os.path.join(d, name) for d in dirs)
        self.member_sizes = tuple(self._member_size(i) for i in range(len(dirs)))
        # Descriptors of unlinked members (None: named members, opened by path).
        self.fds: tuple[int, ...] | None = None
        if unlinked:
            if not create:
                raise ConfigError("create", create, "an unlinked file exists only once created")
            self._create_unlinked()
        elif create:
            self._create()

    def __repr__(self) -> str:
        # Made once: every request through this file names it (its errors, its handle).
        text = getattr(self, "_repr", None)
        if text is None:
            text = self._repr = (f"StripedFile(dirs={list(self.dirs)!r}, name={self.name!r}, size={self.size}, "
                                 f"stripe_unit={self.stripe_unit})")
        return text

    def _member_size(self, i: int) -> int:
        n, unit = len(self.dirs), self.stripe_unit
        stripes = -(-self.size // unit)
        count = max(0, -(-(stripes - i) // n))
        size = count * unit
        if stripes and (stripes - 1) % n == i:
            size -= stripes * unit - self.size   # the last stripe may be short
        return size

    def _create(self) -> None:
        made: list[str] = []
        try:
            for path, want in zip(self.paths, self.member_sizes):
                try:
                    if os.stat(path).st_size == want:
                        continue
                except FileNotFoundError:
                    pass
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                except OSError as exc:
                    raise native.io_error(exc.errno or errno.EIO, path, 0, want, "creating a stripe file") from None
                made.append(path)
                try:
                    _preallocate(fd, path, want)
                finally:
                    os.close(fd)
        except BaseException:
            for path in made:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise

    def _create_unlinked(self) -> None:
        fds: list[int] = []
        try:
            for path, want in zip(self.paths, self.member_sizes):
                fd = _open_nameless(path)
                fds.append(fd)
                _preallocate(fd, path, want)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self.fds = tuple(fds)

    @property
    def unlinked(self) -> bool:
        return self.fds is not None

    def close(self) -> None:
        """Close the descriptors of unlinked members (their space is freed once no other
        descriptor holds them); named members are left alone."""
        fds, self.fds = self.fds, (() if self.fds is not None else None)
        for fd in fds or ():
            try:
                os.close(fd)
            except OSError:
                pass

    def exists(self) -> bool:
        """True when every member file is there with its expected size."""
        if self.fds is not None:
            return len(self.fds) == len(self.paths)
        try:
            return all(os.stat(p).st_size == s for p, s in zip(self.paths, self.member_sizes))
        except FileNotFoundError:
            return False

    def remove(self) -> None:
        """Delete the member files (missing ones are fine); unlinked members are closed."""
        if self.fds is not None:
            self.close()
            return
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def locate(self, offset: int, length: int) -> Iterator[tuple[int, int, int, int]]:
        """Split ``length`` bytes at logical ``offset`` into ``(member, member_offset, logical_offset, n)``."""
        n, unit = len(self.dirs), self.stripe_unit
        end = offset + length
        pos = offset
        while pos < end:
            stripe, within = divmod(pos, unit)
            take = min(unit - within, end - pos)
            yield stripe % n, (stripe // n) * unit + within, pos, take
            pos += take


def _open_nameless(path: str) -> int:
    """A read-write descriptor of a new file with no name in ``dirname(path)``.

    ``O_TMPFILE`` never gives the file a name at all. Filesystems without it get a file
    created ``O_EXCL`` 0600 under ``path`` and unlinked before anything else happens; the
    directory is expected to be private to this process, so the name is never shared.
    """
    directory = os.path.dirname(path) or "."
    flags = os.O_RDWR | os.O_CLOEXEC
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            return os.open(directory, flags | tmpfile, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise native.io_error(exc.errno or errno.EIO, path, 0, 0, "creating an unlinked swap file") from None
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise native.io_error(exc.errno or errno.EIO, path, 0, 0, "creating a swap file") from None
    try:
        os.unlink(path)
    except OSError as exc:
        os.close(fd)
        raise native.io_error(exc.errno or errno.EIO, path, 0, 0, "unlinking a new swap file") from None
    return fd


def _preallocate(fd: int, path: str, want: int) -> None:
    """Claim ``want`` bytes for ``fd`` now, so a full disk is found before training starts."""
    try:
        if os.fstat(fd).st_size > want:
            os.ftruncate(fd, want)
        rc = native.preallocate(fd, want)
        if rc == -errno.EOPNOTSUPP:
            os.ftruncate(fd, want)
        elif rc < 0:
            raise native.io_error(rc, path, 0, want, "preallocating a stripe file (fallocate)")
    except NvmeIOError:
        raise
    except OSError as exc:
        raise native.io_error(exc.errno or errno.EIO, path, 0, want, "sizing a stripe file") from None
