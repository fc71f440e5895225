"""Eviction policies: which chunks leave a tier when it needs room.

A policy sees only keys, sizes and a logical clock; the store tells it about accesses and asks
it to pick victims among the chunks that may leave (never one in COMPUTE or mid-move).
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

from ..errors import ConfigError
from .trace import AccessTrace


class EvictionPolicy:
    """Base: remembers the last use of each key on a logical clock."""

    name = "base"

    def __init__(self) -> None:
        self.clock = 0
        self.last_use: dict[Hashable, int] = {}
        self.hints: dict[Hashable, float] = {}

    def on_access(self, key: Hashable) -> None:
        self.last_use[key] = self.clock
        self.clock += 1
        self.hints.pop(key, None)

    def hint_soon(self, key: Hashable) -> float:
        """Mark ``key`` as needed imminently (fetched ahead of a use the trace does not show, such
        as the optimizer's next chunk) until it is accessed; returns the rank it now has."""
        return self.hint(key, self.soonest())

    def hint(self, key: Hashable, rank: float) -> float:
        """Rank ``key`` at ``rank`` until it is accessed (a use the trace does not show)."""
        self.hints[key] = rank
        return rank

    def keep_hints(self, keep: Callable[[Hashable], bool]) -> None:
        """Drop the hints of keys for which ``keep`` is false."""
        self.hints = {k: v for k, v in self.hints.items() if keep(k)}

    def soonest(self) -> float:
        """The rank of a chunk needed right now."""
        return 0.0

    def soon_limit(self) -> float:
        """The rank above which a chunk may leave for one fetched ahead of an untraced use."""
        return self.soonest()

    def rank(self, key: Hashable) -> float:
        """Higher rank leaves first."""
        hinted = self.hints.get(key)
        return hinted if hinted is not None else self._rank(key)

    def _rank(self, key: Hashable) -> float:
        raise NotImplementedError

    def choose(self, candidates: Iterable[Hashable], need: int, size_of: Callable[[Hashable], int]) -> list[Hashable]:
        """Victims, best first, until their sizes add up to ``need`` bytes (all candidates if they don't)."""
        ordered = sorted(candidates, key=self.rank, reverse=True)
        out, freed = [], 0
        for key in ordered:
            if freed >= need:
                break
            out.append(key)
            freed += size_of(key)
        return out


class LRUPolicy(EvictionPolicy):
    """Least recently used leaves first."""

    name = "lru"

    def _rank(self, key: Hashable) -> float:
        return float(self.clock - self.last_use.get(key, -1))


class NextUsePolicy(EvictionPolicy):
    """Belady: the chunk whose next use lies furthest ahead leaves first (needs a trace).

    The clock is the position in the trace. With ``auto_advance`` every access advances it
    (a store used on its own); an engine that knows the position (its prefetcher follows the
    trace) sets ``position`` itself. Without a trace it behaves as LRU.
    """

    name = "next_use"

    def __init__(self, trace: AccessTrace | None = None, *, auto_advance: bool = True) -> None:
        super().__init__()
        self.trace = trace
        self.position = 0
        self.auto_advance = auto_advance

    def set_trace(self, trace: AccessTrace | None) -> None:
        self.trace = trace
        self.position = 0

    def start_iteration(self) -> None:
        self.position = 0

    def on_access(self, key: Hashable) -> None:
        super().on_access(key)
        if self.auto_advance:
            self.position += 1

    def soonest(self) -> float:
        return float(self.position)

    def soon_limit(self) -> float:
        # Only chunks the trace never uses (optimizer state already updated) make room for the
        # optimizer's next chunk: a parameter pushed out now costs a write and a read before the
        # next forward, and prefetches that evict each other read the same state twice. Every
        # traced chunk ranks below 2·len (its next use is at most len + its first use).
        if self.trace is None or len(self.trace) == 0:
            return self.soonest()
        return float(2 * len(self.trace))

    def _rank(self, key: Hashable) -> float:
        if self.trace is None or len(self.trace) == 0:
            return float(self.clock - self.last_use.get(key, -1))
        return self.trace.next_use(key, self.position % len(self.trace))


def make_policy(name: str, trace: AccessTrace | None = None, *, auto_advance: bool = True) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name in ("next_use", "belady"):
        return NextUsePolicy(trace, auto_advance=auto_advance)
    raise ConfigError("eviction", name, "must be 'lru' or 'next_use'")
