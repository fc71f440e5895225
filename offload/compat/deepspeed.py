"""Migrate from DeepSpeed: ``from_deepspeed(ds)`` builds the ``OffloadConfig`` matching a ZeRO config
``ds`` (a dict, or the path of its JSON file; ``OffloadConfig.from_deepspeed`` calls it), and
``deepspeed_optimizer_kwargs(ds)`` returns ``offload.AdamW``'s keyword arguments from its
``optimizer`` section and ``gradient_clipping`` (read by ``offload.compat.deepspeed_optimizer``).

Every key falls in one of three groups:

* **mapped** — ``zero_optimization.offload_param`` / ``offload_optimizer`` (``device``,
  ``nvme_path``, ``pin_memory``), top-level ``aio`` (``block_size``, ``queue_depth``,
  ``thread_count`` / ``intra_op_parallelism``), ``bf16`` / ``fp16`` (``initial_scale_power``,
  ``loss_scale_window``), ``gradient_accumulation_steps``, ``zero_optimization.sub_group_size``
  (→ ``chunk_size``) and ``stage3_prefetch_bucket_size`` (→ ``prefetch_depth`` in chunks).
* **listed** — every key the ``OffloadConfig`` does not use, with the reason, in one WARNING
  line of the ``offload.config`` logger: tuning knobs of DeepSpeed's own machinery that have no
  counterpart here (bucket sizes for collectives, buffer pools, persistence thresholds, logging,
  batch sizes: loading data stays the user's), keys of a precision section that is not enabled,
  a legacy spelling shadowed by the current one, and ``optimizer`` and ``gradient_clipping``:
  those are ``offload.AdamW``'s arguments (``deepspeed_optimizer_kwargs(ds)`` gives them,
  ``gradient_clipping`` as ``max_grad_norm``), so the line shows their values and says so.
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
from pathlib import Path
from typing import Any, Union

from ..config import CHUNK_QUANTUM, AioConfig, OffloadConfig, read_json_object
from ..errors import ConfigError
from .deepspeed_keys import (
    AIO_KEYS,
    BF16_KEYS,
    FP16_KEYS,
    IGNORED_TOP,
    IGNORED_ZERO,
    OPT_KEYS,
    OPTIMIZER_KEYS,
    PARAM_KEYS,
    SUB_GROUP_DEFAULT,
    check_keys,
    is_auto,
    read_bool,
    read_device,
    read_int,
    read_number,
    read_nvme_path,
    read_section,
)
from .deepspeed_optimizer import read_optimizer

logger = logging.getLogger("offload.config")
_TO_ADAMW = "pass offload.AdamW(params, **deepspeed_optimizer_kwargs(ds))"

__all__ = ["from_deepspeed", "deepspeed_optimizer_kwargs", "load_deepspeed_config"]


def load_deepspeed_config(ds: Union[dict, str, Path]) -> dict:
    """The config as a dict: ``ds`` itself, or the parsed JSON file at path ``ds``."""
    if isinstance(ds, dict):
        return ds
    if isinstance(ds, (str, Path)):
        return read_json_object(ds, "deepspeed config")
    raise ConfigError("deepspeed config", type(ds).__name__, "expected a dict or the path of a JSON file")


def _chunk_from_elements(n: int) -> int:
    return max(CHUNK_QUANTUM, n // CHUNK_QUANTUM * CHUNK_QUANTUM)


# ---- the mapping ------------------------------------------------------------------------------

def from_deepspeed(ds: Union[dict, str, Path], **overrides: Any) -> OffloadConfig:
    """An ``OffloadConfig`` equivalent to DeepSpeed config ``ds`` (a dict or a JSON file path).

    ``overrides`` are ``OffloadConfig`` fields set after the mapping (e.g. ``device="cpu"``,
    ``cpu_budget="8GiB"``): DeepSpeed has no notion of byte budgets, so they stay ``"auto"``
    unless given here. See the module documentation for which keys are mapped, listed (one
    WARNING line on the ``offload.config`` logger) or refused (``ConfigError`` naming the key).
    """
    cfg = load_deepspeed_config(ds)
    ignored: list[str] = []
    fields: dict[str, Any] = {}

    for key in cfg:
        reason = IGNORED_TOP.get(key)
        if reason is None:
            ignored.append(f"{key} (not a setting offload knows)")
        elif reason and key not in OPTIMIZER_KEYS:
            ignored.append(f"{key} ({reason})")

    _map_precision(cfg, fields, ignored)
    _map_zero(cfg, fields, ignored)
    _map_aio(cfg, fields, ignored)

    gas = cfg.get("gradient_accumulation_steps")
    if is_auto(gas):
        ignored.append("gradient_accumulation_steps='auto' (kept 1: set the override "
                       "gradient_accumulation_steps=)")
    elif gas is not None:
        fields["gradient_accumulation_steps"] = read_int(gas, "gradient_accumulation_steps", 1)

    # Refuse an optimizer we cannot run now rather than at optimizer construction; what it does
    # accept is offload.AdamW's, not the wrapped model's, so it is listed with where it goes.
    ignored.extend(_optimizer_keys(cfg, read_optimizer(cfg)[0]))

    try:
        config = OffloadConfig(**fields)
    except ConfigError as exc:  # a value we mapped is out of range: name the DeepSpeed key
        raise ConfigError(_DS_KEY_OF.get(exc.field, exc.field), exc.value, exc.why) from exc
    if overrides:
        config = config.replace(**overrides)
    if ignored:
        logger.warning("from_deepspeed: accepted without effect: %s", "; ".join(ignored))
    return config


def _optimizer_keys(cfg: dict, kwargs: dict) -> list[str]:
    """``optimizer`` and ``gradient_clipping`` as entries of the ignored list: ``OffloadConfig``
    has no field for them (Adam's numbers and clipping are ``offload.AdamW``'s arguments), so each
    says what it holds and where it goes."""
    out = []
    opt = cfg.get("optimizer") or {}
    if opt:
        params = "".join(f", {k}={v!r}" for k, v in (opt.get("params") or {}).items())
        out.append(f"optimizer ({opt.get('type')}{params}: {_TO_ADAMW})")
    if "gradient_clipping" in cfg:
        made = f"max_grad_norm={kwargs['max_grad_norm']!r}" if "max_grad_norm" in kwargs else "AdamW's default"
        out.append(f"gradient_clipping={cfg['gradient_clipping']!r} (-> {made}: {_TO_ADAMW})")
    return out


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
    if read_section(cfg, "amp", "amp").get("enabled"):
        raise ConfigError("amp.enabled", True, "is not supported (apex AMP): use bf16.enabled or fp16.enabled")
    bf_key = "bf16" if "bf16" in cfg else "bfloat16"
    bf16 = read_section(cfg, bf_key, bf_key)
    fp16 = read_section(cfg, "fp16", "fp16")
    check_keys(bf16, BF16_KEYS, bf_key)
    check_keys(fp16, FP16_KEYS, "fp16")
    bf_raw = bf16.get("enabled", False)
    fp_raw = fp16.get("enabled", False)
    # "auto" (the Trainer fills it from --bf16/--fp16) counts as off unless nothing is on.
    bf_on = False if is_auto(bf_raw) else read_bool(bf_raw, f"{bf_key}.enabled")
    fp_on = False if is_auto(fp_raw) else read_bool(fp_raw, "fp16.enabled")
    if bf_on and fp_on:
        raise ConfigError("fp16.enabled", True, f"and {bf_key}.enabled=true cannot both be set")
    if "bf16" in cfg and "bfloat16" in cfg:
        ignored.append("bfloat16 (bf16 is read: the same section under its older name)")
    for key, section, on in ((bf_key, bf16, bf_on), ("fp16", fp16, fp_on)):
        if not on:
            ignored.extend(f"{key}.{k} ({key} is not enabled)" for k in section if k != "enabled")
    if not (bf_on or fp_on) and (is_auto(bf_raw) or is_auto(fp_raw)):
        ignored.append(f"{bf_key if is_auto(bf_raw) else 'fp16'}.enabled='auto' (dtype stays "
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
    if not is_auto(scale) and read_number(scale, "fp16.loss_scale") != 0:
        raise ConfigError("fp16.loss_scale", scale,
                          "(static) is not supported: offload uses dynamic loss scaling "
                          "(set 0 and initial_scale_power instead)")
    power = fp16.get("initial_scale_power")
    if power is not None and not is_auto(power):
        power = read_int(power, "fp16.initial_scale_power", 0)
        if power > 32:
            raise ConfigError("fp16.initial_scale_power", power, "must be at most 32 (a scale of 2**32)")
        fields["initial_loss_scale"] = float(2 ** power)
    window = fp16.get("loss_scale_window")
    if window is not None and not is_auto(window):
        fields["loss_scale_window"] = read_int(window, "fp16.loss_scale_window", 1)
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
    zero = raw if isinstance(raw, dict) else read_section(cfg, "zero_optimization", "zero_optimization")
    p = "zero_optimization"
    stage = zero.get("stage", 0)
    stage = read_int(stage, f"{p}.stage")
    if stage > 3:
        raise ConfigError(f"{p}.stage", stage, "must be 0, 1, 2 or 3")

    for key in zero:
        reason = IGNORED_ZERO.get(key)
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
    if "cpu_offload_use_pin_memory" in zero and not (zero.get("cpu_offload") or zero.get("cpu_offload_params")):
        ignored.append(f"{p}.cpu_offload_use_pin_memory (neither cpu_offload nor cpu_offload_params is set)")
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
        if old in zero and new in zero:
            ignored.append(f"{p}.{old} ({p}.{new} is read: the newer spelling of the same setting)")
    if zero.get("cpu_offload") and "offload_optimizer" not in zero:
        zero = {**zero, "offload_optimizer": {"device": "cpu",
                                              "pin_memory": bool(zero.get("cpu_offload_use_pin_memory", False))}}
    if zero.get("cpu_offload_params") and "offload_param" not in zero:
        zero = {**zero, "offload_param": {"device": "cpu",
                                          "pin_memory": bool(zero.get("cpu_offload_use_pin_memory", False))}}

    param = read_section(zero, "offload_param", f"{p}.offload_param")
    opt = read_section(zero, "offload_optimizer", f"{p}.offload_optimizer")
    check_keys(param, PARAM_KEYS, f"{p}.offload_param")
    check_keys(opt, OPT_KEYS, f"{p}.offload_optimizer")
    param_dev = read_device(param, f"{p}.offload_param")
    opt_dev = read_device(opt, f"{p}.offload_optimizer")
    if param_dev != "none" and stage != 3:
        raise ConfigError(f"{p}.offload_param.device", param_dev,
                          f"requires {p}.stage=3 (as in DeepSpeed); stage is {stage}")

    paths: list[str] = []
    for dev, sec, name in ((param_dev, param, "offload_param"), (opt_dev, opt, "offload_optimizer")):
        if dev == "nvme":
            path = read_nvme_path(sec, f"{p}.{name}")
            if path not in paths:
                paths.append(path)
        elif "nvme_path" in sec and sec["nvme_path"] is not None:
            ignored.append(f"{p}.{name}.nvme_path (device is {dev!r})")
    if paths:
        fields["nvme_paths"] = paths
    if opt_dev == "none" and (param_dev != "none" or stage):
        ignored.append(f"{p}.offload_optimizer.device='none' (Adam always runs on the CPU here)")

    pins = [read_bool(sec["pin_memory"], f"{p}.{name}.pin_memory")
            for sec, name in ((param, "offload_param"), (opt, "offload_optimizer")) if "pin_memory" in sec]
    if pins:
        fields["pin_memory"] = any(pins)

    ratio = opt.get("ratio", 1.0)
    if read_number(ratio, f"{p}.offload_optimizer.ratio") != 1.0:
        raise ConfigError(f"{p}.offload_optimizer.ratio", ratio,
                          "is not supported: offload runs every parameter's Adam on the CPU (ratio 1.0)")
    for key, why in (("pipeline_read", "optimizer I/O is always pipelined"),
                     ("pipeline_write", "optimizer I/O is always pipelined"),
                     ("pipeline", "optimizer I/O is always pipelined"),
                     ("fast_init", "swap files are written once at set-up")):
        if key in opt:
            read_bool(opt[key], f"{p}.offload_optimizer.{key}")
            ignored.append(f"{p}.offload_optimizer.{key} ({why})")
    for key in ("buffer_count",):
        if key in opt:
            read_int(opt[key], f"{p}.offload_optimizer.{key}")
            ignored.append(f"{p}.offload_optimizer.{key} (buffers are sized by chunks and budgets)")
    for key in ("buffer_count", "buffer_size", "max_in_cpu"):
        if key in param and not is_auto(param[key]):
            read_int(param[key], f"{p}.offload_param.{key}")
            ignored.append(f"{p}.offload_param.{key} (buffers are sized by chunks and cpu_budget)")

    # sub_group_size: DeepSpeed's unit of optimizer swapping and stepping = our chunk.
    sub = zero.get("sub_group_size")
    chunk = None
    if sub is not None and not is_auto(sub):
        sub = read_int(sub, f"{p}.sub_group_size", 1)
        if sub >= SUB_GROUP_DEFAULT:
            ignored.append(f"{p}.sub_group_size={sub} (DeepSpeed's 'no split' default: chunk_size stays auto)")
        else:
            chunk = _chunk_from_elements(sub)
            fields["chunk_size"] = chunk
    # stage3_prefetch_bucket_size (elements fetched ahead) -> chunks ahead
    key = "stage3_prefetch_bucket_size" if "stage3_prefetch_bucket_size" in zero else "prefetch_bucket_size"
    if key != "prefetch_bucket_size" and "prefetch_bucket_size" in zero:
        ignored.append(f"{p}.prefetch_bucket_size ({p}.{key} is read: they name the same setting)")
    bucket = zero.get(key)
    if bucket is not None and not is_auto(bucket):
        bucket = read_int(bucket, f"{p}.{key}")
        if chunk is None:
            ignored.append(f"{p}.{key} (chunk_size is auto, so prefetch_depth stays at its default; "
                           f"set sub_group_size or the prefetch_depth override)")
        else:
            fields["prefetch_depth"] = min(1024, -(-bucket // chunk))


def _map_aio(cfg: dict, fields: dict, ignored: list[str]) -> None:
    aio = read_section(cfg, "aio", "aio")
    if not aio:
        return
    check_keys(aio, AIO_KEYS, "aio")
    if aio.get("use_gds"):
        raise ConfigError("aio.use_gds", aio["use_gds"],
                          "is not supported: NVMe traffic goes through libaio into pinned host buffers")
    kw: dict[str, Any] = {}
    if "block_size" in aio and not is_auto(aio["block_size"]):
        size = read_int(aio["block_size"], "aio.block_size", 1)
        if size % 4096:
            raise ConfigError("aio.block_size", aio["block_size"],
                              "must be a multiple of 4096 bytes (O_DIRECT)")
        kw["block_size"] = size
    if "queue_depth" in aio and not is_auto(aio["queue_depth"]):
        kw["queue_depth"] = read_int(aio["queue_depth"], "aio.queue_depth", 1)
    threads = {k: read_int(aio[k], f"aio.{k}", 1) for k in ("thread_count", "intra_op_parallelism")
               if k in aio and not is_auto(aio[k])}
    if len(set(threads.values())) > 1:
        raise ConfigError("aio.intra_op_parallelism", threads["intra_op_parallelism"],
                          f"differs from aio.thread_count={threads['thread_count']} (they name the same setting)")
    if threads:
        kw["threads"] = next(iter(threads.values()))
    for key, why in (("single_submit", "requests per io_submit follow AioConfig.submit_batch"),
                     ("overlap_events", "completions are always reaped while submitting")):
        if key in aio:
            read_bool(aio[key], f"aio.{key}")
            ignored.append(f"aio.{key} ({why})")
    try:
        fields["aio"] = AioConfig(**kw)
    except ConfigError as exc:
        raise ConfigError(_DS_KEY_OF.get(exc.field, exc.field), exc.value, exc.why) from exc


def deepspeed_optimizer_kwargs(ds: Union[dict, str, Path]) -> dict:
    """Keyword arguments of ``offload.AdamW`` from DeepSpeed config ``ds``.

    Returns a subset of ``{"lr", "betas", "eps", "weight_decay", "max_grad_norm"}``: the values
    in ``optimizer.params`` (``optimizer.type`` Adam or AdamW; DeepSpeed's Adam decouples weight
    decay unless ``adam_w_mode`` is false, and so does ``offload.AdamW``) and ``max_grad_norm``
    from ``gradient_clipping`` (absent or 0: no clipping, ``None``). Keys set to ``"auto"`` or
    absent are left out, so ``offload.AdamW``'s defaults (or your own values) apply. Other
    optimizer types, ``amsgrad``, and L2-style decay (``adam_w_mode: false`` with a nonzero
    ``weight_decay``) raise ``ConfigError`` naming the key.
    """
    out, notes = read_optimizer(load_deepspeed_config(ds))
    if notes:
        logger.warning("deepspeed_optimizer_kwargs: left to offload.AdamW's defaults: %s", ", ".join(notes))
    return out
