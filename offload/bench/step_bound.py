"""The arithmetic of ``offload bench step`` (pure, tested): a step's lower bound from what it moved
and the rates measured beside it, the default budgets, and the medians of the engine's own
per-step figures (see ``offload.bench.step`` for what each term means).
"""

from __future__ import annotations

import statistics

from ..units import parse_bytes
from .pcie import pcie_bytes
from .workload import BenchStepError


def step_bound(compute_s: float, nvme_read_bytes: int, nvme_write_bytes: int, read_gbps: float | None,
               write_gbps: float | None, params: int, adam_params_per_s: float, *, h2d_bytes: int = 0,
               d2h_bytes: int = 0, h2d_gbps: float | None = None, d2h_gbps: float | None = None) -> dict:
    """The lower bound of a step and its four terms (seconds)."""
    def io(nbytes, gbps, what):
        if not nbytes:
            return 0.0
        if not gbps:
            raise BenchStepError(f"{nbytes} bytes moved {what} but its bandwidth was not measured")
        return nbytes / (gbps * 1e9)

    nvme_s = io(nvme_read_bytes, read_gbps, "from NVMe") + io(nvme_write_bytes, write_gbps, "to NVMe")
    # Each direction has its own copy engine: the slower direction bounds, not the sum.
    pcie_s = max(io(h2d_bytes, h2d_gbps, "host to device"), io(d2h_bytes, d2h_gbps, "device to host"))
    adam_s = params / adam_params_per_s
    terms = {"compute_s": compute_s, "pcie_s": pcie_s, "nvme_s": nvme_s, "adam_s": adam_s}
    bottleneck = max(terms, key=terms.get)
    return {**terms, "bound_s": terms[bottleneck], "bottleneck": bottleneck.removesuffix("_s")}


def default_budgets(state_bytes: int, cpu_budget=None, device_budget=None) -> tuple[int, int]:
    """CPU budget state/5 and device budget half of it, in whole MiB, unless given."""
    mib = 1 << 20
    cpu = parse_bytes(cpu_budget, "--cpu-budget") if cpu_budget is not None else \
        max(4 * mib, state_bytes // 5 // mib * mib)
    dev = parse_bytes(device_budget, "--device-budget") if device_budget is not None else \
        max(2 * mib, cpu // 2 // mib * mib)
    return cpu, dev


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def breakdown_of(stats: list[dict]) -> dict:
    """Medians over samples of ``model.offload_stats()``: waits, Adam time, prefetch hits, bytes moved
    per direction, and from those the NVMe bytes each way and the PCIe bytes each way."""
    dirs = sorted({d for s in stats for d in s.get("moved_bytes", {})})
    moved = {d: int(_median([s.get("moved_bytes", {}).get(d, 0) for s in stats])) for d in dirs}
    h2d, d2h = pcie_bytes(moved)
    return {
        "wait_s": _median([s.get("wait_s") for s in stats]),
        "optimizer_s": _median([s.get("optimizer_s") for s in stats]),
        "optimizer_wait_s": _median([s.get("optimizer_wait_s") for s in stats]),
        "prefetch_hit_rate": _median([s.get("prefetch_hit_rate") for s in stats]),
        "retraces": max((s.get("retraces") or 0) for s in stats) if stats else 0,
        "moved_bytes": moved,
        "bytes_per_step": sum(moved.values()),
        "nvme_read_bytes": sum(n for d, n in moved.items() if d.startswith("nvme->")),
        "nvme_write_bytes": sum(n for d, n in moved.items() if d.endswith("->nvme")),
        "h2d_bytes": h2d,
        "d2h_bytes": d2h,
    }
