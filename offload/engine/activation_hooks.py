"""Wiring activation offload into the engine: the store behind the saved-tensor hooks.

``SavedParameterViews`` owns the one ``saved_tensors_hooks`` pair the wrapped model's forward
runs under (two nested pairs would hide one another); a saved tensor that is not a view of a
parameter chunk goes on to the ``ActivationStore`` made here, which parks it when the config
says so (``OffloadConfig.activation_offload``).
"""

from __future__ import annotations

import torch

from ..activations import ActivationArea, ActivationStore, SpillSpace
from ..errors import ConfigError


def make_activation_store(config, device: torch.device, budget: int, store, tracer) -> ActivationStore | None:
    """The engine's activation store over an area of ``budget`` bytes (``Budgets.activations``,
    resolved at start with the other budgets), or None when ``activation_offload`` is "none".
    Its copies run on the chunk ``store``'s streams; it spills to the store's NVMe directories."""
    tier = config.activation_tier
    if tier == "none":
        return None
    cuda = device.type == "cuda"
    area = ActivationArea(budget, pin=cuda and config.pin_memory)
    spill = None
    if tier == "nvme":
        nvme = store.tiers.get("nvme")
        if nvme is None:
            raise ConfigError("activation_offload", config.activation_offload, "spills to NVMe: give nvme_paths")
        spill = SpillSpace(nvme.dirs, nvme.aio, nvme.prefix)
    streams = store.streams
    order = config.activation_backward_order
    return ActivationStore(device, area, tier=tier, streams=lambda: streams, spill=spill,
                           min_bytes=config.activation_min_bytes, prefetch=config.activation_prefetch,
                           tracer=tracer, order="reverse" if order == "auto" else order)
