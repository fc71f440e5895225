"""Turning ``"auto"`` budgets into bytes, measured once at start."""

from __future__ import annotations

import os
import warnings
from typing import Iterable, NamedTuple

import torch
import torch.distributed as dist

from ..config import OffloadConfig
from ..errors import ConfigError

# Shares of what is free at start. The rest is left to activations, the CUDA context,
# torch's own allocations and the rest of the system.
AUTO_DEVICE_SHARE_CUDA = 0.5
AUTO_DEVICE_SHARE_CPU = 0.25
AUTO_CPU_SHARE = 0.5
# The "auto" activation area (the engine's and the planner's): this share of the RAM the chunk
# budgets leave of this process's share at start, and at least AUTO_AREA_MIN bytes.
AUTO_AREA_SHARE = 0.5
AUTO_AREA_MIN = 64 << 20


class Budgets(NamedTuple):
    """Bytes of each budget, "auto" resolved."""

    device: int
    cpu: int
    activations: int
    """The CPU activation area (``offload.activations``), used when activation offload is on."""


def compute_device(config: OffloadConfig, tensors: Iterable = ()) -> torch.device:
    """The device the engine computes on: the current CUDA device, or the CPU.

    Under a process group whose ranks each see every GPU of their node (torchrun without
    ``CUDA_VISIBLE_DEVICES`` per process), rank ``LOCAL_RANK`` belongs on ``cuda:LOCAL_RANK``; a loop
    that never called ``torch.cuda.set_device`` would leave every rank of the node on cuda:0. Then
    the process moves to its GPU (with a warning) when ``tensors`` (the model's parameters and
    buffers; only their ``.device`` is read) hold nothing on another GPU, and is refused otherwise.
    """
    if not (config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return torch.device("cuda")         # the first use says why there is none
    rank, local = _local_rank_gpu()
    current = torch.cuda.current_device()
    if local is not None and current != local:
        elsewhere = sorted({t.device.index or 0 for t in tensors
                            if t.device.type == "cuda" and (t.device.index or 0) != local})
        if elsewhere:
            raise ConfigError("device", f"cuda:{current}",
                              f"rank {rank} (LOCAL_RANK={local}) has model tensors on "
                              f"{', '.join(f'cuda:{i}' for i in elsewhere)}, not on its own GPU cuda:{local}: "
                              'call torch.cuda.set_device(int(os.environ["LOCAL_RANK"])) before building '
                              "the model and the process group")
        warnings.warn(f"rank {rank} was on cuda:{current}; the engine made cuda:{local} (its LOCAL_RANK) "
                      'current. Call torch.cuda.set_device(int(os.environ["LOCAL_RANK"])) before building '
                      "the model and the process group to say so yourself", RuntimeWarning, stacklevel=3)
        torch.cuda.set_device(local)
        current = local
    return torch.device("cuda", current)


def _local_rank_gpu() -> tuple[int | None, int | None]:
    """(rank, ``LOCAL_RANK``) when this process is one rank of several in a process group and
    sees a GPU of its local rank's index, else (None, None) (also when ``CUDA_VISIBLE_DEVICES``
    leaves each process one GPU: then cuda:0 is its own)."""
    local = os.environ.get("LOCAL_RANK", "")
    if not local.isdigit() or not (dist.is_available() and dist.is_initialized()
                                   and dist.get_world_size() > 1):
        return None, None
    if torch.cuda.device_count() <= int(local):
        return None, None
    return dist.get_rank(), int(local)


def resolve_budgets(config: OffloadConfig, device: torch.device, local_world: int = 1) -> Budgets:
    """The device, CPU and activation-area budgets in bytes. ``local_world``: processes sharing
    this host's memory (ranks on one node); "auto" host budgets are this process's share of it.

    Available memory is read once, here, before any budget is allocated: every "auto" budget is
    a share of the same figure (read again later, it would already be missing what the engine
    took since)."""
    import psutil

    available = psutil.virtual_memory().available // max(1, local_world)
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
    if config.activation_budget != "auto":
        area = int(config.activation_budget)
    else:
        area = auto_activation_area(available, device_budget, cpu_budget, cpu_compute=device.type == "cpu")
    return Budgets(device_budget, cpu_budget, area)


def auto_activation_area(available: int, device_budget: int, cpu_budget: int, *, cpu_compute: bool) -> int:
    """The "auto" activation area in bytes: ``AUTO_AREA_SHARE`` of the host memory ``available``
    to this process (bytes, measured before anything was allocated) that the CPU budget, and the
    device budget when the compute device is the CPU itself, leave; at least ``AUTO_AREA_MIN``."""
    taken = cpu_budget + (device_budget if cpu_compute else 0)
    return max(int((available - taken) * AUTO_AREA_SHARE), AUTO_AREA_MIN)


def min_device_bytes(chunk_elements: int, elem_bytes: int, largest_elements: int | None = None) -> int:
    """The smallest device budget one training step fits in.

    Backward holds at once: the tied embedding's parameter chunk and its fp32 gradient chunk
    (pinned until the very end), and the current module's parameter and gradient chunks, which
    may straddle two chunks: three of each. An oversized parameter has a chunk of its own
    (``largest_elements``); only one is held beside two bulk chunks.
    """
    largest = max(largest_elements or 0, chunk_elements)
    return (largest + 2 * chunk_elements) * (elem_bytes + 4)


# Data parallel (sliced chunks): what the engine holds on the device beside one process's working
# set, whatever the number of ranks N (offload.distributed.gather / reduce): a window of gathered
# chunks (the 3 a module may use at once, as in one process, and 1 prefetched), and gradient
# chunks whose reduce-scatter is in flight while backward fills the next ones.
GATHERED_CHUNKS = 4
REDUCING_CHUNKS = 2


def min_device_bytes_sharded(chunk_elements: int, elem_bytes: int, largest_elements: int | None,
                             world: int, grad_bytes: int = 4) -> int:
    """``min_device_bytes`` under ``world`` ranks, each holding a 1/world piece of every chunk.

    A chunk in use is all-gathered whole into one buffer, and a complete gradient chunk is
    reduce-scattered whole into this rank's piece, so the device holds whole chunks however many
    ranks there are: ``GATHERED_CHUNKS`` gathered parameter chunks, the 3 gradient chunks one
    process fills at once and ``REDUCING_CHUNKS`` more being reduced (one of each may be the
    oversized chunk), and this rank's pieces in flight — the parameter pieces two gathers read and
    the gradient pieces two reductions write — counted at their largest (half a chunk, at 2
    ranks). That figure does not depend on ``world``. Each whole buffer is also padded to
    ``world`` pieces (< ``world`` elements); for chunks of an even size and
    ``world <= chunk_elements // 16`` the pieces' allowance covers it (pieces shrink faster than
    the padding grows), and beyond that the larger count at ``world`` is returned. One process
    (``world`` 1) gathers and reduces nothing: ``min_device_bytes``. Bytes.
    """
    if world <= 1:
        return min_device_bytes(chunk_elements, elem_bytes, largest_elements)
    largest = max(largest_elements or 0, chunk_elements)
    at_two = _sliced_working_set(chunk_elements, largest, elem_bytes, grad_bytes, pieces_of=2, padded_to=1)
    return max(at_two, _sliced_working_set(chunk_elements, largest, elem_bytes, grad_bytes,
                                           pieces_of=world, padded_to=world))


def _sliced_working_set(chunk: int, largest: int, elem_bytes: int, grad_bytes: int, *, pieces_of: int,
                        padded_to: int) -> int:
    """Bytes the device holds under sliced data parallelism: whole buffers padded to a multiple of
    ``padded_to`` elements, and pieces of 1/``pieces_of`` of a chunk."""
    def whole(n: int) -> int:
        return -(-n // padded_to) * padded_to

    def piece(n: int) -> int:
        return -(-n // pieces_of)
    gathered = (whole(largest) + (GATHERED_CHUNKS - 1) * whole(chunk)) * elem_bytes
    filling = (whole(largest) + 2 * whole(chunk)) * grad_bytes
    reducing = (whole(largest) + (REDUCING_CHUNKS - 1) * whole(chunk)) * grad_bytes
    pieces = (piece(largest) + piece(chunk)) * (elem_bytes + grad_bytes)
    return gathered + filling + reducing + pieces


def min_cpu_bytes(chunk_elements: int, elem_bytes: int) -> int:
    """The smallest CPU budget one chunk's update fits in: its fp32 gradient, master (when the
    compute dtype is not fp32), exp_avg and exp_avg_sq, and its parameters, pinned together
    (``chunk_elements``: the largest trainable chunk)."""
    return chunk_elements * (4 + (4 if elem_bytes < 4 else 0) + 4 + 4 + elem_bytes)
