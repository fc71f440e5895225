"""The access trace: the order in which chunks are used during one iteration.

The first iteration records it; later iterations replay it to prefetch ahead and to evict by
next use. A replay that sees a different access than the trace predicts marks the trace stale,
and the engine records again: the trace only ever steers movement, never correctness.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Hashable, Iterable


class AccessTrace:
    """An ordered list of chunk accesses with fast "when is this used next?" queries.

    Positions are logical time: the i-th access of the iteration happens at time i.
    """

    def __init__(self, accesses: Iterable[Hashable] = ()):
        self._order: list[Hashable] = []
        self._times: dict[Hashable, list[int]] = defaultdict(list)
        # (now, count) -> ``upcoming``'s answer: the engine asks at every access, and a scan over
        # a trace with few distinct keys is the trace's whole length. ``record`` clears it.
        self._upcoming: dict[tuple[int, int], tuple[Hashable, ...]] = {}
        for key in accesses:
            self.record(key)

    def record(self, key: Hashable) -> None:
        self._upcoming.clear()
        self._times[key].append(len(self._order))
        self._order.append(key)

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, i: int) -> Hashable:
        return self._order[i]

    @property
    def order(self) -> list[Hashable]:
        return list(self._order)

    def keys(self) -> list[Hashable]:
        """Distinct keys in first-use order."""
        return list(self._times)

    def next_use(self, key: Hashable, now: int) -> float:
        """The first time >= ``now`` at which ``key`` is used, or ``inf`` if never again this iteration.

        The trace repeats every iteration, so a key not used again in this one is used next
        at its first time in the next iteration: we return ``len + first`` for it, which orders
        "soonest in the next iteration" correctly among keys with no use left in this one.
        """
        times = self._times.get(key)
        if not times:
            return float("inf")
        i = bisect.bisect_left(times, now)
        if i < len(times):
            return float(times[i])
        return float(len(self._order) + times[0])

    def upcoming(self, now: int, count: int) -> list[Hashable]:
        """The next ``count`` distinct keys used at or after ``now`` (wrapping into the next iteration)."""
        cached = self._upcoming.get((now, count))
        if cached is None:
            cached = self._upcoming[(now, count)] = tuple(self._scan(now, count))
        return list(cached)

    def _scan(self, now: int, count: int) -> list[Hashable]:
        out: list[Hashable] = []
        seen: set = set()
        n = len(self._order)
        for step in range(n):
            key = self._order[(now + step) % n]
            if key not in seen:
                seen.add(key)
                out.append(key)
                if len(out) >= count:
                    break
        return out
