"""How far a correct fp32 training run may drift from another: measured from the arithmetic, not guessed.

Two correct fp32 implementations of one training run (torch's kernels on one CPU and on another;
``torch.optim.AdamW`` and our CPU Adam) differ by rounding at every step. Adam's normalised update
``m / sqrt(v)`` then turns a rounding-level difference in a gradient that is itself at rounding
level into a weight difference of up to ``lr``, and the next forward spreads it. How much of that
happens depends on the model, the data and the CPU's kernels, so no fixed ``atol`` holds on every
machine (a LoRA weight 3.3e-6 away on a Zen 4 against 1e-6 written on a Xeon).

What does not depend on the machine is the question: is this run as close to the exact trajectory
as a correct fp32 run is? The same run in float64 stands for the exact trajectory (its own
rounding is 2^-29 of fp32's), and the plain-PyTorch fp32 reference's distance from it, measured in
the same test on the same CPU, is how far rounding alone carries a correct run. The run under test
must stay within ``FACTOR`` times that distance, per tensor, plus ``ULPS`` units in the last place
of the tensor's largest value (a floor for tensors the reference happens to track almost exactly).
A real fault — a missed or doubled update, a stale chunk, a wrong moment — moves weights by about
``lr`` per step, orders of magnitude beyond the bound.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

# A correct run's distance from the exact trajectory, in units of the fp32 reference's. Both are fp32
# runs whose roundings differ, so the distances are of one size, but which elements rounding
# happens to tip is chance and the divergence compounds: over 16 seeds of the LoRA and TinyGPT
# equivalence runs (Xeon, AVX-512) the largest per-tensor ratio was 5.3, and in a quarter of
# tensors above 2. A fault moves weights by ~lr (1e-2 here) against drifts of ~1e-6: 16 leaves
# 3x headroom over chance and still three orders of magnitude below a fault (test_trajectory).
FACTOR = 16.0
ULPS = 8
EPS32 = torch.finfo(torch.float32).eps


def float64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model`` (before training): trained on the same data it is the exact run."""
    return copy.deepcopy(model).double()


@dataclass(frozen=True)
class Drift:
    """One tensor's distances from the exact (float64) value, as absolute maxima."""

    name: str
    error: float        # the run under test
    reference: float    # the plain fp32 reference
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    def __str__(self) -> str:
        return (f"{self.name}: {self.error:.3g} from the float64 run, bound {self.bound:.3g} "
                f"({FACTOR:g} x the fp32 reference's {self.reference:.3g} + {ULPS} ulps)")


def drift(name: str, got: torch.Tensor, ref32: torch.Tensor, exact: torch.Tensor) -> Drift:
    exact = exact.detach().double()
    reference = (ref32.detach().double() - exact).abs().max().item() if exact.numel() else 0.0
    error = (got.detach().double() - exact).abs().max().item() if exact.numel() else 0.0
    scale = exact.abs().max().item() if exact.numel() else 0.0
    return Drift(name, error, reference, FACTOR * reference + ULPS * EPS32 * scale)


def assert_within_drift(got: dict, ref32: dict, exact: dict) -> list[Drift]:
    """Every tensor of state dict ``got`` is as close to ``exact`` (the float64 run's state dict)
    as a correct fp32 run is (``ref32``: plain PyTorch's). Returns the drifts (for reports)."""
    missing = set(exact) - set(got)
    if missing:
        raise AssertionError(f"state dict lacks {sorted(missing)}")
    drifts = [drift(name, got[name], ref32[name], want) for name, want in exact.items()]
    bad = [d for d in drifts if not d.ok]
    if bad:
        raise AssertionError("drifted further from the exact run than rounding explains:\n  "
                             + "\n  ".join(map(str, bad)))
    return drifts


def assert_losses_within_drift(got, ref32, exact) -> None:
    """Per-step losses: the same rule, over the whole curve as one tensor."""
    d = drift("loss", torch.tensor(got, dtype=torch.float64), torch.tensor(ref32, dtype=torch.float64),
              torch.tensor(exact, dtype=torch.float64))
    if not d.ok:
        raise AssertionError(f"losses drifted further from the exact run than rounding explains: {d}")


def train_in_lockstep(runs, batches, loss_of) -> list[list[float]]:
    """Train each ``(model, optimizer)`` of ``runs`` on the same ``batches`` (``loss_of(model, batch)``
    gives the loss), one step each in turn; returns each run's per-step losses."""
    losses = [[] for _ in runs]
    for batch in batches:
        for (model, opt), out in zip(runs, losses):
            loss = loss_of(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
    return losses


def assert_run_within_drift(got, ref32, exact) -> None:
    """``got``, ``ref32``, ``exact``: ``(model, losses)`` of the run under test, plain PyTorch's fp32
    run and the float64 run; the frozen tensors' equality is the caller's to check."""
    assert_losses_within_drift(got[1], ref32[1], exact[1])
    assert_within_drift(got[0].state_dict(), ref32[0].state_dict(), exact[0].state_dict())
