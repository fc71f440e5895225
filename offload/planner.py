"""The planner: where a model's state goes on a box, what moves per step, and how long a step takes.

Pure arithmetic over figures someone measured or stated (``offload/planner_cli.py`` gathers them);
nothing here measures, allocates or touches a device.

Units: bytes, seconds, parameters (elements); bandwidths in GB/s and compute in TFLOPS, both
decimal (1 GB/s = 1e9 bytes/s). The model of a step, per DESIGN.md:

* Bytes per parameter: compute parameter ``e`` (2 for bf16/fp16, 4 for fp32), fp32 master 4
  (none for fp32 compute: the parameter is the master), ``exp_avg`` 4, ``exp_avg_sq`` 4 —
  14 B/param persistent for bf16 — plus ``e`` of gradient in flight.
* Placement (the engine's policy): the device holds a window of layers (parameters and their
  gradients) plus activations, or every parameter when they all fit. The CPU budget holds pinned
  staging buffers, then as much state as fits in priority order: compute parameters (read twice
  a step), master, ``exp_avg``, ``exp_avg_sq``, whole gradients (only when the step is deferred
  to the end of backward, e.g. for global-norm clipping). NVMe holds the rest.
* Traffic per step: optimizer state on NVMe is read and written once; parameters on NVMe are
  written once (after the update) and read twice (forward and backward) unless they stay on the
  device; PCIe carries the parameters host→device twice (once when they stay resident) and the
  gradients device→host once.
* Step time is the bound ``max(compute, PCIe, NVMe, Adam)`` (perfect overlap). PCIe is full duplex
  (separate lanes and copy engines each way): max(H2D, D2H) / GB/s. NVMe is *not* treated as full
  duplex: reads and writes share the drives' flash channels and controller (and here the virtio
  disk), so its time is read/read_GBps + write/write_GBps — conservative, and what mixed workloads
  measure. Without a GPU, compute and Adam run on the same cores and add up; disk I/O (DMA) overlaps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Union

from .errors import ConfigError
from .models.llama import LlamaConfig, flops_per_token, get_preset, layer_param_count, param_count

GB = 1e9
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
STATE_KINDS = ("params", "master", "exp_avg", "exp_avg_sq", "grads")


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

    batch_tokens: int = 16384
    """Tokens per optimizer step (one forward/backward; no gradient accumulation)."""
    seq_len: int | None = None
    """Sequence length; None: min(model max_seq_len, batch_tokens)."""
    dtype: str = "bf16"
    """Compute precision of parameters and gradients."""
    activation_checkpointing: bool = True
    """Keep only each layer's input; recompute the layer in backward (one more forward)."""
    device_budget: int | None = None
    """Bytes of device memory for the engine; None: 90% of gpu_mem (CPU-only: what it needs)."""
    cpu_budget: int | None = None
    """Bytes of RAM for the engine; None: cpu_mem less max(2 GiB, 10%) for the OS and Python."""
    window_layers: int = 3
    """Layers resident on the device at once: being evicted, computing, being prefetched."""
    optimizer_chunk: int = 1 << 26
    """Elements per optimizer chunk; the Adam pipeline double-buffers two of them in pinned memory."""
    defer_step: bool = False
    """Hold all gradients until backward ends (global-norm clipping, fp16 overflow checks)."""

    def __post_init__(self) -> None:
        _positive(self, "batch_tokens")
        _positive(self, "seq_len", optional=True)
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("dtype", self.dtype, f"must be one of {', '.join(DTYPE_BYTES)}")
        _positive(self, "device_budget", optional=True)
        _positive(self, "cpu_budget", optional=True)
        _positive(self, "window_layers")
        _positive(self, "optimizer_chunk")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the planner predicts. Bytes, seconds, tokens; see ``to_json_dict`` for the schema."""

    model: str
    params: int
    tiers: dict
    """{"device"|"cpu"|"nvme": {"bytes": total, <kind>: bytes, ...}}"""
    nvme_bytes_needed: int
    bytes_per_step: dict
    """{"nvme_read", "nvme_write", "pcie_h2d", "pcie_d2h"}: bytes per optimizer step."""
    step_terms_s: dict
    """{"compute", "pcie", "nvme", "adam"}: seconds each would take alone."""
    predicted_step_s: float
    bottleneck: str
    fits: bool
    reason: str
    gpu_bound_batch_tokens: int | None
    """Batch (tokens/step) from which compute is the bottleneck; None if it already is."""
    max_batch_tokens: int | None
    """Largest batch whose activations fit the device budget (whole sequences)."""
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


def format_size(n: float) -> str:
    """Decimal size, as DESIGN.md quotes them: 1.40 TB, 72.0 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


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


def plan(model: Union[str, LlamaConfig], hardware: Hardware, policy: Policy = Policy(), *,
         name: str | None = None) -> Plan:
    """Place ``model``'s state on ``hardware`` under ``policy`` and predict one step."""
    label, cfg = resolve_model(model)
    label = name or label
    hw, po = hardware, policy
    n = param_count(cfg)
    e = DTYPE_BYTES[po.dtype]
    master_b = 4 if e < 4 else 0
    seq = po.seq_len or min(cfg.max_seq_len, po.batch_tokens)
    if seq > po.batch_tokens:
        raise ConfigError("seq_len", seq, f"is longer than batch_tokens={po.batch_tokens}")
    gpu = hw.gpu_mem is not None

    # ---- the device tier: a window of layers (or every parameter) + activations
    layer_params = layer_param_count(cfg)
    unit = max(layer_params, cfg.vocab_size * cfg.hidden_size)   # the largest thing fetched at once
    act_per_tok = activation_bytes_per_token(cfg, e, po.activation_checkpointing)
    acts = {k: v * po.batch_tokens for k, v in act_per_tok.items()}
    act_total = sum(acts.values())
    window = min(po.window_layers * unit, n)
    grads_window = window * e
    cpu_budget = po.cpu_budget if po.cpu_budget is not None else \
        hw.cpu_mem - max(2 << 30, hw.cpu_mem // 10)
    if gpu:
        device_budget = po.device_budget if po.device_budget is not None else int(hw.gpu_mem * 0.9)
        resident = n * e + grads_window + act_total <= device_budget
    else:
        # CPU-only: the device tier is a slice of the same RAM (a window of layers and the
        # activations); the other parameters sit in the CPU tier, so "resident" buys nothing
        device_budget = po.device_budget if po.device_budget is not None else cpu_budget
        resident = False
    dev_params = n * e if resident else window * e
    device = {"params": dev_params, "grads": grads_window, "activations": act_total}
    device_need = sum(device.values())

    # ---- the CPU tier: staging buffers, then state by priority; NVMe: the rest
    kinds = {"params": 0 if resident else n * e, "master": n * master_b,
             "exp_avg": n * 4, "exp_avg_sq": n * 4, "grads": n * e if po.defer_step else 0}
    if not gpu:
        kinds["params"] = max(0, n * e - dev_params)                 # the window's share is on "device"
    staging = (0 if resident else window * e) + grads_window if gpu else 0   # H2D params, D2H grads
    for spill in (False, True):
        if spill:   # state reaches NVMe: the Adam pipeline double-buffers a chunk of it in pinned RAM
            staging += 2 * min(po.optimizer_chunk, n) * (12 + e)
        cpu_room = cpu_budget - staging - (0 if gpu else device_need)
        cpu, nvme = {"staging": staging}, {}
        room = max(cpu_room, 0)
        for kind in STATE_KINDS:
            here = min(kinds[kind], room)
            room -= here
            cpu[kind], nvme[kind] = here, kinds[kind] - here
        if not any(nvme.values()):
            break
    tiers = {"device": {"bytes": device_need, **device},
             "cpu": {"bytes": sum(cpu.values()), **cpu},
             "nvme": {"bytes": sum(nvme.values()), **nvme}}
    nvme_needed = tiers["nvme"]["bytes"]

    # ---- traffic per step
    opt_nvme = nvme["master"] + nvme["exp_avg"] + nvme["exp_avg_sq"] + nvme["grads"]
    param_reads = 0 if resident else 2
    traffic = {
        "nvme_read": opt_nvme + param_reads * nvme["params"],
        "nvme_write": opt_nvme + nvme["params"],
        "pcie_h2d": (n * e * (1 if resident else 2)) if gpu else 0,
        "pcie_d2h": n * e if gpu else 0,
    }

    # ---- time per step
    per_tok = flops_per_token(cfg, seq)
    if po.activation_checkpointing:
        per_tok *= 4.0 / 3.0             # one more forward, and the forward is 1/3 of fwd + bwd
    rate = hw.compute_tflops * 1e12
    compute_per_tok = per_tok / rate
    nvme_s = 0.0
    if (traffic["nvme_read"] or traffic["nvme_write"]) and hw.nvme_capacity > 0:
        # (without an NVMe tier the plan is refused below; its disk time is moot)
        if hw.nvme_read_gbps <= 0 or hw.nvme_write_gbps <= 0:
            raise ConfigError("nvme_gbps", hw.nvme_read_gbps,
                              f"the plan moves {format_size(traffic['nvme_read'] + traffic['nvme_write'])} "
                              "through NVMe per step: an NVMe bandwidth > 0 is needed")
        nvme_s = traffic["nvme_read"] / (hw.nvme_read_gbps * GB) + \
            traffic["nvme_write"] / (hw.nvme_write_gbps * GB)
    terms = {
        "compute": po.batch_tokens * compute_per_tok,
        "pcie": max(traffic["pcie_h2d"], traffic["pcie_d2h"]) / (hw.pcie_gbps * GB) if gpu else 0.0,
        "nvme": nvme_s,
        "adam": n / hw.adam_params_per_s,
    }
    if gpu:
        predicted = max(terms.values())
        bottleneck = max(terms, key=terms.get)
        others = max(terms["pcie"], terms["nvme"], terms["adam"])
        gpu_bound = None if bottleneck == "compute" else others / compute_per_tok
    else:
        cores = terms["compute"] + terms["adam"]
        predicted = max(cores, terms["nvme"])
        if cores >= terms["nvme"]:
            bottleneck = "compute" if terms["compute"] >= terms["adam"] else "adam"
        else:
            bottleneck = "nvme"
        # compute leads once it beats Adam and the cores outlast the disk
        gpu_bound = None if bottleneck == "compute" else \
            max(terms["adam"], terms["nvme"] - terms["adam"]) / compute_per_tok
    gpu_bound_tokens = None if gpu_bound is None else max(seq, math.ceil(gpu_bound / seq) * seq)
    act_room = device_budget - dev_params - grads_window
    max_batch = act_room // sum(act_per_tok.values()) // seq * seq if act_room > 0 else 0

    # ---- does it fit?
    problems = []
    if device_need > device_budget:
        what = "GPU" if gpu else "CPU (compute tier)"
        problems.append(
            f"{what} needs {format_size(device_need)} ({format_size(act_total)} activations for "
            f"{po.batch_tokens} tokens + {format_size(dev_params + grads_window)} of parameters and "
            f"gradients), budget {format_size(device_budget)}; at most {max_batch} tokens/step fit")
    if cpu_room < 0:
        problems.append(f"CPU needs {format_size(cpu_budget - cpu_room)} for buffers"
                        f"{'' if gpu else ' and the compute tier'}, budget {format_size(cpu_budget)}")
    if nvme_needed > hw.nvme_capacity:
        if hw.nvme_capacity == 0:
            problems.append(f"state needs {format_size(nvme_needed)} beyond the CPU budget of "
                            f"{format_size(cpu_budget)} and there is no NVMe tier (give --nvme-path)")
        else:
            problems.append(f"NVMe needs {format_size(nvme_needed)}, "
                            f"{format_size(hw.nvme_capacity)} free at "
                            f"{hw.nvme_where}")
    fits = not problems
    if problems:
        reason = "; ".join(problems)
    elif gpu:
        reason = (f"fits: {format_size(device_need)} on the GPU of {format_size(device_budget)}, "
                  f"{format_size(tiers['cpu']['bytes'])} in RAM of {format_size(cpu_budget)}, "
                  f"{format_size(nvme_needed)} on NVMe of {format_size(hw.nvme_capacity)}")
    else:
        reason = (f"fits: {format_size(device_need + tiers['cpu']['bytes'])} in RAM of "
                  f"{format_size(cpu_budget)} "
                  f"({format_size(device_need)} of it the compute tier), "
                  f"{format_size(nvme_needed)} on NVMe of {format_size(hw.nvme_capacity)}")

    breakdown = {
        "seq_len": seq, "dtype_bytes": e, "device_budget": device_budget, "cpu_budget": cpu_budget,
        "params_resident_on_device": resident, "layer_params": layer_params,
        "state_bytes": n * (e + master_b + 8 + (e if po.defer_step else 0)),
        "state_bytes_per_param": e + master_b + 8, "activations": acts,
        "train_flops_per_token": per_tok, "compute_s_per_token": compute_per_tok,
        "serial_step_s": sum(terms.values()),
        "compute_and_adam_share_cores": not gpu,
    }
    return Plan(model=label, params=n, tiers=tiers, nvme_bytes_needed=nvme_needed,
                bytes_per_step=traffic, step_terms_s=terms, predicted_step_s=predicted,
                bottleneck=bottleneck, fits=fits, reason=reason,
                gpu_bound_batch_tokens=gpu_bound_tokens, max_batch_tokens=int(max_batch),
                breakdown=breakdown, hardware=dataclasses.asdict(hw), policy=dataclasses.asdict(po))
