"""Chunk states as an enum with an explicit transition table; an illegal move raises.

A chunk (one kind of storage for a run of parameters) is FREE until it holds bytes, HOLD
while it holds them and may move or be evicted, and COMPUTE while someone uses it (pinned to
its tier, never evicted). Where a chunk's bytes live and whether a copy is current is kept
beside the state (``ChunkRecord.valid``), not folded into it.
"""

from __future__ import annotations

import enum

from ..errors import StateError


class ChunkState(enum.Enum):
    FREE = "free"          # no bytes anywhere yet (or released for good)
    HOLD = "hold"          # bytes live on one or more tiers; movable and evictable
    COMPUTE = "compute"    # pinned on a tier by at least one user; never evicted


CHUNK_TRANSITIONS: dict[ChunkState, frozenset[ChunkState]] = {
    ChunkState.FREE: frozenset({ChunkState.HOLD}),
    ChunkState.HOLD: frozenset({ChunkState.COMPUTE, ChunkState.FREE}),
    ChunkState.COMPUTE: frozenset({ChunkState.HOLD}),
}


def check_transition(table: dict, current: enum.Enum, new: enum.Enum, what: str) -> enum.Enum:
    """Return ``new`` if ``current -> new`` is in ``table``; else raise ``StateError`` naming both."""
    if new is current or new in table[current]:
        return new
    allowed = ", ".join(sorted(s.name for s in table[current])) or "nothing"
    raise StateError(f"{what}: illegal transition {current.name} -> {new.name} (allowed: {allowed})")
