"""What the planner needs of a Hugging Face model: its parameters' sizes (trainable or frozen) and
a LLaMA-shaped summary for the activation and FLOP estimates — from ``config.json`` alone.

The model is built on the meta device (no weights read, nothing allocated), LoRA adapters added
when asked, and ``named_parameters()`` read in the order the engine packs them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, OffloadError, one_line
from ..models.llama import LlamaConfig


@dataclass(frozen=True)
class ModelDescription:
    name: str
    shape: LlamaConfig                     # for activations and FLOPs (attention, MLP widths)
    params: list[tuple[int, bool]]         # (elements, trainable) per parameter

    @property
    def trainable(self) -> int:
        return sum(n for n, t in self.params if t)

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.params)


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def llama_shape(hf_config) -> LlamaConfig:
    """A LLaMA-architecture stand-in with the same widths (GPT-2's n_embd, OPT's ffn_dim, ...)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    h = int(_first(text, "hidden_size", "n_embd", "d_model"))
    heads = int(_first(text, "num_attention_heads", "n_head", default=1))
    if h % heads or (h // heads) % 2:
        heads = 1 if (h % 2 == 0) else heads
    kv = int(_first(text, "num_key_value_heads", default=heads) or heads)
    if heads % kv:
        kv = heads
    inter = int(_first(text, "intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h)
    return LlamaConfig(vocab_size=int(text.vocab_size), hidden_size=h, intermediate_size=inter,
                       num_layers=int(_first(text, "num_hidden_layers", "n_layer", "num_layers")),
                       num_heads=heads, num_kv_heads=kv,
                       max_seq_len=int(_first(text, "max_position_embeddings", "n_positions", default=2048)),
                       tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))


def describe(directory: str | os.PathLike, lora=None) -> ModelDescription:
    """Build ``directory``'s model on the meta device (``lora``: a ``LoraSettings``) and describe it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(directory)
    if not (root / "config.json").is_file():
        raise ConfigError("--model", str(directory), "has no config.json (expected a Hugging Face model directory)")
    try:
        hf_config = AutoConfig.from_pretrained(str(root), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except Exception as exc:
        raise OffloadError(f"{root / 'config.json'}: transformers cannot build a causal LM from it "
                           f"({one_line(exc)})") from exc
    if lora is not None:
        from .lora import peft_model

        model = peft_model(model, lora)
    params = [(p.numel(), p.requires_grad) for _, p in model.named_parameters()]
    try:
        shape = llama_shape(hf_config)
    except (TypeError, ValueError, ConfigError) as exc:
        raise OffloadError(f"{root / 'config.json'}: cannot read the model's widths for the planner ({exc})") from exc
    name = f"{getattr(hf_config, 'model_type', 'model')} ({root.name})"
    return ModelDescription(name + (f" + LoRA r={lora.rank}" if lora is not None else ""), shape, params)
