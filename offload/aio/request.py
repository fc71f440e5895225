"""What travels through a backend: pieces of at most one block, and the handle that owns them."""

from __future__ import annotations

import errno
import threading
import time

from .. import native
from ..errors import ChecksumError, NvmeIOError


class Piece:
    """One block-sized request on one file (``offset``/``length`` in that file, bytes)."""

    __slots__ = ("handle", "fd", "op", "address", "offset", "length", "path", "crc_key",
                 "crc_expect", "crc_new", "store")

    def __init__(self, handle: "Handle", fd: int, op: int, address: int, offset: int, length: int,
                 path: str):
        self.handle = handle
        self.fd = fd
        self.op = op
        self.address = address
        self.offset = offset
        self.length = length
        self.path = path
        self.crc_key = None      # (file key, block, logical offset, length) when checksums are on
        self.crc_expect = None   # CRC a read must match
        self.crc_new = None      # CRC a write records once it lands
        self.store = None

    def finish(self, result: int, done: int) -> None:
        """Called once by the backend: ``result`` == length, or -errno.

        A short transfer is ``result`` -EIO with ``done`` >= 0 bytes moved; ``done`` -1 marks
        a plain error.
        """
        err = None
        if result < 0:
            what = (f"short {'read' if self.op == native.IO_READ else 'write'}: {done} of "
                    f"{self.length} bytes (file truncated or disk full?)") if done >= 0 else ""
            err = native.io_error(result, self.path, self.offset, self.length, what)
        elif result != self.length:
            err = native.io_error(errno.EIO, self.path, self.offset, self.length,
                                  f"transferred {result} of {self.length} bytes")
        if self.store is not None:
            if self.op == native.IO_WRITE:
                self.store.record(self.crc_key, None if err else self.crc_new)
            elif err is None and self.crc_expect is not None:
                got = native.crc32c(self.address, self.length)
                if got != self.crc_expect:
                    err = ChecksumError(self.path, self.offset, self.length,
                                        f"CRC32C mismatch: read {got:#010x}, wrote {self.crc_expect:#010x}")
        self.handle._piece_done(err)

    def fail(self, err: int, what: str = "") -> None:
        """Complete with errno ``err`` without having run (refused at submission, or shut down)."""
        if self.store is not None and self.op == native.IO_WRITE:
            self.store.record(self.crc_key, None)
        self.handle._piece_done(native.io_error(err, self.path, self.offset, self.length, what))


class Handle:
    """One ``read_into``/``write_from`` call: done when all its pieces are. Keeps the tensor alive."""

    __slots__ = ("op", "path", "offset", "length", "tensor", "_remaining", "_error", "_cond")

    def __init__(self, op: str, path: str, offset: int, length: int, tensor):
        self.op = op
        self.path = path
        self.offset = offset
        self.length = length
        self.tensor = tensor
        self._remaining = 0
        self._error: NvmeIOError | None = None
        self._cond = threading.Condition(threading.Lock())

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<Handle {self.op} {self.path} offset={self.offset} length={self.length} {state}>"

    def _expect(self, n: int) -> None:
        with self._cond:
            self._remaining += n

    def _piece_done(self, err: NvmeIOError | None) -> None:
        with self._cond:
            if err is not None and (self._error is None or err.offset < self._error.offset):
                self._error = err
            self._remaining -= 1
            if self._remaining == 0:
                self._cond.notify_all()

    def done(self) -> bool:
        """True when every piece has completed (successfully or not)."""
        with self._cond:
            return self._remaining == 0

    @property
    def error(self) -> NvmeIOError | None:
        """The failure of the lowest-offset failed piece, once done; else None."""
        with self._cond:
            return self._error if self._remaining == 0 else None

    def _wait(self, deadline: float | None) -> bool:
        with self._cond:
            while self._remaining:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _release(self) -> None:
        # Done: drop the buffer reference so the caller's memory is not pinned by old handles.
        self.tensor = None
