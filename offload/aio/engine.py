"""``AsyncIO``: reads and writes of CPU tensors to files, many requests in flight at once.

A call is split into pieces of at most ``block_size`` bytes (at multiples of ``block_size``
in the logical file, and at stripe boundaries of a ``StripedFile``) and handed to a backend:
``libaio`` (O_DIRECT, kernel AIO, ``queue_depth`` in flight per context) or ``threads`` (a
pread/pwrite pool). ``wait`` returns once every piece of the given handles has completed and
raises the first failure then, so no request is ever left in flight behind an exception.

Errors raised at once by ``read_into``/``write_from`` (nothing was submitted): the engine is
closed (EBADF), the tensor is not a contiguous CPU tensor or the request is out of range
(EINVAL), the file is missing (ENOENT) or cannot be opened. With the libaio backend the
tensor's address, its byte length and the file offset must be multiples of 4096: an
unaligned request raises EINVAL rather than being quietly rerouted (``aligned_empty`` and
``BufferPool`` always give aligned buffers). Errors of the transfer itself (EIO, ENOSPC, a
short read of a truncated file, a CRC mismatch) are raised by ``wait``.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Iterable, Sequence, Union

import torch

from .. import native
from ..config import DIRECT_IO_ALIGNMENT, AioConfig
from ..errors import ConfigError, NvmeIOError
from .checks import supports_o_direct
from .checksums import CrcStore
from .files import FileTable
from .libaio_backend import LibaioBackend
from .request import Handle, Piece
from .striping import StripedFile
from .thread_backend import ThreadBackend

log = logging.getLogger("offload.aio")

PathLike = Union[str, os.PathLike, StripedFile]


def choose_backend(config: AioConfig, paths: Sequence[str] | None = None) -> tuple[str, str]:
    """``(backend, reason)`` for ``config.backend`` on directories ``paths`` (None: not known yet)."""
    linked = native.libaio_linked()
    if config.backend == "threads":
        return "threads", "AioConfig(backend='threads') asked for it"
    if not linked:
        why = "offload._native was built without libaio (install libaio-dev and reinstall offload)"
        if config.backend == "libaio":
            raise ConfigError("aio.backend", "libaio", why + "; use 'auto' or 'threads'")
        return "threads", why
    for d in paths or ():
        ok, reason = supports_o_direct(d)
        if not ok:
            if config.backend == "libaio":
                raise ConfigError("aio.backend", "libaio", reason + "; use 'auto' or 'threads'")
            return "threads", reason
    if paths:
        where = ", ".join(map(str, paths))
        return "libaio", f"libaio is linked and O_DIRECT works in {where}"
    return "libaio", ("libaio is linked (O_DIRECT is checked as each file is opened; a file "
                      "that refuses it goes through threads)" if config.backend == "auto"
                      else "AioConfig(backend='libaio') asked for it")


class AsyncIO:
    """Asynchronous file I/O of CPU tensors. ``paths``: directories it will use (probed by "auto")."""

    def __init__(self, config: AioConfig | None = None, *, paths: Sequence[str | os.PathLike] | None = None):
        self.config = config if config is not None else AioConfig()
        if not isinstance(self.config, AioConfig):
            raise ConfigError("config", config, "expected an offload.AioConfig")
        dirs = [os.fspath(p) for p in paths] if paths else None
        self.backend, self.backend_reason = choose_backend(self.config, dirs)
        self._libaio: LibaioBackend | None = None
        if self.backend == "libaio":
            try:
                self._libaio = LibaioBackend(self.config.queue_depth, self.config.threads,
                                             self.config.submit_batch, self.config.background_depth)
            except NvmeIOError as exc:
                if self.config.backend == "libaio":
                    raise ConfigError("aio.backend", "libaio", f"no AIO context: {exc}") from None
                self.backend, self.backend_reason = "threads", f"no AIO context could be set up ({exc})"
        log.info("using the %s backend: %s", self.backend, self.backend_reason)
        self._threads: ThreadBackend | None = None
        self._files = FileTable()
        self._crc = CrcStore() if self.config.checksum else None
        self._lock = threading.RLock()
        self._no_direct: set[str] = set()
        self._dirs: dict[str, str] = {}      # member path -> its directory (asked at every request)
        self._closed = False

    # ---- public API -------------------------------------------------------------------
    def write_from(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> Handle:
        """Start writing the bytes of ``tensor`` to ``path`` at byte ``offset``; returns a handle.

        A plain path names one file (created 0600 if missing); a ``StripedFile`` spreads the
        bytes over its members. Keep the tensor unchanged until ``wait`` returns.
        """
        return self._start(native.IO_WRITE, tensor, path, offset)

    def read_into(self, tensor: torch.Tensor, path: PathLike, offset: int = 0, *, urgent: bool = False) -> Handle:
        """Start reading ``tensor``'s byte size from ``path`` at byte ``offset`` into ``tensor``.

        ``urgent``: something will wait for these bytes soon (libaio: they pass background
        requests not yet in the kernel; see ``AioConfig.background_depth``).
        """
        return self._start(native.IO_READ, tensor, path, offset, urgent)

    def wait(self, handles: Handle | Iterable[Handle], timeout: float | None = None) -> int:
        """Wait for every handle, then raise the first failure (``NvmeIOError``); returns bytes moved.

        ``timeout`` (seconds) bounds the whole wait; when it expires an ``NvmeIOError``
        with ETIMEDOUT is raised and the requests are still in flight (wait again).
        """
        hs = [handles] if isinstance(handles, Handle) else list(handles)
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in hs:
            if not h._wait(deadline):
                raise native.io_error(errno.ETIMEDOUT, h.path, h.offset, h.length,
                                      f"still in flight after {timeout} s")
        for h in hs:
            h._release()
        for h in hs:
            if h.error is not None:
                raise h.error
        return sum(h.length for h in hs)

    def write(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> None:
        """``write_from`` then ``wait``."""
        self.wait(self.write_from(tensor, path, offset))

    def read(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> None:
        """``read_into`` then ``wait``."""
        self.wait(self.read_into(tensor, path, offset))

    def forget(self, path: PathLike) -> None:
        """Close descriptors and drop checksums of ``path`` (e.g. after removing its files)."""
        members = path.paths if isinstance(path, StripedFile) else (os.fspath(path),)
        for p in members:
            self._files.close_path(p)
        if self._crc is not None:
            self._crc.forget(_file_key(path))

    def close(self) -> None:
        """Finish every request already started, then release contexts, threads and files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for backend in (self._libaio, self._threads):
            if backend is not None:
                backend.close()
        self._files.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    # ---- internals ---------------------------------------------------------------------
    def _start(self, op: int, tensor: torch.Tensor, path: PathLike, offset: int, urgent: bool = False) -> Handle:
        name = repr(path) if isinstance(path, StripedFile) else os.fspath(path)
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise native.io_error(errno.EINVAL, name, offset if isinstance(offset, int) else -1, nbytes,
                                  "offset must be an int >= 0 (bytes)")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise native.io_error(errno.EINVAL, name, offset, nbytes, "expected a contiguous CPU tensor")
        if isinstance(path, StripedFile):
            if offset + nbytes > path.size:
                raise native.io_error(errno.EINVAL, name, offset, nbytes,
                                      f"beyond the end of the striped file ({path.size} bytes)")
            fds = path.fds
            if fds is not None and len(fds) != len(path.paths):
                raise native.io_error(errno.EBADF, name, offset, nbytes, "the striped file is closed")
            segments = [(path.paths[m], moff, loff, n, None if fds is None else fds[m])
                        for m, moff, loff, n in path.locate(offset, nbytes)]
            create = False
        else:
            segments = [(name, offset, offset, nbytes, None)]
            create = op == native.IO_WRITE
        handle = Handle("write" if op == native.IO_WRITE else "read", name, offset, nbytes, tensor)
        if nbytes == 0:
            with self._lock:
                if self._closed:
                    raise native.io_error(errno.EBADF, name, offset, nbytes, "this AsyncIO is closed")
            return handle
        address = tensor.data_ptr()
        bs = self.config.block_size
        # Block-sized pieces: (member, member offset, logical offset, length). Their checksums are
        # computed here, before the engine's lock, so other threads' I/O does not wait on them.
        spans = []
        base_fds: dict[str, int | None] = {}
        for member, moff, loff, n, base_fd in segments:
            base_fds[member] = base_fd
            pos, end = loff, loff + n
            while pos < end:
                stop = min((pos // bs + 1) * bs, end)
                spans.append((member, moff + (pos - loff), pos, stop - pos))
                pos = stop
        crcs = None
        if self._crc is not None and op == native.IO_WRITE:
            crcs = [native.crc32c(address + (pos - offset), n) for _, _, pos, n in spans]
        with self._lock:
            if self._closed:
                raise native.io_error(errno.EBADF, name, offset, nbytes, "this AsyncIO is closed")
            file_key = _file_key(path)
            direct_pieces: list[Piece] = []
            thread_pieces: list[Piece] = []
            opened: dict[str, tuple[int, bool]] = {}     # a striped request visits each member often
            for i, (member, moff, pos, n) in enumerate(spans):
                if member not in opened:
                    opened[member] = self._open(member, create, moff, n, address, offset, nbytes,
                                                base_fds[member])
                fd, direct = opened[member]
                piece = Piece(handle, fd, op, address + (pos - offset), moff, n, member)
                if self._crc is not None:
                    piece.store = self._crc
                    piece.crc_key = CrcStore.key(file_key, pos // bs, pos, n)
                    if crcs is not None:
                        piece.crc_new = crcs[i]
                    else:
                        piece.crc_expect = self._crc.expected(piece.crc_key)
                (direct_pieces if direct else thread_pieces).append(piece)
            handle._expect(len(direct_pieces) + len(thread_pieces))
            if direct_pieces:
                self._libaio.submit(direct_pieces, urgent)
            if thread_pieces:
                self._thread_backend().submit(thread_pieces)
        return handle

    def _open(self, path: str, create: bool, moff: int, n: int, address: int, offset: int,
              nbytes: int, base_fd: int | None = None) -> tuple[int, bool]:
        """``(descriptor, through libaio)`` for one member of a request."""
        where = self._dirs.get(path)
        if where is None:
            where = self._dirs[path] = os.path.dirname(os.path.abspath(path))
        direct = self._libaio is not None and where not in self._no_direct
        if direct:
            bad = [what for what, v in (("buffer address", address), ("length", nbytes), ("offset", offset))
                   if v % DIRECT_IO_ALIGNMENT]
            if bad:
                raise native.io_error(errno.EINVAL, path, moff, n,
                                      f"O_DIRECT (libaio backend) needs the {', '.join(bad)} to be a "
                                      f"multiple of {DIRECT_IO_ALIGNMENT} (use offload.aio.aligned_empty)")
            try:
                return self._files.fd(path, direct=True, create=create, offset=moff, length=n,
                                      base_fd=base_fd), True
            except NvmeIOError as exc:
                if exc.errno != errno.EINVAL or self.config.backend != "auto":
                    raise
                self._no_direct.add(where)
                log.info("%s refuses O_DIRECT; its files go through the threads backend", where)
        elif base_fd is not None and not (address | nbytes | offset) % DIRECT_IO_ALIGNMENT:
            # An unlinked swap file on the threads backend still takes O_DIRECT where it can: a
            # buffered write would "succeed" into the page cache and its EIO surface at writeback,
            # where nobody sees it (and TBs of swap traffic would push everything else out of RAM).
            if where not in self._no_direct:
                try:
                    return self._files.fd(path, direct=True, create=create, offset=moff, length=n,
                                          base_fd=base_fd), False
                except NvmeIOError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._no_direct.add(where)
        return self._files.fd(path, direct=False, create=create, offset=moff, length=n,
                              base_fd=base_fd), False

    def _thread_backend(self) -> ThreadBackend:
        if self._threads is None:
            self._threads = ThreadBackend(self.config.threads)
        return self._threads


def _file_key(path: PathLike):
    return ("striped",) + path.paths if isinstance(path, StripedFile) else os.path.abspath(os.fspath(path))
