"""``offload finetune`` (and ``scripts/finetune_100b.py``): parse, build a ``Trainer``, run it.

Fine-tune a Hugging Face checkpoint, or a LLaMA-architecture model of any size, on one GPU (or the CPU).

The model is never materialized whole: a --model directory (config.json + safetensors shards +
tokenizer) is built on the meta device and each tensor streamed into its chunk; a --preset is
built lazily from random weights. Parameters, gradients and Adam state live in chunks over the
compute device, CPU memory and NVMe directories, and the planner checks -- before anything is
allocated -- that the box can hold it and predicts the step time.

    offload finetune --model ./Llama-3-8B --data chat.jsonl --output ./tuned --nvme-path /mnt/nvme
    offload finetune --model ./Llama-3-8B --lora-rank 16 --output ./adapter   # peft format
    offload finetune --model ./Llama-3-8B --lora-rank 16 --merge --output ./merged
    offload finetune --config run.toml --steps 10        # a TOML file of the same settings; flags win
    offload finetune --preset 100b --nvme-path /mnt/nvme0 --nvme-path /mnt/nvme1 --dry-run

--model DIR: any architecture transformers' AutoModelForCausalLM builds; its tokenizer is used
(a directory without one is an error unless --byte-tokens). Presets train from scratch on bytes.
Data (--data): text, or .jsonl / .json records of {"text"}, {"prompt", "completion"} (loss on the
completion only) or {"messages"} (the tokenizer's chat template; loss on the assistant turns).

Preemption: SIGTERM or SIGINT finishes the step in flight, writes a checkpoint (to --checkpoint-dir,
or the default place the start-up log names) and exits 143 (SIGTERM) or 130 (SIGINT); a second
signal exits at once. --resume continues from the newest checkpoint that verifies, starts fresh
when there is none, and refuses when there are some but none verifies. Exit status 1: a one-line
error; 2: a bad command line or --config file.

Under torchrun (torchrun --nproc-per-node 8 scripts/finetune_100b.py ...) each rank keeps a 1/N
piece of every chunk; --batch-tokens is global, --micro-batches and the budgets are per rank; rank 0 alone
prints, and a failure on any rank ends every rank with one line from rank 0. --pp P cuts a preset
into P pipeline stages over the ranks (world = pp x dp; --schedule, --micro-batches M per step), and
its checkpoints resume under any pp x dp, --pp 1 included (resharded by layer).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import OffloadError
from . import flags
from .ranks import Ranks

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``offload finetune``'s flags (``offload/cli.py`` wires the command)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = DESCRIPTION
    flags.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """``offload finetune``: the parsed flags (and --config) as a run."""
    try:
        config = flags.config_from_args(args)
    except OffloadError as exc:                 # a bad --config file is a usage error
        print(f"offload finetune: error: {exc}", file=sys.stderr)
        return 2
    return execute(config, Ranks.from_env())


def main(argv: list[str] | None = None) -> int:
    """The script's entry point: parse ``argv`` and run. Errors propagate (``entry`` prints them)."""
    ranks = Ranks.from_env()
    parser = flags.build_parser(DESCRIPTION, quiet=not ranks.lead)
    parser.prog = os.path.basename(sys.argv[0]) or "finetune"
    args = parser.parse_args(argv)
    try:
        config = flags.config_from_args(args)
    except OffloadError as exc:
        if ranks.lead:
            print(f"finetune: error: {exc}", file=sys.stderr)
        return 2
    return execute(config, ranks)


def execute(config, ranks: Ranks) -> int:
    """Run ``config`` on this rank: join the ranks, train, leave."""
    from .pipelined import PipelineTrainer
    from .trainer import Trainer

    if ranks.many:
        ranks.start()
    if not ranks.lead:
        import warnings

        warnings.simplefilter("ignore")     # rank 0 shows the same ones: one log for the run
    clean = False
    try:
        code = (PipelineTrainer if config.parallel.pp > 1 else Trainer)(config, ranks).train()
        clean = True
        return code
    except BaseException as exc:
        ranks.failed(exc)
        raise
    finally:
        ranks.stop(clean)


def entry(argv: list[str] | None = None) -> None:
    """``main`` as a process: a user mistake is one line and status 1, never a traceback.

    Under torchrun rank 0 speaks for all; a rank's own failure outside the stretches the ranks
    agree on (``Ranks.together``) is said by that rank, naming it, before torchrun's report of the
    failed process."""
    rank = os.environ.get("RANK", "0")
    try:
        sys.exit(main(argv))
    except KeyboardInterrupt:
        if rank == "0":
            print("\nfinetune: interrupted", file=sys.stderr)
        sys.exit(130)
    except OffloadError as exc:
        who = "" if rank == "0" else f" (rank {rank})"
        print(f"finetune: error{who}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
