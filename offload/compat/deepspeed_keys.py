"""DeepSpeed's config vocabulary, as ``offload.compat.deepspeed`` reads it.

Which keys each section may hold (an unknown one is a ``ConfigError`` naming its path), which
are DeepSpeed machinery accepted without effect (``IGNORED_TOP``, ``IGNORED_ZERO``: key -> the
reason logged; an empty reason marks a key the mapping handles itself), and typed readers of
values whose every error names the DeepSpeed key path, e.g. ``zero_optimization.stage``.
DeepSpeed writes sizes as ``1e8``: integral floats read as integers. ``"auto"`` (Hugging Face's
Trainer integration) is recognised by ``is_auto``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# DeepSpeed's default sub_group_size (1e9 elements) means "one group for most models": no size asked.
SUB_GROUP_DEFAULT = 1_000_000_000
AUTO = "auto"

# Keys of DeepSpeed machinery that have no counterpart here; accepted and logged with the reason.
IGNORED_TOP = {
    "train_batch_size": "batch sizes are the data loader's business",
    "train_micro_batch_size_per_gpu": "batch sizes are the data loader's business",
    "steps_per_print": "logging",
    "wall_clock_breakdown": "logging (see model.offload_stats() and OFFLOAD_TRACE)",
    "memory_breakdown": "logging",
    "dump_state": "logging",
    "tensorboard": "logging",
    "wandb": "logging",
    "csv_monitor": "logging",
    "comet": "logging",
    "flops_profiler": "profiling",
    "comms_logger": "no collectives",
    "scheduler": "use a torch.optim.lr_scheduler on the offload.AdamW optimizer",
    "zero_allow_untested_optimizer": "only Adam/AdamW are accepted anyway",
    "zero_force_ds_cpu_optimizer": "offload always uses its own CPU Adam",
    "prescale_gradients": "no data-parallel reduction",
    "gradient_predivide_factor": "no data-parallel reduction",
    "communication_data_type": "no collectives",
    "seq_parallel_communication_data_type": "no collectives",
    "activation_checkpointing": "use torch.utils.checkpoint in the model (supported)",
    "checkpoint": "use model.state_dict() / optimizer.state_dict()",
    "data_types": "gradients are accumulated in fp32 chunks",
    "sparse_gradients": "gradients are dense chunks",
    "elasticity": "no data-parallel mode yet",
    "compression_training": "not applicable",
    "data_efficiency": "not applicable",
    "curriculum_learning": "not applicable",
    "autotuning": "see `offload plan` and `offload bench nvme --sweep`",
    "gradient_clipping": "pass max_grad_norm to offload.AdamW (deepspeed_optimizer_kwargs)",
    "optimizer": "pass its values to offload.AdamW (deepspeed_optimizer_kwargs)",
    "zero_optimization": "",
    "aio": "",
    "bf16": "",
    "bfloat16": "",
    "fp16": "",
    "amp": "",
    "gradient_accumulation_steps": "",
}

# Top-level keys that are offload.AdamW's arguments (deepspeed_optimizer_kwargs), not OffloadConfig's.
OPTIMIZER_KEYS = ("optimizer", "gradient_clipping")

IGNORED_ZERO = {
    "reduce_bucket_size": "no data-parallel reduction",
    "allgather_bucket_size": "no data-parallel all-gather",
    "allgather_partitions": "no data-parallel all-gather",
    "reduce_scatter": "no data-parallel reduction",
    "overlap_comm": "no collectives; chunk I/O always overlaps compute",
    "contiguous_gradients": "gradients always live in contiguous chunks",
    "load_from_fp32_weights": "fp32 masters are always kept",
    "elastic_checkpoint": "no data-parallel mode yet",
    "round_robin_gradients": "no data-parallel mode yet",
    "stage3_max_live_parameters": "the device tier is bounded by device_budget (bytes)",
    "stage3_max_reuse_distance": "eviction is by next use from the trace (Belady)",
    "stage3_param_persistence_threshold": "small parameters share chunks; no per-parameter persistence",
    "stage3_model_persistence_threshold": "small parameters share chunks; no per-parameter persistence",
    "stage3_gather_16bit_weights_on_model_save": "model.state_dict() always gathers full weights",
    "stage3_gather_fp16_weights_on_model_save": "model.state_dict() always gathers full weights",
    "stage3_module_granularity_threshold": "hooks are per module; chunks group small parameters",
    "zero_hpz_partition_size": "no data-parallel mode yet",
    "mics_shard_size": "no data-parallel mode yet",
    "mics_hierarchical_params_gather": "no data-parallel mode yet",
    "memory_efficient_linear": "not applicable",
    "use_multi_rank_bucket_allreduce": "no collectives",
    "ignore_unused_parameters": "parameters without gradients are handled",
    "legacy_stage1": "not applicable",
    "cpu_offload": "",            # legacy spelling, handled
    "cpu_offload_params": "",     # legacy spelling, handled
    "cpu_offload_use_pin_memory": "",
    "offload_param": "",
    "offload_optimizer": "",
    "stage": "",
    "sub_group_size": "",
    "stage3_prefetch_bucket_size": "",
    "prefetch_bucket_size": "",
    "zero_quantized_weights": "",
    "zero_quantized_nontrainable_weights": "",
    "zero_quantized_gradients": "",
    "aio": "",
}

PARAM_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"}
OPT_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "pipeline_read", "pipeline_write",
            "pipeline", "fast_init", "ratio"}
AIO_KEYS = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit",
            "overlap_events", "use_gds"}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
             "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}
BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
             "bf16_optimizer_states"}
OPT_TYPES = {"adam", "adamw", "cpuadam", "fusedadam", "deepspeedcpuadam"}


# ---- value readers (every error names the DeepSpeed key path) ---------------------------------

def read_section(parent: dict, key: str, path: str) -> dict:
    """``parent[key]`` as a dict (``{}`` when absent or null); ``path`` names it in errors."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(path, value, "expected a JSON object")
    return value


def is_auto(value: Any) -> bool:
    """Whether ``value`` is ``"auto"``: "offload's default" wherever it appears."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def read_bool(value: Any, path: str) -> bool:
    """``value`` when it is true or false."""
    if not isinstance(value, bool):
        raise ConfigError(path, value, "expected true or false")
    return value


def read_int(value: Any, path: str, lo: int = 0) -> int:
    """``value`` as an int >= ``lo``."""
    # DeepSpeed configs write sizes as 1e8 or 5e8: integral floats are fine.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(path, value, "expected an integer")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ConfigError(path, value, "expected an integer")
        value = int(value)
    if value < lo:
        raise ConfigError(path, value, f"must be >= {lo}")
    return value


def read_number(value: Any, path: str) -> float:
    """``value`` as a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(path, value, "expected a number")
    return float(value)


def check_keys(section: dict, known: set[str], path: str) -> None:
    """Refuse a key of ``section`` outside ``known``, naming its path and the known ones."""
    for key in section:
        if key not in known:
            raise ConfigError(f"{path}.{key}", section[key],
                              f"unknown key (known: {', '.join(sorted(known))})")


def read_device(section: dict, path: str) -> str:
    """An offload section's ``device``: none (the default), cpu or nvme."""
    value = section.get("device", "none")
    if value is None:
        return "none"
    if not isinstance(value, str) or value.lower() not in ("none", "cpu", "nvme"):
        raise ConfigError(f"{path}.device", value, "is not supported: offload tiers are none, cpu and nvme")
    return value.lower()


def read_nvme_path(section: dict, path: str) -> str:
    """The ``nvme_path`` a section with ``device: nvme`` must name."""
    value = section.get("nvme_path")
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ConfigError(f"{path}.device", "nvme", f"requires {path}.nvme_path")
    if not isinstance(value, (str, Path)):
        raise ConfigError(f"{path}.nvme_path", value, "expected a directory path")
    return str(value)
