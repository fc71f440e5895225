"""Chunk layout: pack parameters, in first-use (or registration) order, into chunks.

Every kind of state (compute parameters, gradients, fp32 master, ``exp_avg``, ``exp_avg_sq``)
uses the same geometry, so one ``ParamSlot`` (chunk index + element offset) addresses a
parameter in every kind. Chunk sizes are multiples of 2048 elements, so a chunk of any dtype
is a whole number of 4 KiB blocks (O_DIRECT).

Two rules keep one kind of parameter from setting the cost of the others:

* Frozen and trainable parameters never share a chunk: a frozen chunk needs no gradient, fp32
  master or moment chunks (LoRA: the base model costs only its parameters). Each class fills its
  own open chunk, so chunks still follow the parameters' order; each class's last chunk is cut
  to what it holds.
* A parameter larger than the chunk size (an embedding, an lm_head, a fused experts tensor)
  gets a chunk of its own size, so the chunk size is chosen
  for the bulk of the model and one embedding does not set the size of every chunk.

The "auto" size follows the budgets (``auto_max_chunk``), never the number of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Iterable, Sequence, Union

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


@dataclass(frozen=True, slots=True)
class Packing:
    """What ``pack`` decided: ``placed[i]`` = (chunk, offset) of parameter i; per chunk its
    size in elements and whether it holds trainable parameters."""

    placed: list[tuple[int, int]]
    sizes: list[int]
    trainable: list[bool]


def pack(numels: Sequence[int], chunk_size: int, align: int,
         trainable: Sequence[bool] | None = None) -> Packing:
    """Greedy in-order packing. Frozen and trainable parameters fill separate open chunks; a
    parameter that does not fit its class's open chunk opens a new one; a parameter larger than
    ``chunk_size`` gets a chunk of its own (rounded up to ``CHUNK_QUANTUM``)."""
    placed: list[tuple[int, int]] = []
    sizes: list[int] = []
    classes: list[bool] = []
    open_chunk: dict[bool, tuple[int, int]] = {}     # class -> (chunk, elements used)
    for i, n in enumerate(numels):
        cls = True if trainable is None else bool(trainable[i])
        if n > chunk_size:
            placed.append((len(sizes), 0))
            sizes.append(_align(n, CHUNK_QUANTUM))
            classes.append(cls)
            continue
        if cls in open_chunk:
            c, used = open_chunk[cls]
            start = _align(used, align)
            if start + n <= chunk_size:
                placed.append((c, start))
                open_chunk[cls] = (c, start + n)
                continue
        open_chunk[cls] = (len(sizes), n)
        placed.append((len(sizes), 0))
        sizes.append(chunk_size)
        classes.append(cls)
    # The last chunk of each class is only as large as what it holds (LoRA's adapters fill a
    # fraction of one chunk; every kind of their state would pay for the rest).
    for c, used in open_chunk.values():
        sizes[c] = max(CHUNK_QUANTUM, _align(used, CHUNK_QUANTUM))
    return Packing(placed, sizes, classes)


def wasted_elements(numels: Sequence[int], chunk_size: int, align: int = PARAM_ALIGN,
                    trainable: Sequence[bool] | None = None) -> int:
    """Elements of chunk storage that hold no parameter under this chunk size."""
    if not numels:
        return 0
    return sum(pack(numels, chunk_size, align, trainable).sizes) - sum(numels)


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
                      align: int = PARAM_ALIGN, trainable: Sequence[bool] | None = None) -> int:
    """The chunk size (elements) in [largest parameter up to ``max_chunk``, ``max_chunk``] that
    wastes least (Gemini's search). Parameters above ``max_chunk`` get chunks of their own and
    do not raise the size. The number of ranks plays no part: each keeps a piece of every chunk
    (``offload.distributed.sharding``).

    Ties go to the smaller chunk: more, smaller chunks give the scheduler finer control.
    """
    cap = _align(max(max_chunk, CHUNK_QUANTUM), CHUNK_QUANTUM)
    bulk = max((n for n in numels if n <= cap), default=CHUNK_QUANTUM)
    lo = _align(max(bulk, CHUNK_QUANTUM), CHUNK_QUANTUM)
    step = max(CHUNK_QUANTUM, _align((cap - lo) // AUTO_CANDIDATES, CHUNK_QUANTUM))
    best, best_waste = lo, math.inf
    for size in range(lo, cap + 1, step):
        waste = sum(pack(numels, size, align, trainable).sizes) - sum(numels)
        if waste < best_waste:
            best, best_waste = size, waste
    return best


class ChunkLayout:
    """The mapping from parameters to (chunk, offset); immutable once built.

    ``chunk_size`` is the bulk size; ``sizes[c]`` is chunk ``c``'s own (larger for a chunk that
    holds one oversized parameter); ``trainable[c]`` whether it holds trainable parameters (a
    frozen chunk has parameter storage only).
    """

    def __init__(self, slots: Sequence[ParamSlot], chunk_size: int, sizes: Sequence[int] | None = None,
                 trainable: Sequence[bool] | None = None):
        self.chunk_size = chunk_size
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        count = (max(s.chunk for s in slots) + 1) if slots else 0
        self.sizes: tuple[int, ...] = tuple(sizes) if sizes is not None else (chunk_size,) * count
        self.trainable: tuple[bool, ...] = tuple(trainable) if trainable is not None else (True,) * count
        if len(self.sizes) != count or len(self.trainable) != count:
            raise ConfigError("sizes", len(self.sizes), f"expected one size and class per chunk ({count})")
        self.num_chunks = count
        self._by_name = {s.name: s for s in self.slots}
        # Elements of each chunk up to its last parameter's end: the tail beyond is padding,
        # which collectives need not move (offload.distributed).
        self.used: tuple[int, ...] = tuple(
            max((s.end for s in self.slots if s.chunk == c), default=0) for c in range(count))

    @classmethod
    def build(cls, params: Iterable[tuple[str, Sequence[int]]], chunk_size: Union[int, str] = "auto", *,
              max_chunk: int = DEFAULT_MAX_CHUNK, align: int = PARAM_ALIGN,
              frozen: Collection[str] = ()) -> "ChunkLayout":
        """Pack ``(name, shape)`` pairs in the given order. ``chunk_size`` in elements or ``"auto"``;
        ``frozen``: names of parameters that get no gradient (kept apart from trainable ones)."""
        named = [(name, tuple(int(d) for d in shape)) for name, shape in params]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ConfigError("params", names, "a parameter name appears twice")
        frozen = set(frozen)
        trainable = [n not in frozen for n in names]
        numels = [math.prod(shape) for _, shape in named]
        if chunk_size == "auto":
            size = search_chunk_size(numels, max_chunk=max_chunk, align=align, trainable=trainable)
        else:
            size = int(chunk_size)
            if size <= 0 or size % CHUNK_QUANTUM:
                raise ConfigError("chunk_size", chunk_size, f"must be a positive multiple of {CHUNK_QUANTUM}")
        packing = pack(numels, size, align, trainable)
        slots = [ParamSlot(name, c, off, k, shape)
                 for (name, shape), k, (c, off) in zip(named, numels, packing.placed)]
        return cls(slots, size, packing.sizes, packing.trainable)

    def slot(self, name: str) -> ParamSlot:
        return self._by_name[name]

    def chunk_numel(self, c: int) -> int:
        """Elements of chunk ``c`` (``chunk_size``, or more for an oversized parameter's own chunk)."""
        return self.sizes[c]

    def oversized(self, c: int) -> bool:
        return self.sizes[c] > self.chunk_size

    @property
    def largest_chunk(self) -> int:
        return max(self.sizes, default=self.chunk_size)

    @property
    def trainable_chunks(self) -> list[int]:
        return [c for c, t in enumerate(self.trainable) if t]

    @property
    def total_params(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def total_elements(self) -> int:
        """Elements of chunk storage per kind that every chunk has (parameters, padding included)."""
        return sum(self.sizes)

    @property
    def waste(self) -> int:
        return self.total_elements - self.total_params

    def __repr__(self) -> str:
        big = sum(self.oversized(c) for c in range(self.num_chunks))
        frozen = self.num_chunks - len(self.trainable_chunks)
        return (f"ChunkLayout({len(self.slots)} params in {self.num_chunks} chunks of {self.chunk_size} "
                f"elements ({big} oversized, {frozen} frozen), {self.waste} wasted)")
