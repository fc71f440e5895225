"""One plan: where a model's state goes on a box, what moves per step, and how long a step takes.

``plan`` runs the parts in order — the model's chunks (``model``), where its activations sit
(``activations``), where its state sits and whether it fits (``memory``), what a step moves and
how long it takes (``step_time``) — and gathers them in a ``Plan``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Union

from ..errors import ConfigError
from ..models.llama import LlamaConfig, layer_param_count
from .activations import activation_bytes_per_token, area_budget, place_activations
from .inputs import DTYPE_BYTES, Hardware, Policy, rank_share
from .memory import auto_budgets, fit_problems, max_batch_tokens, place_state, verdict
from .model import param_layout, rank_chunks, resolve_model
from .precision import state_per_elem
from .step_time import step_time, traffic


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the planner predicts. Bytes, seconds, tokens; see ``to_json_dict`` for the schema."""

    model: str
    params: int
    tiers: dict
    """{"device"|"cpu"|"nvme": {"bytes": total, <kind>: bytes, ...}}"""
    nvme_bytes_needed: int
    bytes_per_step: dict
    """{"nvme_read", "nvme_write", "pcie_h2d", "pcie_d2h"}: bytes per optimizer step (PCIe 0 without a GPU)."""
    step_terms_s: dict
    """{"compute", "pcie", "nvme", "adam", "interconnect"}: seconds each would take alone (the
    interconnect's 0 for one process)."""
    predicted_step_s: float
    bottleneck: str
    fits: bool
    reason: str
    gpu_bound_batch_tokens: int | None
    """Batch (tokens/step) from which compute is the bottleneck; None if it already is."""
    max_batch_tokens: int | None
    """Largest batch whose activations fit beside the budgets (GPU memory, or RAM without a GPU)."""
    breakdown: dict = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)
    policy: dict = field(default_factory=dict)

    def to_json_dict(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "model", "params", "tiers", "nvme_bytes_needed", "bytes_per_step", "predicted_step_s",
            "bottleneck", "fits", "reason", "step_terms_s", "gpu_bound_batch_tokens",
            "max_batch_tokens", "breakdown", "hardware", "policy")}
        return _plain(out)


def _plain(value):
    """Deep-copy into JSON-ready dicts, lists, ints, floats, strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def plan(model: Union[str, LlamaConfig], hardware: Hardware, policy: Policy = Policy(), *,
         name: str | None = None, params: list[tuple[int, bool]] | None = None) -> Plan:
    """Place ``model``'s state on ``hardware`` under ``policy`` and predict one step.

    ``params``: ``[(elements, trainable)]`` per parameter in ``named_parameters()`` order, when
    the model is not ``LlamaForCausalLM(cfg)`` (a Hugging Face model; ``cfg`` then only shapes the
    activation and FLOP estimates) or some parameters are frozen (LoRA). Frozen parameters are
    packed in chunks of their own and cost only those parameter chunks: no gradient, master or
    moment chunks, no Adam, no NVMe slots beyond their parameters'."""
    label, cfg = resolve_model(model)
    label = name or label
    po = policy
    world = po.world
    hw = rank_share(hardware, po.local_world)       # this rank's share of the box
    if params:
        numels, trainable = [k for k, _ in params], [t for _, t in params]
    else:
        numels, trainable = param_layout(cfg, po.lora_rank, po.lora_targets)
    n = sum(numels)
    n_trained = sum(k for k, t in zip(numels, trainable) if t)
    e = DTYPE_BYTES[po.dtype]
    k = po.micro_batches
    rank_tokens = po.batch_tokens // world           # this rank's part of every step
    micro = -(-rank_tokens // k)                     # tokens per forward/backward pass
    seq = po.seq_len or min(cfg.max_seq_len, micro)
    if seq > micro:
        raise ConfigError("seq_len", seq, f"is longer than batch_tokens={po.batch_tokens}" if k == 1 and world == 1
                          else f"is longer than a micro-batch ({po.batch_tokens} tokens / {world} ranks / {k})")
    gpu = hw.gpu_mem is not None
    device_budget, cpu_budget = auto_budgets(hw, po.device_budget, po.cpu_budget)

    chunks = rank_chunks(cfg, (numels, trainable), device_budget, cpu_budget, po.chunk_size, world)
    layer_params = layer_param_count(cfg) if not params else max(1, (n - max(numels)) // max(cfg.num_layers, 1))
    act_per_tok = activation_bytes_per_token(cfg, e, po.activation_checkpointing)
    placed = place_activations(cfg, e, po.activation_offload, micro, act_per_tok,
                               area_budget(hw, device_budget, cpu_budget))
    per_elem = state_per_elem(po.dtype, e, po.optimizer_state, po.master)
    mem = place_state(chunks, placed, per_elem=per_elem, layer_params=layer_params, world=world,
                      device_budget=device_budget, cpu_budget=cpu_budget, hold_grads=po.defer_step or k > 1,
                      nvme_tier=hw.nvme_capacity > 0, staged=gpu and hw.nvme_capacity > 0)
    moved = traffic(mem, chunks, placed, micro_batches=k, world=world, gpu=gpu)
    timing = step_time(cfg, hw, po, moved, chunks, params=n, trained_params=n_trained, seq=seq,
                     rank_tokens=rank_tokens)
    max_batch = max_batch_tokens(hw, placed, device_budget, cpu_budget, world=world, micro_batches=k, seq=seq)
    problems = fit_problems(hw, po, mem, chunks, placed, device_budget=device_budget, cpu_budget=cpu_budget,
                            max_batch=max_batch, micro_tokens=micro, rank_tokens=rank_tokens)
    reason = verdict(hw, po, mem, placed, problems, device_budget=device_budget, cpu_budget=cpu_budget)

    chunk, sizes, chunk_trainable = chunks.chunk_size, chunks.sizes, chunks.trainable
    num_chunks = len(sizes)
    breakdown = {
        "seq_len": seq, "dtype_bytes": e, "device_budget": device_budget, "cpu_budget": cpu_budget,
        "chunk_size": chunk, "num_chunks": num_chunks, "padding_elements": chunks.all_elems - n,
        "trainable_params": n_trained, "trainable_chunks": sum(chunk_trainable),
        "largest_chunk": chunks.largest, "oversized_chunks": sum(size > chunk for size in sizes),
        "device_min_bytes": mem.device_min, "cpu_min_bytes": mem.cpu_min, "cpu_transit_bytes": mem.cpu_transit,
        "params_resident_on_device": mem.resident, "layer_params": layer_params,
        "state_bytes": mem.state_bytes, "state_bytes_per_param": sum(mem.per_elem.values()),
        "optimizer_state": po.optimizer_state, "master": po.master, "bytes_per_elem": dict(mem.per_elem),
        "frozen_chunks": num_chunks - sum(chunk_trainable),
        "state_by_kind": mem.total, "activations": {part: v * micro for part, v in act_per_tok.items()},
        "device_cpu_copy_bytes": moved.device_cpu_copy,
        "optimizer_nvme_bytes": moved.optimizer_nvme,
        "train_flops_per_token": timing.flops_per_token, "compute_s_per_token": timing.compute_s_per_token,
        "serial_step_s": sum(timing.terms.values()),
        "compute_and_adam_share_cores": not gpu,
        "optimizer_overlaps_backward": not po.defer_step,
        "micro_batches": k, "micro_batch_tokens": micro,
        "activation_offload": po.activation_offload, "activation_placement": dataclasses.asdict(placed),
        "world": world, "local_world": po.local_world, "rank_tokens": rank_tokens,
        "rank_elements": chunks.elems, "collective_bytes": moved.collective, "adam_params": timing.adam_params,
        "rank_hardware": dataclasses.asdict(hw),
    }
    return Plan(model=label, params=n, tiers=mem.tiers, nvme_bytes_needed=mem.nvme_needed,
                bytes_per_step=moved.bytes_per_step, step_terms_s=timing.terms, predicted_step_s=timing.predicted,
                bottleneck=timing.bottleneck, fits=not problems, reason=reason,
                gpu_bound_batch_tokens=timing.gpu_bound_tokens, max_batch_tokens=int(max_batch),
                breakdown=breakdown, hardware=dataclasses.asdict(hardware), policy=dataclasses.asdict(po))
