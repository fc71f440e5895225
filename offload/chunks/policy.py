"""What the chunk store asks of an eviction policy (``offload.scheduler`` implements it).

The store sits below the scheduler: it names the few calls it makes and takes the policy it is
given (LRU, or next use from the trace of the first iteration), never builds one.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Protocol


class Policy(Protocol):
    name: str
    """``"lru"`` or ``"next_use"``."""

    def on_access(self, key: Hashable) -> None:
        """``key`` was used now (a logical clock, not seconds)."""

    def hint_soon(self, key: Hashable) -> float:
        """``key`` is needed imminently though the trace does not show it; returns its rank."""

    def soon_limit(self) -> float:
        """The rank below which a "soon" fetch may not push chunks out."""

    def rank(self, key: Hashable) -> float:
        """How late ``key`` is needed again (larger: later; evicted first)."""

    def choose(self, candidates: Iterable[Hashable], need: int,
               size_of: Callable[[Hashable], int]) -> list[Hashable]:
        """Victims among ``candidates`` whose sizes (bytes) add up to at least ``need``."""
