"""The one exception hierarchy. Every failure the package raises on purpose is an ``OffloadError``.

Each class names what a user needs to act: the config field and value, the file, offset and
errno of an I/O failure, the tier and budget that is full.
"""

from __future__ import annotations

import errno as _errno
import os


class OffloadError(Exception):
    """Base class of every error the package raises on purpose."""


class ConfigError(OffloadError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""

    def __init__(self, field: str, value: object, why: str):
        self.field = field
        self.value = value
        self.why = why
        super().__init__(f"{field}={value!r}: {why}")


class NativeError(OffloadError, RuntimeError):
    """The native extension is missing, failed to load, or returned an unexpected error."""


class UnsupportedError(OffloadError, NotImplementedError):
    """A valid request that this version does not support (the message says what to do instead)."""


class DistributedError(OffloadError, RuntimeError):
    """A collective across ranks failed: a peer died, timed out, or the ranks disagree. The
    message names this rank, the collective, and the failed rank when it is known."""

    def __init__(self, rank: int, what: str, why: str, failed_rank: int | None = None):
        self.rank = rank
        self.what = what
        self.failed_rank = failed_rank
        peer = f"rank {failed_rank} failed" if failed_rank is not None else "a peer rank failed or stopped responding"
        super().__init__(f"rank {rank}: {what}: {peer}: {why}")


class NvmeIOError(OffloadError, OSError):
    """An I/O request failed. Carries ``errno``, ``path``, ``offset`` and ``length`` (bytes)."""

    def __init__(self, err: int, path: str, offset: int, length: int, what: str = ""):
        OSError.__init__(self, err, os.strerror(err) if err > 0 else "I/O error")
        self.errno = err
        self.path = str(path)
        self.offset = int(offset)
        self.length = int(length)
        self.what = what

    def __str__(self) -> str:
        name = _errno.errorcode.get(self.errno, str(self.errno))
        detail = f": {self.what}" if self.what else ""
        return (f"[{name}] {os.strerror(self.errno)} at {self.path} "
                f"offset {self.offset} length {self.length}{detail}")

    def __reduce__(self):
        return (type(self), (self.errno, self.path, self.offset, self.length, self.what))


class ChecksumError(NvmeIOError):
    """Data read back does not match the CRC32C recorded when it was written (or is not the
    size recorded). ``errno`` is EIO for callers that treat it as a failed read, but the message
    says what it is: the read itself succeeded."""

    def __init__(self, path: str, offset: int, length: int, what: str = "CRC32C mismatch"):
        super().__init__(_errno.EIO, path, offset, length, what)

    def __str__(self) -> str:
        return f"{self.path}: {self.what} at offset {self.offset} (length {self.length})"

    def __reduce__(self):
        return (type(self), (self.path, self.offset, self.length, self.what))


class TierFullError(OffloadError, MemoryError):
    """A tier cannot make room: names the tier, its budget and what holds it."""

    def __init__(self, tier: str, budget: int, used: int, requested: int, holders: str = ""):
        self.tier = tier
        self.budget = int(budget)
        self.used = int(used)
        self.requested = int(requested)
        self.holders = holders
        held = f"; held by {holders}" if holders else ""
        super().__init__(f"tier {tier!r} is full: budget {budget} bytes, {used} in use, "
                         f"{requested} more requested and nothing evictable{held}")


class DeviceMemoryError(OffloadError, MemoryError):
    """The GPU itself ran out of memory for a chunk buffer inside the device budget: the budget
    and what the rest of the process (activations, other tensors) holds add up to more than the
    card has. Names the tier, the budget and CUDA's own figures."""


class PinnedMemoryError(OffloadError, MemoryError):
    """A page-locked or aligned host allocation was refused before it could OOM the process."""


class StateError(OffloadError, RuntimeError):
    """An illegal chunk or tensor state transition (names the from/to states)."""


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, the whole message: its lines joined by single spaces (a
    library's multi-line message, e.g. transformers' config validation, is otherwise cut to a
    header ending in ':' with the reason on the next line)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
