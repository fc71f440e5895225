"""Parameter chunks on the compute device: parameters as views into them, pins around their use,
and the trace-driven fetch that each first pin starts.

A ``nn.Parameter`` keeps its identity for the whole run; only its ``.data`` changes. While its
chunk's device buffer exists, ``.data`` may keep viewing it (``ParamViews``): the next module
using the chunk only pins it again. When the store frees or reuses that buffer it tells
``ParamViews.on_store_free`` first, and the parameters go back to a zero-element placeholder of
the right dtype and device, so a use outside the engine's control fails loudly instead of reading
stale memory.

``DevicePins`` counts the pins of each parameter chunk (a module computing, a backward holding
it) and holds the chunk pinned in the store while any is taken. Each first pin is an access in
the iteration's trace: the prefetcher records it and names the chunks that come next, which are
fetched now (``prefetch(j + 1)`` while ``compute(j)``), and the eviction policy learns where the
iteration is. A chunk whose update from the last step is still queued is not fetched ahead: the
update writes its new values in memory, and a copy read now would be stale.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..chunks import ChunkLayout, ChunkStore
from ..scheduler import NextUsePolicy, TracePrefetcher
from ..scheduler.eviction import EvictionPolicy
from ..tracer import Tracer


def empty_placeholder(ndim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The ``.data`` of a parameter of ``ndim`` dimensions whose chunk is not viewed: no element to
    read, but its number of dimensions kept (code that groups parameters by ``p.ndim`` -- weight
    decay for matrices only, as nanoGPT and timm do -- sees what it would unwrapped). A 0-d
    parameter gets 1-d: a 0-d tensor always holds an element."""
    return torch.empty((0,) * max(ndim, 1), dtype=dtype, device=device)


class ParamViews:
    """Which device buffer each chunk's parameters view, on compute tier ``tier``."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], layout: ChunkLayout, dtype: torch.dtype,
                 device: torch.device, tier: str, kind: str = "param"):
        self.tier = tier
        self.kind = kind        # the chunks parameters view: "param", or "gathered" under several ranks
        self.dtype, self.device = dtype, device
        self._placeholders: dict[int, torch.Tensor] = {}
        self.members: list[list] = [[] for _ in range(layout.num_chunks)]    # chunk -> [(param, slot)]
        for name, p in named:
            slot = layout.slot(name)
            self.members[slot.chunk].append((p, slot))
        self.pinned_buffers: dict[int, int] = {}   # device buffer address -> chunk, while attached
        self.attached: dict[int, int] = {}         # chunk -> device buffer address its parameters view

    def placeholder(self, ndim: int) -> torch.Tensor:
        """``empty_placeholder`` of this engine's dtype and device, one per ``ndim``."""
        t = self._placeholders.get(ndim)
        if t is None:
            t = self._placeholders[ndim] = empty_placeholder(ndim, self.dtype, self.device)
        return t

    def attach(self, c: int, view: torch.Tensor) -> None:
        """Make chunk ``c``'s parameters view ``view`` (its device copy), unless they already do."""
        if c in self.attached:
            return
        for p, s in self.members[c]:
            p.data = view[s.offset:s.end].view(s.shape)
        ptr = view.untyped_storage().data_ptr()
        self.pinned_buffers[ptr] = c
        self.attached[c] = ptr

    def detach(self, c: int) -> None:
        """Point chunk ``c``'s parameters at the placeholder (its device buffer is going away)."""
        ptr = self.attached.pop(c, None)
        if ptr is None:
            return
        for p, s in self.members[c]:
            p.data = self.placeholder(len(s.shape))
        self.pinned_buffers.pop(ptr, None)

    def on_store_free(self, key, tier: str) -> None:
        """The store's ``on_free``: a copy's buffer goes back to its tier."""
        if key[0] == self.kind and tier == self.tier:
            self.detach(key[1])


class DevicePins:
    """Pins of the parameter chunks on the compute device, and the fetches ahead they start.

    ``pending(c)``: whether chunk ``c``'s update from the last step is still queued.
    """

    def __init__(self, store: ChunkStore, views: ParamViews, prefetcher: TracePrefetcher,
                 policy: EvictionPolicy, tracer: Tracer, *, pending: Callable[[int], bool]):
        self.store = store
        self.views = views
        self.tier = views.tier
        self.kind = views.kind
        self.prefetcher = prefetcher
        self.policy = policy
        self.tracer = tracer
        self.pending = pending
        self.counts = [0] * len(views.members)

    def count(self, c: int) -> int:
        return self.counts[c]

    def pinned(self, c: int) -> bool:
        return self.counts[c] > 0

    def pinned_chunks(self) -> list[int]:
        """The chunks pinned now, in chunk order."""
        return [c for c, n in enumerate(self.counts) if n]

    def chunk_viewed_at(self, address: int) -> int | None:
        """The chunk whose parameters view the device buffer at ``address``, if any."""
        return self.views.pinned_buffers.get(address)

    def detach(self, c: int) -> None:
        """Chunk ``c``'s parameters stop viewing its device copy (its update is rewriting them)."""
        self.views.detach(c)

    def pin(self, c: int) -> None:
        """Pin chunk ``c`` on the device (its parameters view it); the first pin fetches it and
        starts fetching what the trace says comes next."""
        if self.counts[c] == 0:
            key = (self.kind, c)
            hit = self.store.landed(key, self.tier)
            with self.tracer.span(f"fetch param {c}", "wait", chunk=c, hit=hit):
                view = self.store.access(key, self.tier)
            self.views.attach(c, view)
            self._fetch_ahead(c, hit)
        self.counts[c] += 1

    def unpin(self, c: int) -> bool:
        """Let go of one pin of chunk ``c``; True when that was the last (the store's pin went)."""
        if self.counts[c] <= 0:
            return False
        self.counts[c] -= 1
        if self.counts[c]:
            return False
        self.store.release((self.kind, c), self.tier)
        return True

    def view(self, c: int) -> torch.Tensor | None:
        """Chunk ``c``'s device copy (use only under a pin)."""
        return self.store.view((self.kind, c), self.tier)

    def begin_iteration(self) -> None:
        """A forward starts a new iteration: the last one's order becomes the trace to follow."""
        self.prefetcher.begin_iteration()
        if isinstance(self.policy, NextUsePolicy):
            self.policy.set_trace(self.prefetcher.trace)

    def deadline(self, c: int) -> float:
        """When the next iteration first uses chunk ``c`` (trace position; chunk order before a trace)."""
        trace = self.prefetcher.trace
        return trace.next_use((self.kind, c), 0) if trace is not None else float(c)

    def _fetch_ahead(self, c: int, hit: bool) -> None:
        self.prefetcher.record_hit(hit)
        upcoming = self.prefetcher.on_access((self.kind, c))
        if isinstance(self.policy, NextUsePolicy):
            self.policy.position = self.prefetcher.position
        for key in upcoming:
            if key[0] != "param":
                continue        # a gathered chunk comes by its collective (``ChunkGather``), not by a read
            if self.pending(key[1]):
                continue        # its update writes the new values in memory; a read now would be stale
            self.store.prefetch(key, "device")
