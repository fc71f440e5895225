"""Trace-driven prefetch: record the first iteration's chunk order, replay it to fetch ahead.

Plain Python over keys: the engine reports each access and gets back the keys to start
fetching. A replay that meets an access the trace did not predict stops prefetching for the
rest of the iteration and records a fresh trace; placement may suffer, results never do.
"""

from __future__ import annotations

from typing import Hashable

from .trace import AccessTrace


class TracePrefetcher:
    def __init__(self, depth: int):
        self.depth = depth
        self.trace: AccessTrace | None = None
        self.position = 0
        self.stale = False
        self._recording: list[Hashable] = []
        self.retraces = 0
        self.hits = 0
        self.misses = 0

    def begin_iteration(self) -> None:
        """Call at the start of each iteration: adopts the last one's order as the trace if needed."""
        if self._recording and (self.trace is None or self.stale or len(self._recording) != len(self.trace)):
            if self.trace is not None:
                self.retraces += 1
            self.trace = AccessTrace(self._recording)
        self._recording = []
        self.position = 0
        self.stale = False

    @property
    def following(self) -> bool:
        """True while the current iteration matches the trace."""
        return self.trace is not None and not self.stale

    def on_access(self, key: Hashable) -> list[Hashable]:
        """Record ``key``; return the keys to prefetch next (empty when not following a trace)."""
        self._recording.append(key)
        if not self.following:
            return []
        if self.position >= len(self.trace) or self.trace[self.position] != key:
            self.stale = True
            return []
        self.position += 1
        return [k for k in self.trace.upcoming(self.position, self.depth) if k != key]

    def record_hit(self, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
