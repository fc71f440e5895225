"""The model as the engine would store it: its parameters in the order it packs them, and the chunks
they fill — the whole model's layout (it does not depend on the number of ranks) and the part one
rank holds.

Every kind of state is stored in chunks of one geometry (``offload.chunks.layout``): the chunk
size is the engine's "auto" choice, at most min(32 Mi elements, device_budget / 32 B,
cpu_budget / 48 B); a parameter larger than that (embedding, lm_head, a large matrix) gets a
chunk of its own size, and padding counts. Frozen parameters (LoRA's base model) are packed in
chunks of their own. Under data parallelism every chunk of ``numel`` elements is cut into world
pieces of ceil(numel / world) elements (the last ones padded with zeros) and every rank holds one
piece of each: 1/world of every kind of state, an oversized chunk's included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..chunks.layout import PARAM_ALIGN, auto_max_chunk, pack, search_chunk_size
from ..models.llama import LlamaConfig, get_preset


PLANNER_PRESETS = {
    # a LLaMA shape of ~1e12 parameters (1.0006e12: head_dim 128, GQA 24:1, SwiGLU 65536), for
    # planning clusters only: nothing trains it here, so it is not among the models' presets
    "1t": LlamaConfig(vocab_size=32000, hidden_size=24576, intermediate_size=65536, num_layers=164,
                      num_heads=192, num_kv_heads=8, max_seq_len=4096),
}
"""Shapes the planner knows beyond ``offload.models.llama.PRESETS``."""


def resolve_model(model: Union[str, LlamaConfig]) -> tuple[str, LlamaConfig]:
    """``(label, cfg)`` of a preset name ("7b", "llama-7b": labelled "llama-7b"; the planner's own
    "1t" too) or a config ("custom")."""
    if isinstance(model, LlamaConfig):
        return "custom", model
    key = str(model).strip().lower().removeprefix("llama-").removeprefix("llama")
    cfg = PLANNER_PRESETS[key] if key in PLANNER_PRESETS else get_preset(model)
    return "llama-" + key, cfg


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def param_layout(cfg: LlamaConfig, lora_rank: int | None = None,
                 lora_targets: tuple[str, ...] = ("q_proj", "v_proj")) -> tuple[list[int], list[bool]]:
    """Elements and trainability of each parameter in the order the engine packs them. With
    ``lora_rank`` the model is peft's LoRA model: everything of the base model is frozen, and each
    targeted projection (out x in) is followed by its adapters A (r x in) and B (out x r)."""
    h, kv, i, v = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
    shapes = dict(zip(PROJECTIONS, [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]))
    base = lora_rank is None
    numels, trainable = [v * h], [base]
    for _ in range(cfg.num_layers):
        for name in PROJECTIONS:
            out, inp = shapes[name]
            numels.append(out * inp)
            trainable.append(base)
            if not base and name in lora_targets:
                numels += [lora_rank * inp, out * lora_rank]
                trainable += [True, True]
        numels += [h, h]
        trainable += [base, base]
    numels.append(h)
    trainable.append(base)
    if not cfg.tie_embeddings:
        numels.append(v * h)
        trainable.append(base)
    return numels, trainable


def param_numels(cfg: LlamaConfig) -> list[int]:
    """Elements of each parameter of ``LlamaForCausalLM(cfg)`` in ``named_parameters()`` order (the
    order the engine packs them into chunks; a tied lm_head is the embedding)."""
    h, kv, i, v = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
    layer = [h * h, kv * h, kv * h, h * h, i * h, i * h, h * i, h, h]
    return [v * h] + layer * cfg.num_layers + [h] + ([] if cfg.tie_embeddings else [v * h])


def chunk_sizes(cfg: LlamaConfig, device_budget: int, cpu_budget: int, chunk_size: int | None = None,
                lora_rank: int | None = None, lora_targets: tuple[str, ...] = ("q_proj", "v_proj"),
                layout: tuple[list[int], list[bool]] | None = None) -> tuple[int, list[int], list[bool]]:
    """``(chunk_size, [elements of each chunk], [whether it is trainable])`` the engine would lay out
    (``OffloadEngine.__init__``): bulk chunks of ``chunk_size``, one chunk of its own size per larger
    parameter, frozen and trainable parameters in separate chunks — the same at any number of ranks
    (each holds a piece of every chunk)."""
    numels, trainable = layout or param_layout(cfg, lora_rank, lora_targets)
    if chunk_size is None:
        chunk_size = search_chunk_size(numels, max_chunk=auto_max_chunk(device_budget, cpu_budget),
                                       trainable=trainable)
    packing = pack(numels, chunk_size, PARAM_ALIGN, trainable)
    return chunk_size, packing.sizes, packing.trainable


def chunk_geometry(cfg: LlamaConfig, device_budget: int, cpu_budget: int,
                   chunk_size: int | None = None) -> tuple[int, int]:
    """``(chunk_size, num_chunks)`` the engine would pick (``OffloadEngine.__init__``)."""
    chunk_size, sizes, _ = chunk_sizes(cfg, device_budget, cpu_budget, chunk_size)
    return chunk_size, len(sizes)


def piece_elements(numel: int, world: int) -> int:
    """Elements of one rank's piece of a chunk of ``numel`` elements among ``world`` ranks."""
    return -(-numel // world)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankChunks:
    """The chunk layout and the piece of every chunk one rank holds (elements)."""

    chunk_size: int
    """Elements of a bulk chunk."""
    sizes: list[int]
    """Elements of every chunk of the model, in chunk order (padding included)."""
    trainable: list[bool]
    """Per chunk: does it hold trainable parameters (and so gradient, master and moment chunks)?"""
    world: int
    """Ranks holding a piece of every chunk (1: one process holds every chunk whole)."""
    all_elems: int
    """Elements of all chunks."""
    all_trained: int
    """Elements of all trainable chunks."""
    gathered_elems: int
    """Elements of all chunks padded to ``world`` pieces: what the all-gathers assemble."""
    gathered_trained: int
    """The same for the trainable chunks: what the reduce-scatters take in."""
    elems: int
    """Elements of the rank's pieces (of every chunk)."""
    trained: int
    """Elements of its pieces of the trainable chunks."""
    largest_trained: int
    """Elements of its largest piece of a trainable chunk (0 if none)."""
    largest_piece: int
    """Elements of its largest piece."""

    @property
    def largest(self) -> int:
        """Elements of the largest chunk."""
        return max(self.sizes)


def rank_chunks(cfg: LlamaConfig, layout: tuple[list[int], list[bool]], device_budget: int, cpu_budget: int,
                chunk_size: int | None, world: int) -> RankChunks:
    """The chunks of ``layout`` (``param_layout``'s pair) and one rank's pieces of them among
    ``world`` ranks (every rank's are the same size)."""
    chunk, sizes, chunk_trainable = chunk_sizes(cfg, device_budget, cpu_budget, chunk_size, layout=layout)
    pieces = [piece_elements(size, world) for size in sizes]
    trained = [p for p, t in zip(pieces, chunk_trainable) if t]
    return RankChunks(
        chunk_size=chunk, sizes=sizes, trainable=chunk_trainable, world=world, all_elems=sum(sizes),
        all_trained=sum(size for size, t in zip(sizes, chunk_trainable) if t),
        gathered_elems=world * sum(pieces), gathered_trained=world * sum(trained),
        elems=sum(pieces), trained=sum(trained), largest_trained=max(trained, default=0),
        largest_piece=max(pieces))
