"""What ``--output DIR`` writes: full HF weights, a peft adapter, or the adapter merged into the base."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .export import export_pretrained
from .lora import is_peft, merged_export, save_adapter


def enable_checkpointing(model) -> None:
    """Activation checkpointing of an HF model, non-reentrant (offload's hooks need autograd to see
    the recomputed forward; transformers 5 renamed the method, 4.x has only the old name)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def write_output(model, directory: str | os.PathLike, *, merge: bool = False, max_shard_size="5GB") -> Path:
    """Full fine-tune: an HF model directory. LoRA: the adapter in peft's format, or with ``merge``
    the base model with the adapter folded in, as an HF model directory."""
    source = getattr(getattr(model, "hf_checkpoint", None), "directory", None)
    if is_peft(model):
        if merge:
            rename, transform = merged_export(model)
            return export_pretrained(model, directory, source=source, max_shard_size=max_shard_size,
                                     rename=rename, transform=transform,
                                     hf_config=model.get_base_model().config)
        return save_adapter(model, directory, source=source)
    if merge:
        raise ConfigError("--merge", True, "needs a LoRA run (--lora-rank)")
    return export_pretrained(model, directory, source=source, max_shard_size=max_shard_size)
