"""The values of ``offload plan``'s flags: byte sizes and positive numbers, checked by argparse
when the command line is parsed (``whole``, ``rate``, ``size``: exit 2 naming the flag) and again
when a library caller hands them over (``size_flag`` ...: ``ConfigError`` naming the flag); and the
models ``--model`` names (a preset, or a Hugging Face model directory and, with ``--lora-rank``,
its LoRA fine-tune)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..errors import ConfigError
from ..units import parse_bytes
from .defaults import SEQ_LEN


def whole(text: str) -> int:
    """argparse type: a whole number > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def rate(text: str) -> float:
    """argparse type: a finite number > 0 (GB/s, TFLOPS, parameters/s)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def size(text: str) -> int:
    """argparse type: a byte count > 0 ("512G", "8T", 4096)."""
    try:
        value = parse_bytes(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 80G, 512GB or 8T, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text}")
    return value


def size_flag(value, flag: str) -> int | None:
    """A byte count given as ``flag`` ("512G", 4096; None when not given), > 0."""
    if value is None:
        return None
    n = parse_bytes(value, flag)
    if n == 0:
        raise ConfigError(flag, value, "must be > 0")
    return n


def positive_int_flag(value, flag: str) -> int | None:
    """A count given as ``flag`` (None when not given), > 0."""
    if value is None:
        return None
    if value <= 0:
        raise ConfigError(flag, value, "must be > 0")
    return value


def positive_flag(value: float | None, flag: str) -> float | None:
    """A rate given as ``flag`` (None when not given), > 0."""
    if value is not None and not value > 0:
        raise ConfigError(flag, value, "must be > 0")
    return value


def describe_models(args: argparse.Namespace) -> list:
    """For a model directory: its full fine-tune, and with --lora-rank the LoRA one ([] for a preset)."""
    if getattr(args, "_described", None) is not None:
        return args._described
    out = []
    if not Path(args.model).is_dir():
        from ..models.llama import PRESETS
        from .model import PLANNER_PRESETS, resolve_model

        try:
            resolve_model(args.model)
        except ConfigError:
            names = [*PRESETS, *PLANNER_PRESETS]
            raise ConfigError("--model", args.model, "is neither a model directory (there is none there) nor a "
                                                     f"preset ({', '.join('llama-' + p for p in names)})") from None
    else:
        from ..hf.describe import describe

        out.append(describe(args.model))
        if args.lora_rank:
            from ..hf.lora import LoraSettings

            out.append(describe(args.model, LoraSettings(rank=args.lora_rank, targets=lora_targets(args))))
    args._described = out
    return out


def lora_targets(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--lora-targets as a tuple (None: not given, peft's default for the architecture)."""
    if not args.lora_targets:
        return None
    return tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())


def model_shape(args: argparse.Namespace):
    """The preset name, or a directory's or a planner-only preset's LLaMA-shaped config (for the
    compute probe, which knows the models' presets only)."""
    described = describe_models(args)
    if described:
        return described[0].shape
    from .model import PLANNER_PRESETS, resolve_model

    label, cfg = resolve_model(args.model)
    return cfg if label.removeprefix("llama-") in PLANNER_PRESETS else args.model


def default_seq_len(args: argparse.Namespace, batch_tokens: int) -> int:
    """The sequence length when --seq-len is not given: the trainer's default (``defaults.SEQ_LEN``),
    capped at the model's maximum and at the batch."""
    shape = model_shape(args)
    if isinstance(shape, str):
        from .model import resolve_model

        shape = resolve_model(shape)[1]
    return max(1, min(SEQ_LEN, shape.max_seq_len, batch_tokens))
