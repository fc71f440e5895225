"""Autograd's saved tensors that live in parameter chunks, stored by reference.

Autograd saves views of parameters (``weight.t()`` for a matmul) that point into chunk buffers,
and the tier's pool hands those buffers to other chunks once a chunk is evicted. So while the
wrapped model's forward runs, a saved tensor that lives in an attached parameter chunk is stored
as (chunk, offset, size, stride) and rebuilt from wherever the chunk is on the device when
backward needs it. Any other saved tensor goes on to the activation store, when there is one
(``offload.activations``: it parks the ones ``activation_offload`` chooses off the device). The
store tells checkpoint boundaries from the other saved tensors by the order in which this hook and
the engine's module hooks run (``activations.select``): so every pack is counted, and the forward
module hooks report here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from typing import Callable

from ..activations import module_saves
from .pins import DevicePins


@dataclass(frozen=True, slots=True)
class SavedChunkView:
    """A saved tensor in parameter chunk ``chunk``: ``offset`` elements from the buffer start."""

    chunk: int
    offset: int
    size: tuple
    stride: tuple


class SavedParameterViews:
    """``enter()`` at the start of the model's forward, ``exit()`` at its end (or the next start).

    ``ensure(c)``: under several ranks, brings chunk ``c``'s parameters to this rank before a
    pin needs them (``GroupGather.ensure``); None in a single process.
    """

    def __init__(self, pins: DevicePins, dtype: torch.dtype, device: torch.device, activations=None, *,
                 ensure: Callable[[int], None] | None = None):
        self.pins = pins
        self.dtype = dtype
        self.device = device
        self.ensure = ensure
        self.activations = activations
        self.boundaries = activations.boundaries if activations is not None else None
        self._hooks = None

    def enter(self) -> None:
        self.exit()     # a forward that raised never reached its exit
        if self.activations is not None:
            self.activations.begin_forward()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()

    def exit(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
            if self.activations is not None:
                self.activations.end_forward()

    def module_started(self, module, trainable: bool, args) -> None:
        """A hooked module's forward starts (``trainable``: it owns trainable parameters)."""
        if self._hooks is not None and self.boundaries is not None:
            self.boundaries.module_started(module, module_saves(trainable, args))

    def module_ended(self, module) -> None:
        if self._hooks is not None and self.boundaries is not None:
            self.boundaries.module_ended(module)

    def pack(self, t: torch.Tensor):
        if self.boundaries is not None:
            self.boundaries.packed()
        if t.device != self.device or t.layout != torch.strided:
            return t
        try:
            base = t.untyped_storage().data_ptr()
        except RuntimeError:
            return t
        c = self.pins.chunk_viewed_at(base)
        if c is None:
            acts = self.activations
            return acts.pack(t) if acts is not None and acts.wants(t) else t
        if t.dtype != self.dtype:
            return t.clone()       # a reinterpreting view: keep a private copy
        offset = (t.data_ptr() - base) // t.element_size()
        return SavedChunkView(c, offset, tuple(t.size()), tuple(t.stride()))

    def unpack(self, packed):
        if not isinstance(packed, SavedChunkView):
            return self.activations.unpack(packed) if self.activations is not None else packed
        c = packed.chunk
        if self.pins.count(c) == 0:
            # Used outside the hooks' view: pinned until the backward ends (its unpin-all).
            if self.ensure is not None:
                self.ensure(c)
            self.pins.pin(c)
        return torch.as_strided(self.pins.view(c), packed.size, packed.stride, packed.offset)
