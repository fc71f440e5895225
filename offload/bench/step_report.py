"""The human report of ``offload bench step`` (one process; ``--nproc N`` prints through
``offload.bench.distributed_report``): one line per figure of ``offload.bench.step.measure``'s dict."""

from __future__ import annotations

from .workload import STEPS_PER_SAMPLE


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def print_report(r: dict) -> None:
    """The human lines of ``measure``'s report ``r``."""
    b = r["breakdown"]
    run = b["run"]
    print(f"offload bench step: {run['preset']} ({r['params'] / 1e6:.1f}M params, state {r['state_bytes'] / 1e6:.0f} MB) "
          f"on {r['device']}, CPU budget {r['cpu_budget'] / 1e6:.0f} MB "
          f"({r['state_bytes'] / r['cpu_budget']:.1f}x smaller), {run['batch_tokens']} tokens/step")
    print(f"step        {_seconds(r['step_s'])}  (median of {run['steps']} samples of {STEPS_PER_SAMPLE} steps)")
    pcie = f"PCIe {_seconds(b['pcie_s'])}, " if b.get("pcie_h2d_gbps") else ""
    print(f"bound       {_seconds(r['bound_s'])}  = max(compute {_seconds(b['compute_s'])}, {pcie}NVMe {_seconds(b['nvme_s'])}, "
          f"Adam {_seconds(b['adam_s'])}); bottleneck: {b['bottleneck']}")
    print(f"step/bound  {r['bound_ratio']:.2f}  (target <= 1.2)")
    hits = "-" if b["prefetch_hit_rate"] is None else f"{100 * b['prefetch_hit_rate']:.0f}%"
    print(f"breakdown   waiting for chunks {_seconds(b['wait_s'])}, Adam {_seconds(b['optimizer_s'])}, "
          f"waiting for Adam {_seconds(b['optimizer_wait_s'])}, prefetch hits {hits}")
    moved = ", ".join(f"{d} {n / 1e6:.0f} MB" for d, n in b["moved_bytes"].items())
    print(f"moved/step  {b['bytes_per_step'] / 1e6:.0f} MB ({moved})")
    if b.get("nvme_replay_s"):
        print(f"replay      {_seconds(b['nvme_replay_s'])}  the step's NVMe requests replayed alone "
              f"({b['nvme_replay_gbps']:.2f} GB/s): step/replay {r['step_s'] / b['nvme_replay_s']:.2f}, "
              f"replay/bound {b['nvme_replay_s'] / r['bound_s']:.2f}")
    print(f"measured    NVMe read {b['nvme_read_gbps']} GB/s, write {b['nvme_write_gbps']} GB/s "
          f"({b['nvme_backend']}); Adam roofline {b['adam_roofline_params_per_s'] / 1e9:.2f} G params/s")
    if b.get("pcie_h2d_gbps"):
        print(f"PCIe        H2D {b['pcie_h2d_gbps']} GB/s, D2H {b['pcie_d2h_gbps']} GB/s; this step moved "
              f"{b['h2d_bytes'] / 1e6:.0f} MB up, {b['d2h_bytes'] / 1e6:.0f} MB down")
    m = r["in_memory"]
    if m:
        print(f"in memory   offload {_seconds(m['offload_step_s'])}, torch {_seconds(m['torch_step_s'])}: "
              f"{m['ratio']:.2f}x torch's throughput (target >= 0.9; {b['in_memory']['torch_optimizer']})")
    for point in r.get("batch_curve") or ():
        print(f"curve       {point['batch_tokens']:>6} tokens/step: offload {_seconds(point['offload_step_s'])}, "
              f"torch {_seconds(point['torch_step_s'])}: {point['ratio']:.2f}x")
    for note in run["notes"]:
        print(f"note: {note}")
