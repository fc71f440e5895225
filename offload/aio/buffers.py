"""Aligned host buffers as torch tensors, and a budgeted pool of them.

Memory comes from the native mmap allocator (page-aligned; 2 MiB-aligned over transparent
huge pages for large buffers, which lets 1 MiB O_DIRECT requests reach the disk whole) and is
wrapped by ``torch.frombuffer`` without a copy. It is unmapped when the last tensor viewing it
dies. "Pinned" means page-locked: ``cudaHostRegister`` when CUDA is available, else ``mlock``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from contextlib import contextmanager
from typing import Iterator

import psutil
import torch

from .. import native
from ..errors import ConfigError, PinnedMemoryError, StateError, TierFullError
from .pinning import default_pinner, memlock_usage

HUGE_PAGE = 2 << 20
PAGE = 4096
# Below this a buffer gets 4 KiB pages: rounding a small buffer up to 2 MiB wastes memory.
HUGEPAGE_MIN_BYTES = 1 << 20
# RAM kept free for everything else when sizing host buffers.
RAM_RESERVE_FRACTION = 0.05
RAM_RESERVE_MAX = 1 << 30
_CAP_IPC_LOCK = 14


@dataclasses.dataclass(frozen=True)
class HostBudget:
    """What ``check_host_budget`` found (bytes; ``memlock_limit`` None = unlimited)."""

    requested: int
    available_ram: int
    reserve: int
    memlock_limit: int | None
    memlock_used: int
    memlock_applies: bool


def _has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def _cuda_pinning() -> bool:
    return torch.cuda.is_available()


def check_host_budget(nbytes: int, pin: bool) -> HostBudget:
    """Refuse (``PinnedMemoryError``) host buffers of ``nbytes`` that would not fit.

    Checks available RAM (psutil, keeping a reserve of min(5 % of RAM, 1 GiB)) and, when
    pinning with ``mlock`` (no CUDA), ``ulimit -l`` (RLIMIT_MEMLOCK, less what this process has
    locked already; ignored with CAP_IPC_LOCK). CUDA's ``cudaHostRegister`` is not charged to
    RLIMIT_MEMLOCK, so with CUDA the limit is reported but not enforced. The message names
    both numbers either way.
    """
    nbytes = int(nbytes)
    vm = psutil.virtual_memory()
    reserve = min(int(vm.total * RAM_RESERVE_FRACTION), RAM_RESERVE_MAX)
    limit, used = memlock_usage()
    applies = bool(pin) and not _cuda_pinning() and not _has_cap_ipc_lock() and limit is not None
    budget = HostBudget(nbytes, int(vm.available), reserve, limit, used, applies)
    limit_text = "unlimited" if limit is None else f"{limit} bytes"
    numbers = (f"available RAM is {vm.available} bytes (keeping {reserve} in reserve), "
               f"ulimit -l (RLIMIT_MEMLOCK) is {limit_text} with {used} bytes locked already")
    if nbytes > vm.available - reserve:
        raise PinnedMemoryError(f"refusing {nbytes} bytes of host buffers: {numbers}; "
                                "lower the CPU budget or free memory")
    if applies and nbytes + used > limit:
        raise PinnedMemoryError(f"refusing to lock {nbytes} bytes of host buffers: {numbers}; "
                                "raise `ulimit -l` (e.g. memlock in /etc/security/limits.conf) "
                                "or use pin=False")
    return budget


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, *, hugepage: bool | None = None,
                  pin: bool = False, populate: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements over page-aligned, zero-filled memory (no copy).

    ``hugepage``: 2 MiB-aligned with transparent huge pages (default: when the buffer is at
    least 1 MiB). ``pin``: page-lock it (``cudaHostRegister`` with CUDA, else ``mlock``;
    refusal raises ``PinnedMemoryError``). ``populate``: touch every page now, so the first
    timed use does not pay for page faults. Freed when the last view of it is gone.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ConfigError("numel", numel, "expected an element count >= 0")
    itemsize = dtype.itemsize
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype, device="cpu")
    if hugepage is None:
        hugepage = nbytes >= HUGEPAGE_MIN_BYTES
    if pin:
        check_host_budget(nbytes, pin=True)
    buf, address, on_free = _alloc_pinned(nbytes, hugepage, populate) if pin else \
        (*native.buffer_alloc(nbytes, hugepage=hugepage, populate=populate), None)
    tensor = torch.frombuffer(buf, dtype=dtype, count=numel)
    if on_free is not None:
        # The native free runs when `buf` goes; tie the unpin to the same moment.
        _keepalive_unpin(tensor, on_free)
    return tensor


def _alloc_pinned(nbytes: int, hugepage: bool, populate: bool):
    buf, address = native.buffer_alloc(nbytes, hugepage=hugepage, populate=True)
    pinner = default_pinner()
    pinner.pin(address, nbytes)
    # munmap unlocks an mlock by itself; a CUDA registration must be undone before the unmap.
    return buf, address, (lambda: pinner.unpin(address, nbytes)) if _cuda_pinning() else None


def _keepalive_unpin(tensor: torch.Tensor, unpin) -> None:
    import weakref

    # The storage outlives every view, so finalizing on it is safe for the GPU registration.
    weakref.finalize(tensor.untyped_storage(), unpin)


class BufferPool:
    """A fixed set of equal aligned buffers within a byte budget: ``acquire`` / ``release``.

    All ``budget_bytes // buffer_bytes`` buffers are slices of one arena allocated (and its
    pages touched) up front, after ``check_host_budget`` approved the total; nothing is
    allocated per request.
    ``pin`` defaults to whether CUDA is available. Buffers are 1-D ``torch.uint8`` tensors of
    ``buffer_bytes`` bytes; use ``.view(dtype)`` to reinterpret.
    """

    def __init__(self, budget_bytes: int, buffer_bytes: int, *, pin: bool | None = None,
                 hugepage: bool | None = None):
        for field, value in (("budget_bytes", budget_bytes), ("buffer_bytes", buffer_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(field, value, "expected a positive number of bytes")
        if buffer_bytes % PAGE:
            raise ConfigError("buffer_bytes", buffer_bytes, f"must be a multiple of {PAGE} bytes (O_DIRECT)")
        count = budget_bytes // buffer_bytes
        if count < 1:
            raise ConfigError("budget_bytes", budget_bytes, f"smaller than one buffer of {buffer_bytes} bytes")
        self.pin = _cuda_pinning() if pin is None else bool(pin)
        self.buffer_bytes = buffer_bytes
        self.budget_bytes = budget_bytes
        total = count * buffer_bytes
        if hugepage is None:
            hugepage = total >= HUGEPAGE_MIN_BYTES
        mapped = -(-total // HUGE_PAGE) * HUGE_PAGE if hugepage else total
        self.host = check_host_budget(mapped, self.pin)
        # One arena sliced into buffers: contiguous, huge-page backed, no per-buffer rounding.
        self._arena = aligned_empty(total, torch.uint8, hugepage=hugepage, pin=self.pin, populate=True)
        self._buffers = list(self._arena.split(buffer_bytes))
        self._by_ptr = {b.data_ptr(): b for b in self._buffers}
        self._free = deque(self._buffers)
        self._out: set[int] = set()
        self._cond = threading.Condition()
        self._closed = False

    @property
    def capacity(self) -> int:
        """Number of buffers."""
        return len(self._buffers)

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        """A free buffer; waits up to ``timeout`` seconds (None: forever), then ``TierFullError``."""
        with self._cond:
            if self._closed:
                raise StateError("BufferPool is closed")
            if not self._cond.wait_for(lambda: self._free or self._closed, timeout):
                raise TierFullError("host buffer pool", self.budget_bytes,
                                    len(self._out) * self.buffer_bytes, self.buffer_bytes,
                                    f"{len(self._out)} acquired buffers")
            if self._closed:
                raise StateError("BufferPool is closed")
            buf = self._free.popleft()
            self._out.add(buf.data_ptr())
            return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer from ``acquire`` (releasing one twice, or a stranger, is an error)."""
        ptr = buf.data_ptr()
        with self._cond:
            if ptr not in self._out:
                raise StateError("release of a buffer that is not acquired from this pool")
            self._out.remove(ptr)
            self._free.append(self._by_ptr[ptr])
            self._cond.notify()

    @contextmanager
    def buffer(self, timeout: float | None = None) -> Iterator[torch.Tensor]:
        buf = self.acquire(timeout)
        try:
            yield buf
        finally:
            self.release(buf)

    def close(self) -> None:
        """Drop the pool's references; memory is freed once no acquired view is alive."""
        with self._cond:
            self._closed = True
            self._free.clear()
            self._buffers = []
            self._by_ptr = {}
            self._arena = None
            self._cond.notify_all()

    def __enter__(self) -> "BufferPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
