"""The global gradient norm of a model cut into pipeline stages, and clipping by it.

Each stage's engine knows the norm of its own stage's gradients (summed over its data-parallel
group); the model's norm sums their squares over this rank's stages and then over the pipeline
ranks. ``offload.AdamW(max_grad_norm=...)`` would clip each engine by its own stage's norm, so
under stages it is refused (``check_optimizer``) and ``clip_grad_norm_`` is called instead,
between the pipeline step and ``optimizer.step()``: each engine's Adam applies the coefficient
``min(1, max_norm / (norm + 1e-6))`` as torch's clip followed by AdamW does (``offload.grad_clip``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import ConfigError, OffloadError


def check_optimizer(engines) -> None:
    """Refuse an optimizer that clips each stage by its own norm."""
    for e in engines:
        opt = e.optimizer
        if opt is not None and getattr(opt, "max_grad_norm", None) is not None:
            raise ConfigError("max_grad_norm", opt.max_grad_norm,
                              "under pipeline stages each stage's engine would clip by its own stage's norm: "
                              "create offload.AdamW without it and call staged.clip_grad_norm_(max_norm) "
                              "between staged.step() and optimizer.step()")


def clip_grad_norm_(engines, max_norm: float, pp_group) -> float:
    """Clip this step's gradients of every stage to the model's global L2 norm ``max_norm``; returns
    the norm before clipping. A collective over the pipeline ranks (and each stage's data-parallel
    group): every rank calls it, after the step's backwards and before ``optimizer.step()``."""
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ConfigError("max_norm", max_norm, "must be a positive number")
    for e in engines:
        if e.optimizer is None:
            raise OffloadError("clip_grad_norm_ over pipeline stages needs their offload.AdamW created first")
        if e.chunks.step_state().window_updated:
            raise OffloadError("clip_grad_norm_ came after a stage's update already ran during backward: "
                               "create offload.AdamW before the first step, so that the updates wait for it")
    local = sum(e.grad_norm() ** 2 for e in engines)
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total, group=pp_group)
    norm = math.sqrt(float(total)) if math.isfinite(float(total)) else float("inf")
    for e in engines:
        e.optimizer.clip_this_step = (float(max_norm), norm)
    return norm
