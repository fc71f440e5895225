"""What ``--output DIR`` writes: full HF weights, a peft adapter, or the adapter merged into the base."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .export import export_pretrained
from .lora import is_peft, merged_export, save_adapter


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
