"""Whether a checkpoint fits a model: the same parameters at the same chunk offsets, the same
dtypes and chunk sizes -- at any world size, since the chunk layout does not depend on it (a
chunk_size refusal says to build with the checkpoint's, ``saved_chunk_size``).

A checkpoint written by N ranks is read by M: rank r of M fills its span of every chunk from
the saved pieces that overlap it, so each rank checks every chunk's entry (its size, that its
pieces tile it) and the files it will read from; between them the ranks check every file. A mismatch is the
caller's mistake (``ConfigError`` naming what differs), never a reason to fall back to an older
checkpoint; a missing or truncated file is damage (``OffloadError``).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, OffloadError
from .format import (DTYPES, MANIFEST, SAVED_KINDS, check_kind_file_size, chunk_numel, chunk_pieces, kind_files,
                     saved_precision)
from .model_state import layout_entries, model_kinds
from .pieces import clip, copies, tiling_error
from .ranks import Ranks


def check_compatible(engine, manifest: dict, ckpt: Path, ranks: Ranks | None = None) -> None:
    """Raise ``ConfigError`` naming the difference when checkpoint ``ckpt`` (its parsed
    ``manifest``) does not fit ``engine``'s model; ``OffloadError`` when a chunk file this rank
    reads is missing or of the wrong size."""
    ranks = ranks if ranks is not None else Ranks.of(engine)
    lay = manifest["layout"]
    if manifest["dtype"] != engine.config.dtype:
        raise ConfigError("dtype", engine.config.dtype, f"the checkpoint {ckpt} was saved with dtype "
                                                        f"{manifest['dtype']!r}")
    chunks = engine.chunks
    layout = chunks.layout
    check_precision(chunks, manifest, ckpt)
    # The chunk size first: under another one every parameter sits elsewhere, and the fix is
    # to build the model with the checkpoint's (budgets choose it when it is "auto").
    if lay["chunk_size"] != layout.chunk_size:
        raise ConfigError("chunk_size", layout.chunk_size,
                          f"the checkpoint {ckpt} was written with chunk_size={lay['chunk_size']}, a different "
                          f"chunk layout from this model's chunk_size={layout.chunk_size}: build the model with "
                          f"OffloadConfig(chunk_size={lay['chunk_size']}) -- "
                          f"offload.checkpoint.saved_chunk_size(DIR) reads it -- to resume from it")
    _check_params(chunks, lay, ckpt)
    if lay["num_chunks"] != layout.num_chunks:
        raise ConfigError("chunk_size", layout.chunk_size,
                          f"the checkpoint {ckpt} has {lay['num_chunks']} chunks of {lay['chunk_size']} elements, "
                          f"this model {layout.num_chunks}")
    params = len(chunks.step_state().adam_steps)
    if len(manifest["adam_steps"]) != params:
        raise OffloadError(f"{ckpt / MANIFEST}: {len(manifest['adam_steps'])} step counts for {params} parameters")
    world = int(manifest.get("world", 1))
    if world < 1:
        raise OffloadError(f"{ckpt / MANIFEST}: world size {world}")
    kinds = model_kinds(chunks)
    for kind, info in manifest["kinds"].items():
        if kind not in kinds:
            raise ConfigError("kind", kind, f"the checkpoint {ckpt} has {kind!r} chunks this model does not")
        _check_kind(chunks, ranks, ckpt, kind, info, world)
    for kind in SAVED_KINDS:
        if kind in kinds and kind not in manifest["kinds"]:
            raise ConfigError("kind", kind, f"the model has {kind!r} chunks, the checkpoint {ckpt} none")


def check_precision(chunks, manifest: dict, ckpt: Path) -> None:
    """Optimizer state of another precision is refused, not converted: the codes of 8-bit moments
    mean nothing as fp32 and back, and a silent requantisation would change the run. The way
    across is the optimizer's state_dict, which is fp32 at every precision."""
    saved = saved_precision(manifest)
    for field, mine in (("optimizer_state", chunks.precision["optimizer_state"]), ("master", chunks.precision["master"])):
        if saved[field] != mine:
            raise ConfigError(field, mine, f"the checkpoint {ckpt} holds {saved[field]} {field.replace('_', ' ')}: "
                                           f"wrap the model with OffloadConfig({field}={saved[field]!r}) to resume "
                                           f"from it, or move the state across with optimizer.state_dict() (fp32 "
                                           f"moments at every precision) and load_state_dict")
    block = (manifest.get("precision") or {}).get("block_size", chunks.precision["block_size"])
    if block != chunks.precision["block_size"]:
        raise ConfigError("block_size", chunks.precision["block_size"],
                          f"the checkpoint {ckpt} quantised its moments in blocks of {block}")


def _check_params(chunks, lay: dict, ckpt: Path) -> None:
    saved = {e[0]: e for e in lay["params"]}
    mine = {e[0]: e for e in layout_entries(chunks)}
    for name, e in mine.items():
        if name not in saved:
            raise ConfigError("parameter", name, f"is not in the checkpoint {ckpt}")
        s = saved[name]
        if s[4] != e[4]:
            raise ConfigError("parameter", name, f"has shape {tuple(e[4])} but {tuple(s[4])} in the checkpoint {ckpt}")
        if s[1:4] != e[1:4]:
            raise ConfigError("parameter", name, f"sits at chunk {e[1]} offset {e[2]} but at chunk {s[1]} "
                                                 f"offset {s[2]} in the checkpoint {ckpt} (a different chunk "
                                                 f"layout: use the same chunk_size and parameter order)")
    extra = sorted(set(saved) - set(mine))
    if extra:
        raise ConfigError("parameter", extra[0], f"is in the checkpoint {ckpt} but not in the model "
                                                 f"({len(extra)} such)")


def _check_kind(chunks, ranks: Ranks, ckpt: Path, kind: str, info: dict, world: int) -> None:
    dtype = model_kinds(chunks)[kind]
    layout = chunks.layout
    model = chunks.chunks()
    per_block = max((i.blocks.get(kind, 1) for i in model), default=1)     # the scales of 8-bit moments
    bulk = -(-layout.chunk_size // per_block) * dtype.itemsize
    if DTYPES.get(info["dtype"]) != dtype or info.get("chunk_bytes", bulk) != bulk:
        raise ConfigError("kind", kind, f"{info['dtype']} chunks of {info.get('chunk_bytes', '?')} bytes in the "
                                        f"checkpoint {ckpt}, {dtype} of {bulk} in the model")
    if len(info["chunks"]) != layout.num_chunks:
        raise OffloadError(f"{ckpt / MANIFEST}: {len(info['chunks'])} {kind} chunk entries, expected "
                           f"{layout.num_chunks}")
    if "files" in info and len(info["files"]) != world:
        raise OffloadError(f"{ckpt / MANIFEST}: {len(info['files'])} {kind} files for {world} ranks")
    files = kind_files(info)
    mine = set()
    for c, entry in enumerate(info["chunks"]):
        if entry is None:
            continue
        numel = chunk_numel(info, entry)
        if kind not in model[c].kinds or numel != model[c].kind_numel(kind):
            raise ConfigError("kind", kind, f"chunk {c} of the checkpoint {ckpt} does not match the "
                                            "model's (a different chunk layout or set of frozen parameters)")
        pieces = chunk_pieces(info, entry)
        for p in pieces:
            if not 0 <= p.rank < world or (p.stored and (p.file not in files or p.nbytes != p.numel * dtype.itemsize)):
                raise OffloadError(f"{ckpt / MANIFEST}: chunk {kind}[{c}] has a piece of rank {p.rank} of {world} "
                                   f"in {p.file}, {p.nbytes} bytes for elements [{p.lo}, {p.hi})")
        spans = [(p.lo, p.hi) for p in pieces]
        why = tiling_error(spans, numel)
        if why is not None:
            raise OffloadError(f"{ckpt / MANIFEST}: the pieces of chunk {kind}[{c}] do not tile its {numel} "
                               f"elements: {why}")
        mine.update(pieces[cp.piece].file for cp in copies(spans, clip(model[c].kind_span(kind), numel))
                    if pieces[cp.piece].stored)
    # Each file is checked by a rank that reads from it, and by one rank in any case (an empty one too).
    check_kind_file_size(ckpt, kind, info, [f for i, f in enumerate(files) if f in mine or i % ranks.world == ranks.rank])
