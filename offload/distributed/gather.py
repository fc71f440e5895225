"""Parameter chunks of other ranks, gathered a communication group at a time before use.

Every rank must issue the same collectives in the same order, so nothing here depends on
what a rank's own tiers happen to hold. A group is gathered when one of its chunks is pinned
and the group is not in the *window* of gathered groups; after it, the groups the last
iteration's trace says come next are gathered ahead. The
trace is the order in which groups were asked for in the last whole iteration (the first one
differs: modules pin their children's chunks too until their first forward has shown which
ones they use). The
window keeps ``keep`` groups; beyond that, a group whose chunks no module has pinned is dropped
(its borrowed chunks freed): the one the trace asks for again latest. Pins, the window and the trace are the same
on every rank, so are the decisions.

A gather is a job of the communication thread (see ``comms``): there it waits for this rank's
chunk of the group to be current — its Adam update from the last step done, its bytes read from
NVMe — and then starts the group's broadcasts. The thread that asked for the group (compute)
never waits for those inputs of a group gathered *ahead*: it queues the current group's compute
and waits only when it needs the group itself (``_complete``). Until then this rank's chunk is
*held* (``holds``): its next update waits for the collective that sends it.

A gathered copy of another rank's chunk is current until its owner updates it: every group
is dropped when an optimizer update is about to run (``drop_all``), and a prefetch never
reaches past the end of the iteration into the next one's chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

# How far along the trace a prefetch looks for the next groups (entries, not groups).
LOOKAHEAD = 4


@dataclass
class _Gathered:
    chunks: list[int]
    sending: set[int]                       # ours, held from submission until the collective is done
    pending: Future | None = None           # the communication thread's job
    borrowed: list[tuple[str, int]] = field(default_factory=list)  # other ranks' chunks, pinned while gathered
    own: list[tuple[str, int]] = field(default_factory=list)   # ours, pinned while the collective reads it


class GroupGather:
    """The window of gathered groups of one engine.

    ``store`` holds the chunks and ``layout`` says their sizes; ``tier`` is where compute reads
    parameters. From the engine: ``in_use(c)``, whether a module has chunk ``c`` pinned;
    ``wait_for_update(c)``, which returns once chunk ``c``'s queued Adam update is done (and
    re-raises its error); ``on_sent(c)``, called once a collective no longer reads this rank's
    chunk ``c`` (an update held back for it may go).
    """

    def __init__(self, comms, store, layout, *, tier: str, in_use: Callable[[int], bool],
                 wait_for_update: Callable[[int], None], on_sent: Callable[[int], None],
                 keep: int = 3, prefetch: int = 1):
        self.comms = comms
        self.sharding = comms.sharding
        self.store = store
        self.layout = layout
        self.tier = tier
        self.in_use = in_use
        self.wait_for_update = wait_for_update
        self.on_sent = on_sent
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
        if not self._recording or self._recording[-1] != g:
            self._recording.append(g)
        # The next groups are submitted before this one is waited for: their jobs (after this
        # one's, in the same order on every rank) wait for their own inputs meanwhile.
        protect = {g} | self._follow_trace(g)
        self._complete(g)
        self._trim(protect)

    def take_stats(self) -> dict:
        out = {"gather_hits": self.hits, "gather_misses": self.misses}
        self.hits = self.misses = 0
        return out

    def holds(self, c: int) -> bool:
        """Whether a gather submitted and not yet waited for sends this rank's chunk ``c`` (its
        update must wait)."""
        entry = self.window.get(self.sharding.group_of(c))
        return entry is not None and c in entry.sending

    def drop_all(self) -> None:
        """Finish what is in flight and free every borrowed chunk (an update is about to run)."""
        for g in list(self.window):
            self._complete(g)
            if self._unused(g):
                self._drop(g)

    # ---- internals -------------------------------------------------------------------------
    def _start(self, g: int) -> None:
        """Submit group ``g``'s gather to the communication thread."""
        chunks = self.sharding.group_chunks(g, self.layout.num_chunks)
        entry = _Gathered(chunks, {c for c in chunks if self.sharding.owns(c)})
        entry.pending = self.comms.submit(lambda: self._gather(entry))
        self.window[g] = entry

    def _gather(self, entry: _Gathered) -> list:
        """On the communication thread: pin the group's chunks — ours once current, the others'
        as fresh buffers — and start one broadcast per chunk from its owner (see ``comms`` for why
        not one all-gather). Each moves its chunk up to its last parameter only: the padding after
        it is never read by compute (and the owner's copy keeps it)."""
        s, store, used = self.sharding, self.store, self.layout.used
        views = []
        try:
            for c in entry.chunks:
                key = ("param", c)
                if c in entry.sending:
                    # Contribute the new values, never half-updated ones; waiting here holds up
                    # this collective only, not the thread that computes.
                    self.wait_for_update(c)
                    views.append(store.access(key, self.tier))
                    entry.own.append(key)
                else:
                    views.append(store.access(key, self.tier, overwrite=True))
                    entry.borrowed.append(key)
            return [self.comms.start_broadcast(v[:used[c]], s.owner(c)) for c, v in zip(entry.chunks, views)]
        except BaseException:
            self._release(entry)
            raise

    def _complete(self, g: int) -> None:
        entry = self.window[g]
        if entry.pending is None:
            return
        pending, entry.pending = entry.pending, None
        try:
            self.comms.wait(pending, f"gather of parameter chunks {entry.chunks}")
        except BaseException:
            self.window.pop(g, None)
            entry.sending = set()
            self._release(entry)
            raise
        own, entry.own = entry.own, []
        for key in own:
            self.store.release(key, self.tier)
        sent, entry.sending = entry.sending, set()
        for c in sorted(sent):
            self.on_sent(c)       # its update may have been waiting for the collective

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
        return not any(self.in_use(c) for c in self.window[g].chunks)

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
