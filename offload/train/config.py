"""A fine-tuning run's settings: one tree of documented dataclasses, readable from TOML.

``TrainConfig`` holds one section per concern (``model``, ``data``, ``optimizer``, ``checkpoint``,
``output``, ``parallel``, ``budgets``, ``logging``). Every field is declared once, with
``option(default, help, ...)``: its default, its meaning, its command-line flag (``--`` + the
name with dashes, unless given) and the check its values pass. ``flags.py`` builds the argparse
parser from these declarations and ``load_config`` reads a TOML file against them, so defaults,
help and checks have one source::

    [model]
    preset = "tiny"
    dtype = "fp32"

    [optimizer]
    steps = 10

A key the tree does not have, or a value its check refuses, is a ``ConfigError`` naming the key
and the file. Checks that involve several fields or the ranks (``--batch-tokens`` against
``--seq-len`` and the world size, ``--merge`` needing ``--lora-rank``, ...) live in
``inputs.py``, run once the flags and the file are merged.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .checks import (at_least, byte_size, choice, non_negative_float, non_negative_int, path_list,
                     positive_float, positive_int, text)

from ..config import MASTERS, OPTIMIZER_STATES
from ..plan.defaults import BATCH_TOKENS, SEQ_LEN   # the one place `offload plan` shares them from

DTYPES = ("bf16", "fp16", "fp32")
PRESETS = ("tiny", "small", "1b", "7b", "13b", "70b", "100b")
DATA_FORMATS = ("auto", "text", "jsonl", "json")
# offload.pipeline.SCHEDULES' names (tests/unit/test_pipeline_trainer.py keeps them alike): importing
# the pipeline package here would import torch for --help
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble")
# The corpus shipped in a source checkout (scripts/data/), used when no --data is given.
SHIPPED_CORPUS = Path(__file__).resolve().parents[2] / "scripts" / "data" / "corpus.txt"


def option(default, help: str, *, check=text, flag: str | None = None, metavar: str | None = None):
    """A config field: ``default``, its ``help`` (the meaning, shown by ``--help``), the ``check``
    a value passes (a function of one value, raising ValueError with the reason), its flag.
    A bool field is an on/off flag (``store_true``); a list field is a repeatable flag."""
    return field(default_factory=(lambda: list(default)) if isinstance(default, list) else (lambda: default),
                 metadata={"help": help, "check": check, "flag": flag, "metavar": metavar})


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """What is trained: a Hugging Face directory or a preset built from scratch, and its adapters."""
    model: str | None = option(None, "a local Hugging Face model directory to fine-tune", metavar="DIR")
    preset: str | None = option(None, "train from scratch: tiny, small, 1b, 7b, 13b, 70b, 100b (default tiny)",
                                check=choice(PRESETS))
    tokenizer: str | None = option(None, "a local Hugging Face tokenizer directory (default: the --model "
                                         "directory's)", metavar="DIR")
    byte_tokens: bool = option(False, "train on byte ids (256 tokens) when there is no tokenizer: the default "
                                      "for --preset, an error for a --model directory without one unless given")
    dtype: str = option("bf16", "compute precision: bf16, fp16 or fp32", check=choice(DTYPES))
    no_checkpointing: bool = option(False, "turn activation checkpointing off")
    lora_rank: int | None = option(None, "train LoRA adapters of this rank (peft) instead of all weights",
                                   check=positive_int)
    lora_alpha: float | None = option(None, "LoRA alpha (default 2 x rank)", check=positive_float)
    lora_targets: str | None = option(None, "comma-separated module names to adapt (default: peft's for "
                                            "the architecture)")
    lora_dropout: float = option(0.0, "dropout on the adapters' input", check=non_negative_float)

    @property
    def preset_name(self) -> str:
        """The preset a run without --model builds."""
        return self.preset or "tiny"


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """What the model reads: the file, its format, and the shape of a step's batch."""
    data: str | None = option(None, "a text, .jsonl or .json file (default: the corpus shipped in scripts/data/)",
                              metavar="FILE")
    data_format: str = option("auto", "how --data is read: auto (from the suffix and the content), text, "
                                      "jsonl, json", check=choice(DATA_FORMATS))
    batch_tokens: int = option(BATCH_TOKENS, "tokens per optimizer step, over all ranks under torchrun",
                               check=positive_int)
    seq_len: int = option(SEQ_LEN, "tokens per sequence", check=at_least(2))
    seed: int = option(0, "seed of torch's random generators (initial weights, dropout)", check=non_negative_int)

    @property
    def path(self) -> str:
        """The data file read: --data, or the shipped corpus."""
        return self.data if self.data is not None else str(SHIPPED_CORPUS)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW and its schedule: linear warm-up, then cosine decay to 10 % of --lr."""
    steps: int = option(50, "optimizer steps", check=positive_int)
    lr: float = option(3e-4, "peak learning rate", check=positive_float)
    weight_decay: float = option(0.1, "AdamW's decoupled weight decay", check=non_negative_float)
    warmup: int = option(5, "linear warm-up steps, then cosine decay", check=non_negative_int)
    max_grad_norm: float | None = option(None, "clip the global gradient norm", check=positive_float)
    state: str = option("fp32", "precision of the Adam moments: fp32 (exact torch AdamW), bf16, or 8bit (block-wise "
                                "quantised: a quarter of fp32's bytes)", check=choice(OPTIMIZER_STATES),
                        flag="--optimizer-state")
    master: str = option("fp32", "precision of the master weights: fp32, or bf16 (stochastic rounding; with "
                                 "--dtype bf16 the parameters are the master)", check=choice(MASTERS))


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Where and when checkpoints are written, and whether a run continues from one."""
    checkpoint_dir: str | None = option(None, "where checkpoints go (default: <--output>-checkpoints, else "
                                              "./checkpoints/<run name>; without this flag only a preemption "
                                              "or --checkpoint-every writes there)", metavar="DIR")
    checkpoint_every: int = option(0, "save every N steps (0: at the end, with --checkpoint-dir)",
                                   check=non_negative_int)
    keep_checkpoints: int = option(2, "keep the newest K checkpoints (a resume falls back to an older one "
                                      "when the newest does not verify)", check=positive_int, metavar="K")
    resume: bool = option(False, "continue from the latest checkpoint when there is one (else start fresh, "
                                 "saying so): one requeue command covers the first launch too")


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputConfig:
    """The trained model written as a Hugging Face directory (LoRA: the adapter, or merged weights)."""
    output: str | None = option(None, "write the fine-tuned model here (HF format; LoRA: the adapter)",
                                metavar="DIR")
    save_every: int = option(0, "also write --output every N steps (0: at the end)", check=non_negative_int)
    max_shard_size: str = option("5GB", "largest safetensors shard of --output")
    merge: bool = option(False, "with --lora-rank: --output the merged full weights")
    output_dtype: str | None = option(None, "dtype of --output's weights: bf16, fp16 or fp32 (default: the "
                                            "source model's; from scratch, --dtype's)", check=choice(DTYPES))


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """How a step is split. The ranks themselves come from torchrun (RANK, WORLD_SIZE, ...)."""
    micro_batches: int | None = option(None, "gradient accumulation: forward/backward passes per step, dividing "
                                             "its sequences (each rank's share under torchrun; default: the "
                                             "planner's choice, 1 with --no-plan); under --pp the pipeline's "
                                             "micro-batches per step of each data-parallel rank (default --pp)",
                                       check=positive_int)
    pp: int = option(1, "pipeline stages over the ranks under torchrun: the model is cut by layer into stages, "
                        "world = pp x dp (1: no pipeline)", check=positive_int, metavar="P")
    schedule: str | None = option(None, "the pipeline schedule under --pp (default 1f1b): " + ", ".join(SCHEDULES),
                           check=choice(SCHEDULES), metavar="NAME")


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetConfig:
    """Where the chunks live: the device and CPU budgets, the NVMe directories, the chunk size."""
    nvme_path: list = option([], "directory for the NVMe tier, which must exist (repeat to stripe over drives)",
                             check=path_list, metavar="DIR")
    device_budget: str = option("auto", "bytes of chunks on the compute device, e.g. 60G", check=byte_size)
    cpu_budget: str = option("auto", "bytes of chunks in CPU memory, e.g. 400G", check=byte_size)
    chunk_size: int | None = option(None, "elements per chunk (default: from the budgets; a resume takes the "
                                          "checkpoint's)", check=positive_int)
    keep_nvme: bool = option(False, "keep the NVMe swap files at exit, named offload-<id>-<kind>.swp in each NVMe "
                                    "directory (offload doctor --path DIR --clean removes them)")
    no_plan: bool = option(False, "skip the planner's measurements (no fit check!)")
    dry_run: bool = option(False, "print the plan and exit")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    """Where each step's figures go besides the progress line."""
    json_log: str | None = option(None, "one JSON line per step", metavar="FILE")
    tensorboard: str | None = option(None, "TensorBoard event files (loss, lr, tokens/s, TFLOPS, bytes moved, "
                                           "step time against the plan)", metavar="DIR")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """A whole run; each section is a field named as its TOML table."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_name(self) -> str:
        """``llama-<preset>``, or the --model directory's name."""
        return Path(self.model.model).name if self.model.model else f"llama-{self.model.preset_name}"


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in the order --help lists them."""
    return {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}


def with_values(config: TrainConfig, values: dict[str, dict]) -> TrainConfig:
    """``config`` with ``{section: {field: value}}`` replaced (values already checked)."""
    changed = {name: dataclasses.replace(getattr(config, name), **fields) for name, fields in values.items() if fields}
    return dataclasses.replace(config, **changed)


def check_value(section: str, f: dataclasses.Field, value, where: str):
    """``value`` for field ``f`` after its check, or a ConfigError naming the key and ``where``."""
    key = f"[{section}] {f.name}"
    if f.type == "bool":
        if not isinstance(value, bool):
            raise ConfigError(key, value, f"must be true or false (in {where})")
        return value
    if value is None:
        return None
    try:
        return f.metadata["check"](value)
    except ValueError as exc:
        raise ConfigError(key, value, f"{exc} (in {where})") from None


def load_config(path: str | os.PathLike) -> TrainConfig:
    """A ``TrainConfig`` from TOML file ``path`` (fields it leaves out keep their defaults)."""
    where = str(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("--config", where, "no such file") from None
    except OSError as exc:
        raise ConfigError("--config", where, f"cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", where, f"is not valid TOML: {exc}") from None
    known = sections()
    values: dict[str, dict] = {}
    for name, table in raw.items():
        if name not in known:
            raise ConfigError(f"[{name}]", table if not isinstance(table, dict) else "...",
                              f"unknown section in {where} (known: {', '.join(known)})")
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}]", table, f"must be a table in {where}")
        fields = {f.name: f for f in dataclasses.fields(known[name])}
        values[name] = {}
        for key, value in table.items():
            if key not in fields:
                raise ConfigError(f"[{name}] {key}", value,
                                  f"unknown key in {where} (known in [{name}]: {', '.join(fields)})")
            values[name][key] = check_value(name, fields[key], value, where)
    return with_values(TrainConfig(), values)
