"""LoRA through peft: adapters added to a meta-built model, saved in peft's format, or merged.

``apply_lora(model, LoraSettings(rank=8))`` runs ``peft.get_peft_model`` on the model while its
base weights are still on the meta device (nothing of the base model is materialized); peft then
leaves the new adapter weights on meta too, so they are given real storage and peft's own
initialization (``reset_lora_parameters``: Kaiming A, zero B) here. ``offload.wrap`` copies those
values into their chunks and the checkpoint loader fills the frozen base.

``save_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` through
``PeftModel.save_pretrained`` from the adapter weights alone (gathered from their chunks; the
base is never read). ``merged_export`` gives ``export_pretrained`` the names and values of the
merged model: ``W + (B @ A) * scaling`` per adapted layer, computed as peft's ``merge`` does it,
chunk by chunk as the export streams.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..distributed.arrival import arrive
from ..errors import ConfigError, OffloadError, one_line

PREFIX = "base_model.model."


def _peft():
    try:
        import peft
    except ImportError as exc:
        raise OffloadError("--lora-rank needs the 'peft' package: pip install 'offload[lora]'") from exc
    return peft


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSettings:
    """The LoRA adapters to train."""

    rank: int
    """r: the adapters' inner dimension."""
    alpha: float | None = None
    """lora_alpha (scaling = alpha / rank); None: 2 x rank."""
    targets: tuple[str, ...] | None = None
    """module names to adapt (q_proj, v_proj, ...); None: peft's default for the architecture."""
    dropout: float = 0.0
    """dropout on the adapters' input."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError("--lora-rank", self.rank, "must be a positive integer")
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError("--lora-alpha", self.alpha, "must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("--lora-dropout", self.dropout, "must be in [0, 1)")
        if self.targets is not None and (not self.targets or not all(self.targets)):
            raise ConfigError("--lora-targets", ",".join(self.targets), "expected module names, e.g. q_proj,v_proj")

    def peft_config(self):
        peft = _peft()
        return peft.LoraConfig(r=self.rank, lora_alpha=self.alpha if self.alpha is not None else 2 * self.rank,
                               target_modules=list(self.targets) if self.targets else None,
                               lora_dropout=self.dropout, task_type="CAUSAL_LM")


def peft_model(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """``peft.get_peft_model``; what peft refuses (targets not found, ...) is a one-line ConfigError."""
    peft = _peft()
    try:
        return peft.get_peft_model(model, settings.peft_config())
    except Exception as exc:         # NoMatchingPeftModuleError, ValueError for unsupported layers, ...
        if settings.targets is None and "target_modules" in str(exc):
            raise ConfigError("--lora-targets", None, no_default_targets(model)) from exc
        raise ConfigError("--lora-targets", ",".join(settings.targets or ()) or "(peft default)",
                          one_line(exc)) from exc


def no_default_targets(model: nn.Module) -> str:
    """What to say when peft knows no default target modules for ``model``'s architecture: the
    flag to pass and the model's own linear layers to pick from (the output head left out)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                    if name and m is not head and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")})
    kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    example = ",".join(n for n in ("q_proj", "v_proj") if n in names) or ",".join(names[:2])
    return (f"peft has no default LoRA target modules for {kind!r} models: pass --lora-targets "
            f"{example or 'NAMES'} (this model's linear modules: {', '.join(names) or 'none'})")


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """``peft.get_peft_model`` on a meta-built model, with the adapters given real initial values."""
    from peft.tuners.lora import LoraLayer

    peft_model_ = peft_model(model, settings)
    for module in peft_model_.modules():
        if not isinstance(module, LoraLayer):
            continue
        for attr in module.adapter_layer_names:
            holder = getattr(module, attr)
            if any(p.is_meta for p in holder.parameters()):
                holder.to_empty(device="cpu")
        for adapter in module.active_adapters:
            with torch.no_grad():
                module.reset_lora_parameters(adapter, peft_model_.peft_config[adapter].init_lora_weights)
    return peft_model_


def is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def save_adapter(model: nn.Module, directory: str | os.PathLike, *, source: Path | None = None,
                 tokenizer: str | os.PathLike | None = None) -> Path:
    """Write the trained adapter in peft's format (``PeftModel.from_pretrained`` loads it), staged
    and renamed into place; the fp32 values the optimizer holds, gathered from their chunks."""
    import shutil

    from ..checkpoint.ranks import Ranks
    from .export import StagedDirectory, support_files

    engine = model.offload_engine
    arrive("save_adapter", engine.chunks.sharding)
    named = adapter_parameters(model)
    values = engine.chunks.gather([p for _, p in named])
    state = {n: values[id(p)] for n, p in named}
    if source is not None:
        for cfg in model.peft_config.values():
            cfg.base_model_name_or_path = str(Path(source).resolve())
    ranks, error = Ranks.of(engine), None
    if ranks.lead:                  # under data parallelism every rank gathered; rank 0 writes
        try:
            with StagedDirectory(directory, marker="adapter_config.json") as tmp:
                model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
                for f in support_files(source, tokenizer):
                    if f.name != "generation_config.json":
                        shutil.copy2(f, tmp / f.name)
        except Exception as exc:
            if not ranks.sharded:
                raise
            error = exc
    ranks.settle(error, f"writing the adapter to {directory}")
    return Path(directory)


def merged_export(model: nn.Module):
    """``(rename, transform)`` for ``export_pretrained``: the base model's names, LoRA folded in."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import transpose

    engine = model.offload_engine
    layers: dict[str, tuple] = {}          # base weight's (peft) name -> (layer, adapters)
    for mname, module in model.named_modules():
        if isinstance(module, LoraLayer):
            layers[f"{mname}.base_layer.weight"] = module
    lora_params = [p for _, p in adapter_parameters(model)]
    values = engine.chunks.gather(lora_params)
    tied = dict(getattr(model.get_base_model(), "all_tied_weights_keys", None) or {})

    def rename(name: str) -> str | None:
        if ".lora_" in name:
            return None
        if name.startswith(PREFIX):
            name = name[len(PREFIX):]
        name = name.replace(".base_layer.", ".")
        return tied.get(name, name)

    def transform(name: str, w: torch.Tensor) -> torch.Tensor:
        layer = layers.get(name)
        if layer is None:
            return w
        out = w.clone()
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            a = values[id(layer.lora_A[adapter].weight)]
            b = values[id(layer.lora_B[adapter].weight)]
            # peft's Linear.get_delta_weight, on the gathered values
            delta = transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[adapter]
            out += delta.to(out.dtype)
        return out

    return rename, transform
