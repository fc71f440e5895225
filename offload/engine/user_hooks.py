"""A user's full backward hooks on a wrapped module read its real weights, not empty placeholders.

The engine pins a module's chunks for its backward from inside its outputs (``hooks.PreBackward``,
put there by its forward hook), and lets them go once the module's parameters have their
gradients. torch's full backward hooks sit outside both: a ``register_full_backward_pre_hook``
runs on the output gradients before the engine's pin, and a ``register_full_backward_hook`` runs
on the input gradients after the release (or, when no input needs a gradient, with the
pre-hooks). A hook reading ``module.weight`` there (weight statistics, saliency, pruning masks)
read an empty placeholder -- silently, an empty tensor's norm is 0 -- whenever the chunk had left
the compute device, or values half-rewritten by an overlapped update.

``guard(hooks, module)`` makes the module's ``register_full_backward_pre_hook`` and
``register_full_backward_hook`` (instance attributes, set by ``offload.wrap``) register the user's
hook wrapped so that it runs with the module's chunks pinned: a pre-hook pinned around it; a
(post-)hook with a pin taken by a backward pre-hook of ours that runs first of them, and let go
right after the user's hook, so the module's update (which waits for its last pin) cannot begin
before it. The handle returned removes both. Hooks registered before ``offload.wrap`` are wrapped
the same way when the model is wrapped (``guard_registered``). A forward hook registered after
wrap runs after the engine's, which let the chunks go: ``register_forward_hook`` pins around it too
(one registered before wrap runs before the engine's, pinned; forward pre-hooks run after the
engine's, pinned, whenever registered).
"""

from __future__ import annotations

import functools
import weakref

from torch import nn

from .hooks import outside_inference_mode


class _Handles:
    """The handles of what one user registration added: ``remove()`` removes all of them."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def pin(hooks, module: nn.Module) -> list[int]:
    """Pin ``module``'s chunks on the compute device, as its own backward does (waiting for the
    last step's updates of them first); returns the chunks, for ``unpin``."""
    chunks = list(hooks.module_chunks.get(module, ()))
    hooks.pin_updated(chunks)
    return chunks


# A forward hook may run under torch.inference_mode(): a chunk fetched for it must not become an
# inference tensor (see hooks.outside_inference_mode).
pin_outside_inference = outside_inference_mode(pin)


def unpin(hooks, chunks: list[int]) -> None:
    for c in chunks:
        if hooks.pins.pinned(c):            # end of backward may have let it go already
            hooks.unpin(c)


def _pinned(hooks, hook):
    """``hook`` (any module hook: its module comes first) run with the module's chunks pinned."""
    @functools.wraps(hook)
    def run(module, *args):
        chunks = pin_outside_inference(hooks, module)
        try:
            return hook(module, *args)
        finally:
            unpin(hooks, chunks)
    return run


def _pinned_post_hook(hooks, hook, held: list):
    """``hook`` (a full backward hook), after which the pin ``_hold`` took for it is let go."""
    @functools.wraps(hook)
    def run(module, grad_input, grad_output):
        try:
            return hook(module, grad_input, grad_output)
        finally:
            if held:
                unpin(hooks, held.pop())
    return run


def _hold(hooks, held: list, key: int | None = None):
    """A backward pre-hook pinning for a full backward hook; ``key``: that hook's id in
    ``_backward_hooks`` when it was registered before wrap, whose handle removes it alone: once
    it is gone this pins nothing (a pin no hook lets go stayed until backward ended)."""
    def hold(module, grad_output):
        if key is None or key in module._backward_hooks:
            held.append(pin(hooks, module))
    return hold


def guard(hooks, module: nn.Module) -> None:
    """Make ``module``'s full backward hook registrations pin its chunks around the user's hooks."""
    cls, ref = type(module), weakref.ref(module)       # weakly: no cycle through the module's own dict

    def register_full_backward_pre_hook(hook, prepend: bool = False):
        return cls.register_full_backward_pre_hook(ref(), _pinned(hooks, hook), prepend=prepend)

    def register_full_backward_hook(hook, prepend: bool = False):
        held: list = []       # the pins taken by this registration's backward pre-hook, not yet let go
        first = cls.register_full_backward_pre_hook(ref(), _hold(hooks, held), prepend=True)
        return _Handles(first, cls.register_full_backward_hook(ref(), _pinned_post_hook(hooks, hook, held),
                                                                prepend=prepend))

    def register_forward_hook(hook, **kwargs):
        # After the engine's own forward hook, which let the chunks go: still on the device then,
        # unless an update of the last step, finishing meanwhile, made room by taking them.
        return cls.register_forward_hook(ref(), _pinned(hooks, hook), **kwargs)

    module.register_full_backward_pre_hook = register_full_backward_pre_hook
    module.register_full_backward_hook = register_full_backward_hook
    module.register_forward_hook = register_forward_hook


def guard_registered(hooks, module: nn.Module) -> None:
    """Wrap the full backward hooks ``module`` had before ``offload.wrap`` as ``guard`` wraps new ones.
    torch keeps them in ``_backward_pre_hooks`` / ``_backward_hooks`` (no public API lists them):
    each is replaced in place, under its own handle's id, so the user's handle still removes it
    (a post-hook's pin-taking pre-hook then stays, pinning nothing once the post-hook is gone)."""
    for key, hook in list(module._backward_pre_hooks.items()):
        module._backward_pre_hooks[key] = _pinned(hooks, hook)
    if not getattr(module, "_is_full_backward_hook", None):
        return      # none, or the old register_backward_hook's, which torch calls elsewhere
    for key, hook in list(module._backward_hooks.items()):
        held: list = []
        module._backward_hooks[key] = _pinned_post_hook(hooks, hook, held)
        type(module).register_full_backward_pre_hook(module, _hold(hooks, held, key), prepend=True)
