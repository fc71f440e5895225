"""Loading engine checkpoints into engines that hold the model cut otherwise: resharding by name.

A checkpoint of a pipeline run is one engine checkpoint per stage (``offload.pipeline.checkpoint``);
resumed under another cut (pp = 2 -> 1, 1 -> 2, a different balance) a stage's engine holds
parameters that several old stages held, at other chunks and offsets. ``load_resharded`` fills
each target engine chunk by chunk: for every parameter of a target chunk it finds, by the
parameter's name in the whole model, the old stage (``Source``) and the slot (chunk, offset)
that held it, reads that old chunk whole (``checkpoint.reading.fill_span``: every piece
verified, at whatever data-parallel width it was written) and copies the parameter's elements
of each kind -- the parameter, its master, ``exp_avg``, ``exp_avg_sq`` -- into place; the
target chunk is then written whole (``chunks.write_full``: each data-parallel rank keeps its
piece). Each parameter's Adam step count comes by name too.

Every precision the engine saves is resharded, into engines of the same precision (another is
refused naming the field): fp32 and bf16 state is copied element for element; 8-bit moments
are dequantised, copied and quantised again block by block, a block whose elements did not move
relative to their block keeping its codes and scale (``reshard_state``). A kind that is not one
of ``SAVED_KINDS`` is refused naming it. Memory: one target chunk and one old chunk of one kind
at a time (an old chunk is read once per target chunk that needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import SAVED_KINDS
from ..checkpoint.compat import check_precision
from ..checkpoint.format import DTYPES, chunk_pieces
from ..checkpoint.pieces import copies
from ..checkpoint.reading import OpenFiles, fill_span
from ..engine.access import engine_of
from ..engine.precision import SCALE_KINDS
from ..errors import ConfigError, OffloadError, UnsupportedError
from .reshard_state import OldMoments, quantized_kind, requantised, scale_kind

OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Source:
    """One saved engine checkpoint (a directory holding ``manifest.json``) and, for a stage,
    ``names``: its parameters' names in the stage -> in the whole model (None: the same)."""

    ckpt: Path
    manifest: dict
    names: dict[str, str] | None = None

    def full(self, name: str) -> str:
        return name if self.names is None else self.names.get(name, name)


@dataclass(frozen=True)
class _Saved:
    source: int
    index: int          # position in the saved layout: its Adam step count's index
    chunk: int
    offset: int
    numel: int
    shape: tuple


def saved_names(sources: list[Source]) -> dict[str, _Saved]:
    """Where each parameter, by its name in the whole model, was saved."""
    where: dict[str, _Saved] = {}
    for si, src in enumerate(sources):
        for i, (name, chunk, offset, numel, shape) in enumerate(src.manifest["layout"]["params"]):
            full = src.full(name)
            if full in where:
                raise OffloadError(f"parameter {full} is saved twice: in {sources[where[full].source].ckpt} "
                                   f"and in {src.ckpt}")
            where[full] = _Saved(si, i, int(chunk), int(offset), int(numel), tuple(shape))
    return where


def check_sources(sources: list[Source], engines: list) -> None:
    """Refuse what resharding does not do: another compute dtype or optimizer-state precision
    (``optimizer_state``, ``master``, ``block_size``), unknown state, parameters the engine does
    not hold, persistent buffers, fp16 loss scaling."""
    for src in sources:
        m = src.manifest
        for engine in engines:
            dtype = engine.config.dtype
            if m["dtype"] != dtype:
                raise ConfigError("dtype", dtype, f"the checkpoint {src.ckpt} was saved with dtype {m['dtype']!r}")
            check_precision(engine.chunks, m, src.ckpt)
        for kind in m["kinds"]:
            if kind not in SAVED_KINDS:
                raise UnsupportedError(f"resuming under another pipeline layout: the checkpoint {src.ckpt} holds "
                                       f"{kind!r} state, which is not resharded by layer yet; resume with the "
                                       f"layout it was saved with")
        if m.get("buffers"):
            raise UnsupportedError(f"the checkpoint {src.ckpt} holds persistent buffers, which are not resharded "
                                   "by layer yet: resume with the layout it was saved with")
        if (m.get("optimizer") or {}).get("state"):
            raise UnsupportedError(f"the checkpoint {src.ckpt} holds optimizer state of parameters outside the "
                                   "engine, which is not resharded by layer: resume with the layout it was saved with")
        if m.get("scaler"):
            raise UnsupportedError(f"the checkpoint {src.ckpt} has an fp16 loss scaler; pipeline stages run "
                                   "bf16 or fp32")


class _OldChunks:
    """Whole chunks of the old checkpoints, read and verified on demand; the last one kept."""

    def __init__(self, sources: list[Source]):
        self.sources = sources
        self.files = [OpenFiles(s.ckpt) for s in sources]
        self.key = None
        self.value: torch.Tensor | None = None

    def get(self, source: int, kind: str, c: int) -> torch.Tensor | None:
        """Chunk ``kind[c]`` of source ``source`` (its dtype, ``numel`` elements); None: it held nothing."""
        if self.key == (source, kind, c):
            return self.value
        m = self.sources[source].manifest
        info = m["kinds"].get(kind)
        if info is None:
            raise ConfigError("kind", kind, f"the checkpoint {self.sources[source].ckpt} has no {kind!r} chunks "
                                            "(another dtype or a frozen parameter)")
        entry = info["chunks"][c]
        value = None
        if entry is not None:
            algorithm = m["checksum"]
            pieces = chunk_pieces(info, entry, algorithm)
            numel = max(p.hi for p in pieces)
            dtype = DTYPES[info["dtype"]]
            out = torch.empty(numel * dtype.itemsize, dtype=torch.uint8)
            spans = [(p.lo, p.hi) for p in pieces]
            fill_span(self.files[source], kind, c, pieces, copies(spans, (0, numel)), out, numel, dtype.itemsize,
                      None, algorithm)
            value = out.view(dtype)
        self.key, self.value = (source, kind, c), value
        return value

    def close(self) -> None:
        for f in self.files:
            f.close()


def load_resharded(targets: list[tuple[object, dict[str, str] | None]], optimizer, sources: list[Source],
                   aliases: dict[str, str] | None = None) -> None:
    """Fill each target (a wrapped module and its names in the stage -> in the whole model, None:
    the same) from the ``sources`` by parameter name; ``aliases``: a target name read under
    another saved name (an untied LM head from a tied model's embedding). Every rank of every
    target's data-parallel group calls it alike (no collective: each reads whole old chunks)."""
    if not sources:
        raise OffloadError("no saved stage to reshard from")
    engines = [engine_of(m, required=True) for m, _ in targets]
    check_sources(sources, engines)
    counts = {int(s.manifest["engine_step_count"]) for s in sources}
    if len(counts) != 1:
        raise OffloadError(f"the saved stages disagree on the optimizer step count ({sorted(counts)}): "
                           f"{', '.join(str(s.ckpt) for s in sources)} are not one checkpoint")
    step_count = counts.pop()
    where = saved_names(sources)
    aliases = aliases or {}
    old = _OldChunks(sources)
    try:
        for engine, (_, names) in zip(engines, targets):
            _fill(engine, names or {}, where, aliases, old, sources)
            engine.chunks.restore_step_state(step_count=step_count)
    finally:
        old.close()
    if optimizer is not None:
        groups = (sources[0].manifest.get("optimizer") or {}).get("param_groups")
        if groups:
            _restore_hypers(optimizer, groups, sources[0].ckpt)


def _fill(engine, names: dict, where: dict, aliases: dict, old: _OldChunks, sources: list[Source]) -> None:
    chunks = engine.chunks
    found = {}
    for slot in chunks.layout.slots:
        full = names.get(slot.name, slot.name)
        saved = where.get(full) or where.get(aliases.get(full, ""))
        if saved is None:
            raise ConfigError("parameter", full, "is in the model but in none of the saved stages "
                                                 f"({', '.join(str(s.ckpt) for s in sources)})")
        if saved.shape != tuple(slot.shape):
            raise ConfigError("parameter", full, f"has shape {tuple(slot.shape)} but {saved.shape} in "
                                                 f"{sources[saved.source].ckpt}")
        found[slot.name] = saved
    chunks.drain()
    engine.zero_grad()             # a clean window: no gradients, nothing applied
    engine.drop_gathered()         # other ranks' chunks gathered here go stale now
    moments = OldMoments(old.get, where)
    for info in chunks.chunks():
        for kind, dtype in info.kinds.items():
            if scale_kind(kind):        # written with their codes
                continue
            if quantized_kind(kind, dtype):
                got = requantised(kind, info.numel, [(slot, found[slot.name]) for slot in info.params], moments)
                for k, value in zip((kind, SCALE_KINDS[kind]), got or (None, None)):
                    if value is None:
                        chunks.write(k, info.index, None)   # nothing yet, as before a first step
                    else:
                        chunks.write_full(k, info.index, value)
                continue
            whole = torch.zeros(info.numel, dtype=dtype)
            held = False
            for slot in info.params:
                s = found[slot.name]
                data = old.get(s.source, kind, s.chunk)
                if data is None:        # Adam moments never initialized there: torch's zeros
                    continue
                if data.dtype != dtype:
                    raise ConfigError("kind", kind, f"{data.dtype} in {sources[s.source].ckpt}, {dtype} in the model")
                whole[slot.offset:slot.offset + slot.numel] = data[s.offset:s.offset + s.numel]
                held = True
            if held or kind not in OPTIMIZER_KINDS[1:]:
                chunks.write_full(kind, info.index, whole)
            else:
                chunks.write(kind, info.index, None)     # nothing yet, as before a first step
    steps = []
    for slot in chunks.layout.slots:
        s = found[slot.name]
        steps.append(int(sources[s.source].manifest["adam_steps"][s.index]))
    chunks.restore_step_state(adam_steps=steps)


def _restore_hypers(optimizer, groups: list[dict], where: Path) -> None:
    """The saved hyper-parameters of each parameter group (lr, betas, ...): the groups' sizes
    differ under another cut, so only their number must match."""
    from ..checkpoint.model_state import restore_hypers

    if len(groups) != len(optimizer.param_groups):
        raise ConfigError("optimizer.param_groups", len(optimizer.param_groups),
                          f"the checkpoint {where} has {len(groups)} parameter groups")
    restore_hypers(optimizer, [{k: v for k, v in g.items() if k != "num_params"} for g in groups], where)
