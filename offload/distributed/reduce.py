"""Gradients back into pieces: a chunk's gradient is reduce-scattered as soon as it is complete,
while backward goes on with earlier layers -- one reduce-scatter per chunk, from the chunk's own
buffer into this rank's piece (see ``comms`` for why no staging).

Every micro-batch reduces, and each rank adds what it receives into its piece: a rank never
holds more than its 1/N of an accumulation window's gradients (FSDP2's default too; DDP's
``no_sync``, reducing only the last micro-batch, would keep every rank's whole gradients over the
window -- at 100B, 400 GB of fp32 on each rank's NVMe). A chunk is reduced when its trainable
parameters' gradients are complete on this rank, and at the end of backward (``flush``) the
chunks that never completed go too, with zeros where no gradient came, so every rank issues the
same collectives in the same order. Each rank averages what it receives (sum / N), hands its piece
to the engine's optimizer pipeline, and frees the whole gradient chunk.

At most ``max_in_flight`` chunks are reduced at once: each holds a whole gradient chunk pinned.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, ContextManager

import torch

from ..chunks.states import ChunkState


class GradReducer:
    """The gradient reductions of one engine.

    ``store`` holds the whole gradient chunks (``whole_kind``) and this rank's pieces of the
    reduced ones (``piece_kind``); ``trainable`` lists the chunks that get gradients; ``tier`` is
    where gradients are pinned. From the engine: ``on_compute()``, a context in which device
    work runs on the compute stream; ``on_reduced(c, view)``, which hands this rank's averaged
    piece of chunk ``c`` (pinned ``view``) to the optimizer pipeline.
    """

    def __init__(self, comms, store, trainable, *, tier: str, on_compute: Callable[[], ContextManager],
                 on_reduced: Callable[[int, object], None], max_in_flight: int = 2,
                 whole_kind: str = "grad_full", piece_kind: str = "grad"):
        self.comms = comms
        self.world = comms.sharding.world
        self.store = store
        self.trainable = list(trainable)
        self.tier = tier
        self.on_compute = on_compute
        self.on_reduced = on_reduced
        self.max_in_flight = max(1, max_in_flight)
        self.whole_kind = whole_kind
        self.piece_kind = piece_kind
        self.issued: set[int] = set()
        self.in_flight: deque = deque()     # (chunk, whole view, piece view, received view, pending)

    def chunk_finished(self, c: int, view) -> None:
        """Chunk ``c``'s gradients on this rank are complete; ``view`` is its pinned whole chunk."""
        self._issue(c, view)

    def flush(self) -> None:
        """Reduce every chunk not reduced yet this window (zeros where no gradient came) and wait
        for all of them."""
        for c in self.trainable:
            if c not in self.issued:
                self._issue(c, self._grad_view(c))
        while self.in_flight:
            self._complete(self.in_flight.popleft())
        self.issued.clear()

    def abort(self) -> None:
        """A backward raised on this rank: let go of the gradient chunks held for reduction.
        (The other ranks wait in the collectives this rank will not issue until they time out
        or this process ends: see ``failure``.)"""
        for *_, pending in self.in_flight:
            try:        # started, so that none starts on a buffer given back below
                pending.result()
            except BaseException:
                pass    # moot: the backward's own error is on its way up
        for c, *_ in self.in_flight:
            self.store.release((self.whole_kind, c), self.tier, dirty=True)
            with self.store.lock:
                self.store.release((self.piece_kind, c), self.tier)
                self.store.release_storage((self.piece_kind, c))
        self.in_flight.clear()
        self.issued.clear()

    def _grad_view(self, c: int):
        key = (self.whole_kind, c)
        with self.store.lock:       # a new chunk is pinned before another thread could evict it
            if self.store.records[key].state is ChunkState.FREE:
                self.store.initialize(key, self.tier)           # zeros: no gradient on this rank
                return self.store.access(key, self.tier)
        return self.store.access(key, self.tier)        # accumulated: it may have an NVMe slot

    def _issue(self, c: int, whole) -> None:
        self.issued.add(c)
        key = (self.piece_kind, c)
        with self.store.lock:   # a new piece is pinned before another thread could evict it
            fresh = self.store.records[key].state is ChunkState.FREE
            if fresh:           # the window's first micro-batch: the collective writes every element
                self.store.initialize(key, self.tier, lambda v: None)
                piece = self.store.access(key, self.tier)
        if not fresh:           # an earlier micro-batch's sum is in it (perhaps on NVMe)
            piece = self.store.access(key, self.tier)
        # Later micro-batches receive into a piece-sized temporary (1/N of a chunk, at most
        # max_in_flight of them, outside the budgets) and add it in when it lands.
        received = piece if fresh else torch.empty_like(piece)
        pending = self.comms.submit(lambda: [self.comms.start_reduce_scatter(received, whole)])
        self.in_flight.append((c, whole, piece, received, pending))
        while len(self.in_flight) > self.max_in_flight:
            self._complete(self.in_flight.popleft())

    def _complete(self, entry) -> None:
        c, whole, piece, received, pending = entry
        try:
            self.comms.wait(pending, f"reduce-scatter of gradient chunk {c}")
        except BaseException:
            self.store.release((self.whole_kind, c), self.tier)
            self.store.release((self.piece_kind, c), self.tier)
            raise
        key = (self.whole_kind, c)
        with self.store.lock:       # no other thread may see it unpinned and still holding bytes
            self.store.release(key, self.tier)
            self.store.release_storage(key)
        with self.on_compute():
            received.div_(self.world)   # the average, as DDP and FSDP give
            if received is not piece:
                piece.add_(received)
        self.on_reduced(c, piece)
