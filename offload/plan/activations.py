"""The planner's activation arithmetic: how many bytes a token's activations take, where one
micro-batch's activations sit, and what that moves.

With activation checkpointing each layer keeps its input (tokens x hidden x e bytes) until its
backward; everything else a layer saves lives only while that layer runs. Kept on the GPU
(``"none"``), those inputs add up to ``layer_inputs`` per token. Parked (``"cpu"``/``"nvme"``,
``offload.activations``), the GPU holds a window of them instead — the layer running and the ones
prefetched for the next backward steps — and the rest wait in the pinned activation area in RAM,
which spills to NVMe what does not fit: once per micro-batch they cross PCIe both ways, and the
spilled part crosses the NVMe bus both ways. The area is the engine's "auto" budget; like the
engine, the planner spills what stays above ``SPILL_WATERMARK`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..activations.parking import SPILL_WATERMARK
from ..models.llama import LlamaConfig
from ..tiers.budgets import auto_activation_area
from ..units import format_size

ACT_WINDOW_LAYERS = 5
"""Layer inputs on the GPU at once when parked: the one in use and ``activation_prefetch`` (4) ahead."""


def activation_bytes_per_token(cfg: LlamaConfig, elem: int, checkpointing: bool) -> dict:
    """Estimated device bytes per token of batch for activations, by part (fused attention assumed).

    layer_inputs: what checkpointing keeps (each layer's input). layer_working: one layer's saved
    tensors (q, k, v, attention out, two norms, residuals ~10 d + 2 kv; gate, up, silu, product
    4 I) and their gradients during its backward (x2); without checkpointing every layer keeps its
    saved tensors. logits: the lm_head output, its fp32 copy for the loss and the fp32 gradient.
    """
    saved = (10 * cfg.hidden_size + 2 * cfg.kv_dim + 4 * cfg.intermediate_size) * elem
    if checkpointing:
        inputs, working = cfg.num_layers * cfg.hidden_size * elem, 2 * saved
    else:
        inputs, working = 0, cfg.num_layers * saved + saved
    return {"layer_inputs": inputs, "layer_working": working, "logits": cfg.vocab_size * (elem + 8)}


@dataclass(frozen=True, slots=True)
class ActivationPlacement:
    """One micro-batch's activations (bytes)."""

    mode: str
    device_per_token: int
    """GPU bytes per token of micro-batch."""
    device_bytes: int
    host_bytes: int
    """Layer inputs parked off the GPU (each crosses PCIe out and back)."""
    area_budget: int
    area_bytes: int
    """Of ``host_bytes``, what stays in the RAM area."""
    spill_bytes: int
    """Of ``host_bytes``, what goes to NVMe and back."""

    def describe(self, micro_batches: int) -> str:
        out = ""
        if micro_batches > 1:
            out += f"; {micro_batches} micro-batches (gradient accumulation)"
        if self.mode != "none":
            out += (f"; {format_size(self.host_bytes)} of layer inputs per micro-batch parked: "
                    f"{format_size(self.area_bytes)} in RAM (area {format_size(self.area_budget)})")
            if self.spill_bytes:
                out += f", {format_size(self.spill_bytes)} on NVMe"
        return out


def area_budget(hw, device_budget: int, cpu_budget: int) -> int:
    """The activation area the engine's "auto" would make (``tiers.budgets.resolve_budgets``, from
    the same share of the RAM available at start: ``hw.cpu_mem``, already one rank's share)."""
    return auto_activation_area(hw.cpu_mem, device_budget, cpu_budget, cpu_compute=hw.gpu_mem is None)


def place_activations(cfg, elem: int, mode: str, micro_tokens: int, per_token: dict,
                      area: int) -> ActivationPlacement:
    """Where ``micro_tokens`` tokens' activations sit under ``mode`` ("none", "cpu", "nvme");
    ``per_token``: ``activation_bytes_per_token``."""
    if mode == "none":
        dev = sum(per_token.values())
        return ActivationPlacement(mode, dev, dev * micro_tokens, 0, area, 0, 0)
    window = min(ACT_WINDOW_LAYERS, cfg.num_layers) * cfg.hidden_size * elem
    dev = per_token["layer_working"] + per_token["logits"] + window
    host = per_token["layer_inputs"] * micro_tokens
    if mode == "cpu":
        kept, spilled = host, 0
    else:
        kept = host if host <= area * SPILL_WATERMARK else int(area * SPILL_WATERMARK)
        spilled = host - kept
    return ActivationPlacement(mode, dev, dev * micro_tokens, host, area, kept, spilled)


def activation_problems(placed: ActivationPlacement, mode: str, gpu: bool, nvme_tier: bool) -> list[str]:
    """Why activations cannot be placed as ``mode`` says on this box ([] when they can)."""
    if mode == "none":
        return []
    if not gpu:
        return [f"activation offload '{mode}' moves activations off a GPU; this box computes in RAM"]
    if mode == "nvme" and not nvme_tier:
        return ["activation offload 'nvme' spills to the NVMe tier, and there is none (give --nvme-path)"]
    if mode == "cpu" and placed.host_bytes > placed.area_budget:
        return [f"the activation area ({format_size(placed.area_budget)}, half the RAM beside the CPU budget) "
                f"holds less than the {format_size(placed.host_bytes)} of layer inputs per micro-batch: "
                "spill to NVMe or use more micro-batches"]
    return []
