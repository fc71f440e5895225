"""Parameter chunks of other ranks, all-gathered a communication group at a time before use.

Every rank must issue the same collectives in the same order, so nothing here depends on
what a rank's own tiers happen to hold. A group is gathered when one of its chunks is pinned
and the group is not in the *window* of gathered groups; after it, the groups the last
iteration's trace says come next are gathered ahead (asynchronously, overlapping compute). The
trace is the order in which groups were asked for in the last whole iteration (the first one
differs: modules pin their children's chunks too until their first forward has shown which
ones they use). The
window keeps ``keep`` groups; beyond that, a group whose chunks no module has pinned is dropped
(its borrowed chunks freed): the one the trace asks for again latest. Pins, the window and the trace are the same
on every rank, so are the decisions.

A gathered copy of another rank's chunk is current until its owner updates it: every group
is dropped when an optimizer update is about to run (``drop_all``), and a prefetch never
reaches past the end of the iteration into the next one's chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# How far along the trace a prefetch looks for the next groups (entries, not groups).
LOOKAHEAD = 4


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
        self.trace: list[int] | None = None     # groups in demand order over the last iteration
        self._recording: list[int] = []
        self._pos = 0
        self.hits = 0       # demands met by a group already gathered (or on its way)
        self.misses = 0     # demands that had to start a gather and wait for it

    # ---- the engine's calls ----------------------------------------------------------------
    def begin_iteration(self) -> None:
        if self._recording:
            self.trace, self._recording = self._recording, []
        self._pos = 0

    def ensure(self, c: int) -> None:
        """Chunk ``c``'s parameters are on this rank's compute tier when this returns."""
        g = self.sharding.group_of(c)
        if g not in self.window:
            self.misses += 1
            self._start(g)
        else:
            self.hits += 1
        self.window.move_to_end(g)
        self._complete(g)
        if not self._recording or self._recording[-1] != g:
            self._recording.append(g)
        protect = {g} | self._follow_trace(g)
        self._trim(protect)

    def take_stats(self) -> dict:
        out = {"gather_hits": self.hits, "gather_misses": self.misses}
        self.hits = self.misses = 0
        return out

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
            entry.works = self._collectives(chunks, views)
        except BaseException:
            self._release(entry)
            raise
        self.window[g] = entry

    def _collectives(self, chunks: list[int], views: list) -> list:
        """One all-gather for a full group of chunks of one size, else one broadcast per chunk.
        Either moves each chunk up to its last parameter only: the padding after it is never
        read by compute (and the owner's copy keeps it)."""
        s, used = self.sharding, self.engine.layout.used
        if len(chunks) == s.world and len({v.numel() for v in views}) == 1:
            n = max(used[c] for c in chunks)
            return [self.comms.all_gather([v[:n] for v in views], views[s.rank][:n])]
        # A short last group, or an oversized chunk beside bulk ones.
        return [self.comms.broadcast(v[:used[c]], s.owner(c)) for c, v in zip(chunks, views)]

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
            self._release(entry)
            raise
        own, entry.own = entry.own, []
        for key in own:
            self.store.release(key, self.tier)
            self.engine._on_unpinned(key[1])       # its update may have been waiting for the collective

    def _follow_trace(self, g: int) -> set[int]:
        """Start gathering the groups that come after ``g`` in the last iteration's order."""
        trace, pos = self.trace, self._pos
        if not trace or not self.prefetch:
            return set()
        if trace[pos] != g:
            if pos + 1 < len(trace) and trace[pos + 1] == g:
                pos += 1            # the common case: the iteration replays the trace
            else:                   # else the nearest place it was asked for, ahead first
                places = [j for j, t in enumerate(trace) if t == g]
                if not places:
                    return set()
                pos = min(places, key=lambda j: (abs(j - pos), j < pos))
        self._pos = pos
        ahead: set[int] = set()
        for g2 in trace[pos + 1:pos + 1 + LOOKAHEAD]:
            if len(ahead) == self.prefetch:
                break
            if g2 == g or g2 in ahead:
                continue
            if g2 not in self.window:
                self._start(g2)
            ahead.add(g2)
        return ahead

    def _unused(self, g: int) -> bool:
        pins = self.engine.params.pins
        return all(pins[c] == 0 for c in self.window[g].chunks)

    def _trim(self, protect: set[int]) -> None:
        """Drop groups beyond ``keep``: the one the trace uses again latest (or never), as
        Belady's rule says; the least recently used one before there is a trace. A group that
        is used at both ends of forward (a tied embedding and head) then stays gathered through
        it rather than being gathered twice."""
        while len(self.window) > self.keep:
            candidates = [g for g in self.window if g not in protect and self._unused(g)]
            if not candidates:
                return
            victim = max(candidates, key=self._next_use) if self.trace else candidates[0]
            self._complete(victim)
            self._drop(victim)

    def _next_use(self, g: int) -> float:
        """Trace position at which group ``g`` is asked for next (infinity: not again)."""
        trace = self.trace
        for j in range(self._pos + 1, len(trace)):
            if trace[j] == g:
                return j
        return float("inf")

    def _drop(self, g: int) -> None:
        self._release(self.window.pop(g))

    def _release(self, entry: _Gathered) -> None:
        for key in entry.own:
            self.store.release(key, self.tier)
        entry.own = []
        for key in entry.borrowed:
            with self.store.lock:   # freed before another thread sees it unpinned
                self.store.release(key, self.tier)
                self.store.release_storage(key)
        entry.borrowed = []
