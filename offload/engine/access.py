"""The engine's side of the chunk interface (``offload.chunks.access``): ``engine.chunks``.

Everything outside the engine that needs a wrapped model's chunks -- checkpoints, Hugging Face
loads and exports, ``state_dict()``, LoRA, gradient clipping, benchmarks -- finds the engine with
``engine_of`` and goes through its ``chunks`` (an ``EngineChunks``); this module is the one place
that knows which of the engine's parts answer each question.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterable

import torch

from ..chunks.access import ChunkInfo, ParamInfo, StepState
from ..chunks.states import ChunkState
from ..errors import ConfigError, NvmeIOError, OffloadError
from ..tiers.nvme import SLOT_ALIGN


class EngineChunks:
    """``ChunkAccess`` over one engine: its chunked parameters, store, Adam worker and counters."""

    def __init__(self, engine):
        self._engine = engine
        params, layout, sharding = engine.params, engine.layout, engine.dp
        self._params = params
        self.layout = layout
        self.sharding = sharding
        slots: dict[int, list] = {}
        for s in layout.slots:
            slots.setdefault(s.chunk, []).append(s)
        infos = []
        for c in range(layout.num_chunks):
            # The persistent kinds the engine registers (ChunkedParams, OffloadEngine).
            kinds = {"param": params.dtype}
            if layout.trainable[c]:
                if params.master_kind(c) == "master":
                    kinds["master"] = params.master_dtype
                kinds.update(params.precision.state_kinds())
            infos.append(ChunkInfo(index=c, numel=layout.chunk_numel(c), used=layout.used[c],
                                   trainable=layout.trainable[c], kinds=MappingProxyType(kinds),
                                   params=tuple(slots.get(c, ())), span=params.span(c),
                                   blocks=MappingProxyType({k: params.precision.kind_block(k) for k in kinds})))
        self._infos = tuple(infos)
        kinds: dict[str, torch.dtype] = {}
        for info in infos:
            for kind, dtype in info.kinds.items():
                kinds.setdefault(kind, dtype)
        self.kinds = MappingProxyType(kinds)
        self.precision = params.precision.describe()

    # ---- metadata ----------------------------------------------------------------------------
    def chunks(self) -> tuple[ChunkInfo, ...]:
        return self._infos

    def param(self, p: torch.Tensor) -> ParamInfo | None:
        ref = self._engine.params.refs.get(id(p))
        return None if ref is None else ParamInfo(ref.index, ref.slot)

    # ---- values ------------------------------------------------------------------------------
    def read(self, kind: str, c: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        store, key = self._engine.store, (kind, c)
        with store.lock:
            rec = store.records.get(key)
            if rec is None or rec.state is ChunkState.FREE:
                return None
            return store.read(key) if out is None else store.read_into(key, out)

    def write(self, kind: str, c: int, values: torch.Tensor | None) -> None:
        store, key = self._engine.store, (kind, c)
        if values is not None:
            store.write(key, values)
            return
        with store.lock:
            rec = store.records.get(key)
            if rec is not None and rec.state is not ChunkState.FREE:
                store.release_storage(key)

    def read_full(self, kind: str, c: int) -> torch.Tensor | None:
        if kind not in self._infos[c].kinds:
            return None
        store, key = self._engine.store, (kind, c)
        with store.lock:
            empty = store.records[key].state is ChunkState.FREE
        if self.sharding is not None:
            # A piece holding no parameter with a gradient gets no Adam state while the others do:
            # the chunk is empty only when every piece is (one tiny all-reduce, on every rank).
            holding = torch.tensor([0.0 if empty else 1.0], device=self._params.comm_device)
            self._engine.comms.all_reduce(holding)
            empty = float(holding.item()) == 0
        if empty:
            return None
        return self._params.read_whole(key)

    def write_full(self, kind: str, c: int, values: torch.Tensor) -> None:
        info = self._infos[c]
        numel = info.kind_numel(kind) if kind in info.kinds else info.numel
        if values.numel() != numel:
            raise ConfigError("values", values.numel(), f"chunk {kind}[{c}] has {numel} elements")
        values = values.reshape(-1)
        if numel == info.numel:
            self.write(kind, c, self._params.piece_of(c, values))
            return
        lo, hi = info.kind_span(kind)       # the scales of 8-bit moments: this rank's blocks
        piece = torch.zeros(hi - lo, dtype=values.dtype)
        piece[:max(0, min(hi, numel) - lo)] = values[lo:min(hi, numel)]
        self.write(kind, c, piece)

    def staging(self, nbytes: int, count: int = 1) -> list[torch.Tensor]:
        # Whole 4 KiB blocks: a chunk's 1/N piece is read straight from NVMe by its slot's blocks.
        return self._engine.store.staging_buffers(-(-nbytes // SLOT_ALIGN) * SLOT_ALIGN, count)

    def gather(self, params: Iterable[torch.Tensor] | None = None, kind: str | None = None) -> dict[int, torch.Tensor]:
        return self._engine.params.gather_all(kind, None if params is None else list(params))

    def scatter(self, values: dict[int, torch.Tensor], kinds: Iterable[str] | None = None) -> None:
        self._engine.params.scatter(values, None if kinds is None else list(kinds))

    # ---- in flight, counters -----------------------------------------------------------------
    def drain(self, *, moves: bool = False) -> None:
        try:
            self._engine.adam.drain()
        except NvmeIOError:
            self._engine.check_intact()     # the update's failed request, and what follows from it
            raise
        self._engine.check_intact()         # what reads the chunks next must not save half a step
        if moves:
            self._engine.store.wait_idle()

    def step_state(self) -> StepState:
        e = self._engine
        scaler = None if e.scaler is None else {"scale": e.scaler.scale, "good_steps": e.scaler.good_steps,
                                                "skipped": e.scaler.skipped}
        return StepState(adam_steps=tuple(e.adam.steps), step_count=e.step_count, scaler=scaler,
                         window_open=bool(e.micro_batches or e.window_applied),
                         window_updated=bool(e.updated_chunks))

    def restore_step_state(self, *, adam_steps: Iterable[int] | None = None, step_count: int | None = None,
                           scaler: dict | None = None) -> None:
        e = self._engine
        if adam_steps is not None:
            steps = [int(s) for s in adam_steps]
            if len(steps) != len(e.adam.steps):
                raise ConfigError("adam_steps", len(steps), f"expected one per parameter ({len(e.adam.steps)})")
            e.adam.steps[:] = steps
        if step_count is not None:
            e.step_count = int(step_count)
        if scaler is not None and e.scaler is not None:
            e.scaler.scale = float(scaler["scale"])
            e.scaler.good_steps = int(scaler["good_steps"])
            e.scaler.skipped = int(scaler["skipped"])

    def nvme(self):
        return self._engine.store.tiers.get("nvme")


def engine_of(obj, *, required: bool = False):
    """The ``OffloadEngine`` of a wrapped model (what ``offload.wrap`` returned) or of one of its
    parameters; None when ``obj`` is neither. ``required``: raise ``ConfigError`` then instead,
    and ``OffloadError`` when the engine is closed (its state is gone)."""
    if isinstance(obj, torch.Tensor):
        ref = getattr(obj, "_offload_engine", None)
        engine = ref() if ref is not None else None
    else:
        engine = getattr(obj, "offload_engine", None)
    if not required:
        return engine
    if engine is None:
        if isinstance(obj, torch.Tensor):
            raise ConfigError("param", tuple(obj.shape), "belongs to no wrapped model")
        raise ConfigError("model", type(obj).__name__, "is not wrapped by offload.wrap (no offload_engine)")
    if getattr(engine, "_closed", False):
        raise OffloadError("the model's offload engine is closed: its state is gone")
    return engine
