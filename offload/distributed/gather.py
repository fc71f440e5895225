"""Parameter chunks all-gathered from every rank's piece before use, a chunk at a time.

Every rank must issue the same collectives in the same order, so nothing here depends on
what a rank's own tiers happen to hold. A chunk is gathered when it is pinned and not in the
*window* of gathered chunks; after it, the chunks the last iteration's trace says come next are
gathered ahead. The trace is the order in which chunks were asked for in the last whole
iteration (the first one differs: modules pin their children's chunks too until their first
forward has shown which ones they use). The window keeps ``keep`` chunks; beyond that, a chunk
no module has pinned is dropped (its gathered buffer freed): the one the trace asks for again
latest. Pins, the window and the trace are the same on every rank, so are the decisions.

A gather is a job of the communication thread (see ``comms``): there it waits for this rank's
piece of the chunk to be current -- its Adam update from the last step done, its bytes read
from NVMe -- and then starts one all-gather of the pieces into the chunk's ``gathered`` buffer.
The thread that asked for the chunk (compute) never waits for those inputs of a chunk gathered
*ahead*: it queues the current chunk's compute and waits only when it needs the chunk itself
(``_complete``). Until then this rank's piece is *held* (``holds``): its next update waits for
the collective that sends it.

A gathered chunk is current until the ranks update their pieces: every gathered chunk is
dropped when an optimizer update is about to run (``drop_all``), and a prefetch never reaches
past the end of the iteration into the next one's chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

# How far along the trace a prefetch looks for the next chunks (entries).
LOOKAHEAD = 4


@dataclass
class _Gathered:
    chunk: int
    sending: bool = True                    # our piece, held from submission until the collective is done
    pending: Future | None = None           # the communication thread's job
    borrowed: list[tuple[str, int]] = field(default_factory=list)  # the gathered buffer, pinned while gathered
    own: list[tuple[str, int]] = field(default_factory=list)   # our piece, pinned while the collective reads it


class ChunkGather:
    """The window of gathered chunks of one engine.

    ``store`` holds this rank's pieces (``piece_kind``) and the gathered chunks (``whole_kind``);
    ``tier`` is where compute reads parameters. From the engine: ``in_use(c)``, whether a module
    has chunk ``c`` pinned; ``wait_for_update(c)``, which returns once chunk ``c``'s queued Adam
    update is done (and re-raises its error); ``on_sent(c)``, called once a collective no longer
    reads this rank's piece of chunk ``c`` (an update held back for it may go).
    """

    def __init__(self, comms, store, *, tier: str, in_use: Callable[[int], bool],
                 wait_for_update: Callable[[int], None], on_sent: Callable[[int], None],
                 keep: int = 3, prefetch: int = 1, piece_kind: str = "param", whole_kind: str = "gathered"):
        self.comms = comms
        self.store = store
        self.tier = tier
        self.piece_kind = piece_kind
        self.whole_kind = whole_kind
        self.in_use = in_use
        self.wait_for_update = wait_for_update
        self.on_sent = on_sent
        self.keep = max(2, keep)
        self.prefetch = max(0, prefetch)
        self.window: OrderedDict[int, _Gathered] = OrderedDict()
        self.trace: list[int] | None = None     # chunks in demand order over the last iteration
        self._recording: list[int] = []
        self._pos = 0
        self.hits = 0       # demands met by a chunk already gathered (or on its way)
        self.misses = 0     # demands that had to start a gather and wait for it

    # ---- the engine's calls ----------------------------------------------------------------
    def begin_iteration(self) -> None:
        if self._recording:
            self.trace, self._recording = self._recording, []
        self._pos = 0

    def ensure(self, c: int) -> None:
        """Chunk ``c``'s parameters are on this rank's compute tier when this returns."""
        if c not in self.window:
            self.misses += 1
            self._start(c)
        else:
            self.hits += 1
        self.window.move_to_end(c)
        if not self._recording or self._recording[-1] != c:
            self._recording.append(c)
        # The next chunks are submitted before this one is waited for: their jobs (after this
        # one's, in the same order on every rank) wait for their own inputs meanwhile.
        protect = {c} | self._follow_trace(c)
        self._complete(c)
        self._trim(protect)

    def take_stats(self) -> dict:
        out = {"gather_hits": self.hits, "gather_misses": self.misses}
        self.hits = self.misses = 0
        return out

    def holds(self, c: int) -> bool:
        """Whether a gather submitted and not yet waited for sends this rank's piece of chunk
        ``c`` (its update must wait)."""
        entry = self.window.get(c)
        return entry is not None and entry.sending

    def drop_all(self) -> None:
        """Finish what is in flight and free every gathered chunk no module uses (an update is
        about to run)."""
        for c in list(self.window):
            self._complete(c)
            if not self.in_use(c):
                self._drop(c)

    # ---- internals -------------------------------------------------------------------------
    def _start(self, c: int) -> None:
        """Submit chunk ``c``'s gather to the communication thread."""
        entry = _Gathered(c)
        entry.pending = self.comms.submit(lambda: self._gather(entry))
        self.window[c] = entry

    def _gather(self, entry: _Gathered) -> list:
        """On the communication thread: pin this rank's piece once current and the chunk's
        gathered buffer, and start the all-gather of the pieces into it."""
        store, c = self.store, entry.chunk
        piece_key, whole_key = (self.piece_kind, c), (self.whole_kind, c)
        try:
            # Contribute the new values, never half-updated ones; waiting here holds up this
            # collective only, not the thread that computes.
            self.wait_for_update(c)
            piece = store.access(piece_key, self.tier)
            entry.own.append(piece_key)
            whole = store.access(whole_key, self.tier, overwrite=True)
            entry.borrowed.append(whole_key)
            return [self.comms.start_all_gather(whole, piece)]
        except BaseException:
            self._release(entry)
            raise

    def _complete(self, c: int) -> None:
        entry = self.window[c]
        if entry.pending is None:
            return
        pending, entry.pending = entry.pending, None
        try:
            self.comms.wait(pending, f"all-gather of parameter chunk {c}")
        except BaseException:
            self.window.pop(c, None)
            entry.sending = False
            self._release(entry)
            raise
        own, entry.own = entry.own, []
        for key in own:
            self.store.release(key, self.tier)
        if entry.sending:
            entry.sending = False
            self.on_sent(c)       # its update may have been waiting for the collective

    def _follow_trace(self, c: int) -> set[int]:
        """Start gathering the chunks that come after ``c`` in the last iteration's order, and
        bring this rank's pieces of the ones after those toward the compute tier."""
        trace, pos = self.trace, self._pos
        if not trace or not self.prefetch:
            return set()
        if trace[pos] != c:
            if pos + 1 < len(trace) and trace[pos + 1] == c:
                pos += 1            # the common case: the iteration replays the trace
            else:                   # else the nearest place it was asked for, ahead first
                places = [j for j, t in enumerate(trace) if t == c]
                if not places:
                    return set()
                pos = min(places, key=lambda j: (abs(j - pos), j < pos))
        self._pos = pos
        ahead: set[int] = set()
        for c2 in trace[pos + 1:pos + 1 + LOOKAHEAD]:
            if c2 == c or c2 in ahead:
                continue
            if len(ahead) == self.prefetch:
                # Beyond the gathers started: start reading our piece (from NVMe), so that the
                # gather job finds it in memory. The store skips it when there is no room.
                self.store.prefetch((self.piece_kind, c2), self.tier)
                continue
            if c2 not in self.window:
                self._start(c2)
            ahead.add(c2)
        return ahead

    def _trim(self, protect: set[int]) -> None:
        """Drop chunks beyond ``keep``: the one the trace uses again latest (or never), as
        Belady's rule says; the least recently used one before there is a trace. A chunk that
        is used at both ends of forward (a tied embedding and head) then stays gathered through
        it rather than being gathered twice."""
        while len(self.window) > self.keep:
            candidates = [c for c in self.window if c not in protect and not self.in_use(c)]
            if not candidates:
                return
            victim = max(candidates, key=self._next_use) if self.trace else candidates[0]
            self._complete(victim)
            self._drop(victim)

    def _next_use(self, c: int) -> float:
        """Trace position at which chunk ``c`` is asked for next (infinity: not again)."""
        trace = self.trace
        for j in range(self._pos + 1, len(trace)):
            if trace[j] == c:
                return j
        return float("inf")

    def _drop(self, c: int) -> None:
        self._release(self.window.pop(c))

    def _release(self, entry: _Gathered) -> None:
        for key in entry.own:
            self.store.release(key, self.tier)
        entry.own = []
        for key in entry.borrowed:
            with self.store.lock:   # freed before another thread sees it unpinned
                self.store.release(key, self.tier)
                self.store.release_storage(key)
        entry.borrowed = []
