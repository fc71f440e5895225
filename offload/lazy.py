"""Lazy construction: build a model without allocating its weights, materialize it chunk by chunk.

``with offload.lazy_init(config): model = MyModel(...)`` builds every parameter on the meta
device and remembers the random-number state and the order in which parameters were
registered. ``offload.wrap(model)`` then materializes one module at a time — it gives the
module's parameters real (temporary) storage, calls its ``reset_parameters()`` in that recorded
order starting from the recorded random state, copies the values into their chunks, and drops
the temporaries — so the weights equal eager construction with the same seed (for modules that
initialize in ``reset_parameters``, as ``torch.nn`` layers do) while at most one module and a
couple of partly filled chunks exist in memory outside the tiers.

``lazy_init(config, initialize=False)`` is for weights that will be read from files
(``offload.hf.load_pretrained``): ``wrap`` then initializes nothing — parameters still on the meta
device keep empty chunks until the loader writes them, and parameters created with real values
(LoRA adapters added after the meta build) are copied into their chunks as they are.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import OffloadConfig


@dataclass(eq=False)
class LazyRecord:
    """What one ``lazy_init`` block saw: the RNG state at entry, modules in registration order."""

    rng_state: torch.Tensor
    config: OffloadConfig | None
    modules: list = field(default_factory=list)
    initialize: bool = True     # False: the values come from files, written after wrap


@contextmanager
def lazy_init(config: OffloadConfig | None = None, *, initialize: bool = True):
    """Build models on the meta device inside this block; ``offload.wrap`` materializes them
    (``initialize=False``: leaves them for a loader to write, see the module docstring)."""
    record = LazyRecord(torch.random.get_rng_state(), config, initialize=initialize)
    seen: set[int] = set()

    def on_register(module: nn.Module, name: str, param):
        if param is None:
            return None
        param._offload_lazy = record
        if id(module) not in seen:
            seen.add(id(module))
            record.modules.append(module)
        return None

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(on_register)
    try:
        with torch.device("meta"):
            yield record
    finally:
        handle.remove()


def lazy_record(model: nn.Module) -> LazyRecord | None:
    """The ``LazyRecord`` of a model built under ``lazy_init`` (None for an eagerly built one)."""
    for p in model.parameters():
        if p.is_meta:
            return getattr(p, "_offload_lazy", None) or LazyRecord(torch.random.get_rng_state(), None)
    return None
