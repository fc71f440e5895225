"""Who owns which chunk when N ranks train one model (ZeRO-3 over torch.distributed).

Chunks are dealt round-robin: chunk ``c`` belongs to rank ``c % N``, so the N consecutive
chunks ``g*N .. g*N+N-1`` form *communication group* ``g`` with one chunk per rank (PatrickStar
and Gemini group them the same way): a group's parameters come to every rank together (one
broadcast per chunk from its owner), and its gradients go to their owners together (one reduce
per chunk; see ``comms`` for why not one all-gather / reduce-scatter). The owner alone keeps the chunk's
parameters, fp32 master, Adam moments and NVMe slots; the other ranks hold its parameters only
while a gathered group is in use, and its gradients only until they are reduced.

A checkpoint saved by N ranks is resharded for M ranks by chunk index alone, since an explicit
``chunk_size`` gives the same layout at any world size, and so does an "auto" one unless one
process's layout has fewer than N chunks: a small model is then cut into at least N
(``chunks.layout.search_chunk_size``), else some rank would keep nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import ConfigError


@dataclass(frozen=True)
class Sharding:
    """Rank ``rank`` of ``world`` in process ``group`` (None: torch.distributed's default group)."""

    rank: int
    world: int
    local_rank: int = 0
    group: object = None
    local_world: int = 1        # ranks on this host (they share its memory and cores)

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError("rank", self.rank, f"must be in [0, {self.world})")

    @classmethod
    def from_process_group(cls) -> "Sharding | None":
        """The sharding of the initialised default process group, or None when there is no group
        or it has a single rank (then the engine runs as a single process)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        if world <= 1:
            return None
        rank = dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return cls(rank, world, local, local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)))

    def owner(self, c: int) -> int:
        """The rank that keeps chunk ``c`` (``owner_of``)."""
        return owner_of(c, self.world)

    def owns(self, c: int) -> bool:
        """Whether this rank keeps chunk ``c``."""
        return self.owner(c) == self.rank

    def owned(self, chunks: Iterable[int]) -> list[int]:
        return [c for c in chunks if self.owns(c)]

    def group_of(self, c: int) -> int:
        return c // self.world

    def group_chunks(self, g: int, num_chunks: int) -> list[int]:
        """Chunk indices of communication group ``g`` (the last group may have fewer than N)."""
        return list(range(g * self.world, min((g + 1) * self.world, num_chunks)))

    def num_groups(self, num_chunks: int) -> int:
        return -(-num_chunks // self.world)


def owner_of(c: int, world: int) -> int:
    """Owner of chunk ``c`` among ``world`` ranks: the one ownership rule (round-robin), which
    ``Sharding.owner`` / ``owns`` apply and everything else asks them for."""
    return c % world


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
