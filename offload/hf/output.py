"""What ``--output DIR`` writes: full HF weights, a peft adapter, or the adapter merged into the base.

The output is the source model trained, nothing else changed unless asked: weights in the dtype
the source's files hold (an fp32 checkpoint comes back fp32, converted from the fp32 masters
when training ran in bf16), the source's ``config.json`` byte for byte (training's own settings,
such as ``use_cache=False``, stay out of it), one ``model.safetensors`` when the weights fit one
shard. ``dtype="bf16"|"fp16"|"fp32"`` asks for another dtype, and the config's ``torch_dtype``
then says so. A from-scratch model (``offload.models.llama``, a ``--preset`` run) is written as
an HF Llama directory (``offload.hf.preset``), in the dtype it computes in unless asked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import ConfigError, OffloadError
from .export import export_pretrained
from .lora import is_peft, merged_export, save_adapter
from .preset import hf_llama_config, is_preset
from .safetensors_export import parse_dtype

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
          torch.float64: "float64"}


def write_output(model, directory: str | os.PathLike, *, merge: bool = False, max_shard_size="5GB",
                 dtype=None, tokenizer: str | os.PathLike | None = None) -> Path:
    """Full fine-tune: an HF model directory. LoRA: the adapter in peft's format, or with ``merge``
    the base model with the adapter folded in, as an HF model directory. ``dtype`` (``"bf16"``,
    ``"fp16"``, ``"fp32"`` or a torch dtype): the weights' dtype; default the source's.
    ``tokenizer``: the tokenizer directory the run used when not the source's; its files go along."""
    wanted = parse_dtype(dtype)
    ckpt = getattr(model, "hf_checkpoint", None)
    source = getattr(ckpt, "directory", None)
    if is_peft(model):
        if merge:
            rename, transform = merged_export(model)
            out_dtype, config = source_settings(ckpt, wanted)
            return export_pretrained(model, directory, source=source, max_shard_size=max_shard_size,
                                     rename=rename, transform=transform, dtype=out_dtype, config=config,
                                     hf_config=model.get_base_model().config, tokenizer=tokenizer)
        if wanted is not None:
            raise ConfigError("dtype", dtype, "applies to model weights; a LoRA adapter is written as peft "
                                              "saves it (merge=True writes merged weights in that dtype)")
        return save_adapter(model, directory, source=source, tokenizer=tokenizer)
    if merge:
        raise ConfigError("--merge", True, "needs a LoRA run (--lora-rank)")
    if is_preset(model):
        return export_pretrained(model, directory, max_shard_size=max_shard_size, dtype=wanted,
                                 hf_config=hf_llama_config(model.config), tokenizer=tokenizer)
    out_dtype, config = source_settings(ckpt, wanted)
    return export_pretrained(model, directory, source=source, max_shard_size=max_shard_size, dtype=out_dtype,
                             config=config, tokenizer=tokenizer)


def source_settings(ckpt, wanted: torch.dtype | None) -> tuple[torch.dtype | None, dict | bytes | None]:
    """The weights' dtype and the ``config.json`` an output of a model loaded from ``ckpt`` (an
    ``offload.hf.load.Checkpoint``; None: not loaded from a directory) gets: the source's (its
    bytes), or ``wanted`` and the source's config with its dtype set to it. ``(wanted, None)``
    without a source."""
    if ckpt is None:
        return wanted, None
    path = Path(ckpt.directory) / "config.json"
    try:
        raw = path.read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise OffloadError(f"{path}: the source's config cannot be read again for the output ({exc})") from exc
    if wanted is None:
        return ckpt.weights_dtype, raw
    # transformers 5 writes "dtype", 4.x "torch_dtype"; both read "torch_dtype".
    config["torch_dtype"] = _NAMES[wanted]
    if "dtype" in config:
        config["dtype"] = _NAMES[wanted]
    return wanted, config
