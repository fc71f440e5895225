"""A memory tier (the compute device, or CPU memory): a budgeted set of reusable byte buffers.

Buffers are flat ``uint8`` tensors; a chunk views one as its dtype. ``reserved`` (pooled + in
use) never exceeds ``budget``.

A host tier (``aligned`` for O_DIRECT, or ``pin`` for asynchronous CUDA copies) carves every
buffer out of one huge-page-advised mapping of ``budget`` bytes (see ``arena``): chunks of every
size share it, and nothing is mapped, unmapped, registered or unregistered while training runs.
Unpinned, pages are touched only as they are first used, so resident memory grows to the peak
use, never beyond the budget. Pinned, the whole mapping is page-locked once, at the first
allocation (``cudaHostRegister`` with CUDA): registration populates it, and a chunk of any size
may land anywhere in it, so it is registered whole rather than buffer by buffer — a
register/unregister per buffer costs a page-table walk of MiBs each time, and freeing buffers of
one size to make room for another did that dozens of times a step. A pinned tier whose chunks
need less than its budget is sized to them instead (``fit_to``, called once every chunk is
registered, before the first allocation maps the arena): a budget is a ceiling, and page-locking
all of it pinned tens of GB a 1B model never used. When the budget has the bytes
but the arena no contiguous range for them and nothing can be evicted (every chunk pinned: under
N ranks whole gathered chunks and 1/N pieces interleave), a buffer is taken outside the arena
(``fits_outside_arena``): the budget still holds, only that buffer misses the arena. A buffer
under one page of the arena (``ARENA_PAGE``: the 8-bit moments' block scales of a small chunk
piece, 32 B per 2048 elements) comes from the allocator instead, at its own size: in the arena it
would take a whole page while counted at its size, and neither alignment nor pinning is needed
of it (NVMe slots are whole pages; a GPU copy from pageable memory is only synchronous).

The device tier keeps freed buffers in a pool keyed by size (freshly touched pages cost ~40x
more than reused ones; on a GPU a cudaMalloc is a synchronisation) and gives them back only when
a request of another size needs their share of the budget. A freed device buffer may still be
read by GPU work queued before it was freed: ``free`` takes the CUDA events that work ends with
(its *fences*) and ``take_fences`` hands them to the buffer's next user, which makes its own
stream wait for them.

Releasing a pooled buffer (to make room for another size) never makes the host wait for its
fences: that runs under the chunk store's lock, where a wait would drain the GPU's queue. The
buffer goes back to torch's caching allocator instead, marked (``record_stream``) as used by a
stream of ours that first waits for the fences on the GPU. The allocator then keeps the memory
from every other tensor until that stream's work has passed, polling the event at each
allocation, and only when it runs out of memory does it wait for the event itself (as
``empty_cache`` does). So the host blocks only when the card is truly full. The tier's own
accounting drops the bytes at once: ``reserved`` never exceeds the budget, and for as long as the
GPU is behind the host the card may hold up to the released bytes more, which the allocator
reclaims under pressure for anyone, activations included. Keeping a "retiring" list in the tier
instead would have to charge those bytes to the budget, so a full budget (exactly when the pool
shrinks) would make the host wait again, and memory the tier holds is invisible to the
allocator's out-of-memory recovery. On a CPU device nothing is needed: memory is refcounted, and
whatever still reads a buffer holds a reference to it.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Callable, Sequence

import torch

from ..errors import DeviceMemoryError, StateError, TierFullError
from .arena import Extents, Slots

HUGEPAGE = 2 << 20
ARENA_PAGE = 4096          # the arena's unit: every buffer in it is whole pages (``Extents``)


class MemoryTier:
    """A byte budget on one device.

    ``aligned`` asks for 4 KiB-aligned (O_DIRECT-able) host buffers; ``pin`` page-locks them for
    asynchronous CUDA copies, through ``pinner`` (default: ``offload.aio.pinning.default_pinner()``).
    """

    def __init__(self, name: str, budget: int, device: torch.device | str = "cpu", *,
                 aligned: bool = False, pin: bool = False, pinner=None):
        self.name = name
        self.budget = int(budget)
        self.device = torch.device(device)
        self.aligned = aligned
        self.pin = pin
        self.in_use = 0                     # bytes handed out
        self._pooled: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._pooled_bytes = 0
        self._fences: dict[int, list] = {}  # device buffer address -> events its last users end with
        self._retire_stream = None          # CUDA: waits for released buffers' fences (``_release``)
        # Host memory for O_DIRECT or DMA is one arena: its bookkeeping now, its mapping at first use.
        arena = self.device.type == "cpu" and (aligned or pin)
        self._extents: Extents | Slots | None = Extents(self.budget // ARENA_PAGE * ARENA_PAGE) if arena else None
        self.asked_budget = self.budget     # the budget given; ``budget`` is less once ``fit_to`` fits it
        self._mapping: memoryview | None = None
        self._base = 0
        self._largest_request = 0
        self._pinner = pinner
        self._unpin_at_exit = None
        self._outside: set[int] = set()     # addresses of buffers outside the arena (fragmented, or small)
        self.outside_arena = 0              # how many were ever taken so (each mapped, and pinned, alone)

    @property
    def reserved(self) -> int:
        """Bytes held from the system: in use plus pooled for reuse (always <= budget)."""
        return self.in_use + self._pooled_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes that can still be handed out (pooled buffers count as free)."""
        return self.budget - self.in_use

    def can_allocate(self, nbytes: int) -> bool:
        if self.in_use + nbytes > self.budget:
            return False
        # In an arena the bytes must also be contiguous (evicting more makes them so).
        return self._extents is None or nbytes < ARENA_PAGE or self._extents.fits(nbytes)

    def fit_to(self, sizes: Sequence[int], spare: int) -> int:
        """Size the arena, and the budget with it, to one buffer of each of ``sizes`` at once plus
        ``spare`` bytes, when that is less than the budget (``Slots``: a slot per buffer, so they
        never fragment); returns the budget now. Only before the arena is mapped: it is mapped and
        page-locked once. A tier without an arena maps nothing up front: it stays as it is."""
        if self._extents is None:
            return self.budget
        if self._mapping is not None:
            raise StateError(f"tier {self.name!r}: its {self._extents.size}-byte arena is mapped already; "
                             "fit it to its chunks before the first allocation")
        slots = Slots([n for n in sizes if n >= ARENA_PAGE], spare)
        small = sum(n for n in sizes if n < ARENA_PAGE)     # from the allocator, outside the arena
        if slots.size + small < self._extents.size:
            self._extents = slots
            self.budget = slots.size + small
        return self.budget

    def fits_outside_arena(self, nbytes: int) -> bool:
        """The budget has ``nbytes`` free though the arena has no contiguous range for them: the
        caller may allocate rather than fail (``allocate`` then goes outside the arena)."""
        return self._extents is not None and self.in_use + nbytes <= self.budget

    def shortfall(self, nbytes: int) -> int:
        """Bytes to free before ``nbytes`` can be allocated: the missing budget, or in an arena with
        enough free bytes that are not contiguous, ``nbytes`` (freed victim by victim until it fits)."""
        return nbytes - self.free_bytes if nbytes > self.free_bytes else nbytes

    def allocate(self, nbytes: int, holders: Callable[[], str] = lambda: "") -> torch.Tensor:
        """A buffer of ``nbytes``; raises ``TierFullError`` if the budget cannot cover it. A reused
        device buffer may come with fences (``take_fences``) its new user must wait for."""
        if not (self.can_allocate(nbytes) or self.fits_outside_arena(nbytes)):
            raise TierFullError(self.name, self.budget, self.in_use, nbytes, holders())
        if self._extents is not None:
            buf = self._from_arena(nbytes) if nbytes >= ARENA_PAGE else self._small(nbytes)
            self.in_use += nbytes
            return buf
        if self._pooled[nbytes]:
            # Only a buffer of the exact size: a larger one would count its unused bytes against the
            # budget for as long as its chunk is pinned, and pinned chunks holding such waste ran a
            # budget the engine had accepted out of room once the access order changed (a forward
            # skipping a module, generate after training). A size with nothing pooled releases
            # pooled buffers (the caching allocator keeps the memory) and takes a buffer its size.
            buf = self._pooled[nbytes].pop()
            self._pooled_bytes -= nbytes
            self.in_use += nbytes
            return buf
        self._shrink_pool(self.budget - nbytes - self.in_use)
        buf = self._new_buffer(nbytes)
        self.in_use += nbytes
        return buf

    def free(self, buf: torch.Tensor, fences: Sequence = ()) -> None:
        """Return a buffer (it stays reserved for the next chunk of its size). ``fences``: CUDA
        events after which no GPU work queued so far uses it (device tiers only)."""
        nbytes = buf.numel()
        self.in_use -= nbytes
        if self._outside:
            address = buf.untyped_storage().data_ptr()
            if address in self._outside:
                self._outside.discard(address)
                return          # dropped: its memory goes when its last view does
        if self._extents is not None:
            self._extents.free(buf.data_ptr() - self._base, nbytes)
            return
        if fences:
            self._fences[buf.data_ptr()] = [*self._fences.get(buf.data_ptr(), ()), *fences]
        self._pooled[nbytes].append(buf)
        self._pooled_bytes += nbytes

    def take_fences(self, buf: torch.Tensor) -> list:
        """The events ``buf``'s previous users end with (and forget them): wait for them on the
        stream that uses it next."""
        return self._fences.pop(buf.data_ptr(), [])

    def _shrink_pool(self, keep: int) -> None:
        # Release pooled buffers (largest first) until at most ``keep`` pooled bytes remain.
        for size in sorted(self._pooled, reverse=True):
            pool = self._pooled[size]
            while pool and self._pooled_bytes > max(keep, 0):
                self._release(pool.pop())
                self._pooled_bytes -= size

    def _release(self, buf: torch.Tensor) -> None:
        """Let ``buf`` go without waiting for its fences (see the module's docstring for why)."""
        fences = self._fences.pop(buf.data_ptr(), ())
        if fences and buf.is_cuda:
            if self._retire_stream is None:
                self._retire_stream = torch.cuda.Stream(self.device)
            for fence in fences:
                self._retire_stream.wait_event(fence)
            # Once ``buf`` is deallocated (on return), the allocator records an event on this
            # stream, behind the waits, and reuses the memory only after that event.
            buf.record_stream(self._retire_stream)

    def _small(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self._outside.add(buf.untyped_storage().data_ptr())     # freed as the outside buffers are
        return buf

    def _from_arena(self, nbytes: int) -> torch.Tensor:
        if self._mapping is None:
            self._map_arena()
        # The largest size seen (fp32 chunks) grows from the bottom, smaller ones from the top.
        self._largest_request = max(self._largest_request, nbytes)
        start = self._extents.allocate(nbytes, top=nbytes < self._largest_request)
        if start is None:        # fragmented, nothing evictable (fits_outside_arena said yes)
            from ..aio.buffers import aligned_empty

            buf = aligned_empty(nbytes, torch.uint8, pin=self.pin)
            self._outside.add(buf.untyped_storage().data_ptr())
            self.outside_arena += 1
            return buf
        # A tensor of its own over the range (its storage starts there: the engine tells chunks
        # apart by storage address), keeping the mapping alive as long as it lives.
        return torch.frombuffer(self._mapping[start:start + nbytes], dtype=torch.uint8)

    def _map_arena(self) -> None:
        from .. import native

        size = self._extents.size
        if self.pin and size:
            from ..aio.buffers import check_host_budget

            check_host_budget(size, pin=True)       # refuse before touching a page
        mapping, self._base = native.buffer_alloc(size, hugepage=True, populate=self.pin)
        if self.pin and size:
            from ..aio.pinning import default_pinner

            pinner = self._pinner if self._pinner is not None else default_pinner()
            pinner.pin(self._base, size)
            # Undone when the tier goes, before the mapping can be unmapped: chunk tensors still
            # viewing it keep it mapped (merely unpinned) until they go too.
            self._unpin_at_exit = weakref.finalize(self, pinner.unpin, self._base, size)
        self._mapping = memoryview(mapping)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        buf = self._empty(nbytes)
        if buf.is_cuda:
            # The caching allocator hands out memory that is free in the order of the allocating
            # (current) stream: kernels queued there before may still use it. The buffer's first
            # writer is often a copy stream, so its first fence is this point of that stream.
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))
            self._fences[buf.data_ptr()] = [fence]
        return buf

    def _empty(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            # The budget is ours; the card is shared with activations and everything else.
            self._shrink_pool(0)
            torch.cuda.empty_cache()
            try:
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError:
                free, total = torch.cuda.mem_get_info(self.device)
                raise DeviceMemoryError(
                    f"tier {self.name!r} on {self.device}: CUDA has no {nbytes} bytes left for a chunk "
                    f"buffer ({self.in_use} of the {self.budget}-byte device budget in use, {free} of "
                    f"{total} bytes free on the card, {torch.cuda.memory_allocated(self.device)} "
                    "allocated by this process): activations and other tensors need more than the "
                    "budget leaves; lower device_budget or the batch") from None

    def close(self) -> None:
        """Let go of this tier's memory: pooled buffers, and the arena (unpinned now; unmapped once
        the last tensor viewing it goes). Call when no buffer of the tier is in use any more."""
        self._shrink_pool(0)
        self._pooled.clear()
        if self._unpin_at_exit is not None:
            self._unpin_at_exit()
        self._mapping = None

    def describe(self) -> dict:
        # ``budget`` is the effective one: less than ``asked_budget`` when fitted to the chunks.
        return {"budget": self.budget, "asked_budget": self.asked_budget, "in_use": self.in_use,
                "reserved": self.reserved, "device": str(self.device), "pinned": self.pin,
                "outside_arena": self.outside_arena}
