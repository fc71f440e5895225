"""The planner: where a model's state goes on a box, what moves per step, and how long a step takes.

Pure arithmetic over figures someone measured or stated (``offload/plan/cli.py`` gathers them);
nothing here measures, allocates or touches a device. It models what ``OffloadEngine`` does:

Units: bytes, seconds, parameters (elements); bandwidths in GB/s and compute in TFLOPS, both
decimal (1 GB/s = 1e9 bytes/s).

* Chunks. Every kind of state is stored in chunks of one geometry (``offload.chunks.layout``):
  the chunk size is the engine's "auto" choice, at most min(32 Mi elements, device_budget / 32 B,
  cpu_budget / 48 B); a parameter larger than that (embedding, lm_head, a large matrix) gets a
  chunk of its own size, and padding counts. Kinds, bytes per
  element: compute parameters ``e`` (2 for bf16/fp16, 4 for fp32), fp32 gradients 4, fp32 master 4
  (none for fp32 compute: the parameter is the master), ``exp_avg`` 4, ``exp_avg_sq`` 4 —
  18 B/param for bf16, 16 for fp32.
* Budgets are chunk storage only. ``device_budget``: parameter chunks and the fp32 gradient chunks
  being filled on the compute device; activations, autograd temporaries and the CUDA context are
  outside it (torch's allocator), so a GPU needs device_budget + activations + workspace, and a
  CPU-only box (whose "device" is a region of RAM) device_budget + cpu_budget + activations of
  RAM. ``cpu_budget``: chunks of every kind in RAM; NVMe I/O goes straight into them (no staging).
  Not given: the engine's "auto" (``offload.tiers.budgets``): GPU 50% of its (free) memory, a
  CPU-only device 25% of available RAM; CPU 50% of the RAM the device did not take.
* Minimums: the engine's own (``tiers.budgets.min_device_bytes`` / ``min_cpu_bytes``): the device
  holds the largest chunk and 2 bulk chunks, parameters and fp32 gradients, at once (the tied
  embedding's and a module's that may straddle two), the CPU one chunk of each kind for the
  optimizer (18 B x the largest chunk in bf16).
* Placement: the device keeps as many parameter chunks as fit beside a layer's gradient chunks
  (all of them: "resident"); the CPU keeps, beyond two chunk sets of working room (the chunk Adam
  updates and the next one's prefetch), parameters first (read every step), then master,
  ``exp_avg``, ``exp_avg_sq`` (and whole gradients when the step is deferred). With NVMe paths
  every chunk of every kind has a slot reserved up front: NVMe space needed = all chunks.
* Traffic per step: parameter chunks go CPU->device for the forward (the update rewrote them on the
  CPU, so even resident ones are fetched once) and again for the backward, less what the device
  kept; those not in the CPU tier come from NVMe first (and are written back after the update);
  fp32 gradients device->CPU once; each chunk's optimizer state that lives on NVMe is read once and
  written once. Without a GPU the device<->CPU copies are memcpy within RAM: counted in
  ``breakdown["device_cpu_copy_bytes"]``, not timed (PCIe terms are 0).
* Step time. GPU: ``max(compute, PCIe, NVMe, Adam)`` when the optimizer overlaps backward; with a
  deferred step (clipping, fp16) the optimizer's part — max(Adam, its NVMe traffic) — comes after
  the backward and adds. PCIe is full duplex: max(H2D, D2H) / GB/s. NVMe is not: reads and writes
  share the drives, read/read_GBps + write/write_GBps. Without a GPU, compute, Adam and the disk
  path add up: the same cores run the layers, Adam and the I/O copies, and the chunk store waits on
  I/O holding its lock, which stalls the compute thread's next fetch (measured: NVMe traffic adds
  its time to a CPU-only step rather than hiding under it). Compute is the training FLOPs at the
  measured rate, x 4/3 with activation checkpointing (each layer's forward runs again in backward).
* Data parallelism (``Policy.world`` ranks, ``local_world`` of them on this box; ZeRO-3 as
  ``offload.distributed`` does it). The plan is one rank's: the chunk layout is the whole model's
  (it does not depend on the world size), the rank owns every world-th chunk — their parameters,
  gradients after the reduce-scatter, master, moments, NVMe slots and Adam work — and computes on
  batch_tokens / world tokens per step; the device still sees every parameter (all-gathered
  before use). The ranks on one box share its RAM, NVMe drives (space and bandwidth) and CPU
  cores evenly (``rank_share``); each has a GPU of its own. Parameters cross PCIe only for the
  owned chunks; the collectives' bytes are reported (``breakdown["collective_bytes"]``), not timed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Union

from ..chunks.layout import CHUNK_QUANTUM, PARAM_ALIGN, auto_max_chunk, pack, search_chunk_size
from ..errors import ConfigError
from ..models.llama import LlamaConfig, flops_per_token, get_preset, layer_param_count
from ..tiers.budgets import (AUTO_CPU_SHARE, AUTO_DEVICE_SHARE_CPU, AUTO_DEVICE_SHARE_CUDA, min_cpu_bytes,
                           min_device_bytes_sharded)
from ..units import format_size
from .activations import activation_problems, area_budget, place_activations

GB = 1e9
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ACTIVATION_PLACES = ("none", "cpu", "nvme")
STATE_KINDS = ("params", "master", "exp_avg", "exp_avg_sq", "grads")
"""The CPU tier's priority order (gradients only stay there whole when the step is deferred)."""

CPU_WORKING_SETS = 2
"""Chunk sets (one chunk of every kind) the CPU tier keeps free for Adam: the chunk being updated
and the next one being prefetched."""
GPU_WORKSPACE = 1 << 30
"""GPU memory outside the budget and the activations: CUDA context, cuBLAS workspace, allocator slack."""


def _positive(obj, name: str, allow_zero: bool = False, optional: bool = False) -> None:
    value = getattr(obj, name)
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(name, value, "expected a number >= 0" if allow_zero else "expected a number > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """The box: measured on this machine, or stated for one you are not on."""

    gpu_mem: int | None
    """Bytes of GPU memory, or None for a CPU-only box (the CPU is then the compute device)."""
    cpu_mem: int
    """Bytes of RAM the run may use."""
    nvme_capacity: int = 0
    """Free bytes on the NVMe paths (0: no NVMe tier)."""
    nvme_read_gbps: float = 0.0
    """Aggregate NVMe read bandwidth, GB/s (needed when state lands on NVMe)."""
    nvme_write_gbps: float = 0.0
    """Aggregate NVMe write bandwidth, GB/s."""
    pcie_gbps: float = 25.0
    """Host<->GPU bandwidth each way with pinned buffers, GB/s (Gen4 x16 ~25; ignored without a GPU)."""
    compute_tflops: float
    """Achieved dense matmul rate of the compute device in the plan's dtype, TFLOPS."""
    adam_params_per_s: float
    """CPU Adam throughput, parameters/s (``offload bench adam``)."""
    nvme_where: str = "the NVMe paths"
    """Where the NVMe tier lives, for messages."""

    def __post_init__(self) -> None:
        if self.gpu_mem is not None:
            _positive(self, "gpu_mem")
        _positive(self, "cpu_mem")
        for name in ("nvme_capacity", "nvme_read_gbps", "nvme_write_gbps", "pcie_gbps"):
            _positive(self, name, allow_zero=True)
        _positive(self, "compute_tflops")
        _positive(self, "adam_params_per_s")
        if self.gpu_mem is not None and self.pcie_gbps <= 0:
            raise ConfigError("pcie_gbps", self.pcie_gbps, "a GPU box needs a host<->GPU bandwidth > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """How the engine would run the model (the knobs that change the plan)."""

    batch_tokens: int = 8192
    """Tokens per optimizer step (one forward/backward; no gradient accumulation)."""
    seq_len: int | None = None
    """Sequence length; None: min(model max_seq_len, batch_tokens)."""
    dtype: str = "bf16"
    """Compute precision of parameters and gradients."""
    activation_checkpointing: bool = True
    """Keep only each layer's input; recompute the layer in backward (one more forward)."""
    device_budget: int | None = None
    """Bytes of chunk storage on the compute device; None: the engine's "auto" (GPU: 50% of gpu_mem,
    CPU-only: 25% of cpu_mem)."""
    cpu_budget: int | None = None
    """Bytes of chunk storage in RAM; None: the engine's "auto" (50% of cpu_mem less a CPU device's share)."""
    chunk_size: int | None = None
    """Elements per chunk; None: the engine's "auto" search."""
    defer_step: bool = False
    """Hold all gradients until backward ends (global-norm clipping, fp16 overflow checks)."""
    micro_batches: int = 1
    """Gradient accumulation: forward/backward passes per optimizer step, ``batch_tokens`` split
    evenly; each pass streams the parameters again and adds into fp32 gradients held whole."""
    activation_offload: str = "none"
    """Where checkpointed layers' inputs wait for backward: "none" (GPU), "cpu" (the pinned
    activation area) or "nvme" (that area, spilling the rest); needs activation checkpointing."""
    lora_rank: int | None = None
    """LoRA rank (peft's ``get_peft_model``): the base model is frozen and only the adapters train."""
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    """Projections that get LoRA adapters (of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)."""
    world: int = 1
    """Ranks training the model together (ZeRO-3 data parallelism): each owns 1/world of the chunks
    and computes on batch_tokens / world tokens of every step; the plan is one rank's."""
    local_world: int = 1
    """Of those, the ranks on this box: they share its RAM, NVMe drives and CPU cores evenly; each
    has a GPU of its own (``Hardware.gpu_mem`` is one GPU's)."""

    def __post_init__(self) -> None:
        _positive(self, "batch_tokens")
        for name in ("world", "local_world"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "expected a whole number >= 1")
        if self.local_world > self.world:
            raise ConfigError("local_world", self.local_world, f"is more than world={self.world}")
        if self.batch_tokens % self.world:
            raise ConfigError("batch_tokens", self.batch_tokens,
                              f"is global: it must split evenly over world={self.world} ranks")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or not 1 <= self.micro_batches <= self.batch_tokens:
            raise ConfigError("micro_batches", self.micro_batches,
                              f"must be an integer between 1 and batch_tokens={self.batch_tokens}")
        if self.activation_offload not in ACTIVATION_PLACES:
            raise ConfigError("activation_offload", self.activation_offload,
                              f"must be one of {', '.join(ACTIVATION_PLACES)}")
        if self.activation_offload != "none" and not self.activation_checkpointing:
            raise ConfigError("activation_offload", self.activation_offload,
                              "offloads checkpointed layers' inputs: it needs activation checkpointing")
        _positive(self, "seq_len", optional=True)
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("dtype", self.dtype, f"must be one of {', '.join(DTYPE_BYTES)}")
        _positive(self, "device_budget", optional=True)
        _positive(self, "cpu_budget", optional=True)
        _positive(self, "chunk_size", optional=True)
        if self.chunk_size is not None and self.chunk_size % CHUNK_QUANTUM:
            raise ConfigError("chunk_size", self.chunk_size, f"must be a multiple of {CHUNK_QUANTUM}")
        if self.lora_rank is not None:
            if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1:
                raise ConfigError("lora_rank", self.lora_rank, "expected a whole number >= 1")
            bad = [t for t in self.lora_targets if t not in PROJECTIONS]
            if bad or not self.lora_targets:
                raise ConfigError("lora_targets", ",".join(bad) or "(none)",
                                  f"expected some of {', '.join(PROJECTIONS)}")


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
    """{"compute", "pcie", "nvme", "adam"}: seconds each would take alone."""
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


def resolve_model(model: Union[str, LlamaConfig]) -> tuple[str, LlamaConfig]:
    if isinstance(model, LlamaConfig):
        return "custom", model
    cfg = get_preset(model)
    return "llama-" + str(model).strip().lower().removeprefix("llama-").removeprefix("llama"), cfg


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


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def param_layout(cfg: LlamaConfig, lora_rank: int | None = None,
                 lora_targets: tuple[str, ...] = ("q_proj", "v_proj")) -> tuple[list[int], list[bool]]:
    """Elements and trainability of each parameter in the order the engine packs them. With
    ``lora_rank`` the model is peft's LoRA model: everything of the base model is frozen, and each
    targeted projection (out x in) is followed by its adapters A (r x in) and B (out x r)."""
    h, kv, i, v = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
    shapes = dict(zip(PROJECTIONS, [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]))
    base = lora_rank is None
    numels, trainable = [v * h], [base]
    for _ in range(cfg.num_layers):
        for name in PROJECTIONS:
            out, inp = shapes[name]
            numels.append(out * inp)
            trainable.append(base)
            if not base and name in lora_targets:
                numels += [lora_rank * inp, out * lora_rank]
                trainable += [True, True]
        numels += [h, h]
        trainable += [base, base]
    numels.append(h)
    trainable.append(base)
    if not cfg.tie_embeddings:
        numels.append(v * h)
        trainable.append(base)
    return numels, trainable


def param_numels(cfg: LlamaConfig) -> list[int]:
    """Elements of each parameter of ``LlamaForCausalLM(cfg)`` in ``named_parameters()`` order (the
    order the engine packs them into chunks; a tied lm_head is the embedding)."""
    h, kv, i, v = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
    layer = [h * h, kv * h, kv * h, h * h, i * h, i * h, h * i, h, h]
    return [v * h] + layer * cfg.num_layers + [h] + ([] if cfg.tie_embeddings else [v * h])


def rank_share(hw: Hardware, local_world: int) -> Hardware:
    """One rank's share of a box that ``local_world`` ranks train on: its RAM, NVMe space and
    bandwidth, CPU Adam rate (and, without a GPU, its compute) divided evenly; GPU memory, compute
    and PCIe stay (a GPU per rank)."""
    if local_world == 1:
        return hw
    cpu_only = hw.gpu_mem is None
    return dataclasses.replace(
        hw, cpu_mem=hw.cpu_mem // local_world, nvme_capacity=hw.nvme_capacity // local_world,
        nvme_read_gbps=hw.nvme_read_gbps / local_world, nvme_write_gbps=hw.nvme_write_gbps / local_world,
        adam_params_per_s=hw.adam_params_per_s / local_world,
        compute_tflops=hw.compute_tflops / local_world if cpu_only else hw.compute_tflops)


def auto_budgets(hw: Hardware, device_budget: int | None, cpu_budget: int | None) -> tuple[int, int]:
    """``(device_budget, cpu_budget)`` as ``offload.tiers.budgets.resolve_budgets`` turns "auto" into
    bytes, with ``gpu_mem`` and ``cpu_mem`` standing for the free GPU memory and available RAM."""
    gpu = hw.gpu_mem is not None
    if device_budget is None:
        device_budget = int(hw.gpu_mem * AUTO_DEVICE_SHARE_CUDA) if gpu else int(hw.cpu_mem * AUTO_DEVICE_SHARE_CPU)
    if cpu_budget is None:
        taken = 0 if gpu else device_budget
        cpu_budget = max(int((hw.cpu_mem - taken) * AUTO_CPU_SHARE), 1 << 20)
    return device_budget, cpu_budget


def chunk_sizes(cfg: LlamaConfig, device_budget: int, cpu_budget: int, chunk_size: int | None = None,
                lora_rank: int | None = None, lora_targets: tuple[str, ...] = ("q_proj", "v_proj"),
                layout: tuple[list[int], list[bool]] | None = None) -> tuple[int, list[int], list[bool]]:
    """``(chunk_size, [elements of each chunk], [whether it is trainable])`` the engine would lay out
    (``OffloadEngine.__init__``): bulk chunks of ``chunk_size``, one chunk of its own size per larger
    parameter, frozen and trainable parameters in separate chunks."""
    numels, trainable = layout or param_layout(cfg, lora_rank, lora_targets)
    if chunk_size is None:
        chunk_size = search_chunk_size(numels, max_chunk=auto_max_chunk(device_budget, cpu_budget),
                                       trainable=trainable)
    packing = pack(numels, chunk_size, PARAM_ALIGN, trainable)
    return chunk_size, packing.sizes, packing.trainable


def chunk_geometry(cfg: LlamaConfig, device_budget: int, cpu_budget: int,
                   chunk_size: int | None = None) -> tuple[int, int]:
    """``(chunk_size, num_chunks)`` the engine would pick (``OffloadEngine.__init__``)."""
    chunk_size, sizes, _ = chunk_sizes(cfg, device_budget, cpu_budget, chunk_size)
    return chunk_size, len(sizes)


def _split(kinds: dict, order: tuple, room: int) -> tuple[dict, dict]:
    """Fill ``room`` bytes with ``kinds`` in ``order``: (what stays, what spills)."""
    here, rest = {}, {}
    room = max(room, 0)
    for kind in order:
        take = min(kinds.get(kind, 0), room)
        room -= take
        here[kind], rest[kind] = take, kinds.get(kind, 0) - take
    return here, rest


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
    master_b = 4 if e < 4 else 0
    k = po.micro_batches
    rank_tokens = po.batch_tokens // world           # this rank's part of every step
    micro = -(-rank_tokens // k)                     # tokens per forward/backward pass
    seq = po.seq_len or min(cfg.max_seq_len, micro)
    if seq > micro:
        raise ConfigError("seq_len", seq, f"is longer than batch_tokens={po.batch_tokens}" if k == 1 and world == 1
                          else f"is longer than a micro-batch ({po.batch_tokens} tokens / {world} ranks / {k})")
    gpu = hw.gpu_mem is not None
    device_budget, cpu_budget = auto_budgets(hw, po.device_budget, po.cpu_budget)

    # ---- chunks: every kind has the same geometry; padding is stored like parameters
    chunk, sizes, chunk_trainable = chunk_sizes(cfg, device_budget, cpu_budget, po.chunk_size,
                                                layout=(numels, trainable))
    num_chunks, largest = len(sizes), max(sizes)
    all_elems = sum(sizes)
    all_trained = sum(size for size, t in zip(sizes, chunk_trainable) if t)
    # Under data parallelism chunk c belongs to rank c % world; plan for the rank owning the most.
    owner = max(range(world), key=lambda r: sum(sizes[r::world]))
    own_sizes, own_trainable = sizes[owner::world], chunk_trainable[owner::world]
    elems = sum(own_sizes)
    # Frozen chunks (LoRA's base model) hold parameters only: no gradient, master or moments.
    trained = sum(size for size, t in zip(own_sizes, own_trainable) if t)
    largest_trained = max((size for size, t in zip(own_sizes, own_trainable) if t), default=0)
    per_elem = {"params": e, "grads": 4, "master": master_b, "exp_avg": 4, "exp_avg_sq": 4}
    total = {k: (elems if k == "params" else trained) * b for k, b in per_elem.items()}
    set_bytes = largest_trained * sum(per_elem.values())    # one (largest) chunk of every kind
    state_bytes = sum(total.values())
    all_params = all_elems * e                      # what the device sees: every chunk, gathered
    share = elems / all_elems                       # of the parameter stream, what this rank uploads

    # ---- the device tier: parameter chunks beside a layer's gradient chunks (+ activations, outside)
    layer_params = layer_param_count(cfg) if not params else max(1, (n - max(numels)) // max(cfg.num_layers, 1))
    # A layer's chunks: whole bulk chunks, or (its matrices in chunks of their own) its parameters,
    # plus one chunk it may straddle into.
    layer_elems = min(-(-layer_params // chunk) * chunk, layer_params + chunk) + chunk
    grads_window = min(all_trained * 4, layer_elems * 4)
    dev_params = min(all_params, max(0, device_budget - grads_window))
    resident = dev_params == all_params
    act_per_tok = activation_bytes_per_token(cfg, e, po.activation_checkpointing)
    acts = {part: v * micro for part, v in act_per_tok.items()}
    placed = place_activations(cfg, e, po.activation_offload, micro, act_per_tok,
                               area_budget(hw, device_budget, cpu_budget))
    act_total = placed.device_bytes                 # on the GPU during one micro-batch
    device_min = min_device_bytes_sharded(chunk, e, largest, world)   # gathered groups under several ranks
    tiers_device = {"params": dev_params, "grads": grads_window, "activations": act_total}

    # ---- the CPU tier: working room for the optimizer, then state by priority; NVMe holds the rest
    cpu_min = max(min_cpu_bytes(largest_trained, e), largest * e)
    working = min(CPU_WORKING_SETS * set_bytes, cpu_budget, state_bytes)
    lower = dict(total)            # what lives below the device
    # consumed by Adam as they arrive, unless held whole: a deferred step, or accumulating micro-batches
    lower["grads"] = total["grads"] if po.defer_step or k > 1 else 0
    nvme_tier = hw.nvme_capacity > 0
    cpu, spill = _split(lower, STATE_KINDS, cpu_budget - working)
    if not nvme_tier:
        # the CPU tier is the bottom: everything must be held in RAM (the device's parameters are copies)
        spill = {k: 0 for k in spill}
    tiers = {"device": {"bytes": sum(tiers_device.values()), **tiers_device},
             "cpu": {"bytes": sum(cpu.values()) + working + placed.area_bytes, "working": working, **cpu,
                     "activations": placed.area_bytes},
             "nvme": {"bytes": sum(spill.values()) + placed.spill_bytes, **spill, "activations": placed.spill_bytes}}
    # a slot for every chunk of every kind, and the activations' spill space
    nvme_needed = state_bytes + placed.spill_bytes if nvme_tier else 0

    # ---- traffic per step
    # Rewritten on the CPU by the update, so even resident ones are fetched again; frozen ones the
    # device kept are not.
    h2d_fwd = all_params - min(dev_params, (all_elems - all_trained) * e)
    h2d_bwd = all_params - dev_params                          # what the device could not keep
    d2h = total["grads"]                 # under data parallelism: the owned chunks' reduced gradients
    pn = spill["params"]
    refetch = pn * h2d_bwd / all_params if all_params else 0
    opt_nvme = spill["master"] + spill["exp_avg"] + spill["exp_avg_sq"] + spill["grads"]
    opt_read = opt_nvme + (0 if master_b else pn)               # fp32: Adam reads the parameter as master
    # Each micro-batch after the first streams again what the device does not keep (forward and
    # backward), moves the gradients out and (to add into them) back in, re-reads spilled parameters
    # and gradients; parked activations go out and back once per micro-batch.
    streamed = h2d_fwd + h2d_bwd + (k - 1) * 2 * h2d_bwd     # parameter bytes the device takes in
    # Each rank uploads its own chunks; the all-gather brings the others' (received, per rank).
    h2d_params = streamed * share if world > 1 else streamed
    collective = {"all_gather": int(streamed * (world - 1) / world),
                  "reduce_scatter": int(all_trained * 4 * k * (world - 1) / world)}
    grad_spill = (k - 1) * spill["grads"]
    act_host, act_spill = placed.host_bytes * k, placed.spill_bytes * k
    traffic = {
        "nvme_read": int(opt_read + (pn + refetch) * k + grad_spill + act_spill),
        # frozen parameters are never rewritten
        "nvme_write": int(opt_nvme + pn * trained / elems + grad_spill + act_spill),
        "pcie_h2d": h2d_params + d2h * (k - 1) + act_host if gpu else 0,
        "pcie_d2h": d2h * k + act_host if gpu else 0,
    }

    # ---- time per step
    full_tok = flops_per_token(cfg, seq)
    # Frozen weights get no weight gradient: 2 of the 6 FLOPs per weight and token go.
    per_tok = full_tok - 2.0 * (n - n_trained)
    if po.activation_checkpointing:
        per_tok += full_tok / 3.0        # one more forward, and the forward is 1/3 of fwd + bwd
    rate = hw.compute_tflops * 1e12
    compute_per_tok = per_tok / rate
    nvme_s = opt_nvme_s = 0.0
    if (traffic["nvme_read"] or traffic["nvme_write"]) and nvme_tier:
        if hw.nvme_read_gbps <= 0 or hw.nvme_write_gbps <= 0:
            raise ConfigError("nvme_gbps", hw.nvme_read_gbps,
                              f"the plan moves {format_size(traffic['nvme_read'] + traffic['nvme_write'])} "
                              "through NVMe per step: an NVMe bandwidth > 0 is needed")
        nvme_s = traffic["nvme_read"] / (hw.nvme_read_gbps * GB) + \
            traffic["nvme_write"] / (hw.nvme_write_gbps * GB)
        opt_nvme_s = opt_read / (hw.nvme_read_gbps * GB) + opt_nvme / (hw.nvme_write_gbps * GB)
    # a rank updates the chunks it owns
    adam_params = n_trained * trained / all_trained if world > 1 and all_trained else n_trained
    terms = {
        "compute": rank_tokens * compute_per_tok,
        "pcie": max(traffic["pcie_h2d"], traffic["pcie_d2h"]) / (hw.pcie_gbps * GB) if gpu else 0.0,
        "nvme": nvme_s,
        "adam": adam_params / hw.adam_params_per_s,
    }
    # One micro-batch's share of what runs beside compute (the optimizer's own NVMe traffic aside).
    per_micro = max(terms["compute"], terms["pcie"], nvme_s - opt_nvme_s) / k
    if gpu and not po.defer_step:
        # The update overlaps only the last micro-batch's backward (k = 1: max of the terms).
        predicted = (k - 1) * per_micro + max(terms["compute"] / k, terms["pcie"] / k,
                                              (nvme_s - opt_nvme_s) / k + opt_nvme_s, terms["adam"])
        bottleneck = max(terms, key=terms.get)
        others = max(terms["pcie"], terms["nvme"], terms["adam"])
        gpu_bound = None if bottleneck == "compute" else others / compute_per_tok
    elif gpu:
        # the optimizer (and its share of the disk) runs after the backward
        during = {"compute": terms["compute"], "pcie": terms["pcie"], "nvme": nvme_s - opt_nvme_s}
        after = {"adam": terms["adam"], "nvme": opt_nvme_s}
        predicted = k * per_micro + max(after.values())
        parts = {"compute": terms["compute"], "pcie": terms["pcie"], "nvme": during["nvme"] + opt_nvme_s,
                 "adam": terms["adam"]}
        bottleneck = max(parts, key=parts.get)
        others = max(during["pcie"], during["nvme"])
        gpu_bound = None if terms["compute"] >= others else others / compute_per_tok
    else:
        # one pair of cores runs the layers, Adam and the I/O path; store waits block the compute thread
        predicted = terms["compute"] + terms["adam"] + terms["nvme"]
        bottleneck = max(("compute", "adam", "nvme"), key=terms.get)
        # compute leads once it is the largest of the three
        gpu_bound = None if bottleneck == "compute" else max(terms["adam"], terms["nvme"]) / compute_per_tok
    # (tokens of the whole step: each rank computes 1/world of them)
    gpu_bound_tokens = None if gpu_bound is None else world * max(seq, math.ceil(gpu_bound / seq) * seq)

    # ---- does it fit?
    act_tok = placed.device_per_token
    if gpu:
        act_room = hw.gpu_mem - device_budget - GPU_WORKSPACE
    else:
        act_room = hw.cpu_mem - device_budget - cpu_budget
    max_batch = world * k * (act_room // act_tok // seq * seq) if act_room > 0 else 0
    problems = []
    if device_budget < device_min:
        problems.append(
            f"device budget {format_size(device_budget)} is below the largest chunk ({largest:,} elements) "
            f"and 2 chunks of {chunk:,}, parameters and fp32 gradients ({format_size(device_min)}): the "
            f"device holds the tied embedding's chunks and a module's (which may straddle two) at once"
            + ("" if world == 1 else f", and under {world} ranks each chunk in use brings its group of {world}: "
               "4 gathered parameter groups and 2 gradient groups being reduced"))
    if cpu_budget < cpu_min:
        problems.append(
            f"CPU budget {format_size(cpu_budget)} is below one chunk of every kind "
            f"({format_size(cpu_min)}: {largest:,} elements x {sum(per_elem.values())} B) that Adam needs at once")
    if gpu and device_budget + act_total + GPU_WORKSPACE > hw.gpu_mem:
        problems.append(
            f"GPU needs {format_size(device_budget + act_total + GPU_WORKSPACE)} (device budget "
            f"{format_size(device_budget)} + {format_size(act_total)} activations for {micro} "
            f"tokens + {format_size(GPU_WORKSPACE)} workspace), has {format_size(hw.gpu_mem)}; at most "
            f"{max_batch} tokens/step fit")
    problems += activation_problems(placed, po.activation_offload, gpu, nvme_tier)
    if not gpu and device_budget + cpu_budget + act_total > hw.cpu_mem:
        problems.append(
            f"RAM needs {format_size(device_budget + cpu_budget + act_total)} (device budget "
            f"{format_size(device_budget)} + CPU budget {format_size(cpu_budget)} + "
            f"{format_size(act_total)} activations for {rank_tokens} tokens), "
            f"{format_size(hw.cpu_mem)} available; at most {max_batch} tokens/step fit")
    if not nvme_tier:
        held = state_bytes - (0 if po.defer_step else total["grads"])
        if held > cpu_budget - working:
            problems.append(f"state needs {format_size(held)} in RAM beyond the CPU budget's room of "
                            f"{format_size(max(cpu_budget - working, 0))} and there is no NVMe tier "
                            f"(give --nvme-path)")
    elif nvme_needed > hw.nvme_capacity:
        problems.append(f"NVMe needs {format_size(nvme_needed)}, {format_size(hw.nvme_capacity)} free at "
                        f"{hw.nvme_where}")
    fits = not problems
    ranks_note = "" if world == 1 else (
        f" (one rank of {world}, {po.local_world} on this box sharing its RAM, NVMe and CPU)")
    if problems:
        reason = "; ".join(problems) + ranks_note
    elif gpu:
        reason = (f"fits: device budget {format_size(device_budget)} + {format_size(act_total)} activations "
                  f"on the GPU of {format_size(hw.gpu_mem)}, CPU budget {format_size(cpu_budget)}, "
                  f"{format_size(nvme_needed)} on NVMe of {format_size(hw.nvme_capacity)}"
                  + placed.describe(k) + ranks_note)
    else:
        reason = (f"fits: budgets {format_size(device_budget)} (device) + {format_size(cpu_budget)} (CPU) "
                  f"+ {format_size(act_total)} activations in RAM of {format_size(hw.cpu_mem)}, "
                  f"{format_size(nvme_needed)} on NVMe of {format_size(hw.nvme_capacity)}" + ranks_note)

    breakdown = {
        "seq_len": seq, "dtype_bytes": e, "device_budget": device_budget, "cpu_budget": cpu_budget,
        "chunk_size": chunk, "num_chunks": num_chunks, "padding_elements": all_elems - n,
        "trainable_params": n_trained, "trainable_chunks": sum(chunk_trainable),
        "largest_chunk": largest, "oversized_chunks": sum(size > chunk for size in sizes),
        "device_min_bytes": device_min, "cpu_min_bytes": cpu_min,
        "params_resident_on_device": resident, "layer_params": layer_params,
        "state_bytes": state_bytes, "state_bytes_per_param": sum(per_elem.values()),
        "trainable_params": n_trained, "frozen_chunks": num_chunks - sum(chunk_trainable),
        "state_by_kind": total, "activations": acts,
        "device_cpu_copy_bytes": {"h2d": h2d_fwd + h2d_bwd, "d2h": d2h},
        "optimizer_nvme_bytes": opt_nvme,
        "train_flops_per_token": per_tok, "compute_s_per_token": compute_per_tok,
        "serial_step_s": sum(terms.values()),
        "compute_and_adam_share_cores": not gpu,
        "optimizer_overlaps_backward": not po.defer_step,
        "micro_batches": k, "micro_batch_tokens": micro,
        "activation_offload": po.activation_offload, "activation_placement": dataclasses.asdict(placed),
        "world": world, "local_world": po.local_world, "rank_tokens": rank_tokens,
        "owned_chunks": len(own_sizes), "collective_bytes": collective, "adam_params": adam_params,
        "rank_hardware": dataclasses.asdict(hw),
    }
    return Plan(model=label, params=n, tiers=tiers, nvme_bytes_needed=nvme_needed,
                bytes_per_step=traffic, step_terms_s=terms, predicted_step_s=predicted,
                bottleneck=bottleneck, fits=fits, reason=reason,
                gpu_bound_batch_tokens=gpu_bound_tokens, max_batch_tokens=int(max_batch),
                breakdown=breakdown, hardware=dataclasses.asdict(hardware), policy=dataclasses.asdict(po))
