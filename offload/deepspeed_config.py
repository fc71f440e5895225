"""Migrate from DeepSpeed: read a ZeRO config and build the matching ``OffloadConfig``.

``from_deepspeed(ds)`` takes a DeepSpeed config (a dict, or the path of its JSON file) and
returns an ``OffloadConfig``; ``deepspeed_optimizer_kwargs(ds)`` returns the keyword arguments
of ``offload.AdamW`` from its ``optimizer`` section and ``gradient_clipping``::

    cfg = OffloadConfig.from_deepspeed("ds_config.json")
    model = offload.wrap(model, cfg)
    optimizer = offload.AdamW(model.parameters(), **deepspeed_optimizer_kwargs("ds_config.json"))

Every key falls in one of three groups:

* **mapped** — ``zero_optimization.offload_param`` / ``offload_optimizer`` (``device``,
  ``nvme_path``, ``pin_memory``), top-level ``aio`` (``block_size``, ``queue_depth``,
  ``thread_count`` / ``intra_op_parallelism``), ``bf16`` / ``fp16`` (``initial_scale_power``,
  ``loss_scale_window``), ``gradient_accumulation_steps``, ``zero_optimization.sub_group_size``
  (→ ``chunk_size``) and ``stage3_prefetch_bucket_size`` (→ ``prefetch_depth`` in chunks).
* **ignored** — tuning knobs of DeepSpeed's own machinery that have no counterpart here (bucket
  sizes for collectives, buffer pools, persistence thresholds, logging, batch sizes: loading data
  stays the user's). They are accepted and listed, with the reason, in one WARNING line of the
  ``offload.config`` logger.
* **refused** — settings whose meaning we would not honour (static loss scaling, GPUDirect
  Storage, a partial CPU optimizer ``ratio``, optimizers other than Adam/AdamW, quantized ZeRO
  weights or gradients, ...). They raise ``ConfigError`` whose field is the exact DeepSpeed key
  path, e.g. ``aio.use_gds=True: ... is not supported``.

The value ``"auto"`` (written by Hugging Face's Trainer integration) means "our default" for every
key; it is accepted everywhere and listed in the warning line when it stands for a number that
DeepSpeed would have taken from elsewhere (batch sizes, gradient accumulation, clipping, lr).

**ZeRO stage.** The engine always keeps parameters, gradients and Adam state in chunks and runs
Adam on the CPU: there is no "parameters stay whole on the GPU" mode to switch to. Stage 3 is
what matches it. Stages 0-2 are still accepted (many configs that use ``offload_optimizer`` are
stage 2): the mapped config then leaves ``device_budget="auto"``, so parameters stay on the
compute device whenever they fit — the closest equivalent of not partitioning them — and only
the optimizer state moves. ``offload_param`` with a device other than ``none`` requires stage 3,
as in DeepSpeed, and raises otherwise.

**Placement.** DeepSpeed places each kind of state by its section (parameters in one place,
optimizer state in another); offload places every chunk by budgets and next use. A section with
``device: nvme`` therefore adds its ``nvme_path`` to ``nvme_paths`` (both paths when they
differ), and ``device: cpu`` keeps the NVMe tier off unless the other section asks for it.
``offload_optimizer.device: none`` is accepted, but Adam still runs on the CPU (noted in the
warning line). Budgets stay ``"auto"``; pass ``cpu_budget=`` / ``device_budget=`` as overrides.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Union

from .config import CHUNK_QUANTUM, AioConfig, OffloadConfig, read_json_object
from .errors import ConfigError

logger = logging.getLogger("offload.config")

__all__ = ["from_deepspeed", "deepspeed_optimizer_kwargs", "load_deepspeed_config"]

# DeepSpeed's default sub_group_size (1e9 elements) means "one group for most models": no size asked.
_SUB_GROUP_DEFAULT = 1_000_000_000
_AUTO = "auto"

# Keys of DeepSpeed machinery that have no counterpart here; accepted and logged with the reason.
_IGNORED_TOP = {
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

_IGNORED_ZERO = {
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

_PARAM_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"}
_OPT_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "pipeline_read", "pipeline_write",
             "pipeline", "fast_init", "ratio"}
_AIO_KEYS = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit",
             "overlap_events", "use_gds"}
_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}
_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states"}
_OPT_TYPES = {"adam", "adamw", "cpuadam", "fusedadam", "deepspeedcpuadam"}


def load_deepspeed_config(ds: Union[dict, str, Path]) -> dict:
    """The config as a dict: ``ds`` itself, or the parsed JSON file at path ``ds``."""
    if isinstance(ds, dict):
        return ds
    if isinstance(ds, (str, Path)):
        return read_json_object(ds, "deepspeed config")
    raise ConfigError("deepspeed config", type(ds).__name__, "expected a dict or the path of a JSON file")


# ---- small value readers (every error names the DeepSpeed key path) -------------------------

def _section(parent: dict, key: str, path: str) -> dict:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(path, value, "expected a JSON object")
    return value


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == _AUTO


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, value, "expected true or false")
    return value


def _int(value: Any, path: str, lo: int = 0) -> int:
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


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(path, value, "expected a number")
    return float(value)


def _check_keys(section: dict, known: set[str], path: str) -> None:
    for key in section:
        if key not in known:
            raise ConfigError(f"{path}.{key}", section[key],
                              f"unknown key (known: {', '.join(sorted(known))})")


def _device(section: dict, path: str) -> str:
    value = section.get("device", "none")
    if value is None:
        return "none"
    if not isinstance(value, str) or value.lower() not in ("none", "cpu", "nvme"):
        raise ConfigError(f"{path}.device", value, "is not supported: offload tiers are none, cpu and nvme")
    return value.lower()


def _nvme_path(section: dict, path: str) -> str:
    value = section.get("nvme_path")
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ConfigError(f"{path}.device", "nvme", f"requires {path}.nvme_path")
    if not isinstance(value, (str, Path)):
        raise ConfigError(f"{path}.nvme_path", value, "expected a directory path")
    return str(value)


def _chunk_from_elements(n: int) -> int:
    return max(CHUNK_QUANTUM, n // CHUNK_QUANTUM * CHUNK_QUANTUM)


# ---- the mapping ------------------------------------------------------------------------------

def from_deepspeed(ds: Union[dict, str, Path], **overrides: Any) -> OffloadConfig:
    """An ``OffloadConfig`` equivalent to DeepSpeed config ``ds`` (a dict or a JSON file path).

    ``overrides`` are ``OffloadConfig`` fields set after the mapping (e.g. ``device="cpu"``,
    ``cpu_budget="8GiB"``): DeepSpeed has no notion of byte budgets, so they stay ``"auto"``
    unless given here. See the module documentation for which keys are mapped, ignored (one
    WARNING line on the ``offload.config`` logger) or refused (``ConfigError`` naming the key).
    """
    cfg = load_deepspeed_config(ds)
    ignored: list[str] = []
    fields: dict[str, Any] = {}

    for key in cfg:
        reason = _IGNORED_TOP.get(key)
        if reason is None:
            ignored.append(f"{key} (not a setting offload knows)")
        elif reason and key not in ("optimizer", "gradient_clipping"):
            ignored.append(f"{key} ({reason})")

    _map_precision(cfg, fields, ignored)
    _map_zero(cfg, fields, ignored)
    _map_aio(cfg, fields, ignored)

    gas = cfg.get("gradient_accumulation_steps")
    if _is_auto(gas):
        ignored.append("gradient_accumulation_steps='auto' (kept 1: set the override "
                       "gradient_accumulation_steps=)")
    elif gas is not None:
        fields["gradient_accumulation_steps"] = _int(gas, "gradient_accumulation_steps", 1)

    # Refuse an optimizer we cannot run now rather than at optimizer construction.
    deepspeed_optimizer_kwargs(cfg, _log=False)

    try:
        config = OffloadConfig(**fields)
    except ConfigError as exc:  # a value we mapped is out of range: name the DeepSpeed key
        raise ConfigError(_DS_KEY_OF.get(exc.field, exc.field), exc.value, exc.why) from exc
    if overrides:
        config = config.replace(**overrides)
    if ignored:
        logger.warning("from_deepspeed: accepted without effect: %s", "; ".join(ignored))
    return config


# OffloadConfig field -> the DeepSpeed key it came from (to name it in range errors)
_DS_KEY_OF = {
    "aio.block_size": "aio.block_size",
    "aio.queue_depth": "aio.queue_depth",
    "aio.threads": "aio.thread_count",
    "initial_loss_scale": "fp16.initial_scale_power",
    "loss_scale_window": "fp16.loss_scale_window",
    "chunk_size": "zero_optimization.sub_group_size",
    "prefetch_depth": "zero_optimization.stage3_prefetch_bucket_size",
    "nvme_paths": "zero_optimization.offload_param.nvme_path",
}


def _map_precision(cfg: dict, fields: dict, ignored: list[str]) -> None:
    if _section(cfg, "amp", "amp").get("enabled"):
        raise ConfigError("amp.enabled", True, "is not supported (apex AMP): use bf16.enabled or fp16.enabled")
    bf_key = "bf16" if "bf16" in cfg else "bfloat16"
    bf16 = _section(cfg, bf_key, bf_key)
    fp16 = _section(cfg, "fp16", "fp16")
    _check_keys(bf16, _BF16_KEYS, bf_key)
    _check_keys(fp16, _FP16_KEYS, "fp16")
    bf_raw = bf16.get("enabled", False)
    fp_raw = fp16.get("enabled", False)
    # "auto" (the Trainer fills it from --bf16/--fp16) counts as off unless nothing is on.
    bf_on = False if _is_auto(bf_raw) else _bool(bf_raw, f"{bf_key}.enabled")
    fp_on = False if _is_auto(fp_raw) else _bool(fp_raw, "fp16.enabled")
    if bf_on and fp_on:
        raise ConfigError("fp16.enabled", True, f"and {bf_key}.enabled=true cannot both be set")
    if not (bf_on or fp_on) and (_is_auto(bf_raw) or _is_auto(fp_raw)):
        ignored.append(f"{bf_key if _is_auto(bf_raw) else 'fp16'}.enabled='auto' (dtype stays "
                       f"{OffloadConfig().dtype}: pass the dtype= override)")
        return
    fields["dtype"] = "bf16" if bf_on else "fp16" if fp_on else "fp32"
    if bf_on:
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if bf16.get(key):
                raise ConfigError(f"{bf_key}.{key}", bf16[key],
                                  "is not supported: offload keeps fp32 masters and fp32 Adam state")
        for key in ("immediate_grad_update", "check_grad_overflow"):
            if key in bf16:
                ignored.append(f"{bf_key}.{key} (gradients go to the optimizer as soon as a chunk completes)")
    if not fp_on:
        return
    scale = fp16.get("loss_scale", 0)
    if not _is_auto(scale) and _number(scale, "fp16.loss_scale") != 0:
        raise ConfigError("fp16.loss_scale", scale,
                          "(static) is not supported: offload uses dynamic loss scaling "
                          "(set 0 and initial_scale_power instead)")
    power = fp16.get("initial_scale_power")
    if power is not None and not _is_auto(power):
        power = _int(power, "fp16.initial_scale_power", 0)
        if power > 32:
            raise ConfigError("fp16.initial_scale_power", power, "must be at most 32 (a scale of 2**32)")
        fields["initial_loss_scale"] = float(2 ** power)
    window = fp16.get("loss_scale_window")
    if window is not None and not _is_auto(window):
        fields["loss_scale_window"] = _int(window, "fp16.loss_scale_window", 1)
    if fp16.get("fp16_master_weights_and_grads"):
        raise ConfigError("fp16.fp16_master_weights_and_grads", True,
                          "is not supported: offload keeps fp32 masters")
    if fp16.get("auto_cast"):
        raise ConfigError("fp16.auto_cast", True,
                          "is not supported: feed the model its inputs; parameters are fp16 already")
    for key, why in (("hysteresis", "the scale halves on every overflow (hysteresis 1)"),
                     ("consecutive_hysteresis", "the scale halves on every overflow"),
                     ("min_loss_scale", "the scale has a floor of 1")):
        if key in fp16:
            ignored.append(f"fp16.{key} ({why})")


def _map_zero(cfg: dict, fields: dict, ignored: list[str]) -> None:
    raw = cfg.get("zero_optimization")
    if isinstance(raw, bool):  # DeepSpeed's legacy form: true means stage 1
        raw = {"stage": 1 if raw else 0}
    zero = raw if isinstance(raw, dict) else _section(cfg, "zero_optimization", "zero_optimization")
    p = "zero_optimization"
    stage = zero.get("stage", 0)
    stage = _int(stage, f"{p}.stage")
    if stage > 3:
        raise ConfigError(f"{p}.stage", stage, "must be 0, 1, 2 or 3")

    for key in zero:
        reason = _IGNORED_ZERO.get(key)
        if reason is None:
            ignored.append(f"{p}.{key} (not a setting offload knows)")
        elif reason:
            ignored.append(f"{p}.{key} ({reason})")

    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        if zero.get(key):
            raise ConfigError(f"{p}.{key}", zero[key], "is not supported: chunks hold exact values")
    if "aio" in zero:
        raise ConfigError(f"{p}.aio", zero["aio"],
                          "DeepSpeed reads aio only at the top level (it ignores it here); "
                          "move the section to the top level")

    # legacy spellings (DeepSpeed < 0.3.16)
    if zero.get("cpu_offload") and "offload_optimizer" not in zero:
        zero = {**zero, "offload_optimizer": {"device": "cpu",
                                              "pin_memory": bool(zero.get("cpu_offload_use_pin_memory", False))}}
    if zero.get("cpu_offload_params") and "offload_param" not in zero:
        zero = {**zero, "offload_param": {"device": "cpu",
                                          "pin_memory": bool(zero.get("cpu_offload_use_pin_memory", False))}}

    param = _section(zero, "offload_param", f"{p}.offload_param")
    opt = _section(zero, "offload_optimizer", f"{p}.offload_optimizer")
    _check_keys(param, _PARAM_KEYS, f"{p}.offload_param")
    _check_keys(opt, _OPT_KEYS, f"{p}.offload_optimizer")
    param_dev = _device(param, f"{p}.offload_param")
    opt_dev = _device(opt, f"{p}.offload_optimizer")
    if param_dev != "none" and stage != 3:
        raise ConfigError(f"{p}.offload_param.device", param_dev,
                          f"requires {p}.stage=3 (as in DeepSpeed); stage is {stage}")

    paths: list[str] = []
    for dev, sec, name in ((param_dev, param, "offload_param"), (opt_dev, opt, "offload_optimizer")):
        if dev == "nvme":
            path = _nvme_path(sec, f"{p}.{name}")
            if path not in paths:
                paths.append(path)
        elif "nvme_path" in sec and sec["nvme_path"] is not None:
            ignored.append(f"{p}.{name}.nvme_path (device is {dev!r})")
    if paths:
        fields["nvme_paths"] = paths
    if opt_dev == "none" and (param_dev != "none" or stage):
        ignored.append(f"{p}.offload_optimizer.device='none' (Adam always runs on the CPU here)")

    pins = [_bool(sec["pin_memory"], f"{p}.{name}.pin_memory")
            for sec, name in ((param, "offload_param"), (opt, "offload_optimizer")) if "pin_memory" in sec]
    if pins:
        fields["pin_memory"] = any(pins)

    ratio = opt.get("ratio", 1.0)
    if _number(ratio, f"{p}.offload_optimizer.ratio") != 1.0:
        raise ConfigError(f"{p}.offload_optimizer.ratio", ratio,
                          "is not supported: offload runs every parameter's Adam on the CPU (ratio 1.0)")
    for key, why in (("pipeline_read", "optimizer I/O is always pipelined"),
                     ("pipeline_write", "optimizer I/O is always pipelined"),
                     ("pipeline", "optimizer I/O is always pipelined"),
                     ("fast_init", "swap files are written once at set-up")):
        if key in opt:
            _bool(opt[key], f"{p}.offload_optimizer.{key}")
            ignored.append(f"{p}.offload_optimizer.{key} ({why})")
    for key in ("buffer_count",):
        if key in opt:
            _int(opt[key], f"{p}.offload_optimizer.{key}")
            ignored.append(f"{p}.offload_optimizer.{key} (buffers are sized by chunks and budgets)")
    for key in ("buffer_count", "buffer_size", "max_in_cpu"):
        if key in param and not _is_auto(param[key]):
            _int(param[key], f"{p}.offload_param.{key}")
            ignored.append(f"{p}.offload_param.{key} (buffers are sized by chunks and cpu_budget)")

    # sub_group_size: DeepSpeed's unit of optimizer swapping and stepping = our chunk.
    sub = zero.get("sub_group_size")
    chunk = None
    if sub is not None and not _is_auto(sub):
        sub = _int(sub, f"{p}.sub_group_size", 1)
        if sub >= _SUB_GROUP_DEFAULT:
            ignored.append(f"{p}.sub_group_size={sub} (DeepSpeed's 'no split' default: chunk_size stays auto)")
        else:
            chunk = _chunk_from_elements(sub)
            fields["chunk_size"] = chunk
    # stage3_prefetch_bucket_size (elements fetched ahead) -> chunks ahead
    key = "stage3_prefetch_bucket_size" if "stage3_prefetch_bucket_size" in zero else "prefetch_bucket_size"
    bucket = zero.get(key)
    if bucket is not None and not _is_auto(bucket):
        bucket = _int(bucket, f"{p}.{key}")
        if chunk is None:
            ignored.append(f"{p}.{key} (chunk_size is auto, so prefetch_depth stays at its default; "
                           f"set sub_group_size or the prefetch_depth override)")
        else:
            fields["prefetch_depth"] = min(1024, -(-bucket // chunk))


def _map_aio(cfg: dict, fields: dict, ignored: list[str]) -> None:
    aio = _section(cfg, "aio", "aio")
    if not aio:
        return
    _check_keys(aio, _AIO_KEYS, "aio")
    if aio.get("use_gds"):
        raise ConfigError("aio.use_gds", aio["use_gds"],
                          "is not supported: NVMe traffic goes through libaio into pinned host buffers")
    kw: dict[str, Any] = {}
    if "block_size" in aio and not _is_auto(aio["block_size"]):
        size = _int(aio["block_size"], "aio.block_size", 1)
        if size % 4096:
            raise ConfigError("aio.block_size", aio["block_size"],
                              "must be a multiple of 4096 bytes (O_DIRECT)")
        kw["block_size"] = size
    if "queue_depth" in aio and not _is_auto(aio["queue_depth"]):
        kw["queue_depth"] = _int(aio["queue_depth"], "aio.queue_depth", 1)
    threads = {k: _int(aio[k], f"aio.{k}", 1) for k in ("thread_count", "intra_op_parallelism")
               if k in aio and not _is_auto(aio[k])}
    if len(set(threads.values())) > 1:
        raise ConfigError("aio.intra_op_parallelism", threads["intra_op_parallelism"],
                          f"differs from aio.thread_count={threads['thread_count']} (they name the same setting)")
    if threads:
        kw["threads"] = next(iter(threads.values()))
    for key, why in (("single_submit", "requests per io_submit follow AioConfig.submit_batch"),
                     ("overlap_events", "completions are always reaped while submitting")):
        if key in aio:
            _bool(aio[key], f"aio.{key}")
            ignored.append(f"aio.{key} ({why})")
    try:
        fields["aio"] = AioConfig(**kw)
    except ConfigError as exc:
        raise ConfigError(_DS_KEY_OF.get(exc.field, exc.field), exc.value, exc.why) from exc


def deepspeed_optimizer_kwargs(ds: Union[dict, str, Path], *, _log: bool = True) -> dict:
    """Keyword arguments of ``offload.AdamW`` from DeepSpeed config ``ds``.

    Returns a subset of ``{"lr", "betas", "eps", "weight_decay", "max_grad_norm"}``: the values
    in ``optimizer.params`` (``optimizer.type`` Adam or AdamW; DeepSpeed's Adam decouples weight
    decay unless ``adam_w_mode`` is false, and so does ``offload.AdamW``) and ``max_grad_norm``
    from ``gradient_clipping`` (absent or 0: no clipping, ``None``). Keys set to ``"auto"`` or
    absent are left out, so ``offload.AdamW``'s defaults (or your own values) apply. Other
    optimizer types, ``amsgrad``, and L2-style decay (``adam_w_mode: false`` with a nonzero
    ``weight_decay``) raise ``ConfigError`` naming the key.
    """
    cfg = load_deepspeed_config(ds)
    out: dict[str, Any] = {}
    notes: list[str] = []
    opt = _section(cfg, "optimizer", "optimizer")
    if opt:
        kind = opt.get("type")
        if not isinstance(kind, str) or kind.replace("_", "").lower() not in _OPT_TYPES:
            raise ConfigError("optimizer.type", kind,
                              "is not supported: offload runs AdamW on the CPU (use type Adam or AdamW)")
        params = _section(opt, "params", "optimizer.params")
        known = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction",
                 "torch_adam", "fp32_optimizer_states", "max_grad_norm"}
        _check_keys(params, known, "optimizer.params")
        if params.get("amsgrad"):
            raise ConfigError("optimizer.params.amsgrad", params["amsgrad"], "is not supported")
        if params.get("bias_correction", True) is not True:
            raise ConfigError("optimizer.params.bias_correction", params["bias_correction"],
                              "is not supported: offload's Adam always corrects bias")
        if params.get("fp32_optimizer_states", True) is not True:
            raise ConfigError("optimizer.params.fp32_optimizer_states", params["fp32_optimizer_states"],
                              "is not supported: Adam state is always fp32")
        for key in ("lr", "eps", "weight_decay"):
            value = params.get(key)
            if value is not None and not _is_auto(value):
                out[key] = _number(value, f"optimizer.params.{key}")
            elif _is_auto(value):
                notes.append(f"optimizer.params.{key}='auto'")
        betas = params.get("betas")
        if betas is not None and not _is_auto(betas):
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise ConfigError("optimizer.params.betas", betas, "expected two numbers")
            out["betas"] = tuple(_number(b, "optimizer.params.betas") for b in betas)
        elif _is_auto(betas):
            notes.append("optimizer.params.betas='auto'")
        decoupled = kind.lower() == "adamw" or params.get("adam_w_mode", True)
        if not _bool(decoupled, "optimizer.params.adam_w_mode") and out.get("weight_decay", 0.0) != 0.0:
            raise ConfigError("optimizer.params.adam_w_mode", False,
                              "is not supported with weight_decay != 0: offload.AdamW decouples weight decay")
        if not decoupled and "weight_decay" not in out:
            # DeepSpeed's Adam in L2 mode defaults to no decay; offload.AdamW's default is 0.01.
            out["weight_decay"] = 0.0
    clip = cfg.get("gradient_clipping")
    if _is_auto(clip):
        notes.append("gradient_clipping='auto'")
    elif clip is not None:
        norm = _number(clip, "gradient_clipping")
        if norm < 0:
            raise ConfigError("gradient_clipping", clip, "must be >= 0 (0 means no clipping)")
        out["max_grad_norm"] = norm if norm > 0 else None
    if notes and _log:
        logger.warning("deepspeed_optimizer_kwargs: left to offload.AdamW's defaults: %s", ", ".join(notes))
    return out
