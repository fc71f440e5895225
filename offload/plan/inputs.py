"""What a plan is made of: the box (``Hardware``, measured or stated) and the way the engine would
run on it (``Policy``), both checked when built; and one rank's share of a box that several ranks
train on (``rank_share``).

Units: bytes, parameters (elements); bandwidths in GB/s and compute in TFLOPS, both decimal.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..chunks.layout import CHUNK_QUANTUM
from ..errors import ConfigError
from .model import PROJECTIONS
from .precision import MASTER_PRECISIONS, STATE_PRECISIONS, master_bytes

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ACTIVATION_PLACES = ("none", "cpu", "nvme")


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
    net_gbps: float = 25.0
    """Each rank's collective bandwidth under data parallelism, GB/s each way as NCCL reports it
    ("bus bandwidth"): the slowest link a ring of the ranks crosses — a 200 Gb/s NIC per GPU between
    boxes ~25, NVLink within one box far more. Unused by a single process."""
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
        _positive(self, "net_gbps")
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
    """Ranks training the model together (ZeRO-3 data parallelism): each holds a 1/world piece of
    every chunk and computes on batch_tokens / world tokens of every step; the plan is one rank's."""
    local_world: int = 1
    """Of those, the ranks on this box: they share its RAM, NVMe drives and CPU cores evenly; each
    has a GPU of its own (``Hardware.gpu_mem`` is one GPU's)."""
    optimizer_state: str = "fp32"
    """Precision of Adam's moments: "fp32" (4 B each), "bf16" (2 B) or "8bit" (a byte and one fp32
    scale per 256 elements) — ``OffloadConfig.optimizer_state``."""
    master: str = "fp32"
    """Precision of the master weights: "fp32" (4 B; none under fp32 compute) or "bf16" (2 B,
    stochastic rounding; none under bf16 compute, whose parameters are the master) — ``OffloadConfig.master``."""

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
        if self.optimizer_state not in STATE_PRECISIONS:
            raise ConfigError("optimizer_state", self.optimizer_state, f"must be one of {', '.join(STATE_PRECISIONS)}")
        if self.master not in MASTER_PRECISIONS:
            raise ConfigError("master", self.master, f"must be one of {', '.join(MASTER_PRECISIONS)}")
        if self.activation_offload not in ACTIVATION_PLACES:
            raise ConfigError("activation_offload", self.activation_offload,
                              f"must be one of {', '.join(ACTIVATION_PLACES)}")
        if self.activation_offload != "none" and not self.activation_checkpointing:
            raise ConfigError("activation_offload", self.activation_offload,
                              "offloads checkpointed layers' inputs: it needs activation checkpointing")
        _positive(self, "seq_len", optional=True)
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("dtype", self.dtype, f"must be one of {', '.join(DTYPE_BYTES)}")
        master_bytes(self.master, self.dtype)          # a bf16 master under fp32 compute is refused
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


def rank_share(hw: Hardware, local_world: int) -> Hardware:
    """One rank's share of a box that ``local_world`` ranks train on: its RAM, NVMe space and
    bandwidth, CPU Adam rate (and, without a GPU, its compute) divided evenly; GPU memory, compute,
    PCIe and the collective bandwidth stay (a GPU per rank; ``net_gbps`` is already a rank's)."""
    if local_world == 1:
        return hw
    cpu_only = hw.gpu_mem is None
    return dataclasses.replace(
        hw, cpu_mem=hw.cpu_mem // local_world, nvme_capacity=hw.nvme_capacity // local_world,
        nvme_read_gbps=hw.nvme_read_gbps / local_world, nvme_write_gbps=hw.nvme_write_gbps / local_world,
        adam_params_per_s=hw.adam_params_per_s / local_world,
        compute_tflops=hw.compute_tflops / local_world if cpu_only else hw.compute_tflops)
