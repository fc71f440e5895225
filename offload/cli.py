"""The ``offload`` console script: ``doctor``, ``bench nvme|adam|step|pipeline``, ``plan``, ``finetune``, ``checkpoint verify``.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up and turns user mistakes
(``OffloadError``) into a one-line message and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .errors import OffloadError

# name -> (module, one-line help); modules are imported only when their command runs or
# when --help needs their arguments, so `offload doctor` never pays for torch at parse time.
COMMANDS = {
    "doctor": ("offload.doctor", "check this machine: torch, CUDA, SIMD, libaio, O_DIRECT, memory"),
    "plan": ("offload.plan.cli", "predict memory, disk and step time for a model on this box"),
    "finetune": ("offload.train.cli", "fine-tune a Hugging Face model or train a preset (offloaded)"),
}
CHECKPOINT_COMMANDS = {
    "verify": ("offload.checkpoint.verify", "check every checksum of the checkpoints in DIR (exit 1 on corruption)"),
}
BENCH_COMMANDS = {
    "nvme": ("offload.bench.nvme", "NVMe throughput through the engine (and fio beside it)"),
    "adam": ("offload.bench.adam", "CPU Adam parameters/s against torch and the memory roofline"),
    "step": ("offload.bench.step", "an offloaded training step against its lower bound"),
    "pipeline": ("offload.bench.pipeline", "pipeline stages: bubble per schedule, step vs data parallelism, "
                 "activation memory per stage"),
}


class HelpParser(argparse.ArgumentParser):
    """argparse printing help as plain text: a docstring's reST literal (two backticks each side)
    shows as 'literal'. Subcommands' parsers are of this class too (argparse makes them of
    the parent's class), so every ``--help`` reads the same."""

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def format_usage(self) -> str:
        return plain_text(super().format_usage())

    def error(self, message: str):
        # Under torchrun every rank parses the same command line: rank 0 alone says what is wrong
        # (the others exit with the same status), as for every other error of a run.
        if os.environ.get("RANK", "0") != "0":
            self.exit(2)
        super().error(message)


def plain_text(text: str) -> str:
    """``text`` with reST inline literals (also when help wrapping broke one over lines) in single quotes."""
    return re.sub(r"``(.+?)``", r"'\1'", text, flags=re.S)


def _add(sub, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        parser.set_defaults(_unavailable=f"`{name}` is not available in this build ({exc})")
        return
    mod.add_arguments(parser)
    parser.set_defaults(_run=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = HelpParser(prog="offload", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks: nvme, adam, step, pipeline", description="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    bench_sub.required = True
    for name, (module, help_text) in BENCH_COMMANDS.items():
        _add(bench_sub, name, module, help_text)
    ckpt = sub.add_parser("checkpoint", help="checkpoints: verify", description="checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint", metavar="ACTION")
    ckpt_sub.required = True
    for name, (module, help_text) in CHECKPOINT_COMMANDS.items():
        _add(ckpt_sub, name, module, help_text)
    return parser


def _rank_tag() -> str:
    """``" (rank N)"`` under torchrun on a rank other than 0 (rank 0's line speaks for the run)."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    return f" (rank {rank})" if world not in ("", "1") and rank not in ("", "0") else ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(f"offload: error: {args._unavailable}", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except OffloadError as exc:
        print(f"offload: error{_rank_tag()}: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("offload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
