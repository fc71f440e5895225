"""Chunk layout: pack parameters, in first-use (or registration) order, into fixed-size chunks.

Every kind of state (compute parameters, gradients, fp32 master, ``exp_avg``, ``exp_avg_sq``)
uses the same geometry, so one ``ParamSlot`` (chunk index + element offset) addresses a
parameter in every kind. Chunk sizes are multiples of 2048 elements, so a chunk of any dtype
is a whole number of 4 KiB blocks (O_DIRECT). Chunks are uniform, so a data-parallel rank can
own every N-th chunk (``shard``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

from ..config import CHUNK_QUANTUM
from ..errors import ConfigError

PARAM_ALIGN = 64              # elements: each parameter starts on a 128-byte (bf16) boundary
DEFAULT_MAX_CHUNK = 1 << 25   # 32 Mi elements = 64 MiB in bf16, PatrickStar's chunk size
AUTO_CANDIDATES = 256         # sizes the "auto" search tries


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives: ``chunk`` index, ``offset`` and ``numel`` in elements."""

    name: str
    chunk: int
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.numel


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _pack(numels: Sequence[int], chunk_size: int, align: int) -> list[tuple[int, int]]:
    """Greedy in-order packing: (chunk, offset) per parameter; a parameter that does not fit opens a chunk."""
    out, chunk, used = [], 0, 0
    for n in numels:
        start = _align(used, align)
        if used and start + n > chunk_size:
            chunk, start = chunk + 1, 0
        out.append((chunk, start))
        used = start + n
    return out


def wasted_elements(numels: Sequence[int], chunk_size: int, align: int = PARAM_ALIGN) -> int:
    """Elements of chunk storage that hold no parameter under this chunk size."""
    if not numels:
        return 0
    chunks = _pack(numels, chunk_size, align)[-1][0] + 1
    return chunks * chunk_size - sum(numels)


# "Auto" chunk sizes are capped so that this many fp32 chunks fit in each budget: the device tier
# holds a few parameter chunks plus the fp32 gradient chunks being filled, the CPU tier one
# chunk's gradient, master, exp_avg, exp_avg_sq and parameters plus prefetches.
CHUNKS_PER_DEVICE_BUDGET = 8
CHUNKS_PER_CPU_BUDGET = 12


def auto_max_chunk(device_budget: int, cpu_budget: int) -> int:
    """The largest chunk (elements) the "auto" search may pick for these budgets (bytes)."""
    return max(CHUNK_QUANTUM, min(DEFAULT_MAX_CHUNK, device_budget // (4 * CHUNKS_PER_DEVICE_BUDGET),
                                  cpu_budget // (4 * CHUNKS_PER_CPU_BUDGET)))


def search_chunk_size(numels: Sequence[int], *, max_chunk: int = DEFAULT_MAX_CHUNK,
                      align: int = PARAM_ALIGN) -> int:
    """The chunk size (elements) in [largest parameter, max_chunk] that wastes least (Gemini's search).

    Ties go to the smaller chunk: more, smaller chunks give the scheduler finer control.
    """
    largest = max(numels, default=1)
    lo = _align(max(largest, CHUNK_QUANTUM), CHUNK_QUANTUM)
    hi = max(lo, _align(max_chunk, CHUNK_QUANTUM))
    step = max(CHUNK_QUANTUM, _align((hi - lo) // AUTO_CANDIDATES, CHUNK_QUANTUM))
    best, best_waste = lo, math.inf
    for size in range(lo, hi + 1, step):
        waste = wasted_elements(numels, size, align)
        if waste < best_waste:
            best, best_waste = size, waste
    return best


class ChunkLayout:
    """The mapping from parameters to (chunk, offset); immutable once built."""

    def __init__(self, slots: Sequence[ParamSlot], chunk_size: int):
        self.chunk_size = chunk_size
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.num_chunks = (max(s.chunk for s in slots) + 1) if slots else 0
        self._by_name = {s.name: s for s in self.slots}

    @classmethod
    def build(cls, params: Iterable[tuple[str, Sequence[int]]], chunk_size: Union[int, str] = "auto", *,
              max_chunk: int = DEFAULT_MAX_CHUNK, align: int = PARAM_ALIGN) -> "ChunkLayout":
        """Pack ``(name, shape)`` pairs in the given order. ``chunk_size`` in elements or ``"auto"``."""
        named = [(name, tuple(int(d) for d in shape)) for name, shape in params]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ConfigError("params", names, "a parameter name appears twice")
        numels = [math.prod(shape) for _, shape in named]
        if chunk_size == "auto":
            size = search_chunk_size(numels, max_chunk=max_chunk, align=align)
        else:
            size = int(chunk_size)
            if size <= 0 or size % CHUNK_QUANTUM:
                raise ConfigError("chunk_size", chunk_size, f"must be a positive multiple of {CHUNK_QUANTUM}")
            too_big = [(n, k) for (n, _), k in zip(named, numels) if k > size]
            if too_big:
                name, k = max(too_big, key=lambda t: t[1])
                raise ConfigError("chunk_size", chunk_size,
                                  f"parameter {name!r} has {k} elements and must fit in one chunk; "
                                  f"use chunk_size >= {_align(k, CHUNK_QUANTUM)} or 'auto'")
        placed = _pack(numels, size, align)
        slots = [ParamSlot(name, c, off, k, shape)
                 for (name, shape), k, (c, off) in zip(named, numels, placed)]
        return cls(slots, size)

    def slot(self, name: str) -> ParamSlot:
        return self._by_name[name]

    @property
    def total_params(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def waste(self) -> int:
        return self.num_chunks * self.chunk_size - self.total_params

    def shard(self, rank: int, world_size: int) -> list[int]:
        """Chunks owned by ``rank`` of ``world_size`` (round-robin, so every rank gets about 1/N)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError("rank", rank, f"must be in [0, {world_size})")
        return list(range(rank, self.num_chunks, world_size))

    def __repr__(self) -> str:
        return (f"ChunkLayout({len(self.slots)} params in {self.num_chunks} chunks of {self.chunk_size} "
                f"elements, {self.waste} wasted)")
