"""Choosing how to reach a token count per step: activations on the GPU, parked activations, gradient
accumulation, or a mix; the fastest plan that fits wins.

Each way is a ``Policy`` for ``plan``: ``activation_offload`` in "none"/"cpu"/"nvme" times
``micro_batches`` from 1 up to one sequence per micro-batch. When the policy leaves the device
budget to the engine ("auto") and the activations do not fit beside it, the candidate is also
tried with the device budget cut to what the activations leave of the GPU (not below the engine's
minimum): fewer parameters stay on the GPU and more cross PCIe, which is often the cheaper price.
Plans within ``TIE`` of the fastest count as equal, and the one with the fewest moving parts
(fewer micro-batches, activations kept, no spill, the auto budget) is taken.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from .inputs import Hardware, Policy
from .memory import GPU_WORKSPACE
from .model import resolve_model
from .planner import Plan, plan

TIE = 0.01
MAX_MICRO_BATCHES = 64
FAMILIES = (("gpu", "activations on the GPU"), ("offload", "offloaded activations"),
            ("accumulate", "gradient accumulation"), ("mix", "offloaded activations + accumulation"))


@dataclass(frozen=True)
class Choice:
    """The chosen plan (None when nothing fits), the plan of the policy as given, and per family
    of ways (``FAMILIES``) its best candidate."""

    best: Plan | None
    given: Plan
    families: dict = field(default_factory=dict)
    """{family: Plan} (the fastest fitting one, else the simplest refused one)."""
    candidates: int = 0


def family_of(p: Plan) -> str:
    """The family of ways (``FAMILIES``) that ``p``'s policy belongs to."""
    k, mode = p.policy["micro_batches"], p.policy["activation_offload"]
    return ("gpu" if mode == "none" else "offload") if k == 1 else ("accumulate" if mode == "none" else "mix")


def _complexity(p: Plan) -> tuple:
    po = p.policy
    return (po["micro_batches"], ("none", "cpu", "nvme").index(po["activation_offload"]),
            po["device_budget"] is not None)


def choose(model, hardware: Hardware, policy: Policy = Policy(), *, modes: Sequence[str] | None = None,
           micro_batches: Sequence[int] | None = None, name: str | None = None,
           params: list[tuple[int, bool]] | None = None) -> Choice:
    """Plan every way allowed (``modes``, ``micro_batches``: None for all) and pick the fastest fit."""
    _, cfg = resolve_model(model)
    gpu = hardware.gpu_mem is not None
    if modes is None:
        modes = ["none"]
        if gpu and policy.activation_checkpointing:
            modes += ["cpu"] + (["nvme"] if hardware.nvme_capacity > 0 else [])
    if micro_batches is None:
        seq = policy.seq_len or min(cfg.max_seq_len, policy.batch_tokens)
        rows = policy.batch_tokens // policy.world // seq          # one rank's sequences of a step
        micro_batches = range(1, max(1, min(rows, MAX_MICRO_BATCHES)) + 1)
    given = plan(model, hardware, policy, name=name, params=params)
    plans = []
    for k in micro_batches:
        for mode in modes:
            p = plan(model, hardware, dataclasses.replace(policy, micro_batches=k, activation_offload=mode),
                     name=name, params=params)
            plans.append(p)
            if not p.fits and gpu and policy.device_budget is None:
                smaller = _budget_for_activations(p, hardware)
                if smaller is not None:
                    plans.append(plan(model, hardware, dataclasses.replace(
                        policy, micro_batches=k, activation_offload=mode, device_budget=smaller),
                        name=name, params=params))
    fitting = [p for p in plans if p.fits]
    best = None
    if fitting:
        fastest = min(p.predicted_step_s for p in fitting)
        best = min((p for p in fitting if p.predicted_step_s <= fastest * (1 + TIE)), key=_complexity)
    families = {}
    for fam, _ in FAMILIES:
        mine = [p for p in plans if family_of(p) == fam]
        if not mine:
            continue
        fits = [p for p in mine if p.fits]
        families[fam] = (min(fits, key=lambda p: (p.predicted_step_s, _complexity(p))) if fits
                         else min(mine, key=_complexity))
    return Choice(best, given, families, len(plans))


def _budget_for_activations(p: Plan, hw: Hardware) -> int | None:
    """The device budget that leaves the GPU room for ``p``'s activations, if the engine can run
    with it (at least its minimum, and smaller than what ``p`` had)."""
    b = p.breakdown
    act = p.tiers["device"]["activations"]
    budget = int(hw.gpu_mem - GPU_WORKSPACE - act)
    if budget < b["device_min_bytes"] or budget >= b["device_budget"]:
        return None
    return budget


def choice_json(c: Choice) -> dict:
    """The choice as ``offload plan --json`` writes it under "ways"."""
    return {"chosen": None if c.best is None else {"family": family_of(c.best), **_way(c.best)},
            "ways": {fam: _way(p) for fam, p in c.families.items()}, "candidates": c.candidates}


def _way(p: Plan) -> dict:
    return {"micro_batches": p.policy["micro_batches"], "activation_offload": p.policy["activation_offload"],
            "device_budget": p.breakdown["device_budget"], "fits": p.fits,
            "predicted_step_s": p.predicted_step_s, "bottleneck": p.bottleneck,
            "reason": p.reason}
