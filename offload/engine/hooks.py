"""Module hooks: fetch a module's chunks before its forward and its backward, release them after.

Forward: a pre-hook pins the module's chunks on the compute device (their parameters' ``.data``
become views), a post-hook unpins them. Backward: the post-hook wraps the module's outputs in an
identity autograd function whose backward runs just before the module's own backward and pins
the chunks again; they are released once every parameter of the module has its gradient (or
when the whole backward ends; a parameter with several uses in one forward: after each use's,
``ModuleHooks._release_after_each_use``). ``torch.utils.checkpoint`` re-runs forward inside
backward: pins taken then are tied to the backward and released the same way, so a recompute
that stops early (and never reaches its post-hook) leaks nothing.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import torch


class PreBackward(torch.autograd.Function):
    """Identity on the way forward; on the way back, calls ``hook`` before the module's backward.

    The outputs are aliases of the inputs (same storage and version counter), not autograd views:
    users modify model outputs in place (``loss *= scale`` in ``transformers.Trainer``,
    ``logits.div_(temperature)``), which autograd forbids on views made inside a custom Function.
    Gradients are not materialized: an output nobody backpropagates through (``logits`` when only
    ``loss`` is) passes None, not a ``[batch, seq, vocab]`` tensor of zeros.
    """

    @staticmethod
    def forward(ctx, hook, *tensors):
        ctx.hook = hook
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a nest of tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):          # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            obj[k] = map_tensors(obj[k], fn)
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            object.__setattr__(obj, f.name, map_tensors(getattr(obj, f.name), fn))
        return obj
    return obj


def wrap_for_backward(output: Any, hook: Callable[[], None]) -> Any:
    """Route the gradients of ``output``'s differentiable tensors through one ``PreBackward``."""
    if isinstance(output, torch.Tensor):
        # Most modules return one tensor: no walk of a nest (this runs after every module's forward).
        if not (output.requires_grad and output.is_floating_point()):
            return output
        return PreBackward.apply(hook, output)[0]
    tensors: list[torch.Tensor] = []
    map_tensors(output, lambda t: tensors.append(t) or t)
    wanted = [t for t in tensors if t.requires_grad and t.is_floating_point()]
    if not wanted:
        return output
    wrapped = dict(zip(map(id, wanted), PreBackward.apply(hook, *wanted)))
    return map_tensors(output, lambda t: wrapped.get(id(t), t))


def outside_inference_mode(hook: Callable) -> Callable:
    """``hook`` run with inference mode off (grad mode still off) when a forward runs under
    ``torch.inference_mode()``: every buffer the engine allocates there (chunk copies, the pooled
    buffers they come from, their typed views) outlives that forward, and one made as an inference
    tensor would be refused by the next training step's autograd (or by Adam's in-place update)."""
    def run(*args):
        if not torch.is_inference_mode_enabled():
            return hook(*args)
        with torch.inference_mode(False), torch.no_grad():
            return hook(*args)
    return run


def register_forward_hooks(module: torch.nn.Module, pre: Callable, post: Callable) -> list:
    """Register the engine's forward ``pre``- and ``post``-hooks on ``module``; returns their handles.

    ``pre`` goes first among the module's pre-hooks (``prepend``): a user's pre-hook registered
    before ``offload.wrap`` then reads the pinned weights, not empty placeholders (hooks registered
    after wrap run after the engine's anyway). Both run outside inference mode
    (``outside_inference_mode``). The class's methods, not the instance's: on a wrapped module those
    are ``user_hooks``' for users' hooks (``register_external_parameter`` installs again)."""
    cls = type(module)
    return [cls.register_forward_pre_hook(module, outside_inference_mode(pre), prepend=True),
            cls.register_forward_hook(module, outside_inference_mode(post))]


def autograd_running() -> bool:
    """Whether a backward is running on this thread: no public API (FSDP2 asks the same way)."""
    return torch._C._current_graph_task_id() != -1


def weak_grad_hook(hooks):
    """``hooks._on_grad`` holding ``hooks`` (a ``ModuleHooks``) weakly: torch keeps post-accumulate-grad
    hooks where the garbage collector cannot see them, so a bound method there made a cycle
    (parameter, hook, engine) that was never freed, and a dropped engine kept its device chunks
    allocated for good."""
    ref = weakref.ref(hooks)

    def on_grad(p: torch.nn.Parameter) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad(p)
    return on_grad
