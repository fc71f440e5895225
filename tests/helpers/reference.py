"""The plain-PyTorch runs the engine is compared with: TinyGPT + ``torch.optim.AdamW`` on the
same batches, in fp32 and in float64 (the exact run that tests/helpers/trajectory.py judges by).

``small_config`` is the engine's side of the comparison: budgets far below TinyGPT's state, so
every chunk passes through every tier (the device and CPU budgets are one host-memory tier by
default, plus NVMe in ``path``).
"""

from __future__ import annotations

import copy

import torch

import offload

from .tiny_gpt import TinyGPT, batches
from .trajectory import assert_losses_within_drift, assert_within_drift, float64_twin

LR, WD = 1e-2, 0.1


def small_config(path, **kw) -> offload.OffloadConfig:
    base = dict(device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
                nvme_paths=[str(path)], chunk_size=8192)
    base.update(kw)
    return offload.OffloadConfig(**base)


def make_models(checkpointing=True, seed=0):
    """Two TinyGPTs with the same initial values: the reference and the one to wrap."""
    torch.manual_seed(seed)
    ref = TinyGPT(checkpointing=checkpointing)
    return ref, copy.deepcopy(ref)


def run_reference(ref, steps, *, accumulate=1, clip=None, skip=(), batch=4, vocab=64) -> list[float]:
    """Train ``ref`` with torch's AdamW (steps in ``skip`` are skipped, as an fp16 overflow
    skips them) on ``batches`` of ``vocab`` tokens; each step's loss, summed over its
    ``accumulate`` micro-batches. Frozen parameters (no gradient) are left alone by AdamW."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    losses = []
    data = iter(batches(steps * accumulate, batch=batch, vocab=vocab))
    for step in range(steps):
        total = 0.0
        for _ in range(accumulate):
            x, y = next(data)
            loss = ref(x, y) / accumulate
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        if step not in skip:
            opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


class Reference:
    """Plain PyTorch's fp32 run of a model and the same run in float64 (the exact one)."""

    def __init__(self, ref, steps, **kw):
        exact = float64_twin(ref)
        self.fp32, self.losses = ref, run_reference(ref, steps, **kw)
        self.exact, self.exact_losses = exact, run_reference(exact, steps, **kw)

    def check(self, model, losses) -> None:
        """``model`` (trained, with per-step ``losses``) is as close to the exact run as plain PyTorch's."""
        assert_losses_within_drift(losses, self.losses, self.exact_losses)
        assert_within_drift(model.state_dict(), self.fp32.state_dict(), self.exact.state_dict())


def mean_losses(out: list[dict]) -> list[float]:
    """Per step, the mean of the ranks' losses (``out``: each rank's result, with ``losses``):
    the loss of the global batch when every rank's slice is the same size."""
    return [sum(o["losses"][i] for o in out) / len(out) for i in range(len(out[0]["losses"]))]
