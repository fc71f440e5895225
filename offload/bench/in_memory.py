"""The "everything fits in memory" side of ``offload bench step``: the same model wrapped with
budgets above its state and no NVMe tier, against the mixed-precision update a PyTorch user
would write (bf16 model, fp32 masters, ``torch.optim.AdamW``, copy back), steps alternating.
"""

from __future__ import annotations

import statistics
import time

from ..config import OffloadConfig
from .workload import STEPS_PER_SAMPLE, build_model, offload_steps, sync


class TorchMixedAdam:
    """What a PyTorch user writes for offload's update: fp32 masters, AdamW, copy back to bf16."""

    def __init__(self, model, lr: float):
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        try:
            self.opt = torch.optim.AdamW(self.masters, lr=lr, fused=True)
            self.kind = "fused"
            for m in self.masters:
                m.grad = torch.zeros_like(m)
            self.opt.step()   # builds without the fused CPU kernel fail here
        except (RuntimeError, NotImplementedError):
            self.opt = torch.optim.AdamW(self.masters, lr=lr, foreach=True)
            self.kind = "foreach"
        self.opt.state.clear()

    def step(self) -> None:
        import torch

        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None
            else:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                m.grad.copy_(p.grad)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def zero_grad(self, model) -> None:
        model.zero_grad(set_to_none=True)


def torch_step(model, opt: TorchMixedAdam, ids, device: str) -> float:
    """Seconds of one plain PyTorch step: forward, backward, ``opt``'s update."""
    sync(device)
    t0 = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(model)
    sync(device)
    return time.perf_counter() - t0


def compare_in_memory(preset: str, device: str, ids, state_bytes: int, steps: int, warmup: int,
                      lr: float) -> tuple[dict, dict]:
    """(summary, detail): offload with everything in memory against ``TorchMixedAdam``, ``steps``
    samples each after ``warmup`` steps, alternating who goes first; ``ratio`` = torch's step time
    over offload's (offload's relative throughput)."""
    import offload

    big = 2 * state_bytes + (256 << 20)
    ours, _ = build_model(preset, device)
    ours = ours.cpu() if device == "cuda" else ours
    ours = offload.wrap(ours, OffloadConfig(device=device, dtype="bf16", device_budget=big,
                                            cpu_budget=big, nvme_paths=None))
    try:
        ours_opt = offload.AdamW(ours.parameters(), lr=lr)
        theirs, _ = build_model(preset, device)
        theirs_opt = TorchMixedAdam(theirs, lr)
        for _ in range(warmup):
            offload_steps(ours, ours_opt, ids, device, 1)
            torch_step(theirs, theirs_opt, ids, device)
        t_ours, t_torch = [], []

        def torch_sample():
            return sum(torch_step(theirs, theirs_opt, ids, device) for _ in range(STEPS_PER_SAMPLE)) / STEPS_PER_SAMPLE

        for i in range(steps):   # alternate, and alternate who goes first (drift hits both)
            if i % 2 == 0:
                t_ours.append(offload_steps(ours, ours_opt, ids, device))
                t_torch.append(torch_sample())
            else:
                t_torch.append(torch_sample())
                t_ours.append(offload_steps(ours, ours_opt, ids, device))
        moved = ours.offload_stats().get("moved_bytes", {})
    finally:
        ours.offload_engine.close()
    offload_s, torch_s = statistics.median(t_ours), statistics.median(t_torch)
    summary = {"offload_step_s": offload_s, "torch_step_s": torch_s, "ratio": torch_s / offload_s}
    detail = {"torch_optimizer": f"torch.optim.AdamW({theirs_opt.kind}) on fp32 masters, copied back to bf16",
              "offload_moved_bytes": moved, "offload_times_s": [round(t, 4) for t in t_ours],
              "torch_times_s": [round(t, 4) for t in t_torch]}
    return summary, detail
