"""Parameter chunks of other ranks, all-gathered a communication group at a time before use.

Every rank must issue the same collectives in the same order, so nothing here depends on
what a rank's own tiers happen to hold. A group is gathered when one of its chunks is pinned
and the group is not in the *window* of gathered groups; after it, the groups the first
iteration's trace says come next are gathered ahead (asynchronously, overlapping compute). The
window keeps the ``keep`` most recently used groups; older ones whose chunks no module has
pinned are dropped (their borrowed chunks freed). Pins, the window and the trace are the same
on every rank, so are the decisions.

A gathered copy of another rank's chunk is current until its owner updates it: every group
is dropped when an optimizer update is about to run (``drop_all``), and a prefetch never
reaches past the end of the iteration into the next one's chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Gathered:
    chunks: list[int]
    borrowed: list[tuple[str, int]]        # other ranks' chunks, pinned by us while gathered
    own: list[tuple[str, int]] = field(default_factory=list)   # ours, pinned while the collective reads it
    works: list = field(default_factory=list)


class GroupGather:
    def __init__(self, engine, comms, *, keep: int = 3, prefetch: int = 1):
        self.engine = engine
        self.comms = comms
        self.sharding = comms.sharding
        self.store = engine.store
        self.tier = engine.params.tier
        self.keep = max(2, keep)
        self.prefetch = max(0, prefetch)
        self.window: OrderedDict[int, _Gathered] = OrderedDict()
        self.trace: list[int] | None = None     # groups in first-demand order over the first iteration
        self._recording: list[int] = []
        self._pos = 0

    # ---- the engine's calls ----------------------------------------------------------------
    def begin_iteration(self) -> None:
        if self.trace is None and self._recording:
            self.trace = self._recording
        self._pos = 0

    def ensure(self, c: int) -> None:
        """Chunk ``c``'s parameters are on this rank's compute tier when this returns."""
        g = self.sharding.group_of(c)
        if g not in self.window:
            self._start(g)
        self.window.move_to_end(g)
        self._complete(g)
        protect = {g} | self._follow_trace(g)
        self._trim(protect)

    def holds(self, c: int) -> bool:
        """Whether a collective in flight reads this rank's chunk ``c`` (its update must wait)."""
        entry = self.window.get(self.sharding.group_of(c))
        return entry is not None and ("param", c) in entry.own

    def drop_all(self) -> None:
        """Finish what is in flight and free every borrowed chunk (an update is about to run)."""
        for g in list(self.window):
            self._complete(g)
            if self._unused(g):
                self._drop(g)

    # ---- internals -------------------------------------------------------------------------
    def _start(self, g: int) -> None:
        s, store = self.sharding, self.store
        chunks = s.group_chunks(g, self.engine.layout.num_chunks)
        entry = _Gathered(chunks, [])
        views = []
        try:
            for c in chunks:
                key = ("param", c)
                if s.owns(c):
                    self.engine._await_update(c)          # contribute the new values, never half-updated ones
                    views.append(store.access(key, self.tier))
                    entry.own.append(key)
                else:
                    views.append(store.access(key, self.tier, overwrite=True))
                    entry.borrowed.append(key)
            sizes = {v.numel() for v in views}
            if len(chunks) == s.world and len(sizes) == 1:
                entry.works = [self.comms.all_gather(views, views[s.rank])]
            else:       # a short last group, or an oversized chunk beside bulk ones: one broadcast each
                entry.works = [self.comms.broadcast(v, s.owner(c)) for c, v in zip(chunks, views)]
        except BaseException:
            self._release(entry, free=True)
            raise
        self.window[g] = entry
        if self.trace is None and (not self._recording or self._recording[-1] != g):
            self._recording.append(g)

    def _complete(self, g: int) -> None:
        entry = self.window[g]
        if not entry.works:
            return
        works, entry.works = entry.works, []
        try:
            for work in works:
                self.comms.wait(work, f"all-gather of parameter chunks {entry.chunks}")
        except BaseException:
            self.window.pop(g, None)
            self._release(entry, free=True)
            raise
        own, entry.own = entry.own, []
        for key in own:
            self.store.release(key, self.tier)
            self.engine._on_unpinned(key[1])       # its update may have been waiting for the collective

    def _follow_trace(self, g: int) -> set[int]:
        """Start gathering the groups that come after ``g`` in the first iteration."""
        trace = self.trace
        if not trace or not self.prefetch:
            return set()
        if trace[self._pos] != g:
            later = [j for j in range(self._pos + 1, len(trace)) if trace[j] == g]
            earlier = [j for j in range(0, self._pos) if trace[j] == g]
            if not later and not earlier:
                return set()
            self._pos = (later or earlier)[0]
        ahead = set()
        for g2 in trace[self._pos + 1:self._pos + 1 + self.prefetch]:
            if g2 not in self.window:
                self._start(g2)
            ahead.add(g2)
        return ahead

    def _unused(self, g: int) -> bool:
        pins = self.engine.params.pins
        return all(pins[c] == 0 for c in self.window[g].chunks)

    def _trim(self, protect: set[int]) -> None:
        while len(self.window) > self.keep:
            victim = next((g for g in self.window if g not in protect and self._unused(g)), None)
            if victim is None:
                return
            self._complete(victim)
            self._drop(victim)

    def _drop(self, g: int) -> None:
        self._release(self.window.pop(g), free=True)

    def _release(self, entry: _Gathered, *, free: bool) -> None:
        for key in entry.own:
            self.store.release(key, self.tier)
        entry.own = []
        for key in entry.borrowed:
            self.store.release(key, self.tier)
            if free:
                self.store.release_storage(key)
        entry.borrowed = []
