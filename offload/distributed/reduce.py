"""Gradients to their owners: a communication group is reduced once all its chunks' gradients
are complete, while backward goes on with earlier layers — one reduce per chunk to its owner, in
the chunk's own buffer (see ``comms`` for why not one reduce-scatter).

Only the last micro-batch of an accumulation window reduces (``no_sync`` semantics: the others
add into each rank's own gradient chunks). A group is reduced when every trainable chunk in it
is complete on this rank, and at the end of backward (``flush``) the groups that never
completed go too, with zeros for chunks that got no gradient, so every rank issues the same
collectives in the same order. The owner averages its chunk (sum / N) and hands it to the
engine's optimizer pipeline; the other ranks free theirs at once.

At most ``max_in_flight`` groups are reduced at once: each holds N gradient chunks pinned.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, ContextManager

from ..chunks.states import ChunkState


class GradReducer:
    """The gradient reductions of one engine.

    ``store`` holds the gradient chunks and ``layout`` says which are trainable and how much of
    each is used; ``tier`` is where gradients are pinned. From the engine: ``on_compute()``, a
    context in which device work runs on the compute stream; ``on_reduced(c, view)``, which hands
    this rank's averaged gradient chunk ``c`` (pinned ``view``) to the optimizer pipeline;
    ``on_dropped(c)``, told that another rank's chunk ``c`` left with its gradients.
    """

    def __init__(self, comms, store, layout, *, tier: str, on_compute: Callable[[], ContextManager],
                 on_reduced: Callable[[int, object], None], on_dropped: Callable[[int], None],
                 max_in_flight: int = 2):
        self.comms = comms
        self.sharding = comms.sharding
        self.store = store
        self.tier = tier
        self.used = layout.used
        self.on_compute = on_compute
        self.on_reduced = on_reduced
        self.on_dropped = on_dropped
        self.max_in_flight = max(1, max_in_flight)
        lay = layout
        self.trainable: dict[int, list[int]] = {}      # group -> its trainable chunks
        for c in lay.trainable_chunks:
            self.trainable.setdefault(self.sharding.group_of(c), []).append(c)
        self.finished: dict[int, dict[int, object]] = {}  # group -> {chunk: pinned grad view}
        self.issued: set[int] = set()
        self.in_flight: deque = deque()

    def chunk_finished(self, c: int, view) -> None:
        """Chunk ``c``'s gradients on this rank are complete; ``view`` is its pinned grad chunk."""
        g = self.sharding.group_of(c)
        done = self.finished.setdefault(g, {})
        done[c] = view
        if len(done) == len(self.trainable[g]):
            self._issue(g)

    def flush(self) -> None:
        """Reduce every group not reduced yet this window (zeros where a chunk got no gradient)
        and wait for all of them."""
        for g in sorted(set(self.trainable) - self.issued):
            done = self.finished.setdefault(g, {})
            for c in self.trainable[g]:
                if c not in done:
                    done[c] = self._grad_view(c)
            self._issue(g)
        while self.in_flight:
            self._complete(self.in_flight.popleft())
        self.issued.clear()

    def abort(self) -> None:
        """A backward raised on this rank: let go of the gradient chunks held for reduction.
        (The other ranks wait in the collectives this rank will not issue until they time out
        or this process ends: see ``failure``.)"""
        held = [c for done in self.finished.values() for c in done]
        held += [c for _, chunks, _, _ in self.in_flight for c in chunks]
        for *_, pending in self.in_flight:
            try:        # started, so that none starts on a buffer given back below
                pending.result()
            except BaseException:
                pass    # moot: the backward's own error is on its way up
        for c in held:
            key = ("grad", c)
            with self.store.lock:
                self.store.release(key, self.tier, dirty=True)
                if self.store.records[key].slot is None and "nvme" in self.store.tiers:
                    self.store.release_storage(key)     # another rank's, with nowhere to go
        self.finished.clear()
        self.in_flight.clear()
        self.issued.clear()

    def _grad_view(self, c: int):
        key = ("grad", c)
        with self.store.lock:       # a new chunk is pinned before another thread could evict it
            if self.store.records[key].state is ChunkState.FREE:
                self.store.initialize(key, self.tier)           # zeros: no gradient on this rank
                return self.store.access(key, self.tier)
        return self.store.access(key, self.tier)        # accumulated: it has an NVMe slot

    def _issue(self, g: int) -> None:
        s = self.sharding
        done = self.finished.pop(g)
        chunks = sorted(done)
        views = [done[c] for c in chunks]
        self.issued.add(g)
        used = self.used
        # Up to each chunk's last parameter: the padding after it is zeros on every rank.
        pending = self.comms.submit(lambda: [self.comms.start_reduce(v[:used[c]], s.owner(c))
                                             for c, v in zip(chunks, views)])
        self.in_flight.append((g, chunks, views, pending))
        while len(self.in_flight) > self.max_in_flight:
            self._complete(self.in_flight.popleft())

    def _complete(self, entry) -> None:
        g, chunks, views, pending = entry
        try:
            self.comms.wait(pending, f"reduce of gradient chunks {chunks}")
        except BaseException:
            for c in chunks:
                self.store.release(("grad", c), self.tier)
            raise
        for c, view in zip(chunks, views):
            if self.sharding.owns(c):
                with self.on_compute():
                    view.div_(self.sharding.world)      # the average, as DDP and FSDP give
                self.on_reduced(c, view)
            else:
                key = ("grad", c)
                with self.store.lock:       # no other thread may see it unpinned and still holding bytes
                    self.store.release(key, self.tier)
                    self.store.release_storage(key)
                self.on_dropped(c)
