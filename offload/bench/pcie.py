"""Host↔device copy bandwidth, each direction, from host memory pinned the way the engine pins its
CPU tier (one mmap'd region registered with ``cudaHostRegister``).

Copies each way run on their own engine on every current GPU, so a step's PCIe time is the larger
of the two directions, not their sum."""

from __future__ import annotations

from .common import seconds_per_call

PROBE_BYTES = 256 << 20


def measure(nbytes: int = PROBE_BYTES) -> dict:
    """``{"h2d_gbps", "d2h_gbps"}`` for copies of ``nbytes`` (needs CUDA)."""
    import torch

    from ..aio import aligned_empty

    host = aligned_empty(nbytes, torch.uint8, pin=True, populate=True)
    dev = torch.empty_like(host, device="cuda")
    sync = torch.cuda.synchronize
    h2d = seconds_per_call(lambda: dev.copy_(host, non_blocking=True), sync=sync)
    d2h = seconds_per_call(lambda: host.copy_(dev, non_blocking=True), sync=sync)
    return {"h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9}


def pcie_bytes(moved: dict[str, int]) -> tuple[int, int]:
    """(host→device, device→host) bytes of a step's ``moved_bytes`` (keys "src->dst" over the
    tiers "device", "cpu", "nvme")."""
    h2d = d2h = 0
    for direction, n in moved.items():
        src, _, dst = direction.partition("->")
        if dst == "device" and src != "device":
            h2d += n
        elif src == "device" and dst != "device":
            d2h += n
    return h2d, d2h
