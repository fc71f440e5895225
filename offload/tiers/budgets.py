"""Turning ``"auto"`` budgets into bytes, measured once at start."""

from __future__ import annotations

import torch

from ..config import OffloadConfig

# Shares of what is free at start. The rest is left to activations, the CUDA context,
# torch's own allocations and the rest of the system.
AUTO_DEVICE_SHARE_CUDA = 0.5
AUTO_DEVICE_SHARE_CPU = 0.25
AUTO_CPU_SHARE = 0.5


def compute_device(config: OffloadConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cuda")
    return torch.device("cpu")


def resolve_budgets(config: OffloadConfig, device: torch.device) -> tuple[int, int]:
    """``(device_budget, cpu_budget)`` in bytes."""
    import psutil

    available = psutil.virtual_memory().available
    if config.device_budget != "auto":
        device_budget = int(config.device_budget)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        device_budget = int(free * AUTO_DEVICE_SHARE_CUDA)
    else:
        device_budget = int(available * AUTO_DEVICE_SHARE_CPU)
    if config.cpu_budget != "auto":
        cpu_budget = int(config.cpu_budget)
    else:
        taken = device_budget if device.type == "cpu" else 0
        cpu_budget = max(int((available - taken) * AUTO_CPU_SHARE), 1 << 20)
    return device_budget, cpu_budget


def min_device_bytes(chunk_elements: int, elem_bytes: int, largest_elements: int | None = None) -> int:
    """The smallest device budget one training step fits in.

    Backward holds at once: the tied embedding's parameter chunk and its fp32 gradient chunk
    (pinned until the very end), and the current module's parameter and gradient chunks, which
    may straddle two chunks: three of each. An oversized parameter has a chunk of its own
    (``largest_elements``); only one is held beside two bulk chunks.
    """
    largest = max(largest_elements or 0, chunk_elements)
    return (largest + 2 * chunk_elements) * (elem_bytes + 4)


# Data parallel: parameter groups gathered at once (the window of 3 plus 1 prefetched), and
# gradient groups being reduced at once (see offload.distributed.gather / reduce).
GATHERED_GROUPS = 4
REDUCING_GROUPS = 2


def min_device_bytes_sharded(chunk_elements: int, elem_bytes: int, largest_elements: int | None,
                             world: int, grad_bytes: int = 4) -> int:
    """``min_device_bytes`` under ``world`` ranks: each chunk in use brings its communication
    group (one chunk per rank), so the window of gathered parameter groups and the gradient
    groups being reduced hold ``world`` chunks each."""
    largest = max(largest_elements or 0, chunk_elements)
    one = min_device_bytes(chunk_elements, elem_bytes, largest_elements)
    if world <= 1:
        return one
    return one + (world - 1) * largest * (GATHERED_GROUPS * elem_bytes + REDUCING_GROUPS * grad_bytes)


def min_cpu_bytes(chunk_elements: int, elem_bytes: int) -> int:
    """The smallest CPU budget one chunk's update fits in: its fp32 gradient, master (when the
    compute dtype is not fp32), exp_avg and exp_avg_sq, and its parameters, pinned together
    (``chunk_elements``: the largest trainable chunk)."""
    return chunk_elements * (4 + (4 if elem_bytes < 4 else 0) + 4 + 4 + elem_bytes)
