"""The configuration tree: frozen, keyword-only dataclasses checked in ``__post_init__``.

Sizes are bytes (budgets, block sizes) or elements (``chunk_size``); budgets also accept
strings such as ``"4GiB"`` or ``"512MB"`` and are normalised to ``int`` bytes. Every bad
value raises ``ConfigError`` naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from .errors import ConfigError
from .units import parse_bytes

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("bf16", "fp16", "fp32")
AIO_BACKENDS = ("auto", "libaio", "threads")
EVICTIONS = ("next_use", "lru")
ACTIVATION_OFFLOADS = ("none", "cpu", "nvme", "auto")
OPTIMIZER_STATES = ("fp32", "bf16", "8bit")
MASTERS = ("fp32", "bf16")
CHUNK_QUANTUM = 2048
"""Chunk sizes are multiples of this many elements: whole 4 KiB blocks (O_DIRECT) at any dtype."""
DIRECT_IO_ALIGNMENT = 4096


def _budget(value: Any, field_name: str) -> Union[int, str]:
    if value == "auto":
        return "auto"
    n = parse_bytes(value, field_name)
    if n == 0:
        raise ConfigError(field_name, value, "a budget must be > 0 bytes (or 'auto')")
    return n


def _int_in(value: Any, field_name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field_name, value, "expected an integer")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ConfigError(field_name, value, f"must be {bound}")
    return value


def _choice(value: Any, field_name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(field_name, value, f"must be one of {', '.join(map(repr, choices))}")
    return value


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, kw_only=True, slots=True)
class AioConfig:
    """How NVMe traffic is issued (see ``offload bench nvme --sweep`` for good values)."""

    backend: str = "auto"
    """"libaio" (O_DIRECT, kernel AIO), "threads" (a pread/pwrite pool), or "auto" (libaio where it works)."""
    block_size: int = 1 << 20
    """Bytes per request; a multiple of 4096 (O_DIRECT)."""
    queue_depth: int = 32
    """Requests in flight per context."""
    threads: int = 1
    """Submitting threads (libaio: one context each) or pool workers (threads backend)."""
    checksum: bool = False
    """Store a CRC32C per block and verify it on every read."""
    submit_batch: int = 1
    """libaio: most requests per io_submit call (1 measured fastest on virtio, where batches merge)."""
    background_depth: int = 16
    """libaio: most background requests (writes, optimizer-state prefetch) in the kernel at once, so a
    read compute waits for queues behind at most this many; 0 for no limit."""

    def __post_init__(self) -> None:
        _choice(self.backend, "aio.backend", AIO_BACKENDS)
        size = parse_bytes(self.block_size, "aio.block_size")
        if size < DIRECT_IO_ALIGNMENT or size % DIRECT_IO_ALIGNMENT:
            raise ConfigError("aio.block_size", self.block_size,
                              f"must be a positive multiple of {DIRECT_IO_ALIGNMENT} bytes (O_DIRECT)")
        if size > 1 << 30:
            raise ConfigError("aio.block_size", self.block_size, "must be at most 1 GiB")
        _set(self, "block_size", size)
        _int_in(self.queue_depth, "aio.queue_depth", 1, 65536)
        _int_in(self.threads, "aio.threads", 1, 256)
        if not isinstance(self.checksum, bool):
            raise ConfigError("aio.checksum", self.checksum, "expected true or false")
        _int_in(self.submit_batch, "aio.submit_batch", 1, 65536)
        _int_in(self.background_depth, "aio.background_depth", 0, 65536)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """Where model and optimizer state live and how it moves between the tiers."""

    device: str = "auto"
    """Compute device: "cuda", "cpu", or "auto" (cuda when available)."""
    dtype: str = "bf16"
    """Compute precision of parameters and gradients: "bf16", "fp16" (loss scaling) or "fp32"."""
    device_budget: Union[int, str] = "auto"
    """Bytes of chunk storage on the compute device, or "auto" (measured at start)."""
    cpu_budget: Union[int, str] = "auto"
    """Bytes of (pinned) CPU chunk storage, or "auto" (a share of available RAM)."""
    nvme_paths: tuple[str, ...] | None = None
    """Directories for the NVMe tier (striped RAID-0 style), or None for no NVMe tier."""
    chunk_size: Union[int, str] = "auto"
    """Elements per chunk (a multiple of 2048, so any dtype keeps 4 KiB alignment), or "auto"."""
    prefetch_depth: int = 2
    """How many chunks ahead of use the scheduler fetches."""
    optimizer_threads: Union[int, str] = "auto"
    """Threads of the CPU Adam, or "auto" (physical cores)."""
    aio: AioConfig = field(default_factory=AioConfig)
    """NVMe I/O settings."""
    gradient_accumulation_steps: int = 1
    """Backward passes per optimizer step; the update overlaps only the last one's backward."""
    overlap_optimizer: bool = True
    """Run each chunk's Adam as soon as its gradients are complete (when the update allows it)."""
    eviction: str = "next_use"
    """Eviction policy: "next_use" (Belady, from the trace) or "lru"."""
    pin_memory: bool = True
    """Page-lock the CPU tier when computing on CUDA (fast asynchronous copies)."""
    merge_host_tiers: bool = True
    """Computing on the CPU, hold the device and CPU budgets as one host-memory tier (nothing is
    copied between them or held twice). False keeps two tiers with copies between them, the way a
    GPU run moves data: for exercising those paths on a machine without a GPU."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: the first dynamic loss scale."""
    loss_scale_window: int = 1000
    """fp16 only: good steps before the loss scale doubles."""
    activation_offload: str = "none"
    """Where tensors saved for backward at checkpoint boundaries (each checkpointed layer's input)
    go until backward needs them: "none" (stay on the compute device), "cpu" (a budgeted area of
    CPU memory, pinned with CUDA), "nvme" (that area, spilling to ``nvme_paths`` what does not fit),
    or "auto" ("nvme" when there are nvme_paths, else "cpu")."""
    activation_budget: Union[int, str] = "auto"
    """Bytes of the CPU activation area, or "auto" (half the RAM left beside the chunk budgets)."""
    activation_min_bytes: int | None = None
    """Also offload any other saved tensor of at least this many bytes (activations without
    checkpointing, the lm_head input); None: checkpoint boundaries only."""
    activation_prefetch: int = 4
    """Offloaded tensors brought back ahead of the backward that needs them (reverse forward order)."""
    optimizer_state: str = "fp32"
    """Precision of the Adam moments: "fp32" (exact torch AdamW), "8bit" (block-wise dynamic
    quantisation, 256-element blocks, one fp32 absmax per block: 1.016 B per moment element) or
    "bf16" (2 B)."""
    master: str = "fp32"
    """Precision of the master weights: "fp32", or "bf16" (stochastic rounding; with dtype "bf16"
    the compute parameters are the master and no separate copy is kept)."""

    def __post_init__(self) -> None:
        _choice(self.device, "device", DEVICES)
        _choice(self.dtype, "dtype", DTYPES)
        _set(self, "device_budget", _budget(self.device_budget, "device_budget"))
        _set(self, "cpu_budget", _budget(self.cpu_budget, "cpu_budget"))
        _set(self, "nvme_paths", _paths(self.nvme_paths))
        if self.chunk_size != "auto":
            _int_in(self.chunk_size, "chunk_size", CHUNK_QUANTUM)
            if self.chunk_size % CHUNK_QUANTUM:
                raise ConfigError("chunk_size", self.chunk_size,
                                  f"must be a multiple of {CHUNK_QUANTUM} elements (4 KiB alignment for "
                                  "O_DIRECT at every dtype), or 'auto'")
        _int_in(self.prefetch_depth, "prefetch_depth", 0, 1024)
        if self.optimizer_threads != "auto":
            _int_in(self.optimizer_threads, "optimizer_threads", 1, 1024)
        _int_in(self.gradient_accumulation_steps, "gradient_accumulation_steps", 1, 1 << 20)
        for flag in ("overlap_optimizer", "pin_memory", "merge_host_tiers"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(flag, getattr(self, flag), "expected true or false")
        _choice(self.eviction, "eviction", EVICTIONS)
        scale = self.initial_loss_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (1.0 <= scale <= 2.0**32):
            raise ConfigError("initial_loss_scale", scale, "must be a number between 1 and 2**32")
        _int_in(self.loss_scale_window, "loss_scale_window", 1)
        _choice(self.activation_offload, "activation_offload", ACTIVATION_OFFLOADS)
        _set(self, "activation_budget", _budget(self.activation_budget, "activation_budget"))
        if self.activation_min_bytes is not None:
            _int_in(self.activation_min_bytes, "activation_min_bytes", 0)
        _int_in(self.activation_prefetch, "activation_prefetch", 0, 1 << 20)
        if self.activation_offload == "nvme" and self.nvme_paths is None:
            raise ConfigError("activation_offload", "nvme", "spills to NVMe: give nvme_paths (or use 'cpu')")
        _choice(self.optimizer_state, "optimizer_state", OPTIMIZER_STATES)
        _choice(self.master, "master", MASTERS)
        if self.master == "bf16" and self.dtype == "fp32":
            raise ConfigError("master", "bf16", "with dtype 'fp32' the fp32 parameters are the master: a bf16 "
                                                "master needs dtype 'bf16' (it is then the parameters) or 'fp16'")
        if isinstance(self.aio, dict):
            _set(self, "aio", _from_mapping(AioConfig, self.aio, "aio."))
        if not isinstance(self.aio, AioConfig):
            raise ConfigError("aio", self.aio, "expected an offload.AioConfig or a dict of its fields")

    @property
    def activation_tier(self) -> str:
        """Where offloaded activations may go: "none", "cpu" or "nvme" ("auto" resolved)."""
        if self.activation_offload == "auto":
            return "nvme" if self.nvme_paths is not None else "cpu"
        return self.activation_offload

    def replace(self, **changes: Any) -> "OffloadConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["nvme_paths"] = list(self.nvme_paths) if self.nvme_paths is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "OffloadConfig":
        """Build from a plain dict (e.g. parsed JSON); unknown keys are errors, ``aio`` may be a dict."""
        return _from_mapping(cls, data, "")

    @classmethod
    def from_json(cls, path: Union[str, Path]) -> "OffloadConfig":
        """Read a JSON file holding the fields of ``from_dict``."""
        return cls.from_dict(read_json_object(path, "config file"))

    @classmethod
    def from_deepspeed(cls, ds: Union[dict, str, Path], **overrides: Any) -> "OffloadConfig":
        """Map a DeepSpeed ZeRO config (dict or JSON path); see ``offload.compat.deepspeed``."""
        # Imported here, not at the top: the mapping builds OffloadConfigs and imports this
        # module; this is the one way back, taken only when called.
        from .compat.deepspeed import from_deepspeed

        return from_deepspeed(ds, **overrides)


def read_json_object(path: Union[str, Path], what: str) -> dict:
    """The JSON object in file ``path``; a ConfigError names ``what``, the file and the problem."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(what, str(path), f"cannot be read: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(what, str(path),
                          f"is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    if not isinstance(data, dict):
        raise ConfigError(what, str(path), "must hold a JSON object")
    return data


def _paths(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, Path)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError("nvme_paths", value, "expected a non-empty list of directories, or None")
    out = []
    for p in value:
        if not isinstance(p, (str, Path)) or not str(p):
            raise ConfigError("nvme_paths", value, f"entry {p!r} is not a path")
        out.append(str(p))
    if len(set(out)) != len(out):
        raise ConfigError("nvme_paths", value, "lists the same directory twice")
    return tuple(out)


def _from_mapping(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "config", data, "expected a JSON object / dict")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}", data[key], f"unknown field; known: {', '.join(sorted(names))}")
    kwargs = dict(data)
    if cls is OffloadConfig and isinstance(kwargs.get("aio"), dict):
        kwargs["aio"] = _from_mapping(AioConfig, kwargs["aio"], "aio.")
    return cls(**kwargs)
