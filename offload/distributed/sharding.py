"""How N ranks share one model's state (ZeRO-3 over torch.distributed): every chunk sliced N ways.

Chunk ``c`` of ``numel`` elements is cut into N equal *pieces* of ``ceil(numel / N)`` elements
(rounded up to whole 256-element blocks when the Adam moments are 8-bit: ``quantum``):
rank ``r`` keeps elements ``[r*p, r*p + p)`` of the chunk padded with zeros to ``N*p`` (fewer
than N elements of padding) -- that piece of its parameters, fp32 master and Adam moments, their
NVMe slots, and the Adam work on them. Before a chunk's layers run it is all-gathered into one
buffer of the whole (padded) chunk; its gradient is reduce-scattered back into pieces as soon as
it is complete (``gather``, ``reduce``). So the gathered working set on the device is a few
chunks whatever N is (as FSDP2 and Colossal-AI Gemini keep it), and an oversized chunk (a 100B
embedding) is split like any other: no rank holds more than its 1/N.

The chunk layout never depends on N; a checkpoint of N ranks is resharded for M by slicing the
same chunks differently (``offload.checkpoint``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError


@dataclass(frozen=True)
class Sharding:
    """Rank ``rank`` of ``world`` in process ``group`` (None: torch.distributed's default group)."""

    rank: int
    world: int
    local_rank: int = 0
    group: object = None
    local_world: int = 1        # ranks on this host (they share its memory and cores)
    quantum: int = 1            # pieces are whole multiples of it (8-bit state: its 256-element blocks)

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError("rank", self.rank, f"must be in [0, {self.world})")
        if self.quantum < 1:
            raise ConfigError("quantum", self.quantum, "must be >= 1")

    @classmethod
    def from_process_group(cls, group=None) -> "Sharding | None":
        """The sharding over process ``group`` (None: the initialised default group), or None when
        there is no process group or ``group`` has a single rank (then the engine runs as a single
        process). Under pipeline stages ``group`` is one stage's data-parallel group: ``rank`` and
        ``world`` are within it, while ``local_rank`` and ``local_world`` stay the host's (its GPU,
        its memory and cores are shared by every process on it, whatever their groups)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ConfigError("process_group", group, "was given but torch.distributed is not initialised")
            return None
        world = dist.get_world_size(group)
        if world <= 1:
            return None
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError("process_group", group, f"does not contain this process (global rank "
                                                      f"{dist.get_rank()})")
        glob = dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", glob))
        return cls(rank, world, local, group=group,
                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))

    def piece_numel(self, numel: int) -> int:
        """Elements of each rank's piece of a chunk of ``numel`` elements: a 1/N share rounded up
        to whole ``quantum``s, so that no block of quantised state straddles two ranks."""
        share = -(-numel // self.world)
        return -(-share // self.quantum) * self.quantum

    def padded(self, numel: int) -> int:
        """Elements of a whole chunk of ``numel`` once padded to N equal pieces."""
        return self.world * self.piece_numel(numel)

    def span(self, numel: int, rank: int | None = None) -> tuple[int, int]:
        """``(lo, hi)``: the elements of a ``numel``-element chunk that ``rank`` (default this
        one) keeps; ``hi`` may pass ``numel`` (that part of the piece is padding, zeros)."""
        p = self.piece_numel(numel)
        r = self.rank if rank is None else rank
        return r * p, r * p + p


def expand_rank(paths: Sequence[str] | None, sharding: "Sharding | None") -> tuple[str, ...] | None:
    """``nvme_paths`` with ``{rank}`` and ``{local_rank}`` filled in (0 without a process group).

    Two ranks must never share swap files: under several ranks, a path without either field gets
    a ``rank<N>`` subdirectory of its own.
    """
    if paths is None:
        return None
    rank = sharding.rank if sharding is not None else 0
    local = sharding.local_rank if sharding is not None else 0
    out = []
    for p in paths:
        try:
            filled = p.format(rank=rank, local_rank=local)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError("nvme_paths", p, "may only use the fields {rank} and {local_rank} "
                                               f"(braces elsewhere must be doubled): {exc}") from None
        if sharding is not None and filled == p:
            filled = os.path.join(p, f"rank{rank}")
        out.append(filled)
    return tuple(out)
