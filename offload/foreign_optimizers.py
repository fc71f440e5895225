"""Refuse a torch optimizer that would step a wrapped model's parameters and update nothing.

After ``offload.wrap`` a parameter is a placeholder with no elements: its values, gradient and
Adam state live in the engine's chunks, and only ``offload.AdamW`` updates them. A loop that
wrapped the model but kept ``torch.optim.AdamW(model.parameters())`` (the second of the two
lines forgotten) ran, printed losses, and trained nothing at all: torch's step found no
gradients on the placeholders and skipped them, silently. ``install()`` (done by
``offload.wrap``) registers a pre-hook on every optimizer's ``step()`` (torch's public
``register_optimizer_step_pre_hook``) that raises ``ConfigError`` naming the optimizer and a
parameter instead.

An optimizer passes when its class says it steps offloaded parameters
(``steps_offloaded_parameters``: ``offload.AdamW``) or wraps one that does (``.optimizer``, as
accelerate's ``AcceleratedOptimizer`` does), and when it holds no trainable parameter of an
open engine (plain parameters, a frozen offloaded encoder under a head it trains). The verdict
is kept per optimizer until its parameter groups or their ``requires_grad`` change, or a model
is wrapped.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .engine.access import engine_of
from .errors import ConfigError

_handle = None
_requires_grad = operator.attrgetter("requires_grad")
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()


def install() -> None:
    """Register the pre-hook on every optimizer's step (once), and forget the verdicts: each
    ``offload.wrap`` calls it, and wrap keeps the parameter objects, so an optimizer that stepped
    them before (same groups, same signature) would otherwise go on, updating nothing."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_before_any_step)
    _checked.clear()


def steps_offloaded(optimizer) -> bool:
    """Whether ``optimizer``, or one it wraps, is one of offload's (their class says so)."""
    seen = 0
    while optimizer is not None and seen < 8:        # wrappers of wrappers, never a cycle
        if getattr(type(optimizer), "steps_offloaded_parameters", False):
            return True
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return False


def _groups_signature(optimizer) -> tuple:
    # Which parameters they are, and which of them require a gradient, each: a frozen wrapped
    # encoder thawed later (staged unfreezing) would otherwise go on untrained, silently, and a
    # count would miss it when as many plain ones were frozen with it, or a parameter replaced
    # in its group's list. Two C-level passes (map): about 0.12 us a parameter per step.
    return tuple((tuple(map(id, g["params"])), tuple(map(_requires_grad, g["params"])))
                 for g in optimizer.param_groups)


def _before_any_step(optimizer, args, kwargs) -> None:
    if steps_offloaded(optimizer):
        return None
    signature = _groups_signature(optimizer)
    if _checked.get(optimizer) == signature:
        return None
    refuse_offloaded_params(optimizer)
    _checked[optimizer] = signature
    return None


def refuse_offloaded_params(optimizer) -> None:
    """Raise ``ConfigError`` if ``optimizer`` holds a trainable parameter of an open wrapped model."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            engine = engine_of(p) if isinstance(p, torch.Tensor) and p.requires_grad else None
            if engine is None or getattr(engine, "_closed", False):
                continue
            info = engine.chunks.param(p)
            name = info.slot.name if info is not None else tuple(p.shape)
            raise ConfigError(
                "optimizer", f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                f"holds {name!r}, a parameter of a model wrapped by offload.wrap: its values, gradient "
                "and state live in the engine's chunks, so this optimizer's step() would update nothing. "
                "Build the optimizer with offload.AdamW(model.parameters(), ...) (torch.optim.AdamW's "
                "arguments); with HF Trainer pass optimizers=(offload.AdamW(...), scheduler)")
