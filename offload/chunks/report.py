"""The store's report: what each tier holds, by kind, what state the chunks are in, what moved."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from .records import ChunkRecord


def by_direction(moved: Counter) -> dict:
    """``{(src, dst): bytes}`` as ``{"src->dst": bytes}``, sorted."""
    return {f"{s}->{d}": n for (s, d), n in sorted(moved.items())}


def memory_report(tiers: dict, records: Iterable[ChunkRecord], moved: Counter) -> dict:
    """Per tier its ``describe()`` plus the bytes and chunk counts it holds by kind and its use of
    the budget; chunk counts by state; bytes ``moved`` per direction."""
    records = list(records)
    report: dict[str, dict] = {}
    for name, tier in tiers.items():
        info = tier.describe()
        by_kind: Counter = Counter()
        counts: Counter = Counter()
        for rec in records:
            if rec.has(name):
                by_kind[rec.key[0]] += rec.nbytes
                counts[rec.key[0]] += 1
        info["bytes_by_kind"] = dict(by_kind)
        info["chunks_by_kind"] = dict(counts)
        info["use"] = info["reserved"] / info["budget"] if info["budget"] else 0.0
        report[name] = info
    return {
        "tiers": report,
        "chunks": len(records),
        "chunk_states": dict(Counter(rec.state.name for rec in records)),
        "moved_bytes": by_direction(moved),
    }


def tier_holders(records: Iterable[ChunkRecord], tier: str, *, spills: bool) -> str:
    """Who holds ``tier``, for a full tier's error: the chunks pinned there (in compute), those
    mid-move, the bytes of copies; ``spills`` False adds that there is no tier below to write to."""
    records = list(records)
    pinned = [r for r in records if r.pins.get(tier)]
    moving = [r for r in records if tier in r.incoming]
    parts = []
    if pinned:
        parts.append(f"{len(pinned)} chunks in COMPUTE ({', '.join(f'{k}{i}' for (k, i) in (r.key for r in pinned[:6]))}"
                     f"{', ...' if len(pinned) > 6 else ''})")
    if moving:
        parts.append(f"{len(moving)} chunks mid-move")
    held = sum(r.nbytes for r in records if tier in r.buffers)
    parts.append(f"{held} bytes of chunk copies")
    if not spills:
        parts.append("no NVMe tier to spill to (set nvme_paths)")
    return "; ".join(parts)
