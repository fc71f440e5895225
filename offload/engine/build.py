"""Building an engine's parts from the model and the config: pure set-up, run once per wrap."""

from __future__ import annotations

import torch

from ..tiers.streams import CopyStreams, DeviceStreams


def copy_streams(device: torch.device) -> CopyStreams | None:
    """The copy streams of ``device``: a CUDA device's (its compute stream is the one current
    now, and again at each forward's start), None for the CPU (copies are synchronous). Tests
    put simulated streams here to run the GPU path's ordering on the CPU."""
    return DeviceStreams(device) if device.type == "cuda" else None
