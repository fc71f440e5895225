"""The values of ``offload plan``'s flags: byte sizes and positive numbers (a bad one raises
``ConfigError`` naming the flag), and the models ``--model`` names (a preset, or a Hugging Face
model directory and, with ``--lora-rank``, its LoRA fine-tune)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError
from ..units import parse_bytes
from .defaults import SEQ_LEN


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
    if Path(args.model).is_dir():
        from ..hf.describe import describe

        out.append(describe(args.model))
        if args.lora_rank:
            from ..hf.lora import LoraSettings

            targets = tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None
            out.append(describe(args.model, LoraSettings(rank=args.lora_rank, targets=targets)))
    elif args.lora_rank:
        raise ConfigError("--lora-rank", args.lora_rank, "needs --model DIR (a Hugging Face model directory)")
    args._described = out
    return out


def model_shape(args: argparse.Namespace):
    """The preset name, or a directory's LLaMA-shaped summary (for the compute probe)."""
    described = describe_models(args)
    return described[0].shape if described else args.model


def default_seq_len(args: argparse.Namespace, batch_tokens: int) -> int:
    """The sequence length when --seq-len is not given: the trainer's default (``defaults.SEQ_LEN``),
    capped at the model's maximum and at the batch."""
    shape = model_shape(args)
    if isinstance(shape, str):
        from .model import resolve_model

        shape = resolve_model(shape)[1]
    return max(1, min(SEQ_LEN, shape.max_seq_len, batch_tokens))
