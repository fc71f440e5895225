"""``torch.nn.utils.clip_grad_norm_`` that sees offloaded gradients.

A wrapped model's gradients live in chunks, not in ``p.grad``: torch's clip would find none,
return a norm of 0 and clip nothing. ``HF Trainer`` (its default ``max_grad_norm=1.0``) and
``accelerate`` call ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` between
backward and ``optimizer.step()``; ``install()`` (done by ``offload.wrap`` and ``offload.AdamW``) points that name at
``clip_grad_norm_`` below. Parameters of no wrapped model go to torch's own function unchanged.
For offloaded ones the global L2 norm is torch's (every gradient counted once, as if
concatenated) and the clip coefficient ``min(1, max_norm / (norm + 1e-6))`` is applied by the
engine's Adam at ``step()`` — the numbers torch's clip followed by ``AdamW`` gives.

The engine can only apply a norm it has before the update runs: ``offload.AdamW`` keeps the
first step's update until ``step()`` (as it does with ``max_grad_norm``), and keeps doing so
when that step was clipped (see ``AdamW.defers_update``).
"""

from __future__ import annotations

import math

import torch

from .engine.access import engine_of
from .errors import ConfigError, OffloadError

_torch_clip = None       # torch's own clip_grad_norm_, once install() has replaced it


def install() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` through ``clip_grad_norm_`` (idempotent)."""
    global _torch_clip
    if _torch_clip is None:
        _torch_clip = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


def torch_clip():
    return _torch_clip if _torch_clip is not None else torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over plain and offloaded parameters; returns the total norm."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engines: dict = {}
    plain = []
    for p in params:
        e = engine_of(p)
        if e is None or not p.requires_grad:
            # A frozen wrapped parameter has no gradient to clip (a frozen offloaded encoder under
            # a head trained by another optimizer): as a plain one, it adds nothing.
            plain.append(p)
        else:
            engines.setdefault(e, set()).add(id(p))
    if not engines:
        return torch_clip()(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    if float(norm_type) != 2.0:
        raise ConfigError("norm_type", norm_type, "offloaded gradients are clipped by their L2 norm only")
    for e, ids in engines.items():
        missing = [n for n, p in e.model.named_parameters()
                   if p.requires_grad and id(p) not in ids and e.chunks.param(p) is not None]
        if missing:
            raise ConfigError("parameters", missing[0], "is missing: clip_grad_norm_ over an offloaded model "
                                                        "takes all its trainable parameters (model.parameters())")
        if e.optimizer is None:
            raise OffloadError("clip_grad_norm_ over an offloaded model needs its offload.AdamW created first")
        if e.chunks.step_state().window_updated:
            raise OffloadError("clip_grad_norm_ came after the update already ran during backward; "
                               "pass max_grad_norm=... to offload.AdamW(...) instead")
    grads = [p.grad for p in plain if p.grad is not None]
    plain_norm = float(torch.nn.utils.get_total_norm(grads, 2.0, foreach=foreach)) if grads else 0.0
    total = math.sqrt(sum(e.grad_norm() ** 2 for e in engines) + plain_norm ** 2)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({total}), "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    total_t = torch.tensor(total, dtype=torch.float32)
    if grads:
        torch.nn.utils.clip_grads_with_norm_(plain, max_norm, total_t, foreach=foreach)
    for e in engines:
        e.optimizer.clip_this_step = (float(max_norm), total)
    return total_t
