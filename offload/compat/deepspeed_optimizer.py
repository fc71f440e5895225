"""A DeepSpeed config's ``optimizer`` section and ``gradient_clipping`` read as the keyword
arguments of ``offload.AdamW`` (``deepspeed_optimizer_kwargs`` in ``offload.compat.deepspeed``
loads the file and logs what was left to AdamW's defaults; the rest of the config maps to an
``OffloadConfig``)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .deepspeed_keys import OPT_TYPES, check_keys, is_auto, read_bool, read_number, read_section

__all__ = ["read_optimizer"]


def read_optimizer(cfg: dict) -> tuple[dict, list[str]]:
    """(``deepspeed_optimizer_kwargs``'s result, the keys set to ``"auto"``) for config dict ``cfg``.

    Logs nothing: ``from_deepspeed`` runs it too, to refuse an optimizer it cannot honour early."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    opt = read_section(cfg, "optimizer", "optimizer")
    if opt:
        kind = opt.get("type")
        if not isinstance(kind, str) or kind.replace("_", "").lower() not in OPT_TYPES:
            raise ConfigError("optimizer.type", kind,
                              "is not supported: offload runs AdamW on the CPU (use type Adam or AdamW)")
        params = read_section(opt, "params", "optimizer.params")
        known = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction",
                 "torch_adam", "fp32_optimizer_states", "max_grad_norm"}
        check_keys(params, known, "optimizer.params")
        if params.get("amsgrad"):
            raise ConfigError("optimizer.params.amsgrad", params["amsgrad"], "is not supported")
        if params.get("bias_correction", True) is not True:
            raise ConfigError("optimizer.params.bias_correction", params["bias_correction"],
                              "is not supported: offload's Adam always corrects bias")
        if params.get("fp32_optimizer_states", True) is not True:
            raise ConfigError("optimizer.params.fp32_optimizer_states", params["fp32_optimizer_states"],
                              "is not supported: Adam state is always fp32")
        for key in ("lr", "eps", "weight_decay"):
            value = params.get(key)
            if value is not None and not is_auto(value):
                out[key] = read_number(value, f"optimizer.params.{key}")
            elif is_auto(value):
                notes.append(f"optimizer.params.{key}='auto'")
        betas = params.get("betas")
        if betas is not None and not is_auto(betas):
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise ConfigError("optimizer.params.betas", betas, "expected two numbers")
            out["betas"] = tuple(read_number(b, "optimizer.params.betas") for b in betas)
        elif is_auto(betas):
            notes.append("optimizer.params.betas='auto'")
        decoupled = kind.lower() == "adamw" or params.get("adam_w_mode", True)
        if not read_bool(decoupled, "optimizer.params.adam_w_mode") and out.get("weight_decay", 0.0) != 0.0:
            raise ConfigError("optimizer.params.adam_w_mode", False,
                              "is not supported with weight_decay != 0: offload.AdamW decouples weight decay")
        if not decoupled and "weight_decay" not in out:
            # DeepSpeed's Adam in L2 mode defaults to no decay; offload.AdamW's default is 0.01.
            out["weight_decay"] = 0.0
    clip = cfg.get("gradient_clipping")
    if is_auto(clip):
        notes.append("gradient_clipping='auto'")
    elif clip is not None:
        norm = read_number(clip, "gradient_clipping")
        if norm < 0:
            raise ConfigError("gradient_clipping", clip, "must be >= 0 (0 means no clipping)")
        out["max_grad_norm"] = norm if norm > 0 else None
    return out, notes
