"""The chunk interface: what code outside the engine may know of a wrapped model's chunks.

Checkpoints, Hugging Face loads and exports, ``state_dict()``, LoRA adapters and the benchmarks
all go through ``engine.chunks`` (a ``ChunkAccess``), never through the engine's store, layout,
parameters or optimizer worker. It answers four questions:

* **Which chunks are there?** ``chunks()`` lists every chunk with its metadata (``ChunkInfo``:
  size, the kinds of state it has and their dtypes, its parameters, the piece this rank keeps);
  ``layout`` is the immutable geometry (bulk chunk size, every parameter's ``ParamSlot``);
  ``param(p)`` places one parameter. None of this but ``span`` depends on the world size.
* **What values does a chunk hold?** ``read(kind, c)`` copies chunk ``c``'s ``kind`` state from
  whichever tier holds it (device, pinned CPU or NVMe) into a CPU buffer; ``write(kind, c, values)``
  replaces it. ``gather`` / ``scatter`` do the same per parameter, reading each chunk once.
* **Is anything still in flight?** ``drain()`` finishes queued Adam updates (and, on request, moves
  between tiers) before values are read or overwritten.
* **Where is the training?** ``step_state()`` / ``restore_step_state()``: per-parameter Adam step
  counts, the optimizer step count and the fp16 loss scaler, which a checkpoint saves with the chunks.

Units: ``numel``, ``used`` and offsets are elements; ``nbytes`` and staging sizes are bytes. A
chunk's kinds are ``"param"`` (compute dtype) and, for a trainable chunk, ``"master"`` (fp32,
only when the compute dtype is not fp32; bf16 under ``master="bf16"``, and none at all when the
compute dtype is bf16 too: the parameters are the master), ``"exp_avg"`` and ``"exp_avg_sq"`` (fp32;
uint8 codes under 8-bit moments, with their per-block fp32 scales ``"exp_avg_absmax"`` and
``"exp_avg_sq_absmax"``: ``ChunkInfo.blocks``); gradients are transient and not part of this interface.

Under data parallelism (``sharding`` set) every rank keeps one piece of every chunk
(``offload.distributed.sharding``): ``read``/``write`` act on this rank's piece (elements
``span`` of the chunk), ``read_full`` is a collective that all-gathers the whole chunk, and
``write_full`` takes the whole chunk and keeps this rank's piece of it; ``gather`` is a
collective every rank calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Mapping, Protocol, Sequence

import torch

from .layout import ChunkLayout, ParamSlot

if TYPE_CHECKING:
    from ..distributed.sharding import Sharding
    from ..tiers import NvmeTier


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """One chunk, the same on every rank."""

    index: int
    numel: int
    """elements of storage in every kind (the bulk chunk size, or an oversized parameter's own)."""
    used: int
    """elements up to the end of its last parameter (the rest is zero padding)."""
    trainable: bool
    """it holds trainable parameters (a frozen chunk has ``"param"`` state only)."""
    kinds: Mapping[str, torch.dtype]
    """the persistent kinds of state it has, with their dtypes."""
    params: tuple[ParamSlot, ...]
    """its parameters, in layout order (name, offset, numel, shape)."""
    span: tuple[int, int]
    """``(lo, hi)``: the elements of the chunk this rank's piece holds (``(0, numel)`` in a single
    process); ``hi`` may pass ``numel``: that end of the piece is padding (zeros)."""

    blocks: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """chunk elements per stored element of a kind where not 1: the scales of 8-bit moments
    (``"exp_avg_absmax"``, ``"exp_avg_sq_absmax"``) hold one fp32 per 256-element block."""

    @property
    def piece_numel(self) -> int:
        """Elements of this rank's piece (``numel`` in a single process)."""
        return self.span[1] - self.span[0]

    def kind_numel(self, kind: str) -> int:
        """Stored elements of its whole ``kind`` state (``numel``, or its blocks for a scale kind)."""
        return -(-self.numel // self.blocks.get(kind, 1))

    def kind_span(self, kind: str) -> tuple[int, int]:
        """``span`` in stored elements of ``kind`` (pieces are whole blocks where a kind has them)."""
        block = self.blocks.get(kind, 1)
        return self.span[0] // block, self.span[1] // block

    def nbytes(self, kind: str) -> int:
        """Bytes of its whole ``kind`` state."""
        return self.kind_numel(kind) * self.kinds[kind].itemsize

    def piece_nbytes(self, kind: str) -> int:
        """Bytes of this rank's piece of its ``kind`` state (what ``read`` returns)."""
        span = self.kind_span(kind)
        return (span[1] - span[0]) * self.kinds[kind].itemsize


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """Where one parameter lives."""

    index: int
    """its position in layout order (``layout.slots``): the index of its Adam step count."""
    slot: ParamSlot

    @property
    def name(self) -> str:
        return self.slot.name


@dataclass(frozen=True, slots=True)
class StepState:
    """Where the training is, apart from the chunks' values."""

    adam_steps: tuple[int, ...]
    """Adam steps taken per parameter, in layout order (torch's per-parameter ``step``)."""
    step_count: int
    """optimizer steps applied to the model."""
    scaler: dict | None
    """the fp16 loss scaler (``scale``, ``good_steps``, ``skipped``); None under bf16 / fp32."""
    window_open: bool
    """backward ran since the last ``optimizer.step()`` (gradients are waiting)."""
    window_updated: bool
    """some chunk's update of this window already ran, during backward (a global norm found now
    comes too late for it)."""


class ChunkAccess(Protocol):
    """A wrapped model's chunks, as code outside the engine sees them (see the module docstring)."""

    @property
    def layout(self) -> ChunkLayout:
        """The immutable geometry: ``chunk_size`` and every parameter's ``ParamSlot`` in layout order."""

    @property
    def kinds(self) -> Mapping[str, torch.dtype]:
        """The persistent kinds any chunk has, with their dtypes: ``kinds["param"]`` is the compute
        dtype; ``"master"`` is there when some chunk is trainable and compute is not fp32."""

    @property
    def precision(self) -> Mapping[str, object]:
        """The optimizer state's precision: ``{"optimizer_state": "fp32" | "8bit", "master": "fp32" |
        "bf16", "block_size": 256}`` (what a checkpoint records of it)."""

    @property
    def sharding(self) -> "Sharding | None":
        """This rank's place among the data-parallel ranks (None in a single process)."""

    def chunks(self) -> Sequence[ChunkInfo]:
        """Every chunk, in index order (``chunks()[c]`` is chunk ``c``)."""

    def param(self, p: torch.Tensor) -> ParamInfo | None:
        """Where parameter ``p`` lives; None when this engine does not hold it."""

    def read(self, kind: str, c: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """This rank's piece of chunk ``c``'s ``kind`` state (the whole chunk in a single
        process) as a 1-D CPU tensor of ``piece_numel`` elements (its dtype), copied from
        whichever tier holds it; None when the chunk has no such state or holds nothing yet
        (Adam moments before the first step). ``out``: a buffer from ``staging`` to copy into (the
        result is a view of it); None: a fresh one."""

    def write(self, kind: str, c: int, values: torch.Tensor | None) -> None:
        """Replace this rank's piece of chunk ``c``'s ``kind`` state with ``values``
        (``piece_numel`` elements, converted to the kind's dtype); None empties it (it then holds
        nothing, as before a first step)."""

    def read_full(self, kind: str, c: int) -> torch.Tensor | None:
        """Chunk ``c``'s whole ``kind`` state (``numel`` elements) on every rank: a collective that
        every rank calls in the same order (``read`` in a single process). None on every rank when
        the chunk has no such state or holds nothing yet."""

    def write_full(self, kind: str, c: int, values: torch.Tensor) -> None:
        """Replace chunk ``c``'s ``kind`` state with ``values``, the whole chunk (``numel``
        elements) given alike on every rank: each rank keeps its piece (no collective)."""

    def staging(self, nbytes: int, count: int = 1) -> list[torch.Tensor]:
        """``count`` reusable CPU buffers of ``nbytes`` bytes for ``read`` (page-aligned when chunks
        may be read straight from NVMe), touched now so their first use costs no page faults."""

    def gather(self, params: Iterable[torch.Tensor] | None = None, kind: str | None = None) -> dict[int, torch.Tensor]:
        """``{id(param): value}`` of ``params`` (default: all) from their ``kind`` chunks (default:
        the most precise values, as fp32), each chunk read once; zeros where a chunk has no such
        state. Under several ranks a collective: every rank calls it alike and gets every value."""

    def scatter(self, values: dict[int, torch.Tensor], kinds: Iterable[str] | None = None) -> None:
        """Write ``{id(param): value}`` into the chunks of ``kinds`` (default: ``"param"`` and
        ``"master"``), each chunk read and written once; a rank writes its pieces of them."""

    def drain(self, *, moves: bool = False) -> None:
        """Finish the queued Adam updates (re-raising the worker's error); ``moves``: also wait for
        every move between tiers under way (write-backs included)."""

    def step_state(self) -> StepState:
        """The training's counters now."""

    def restore_step_state(self, *, adam_steps: Iterable[int] | None = None, step_count: int | None = None,
                           scaler: dict | None = None) -> None:
        """Set the counters given (a checkpoint's, an optimizer ``state_dict``'s); ``scaler`` is
        ignored without an fp16 loss scaler."""

    def nvme(self) -> "NvmeTier | None":
        """The NVMe tier holding the swap files (None without ``nvme_paths``): for I/O benchmarks."""

