"""A run's inputs checked before anything slow happens (planning, building the model).

``check_config``: the checks that involve several settings or the ranks (single values were
checked when the flags or the TOML file were read). ``check_paths``: the NVMe directories exist
(a mistyped or unmounted ``/mnt/nvme0`` is an error, not a directory silently created on the root
disk; only ``{rank}`` subdirectories and the ``rank<N>`` ones of several ranks are created), and
``--output`` can be written. ``load_dataset``: the tokenizer and the data file, read and tokenized
-- so a bad file, a missing tokenizer or a chat template the tokenizer lacks ends the run in a
second, before the planner's measurements.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .config import TrainConfig
from .pipeline_checks import check_pipeline, data_world, micro_batches
from .ranks import Ranks


def check_config(config: TrainConfig, ranks: Ranks = Ranks()) -> None:
    """Cross-field checks; each failure is a ConfigError naming the flag."""
    m, d, o, par = config.model, config.data, config.output, config.parallel
    if m.model and m.preset:
        raise ConfigError("--preset", m.preset, "and --model exclude each other (a preset trains from scratch)")
    if not m.model and m.lora_rank is not None:
        raise ConfigError("--lora-rank", m.lora_rank, "needs --model DIR (a Hugging Face model directory)")
    if o.merge and m.lora_rank is None:
        raise ConfigError("--merge", True, "needs --lora-rank (it merges the trained adapter into the base)")
    if o.output_dtype and m.lora_rank is not None and not o.merge:
        raise ConfigError("--output-dtype", o.output_dtype, "applies to model weights: a LoRA adapter is written "
                                                            "as peft saves it (--merge writes merged weights in it)")
    if config.optimizer.master == "bf16" and m.dtype == "fp32":
        raise ConfigError("--master", "bf16", "needs --dtype bf16 (the parameters are then the master) or fp16: "
                                              "with --dtype fp32 the fp32 parameters are the master")
    if o.save_every and not o.output:
        raise ConfigError("--save-every", o.save_every, "needs --output")
    if d.batch_tokens < d.seq_len:
        raise ConfigError("--batch-tokens", d.batch_tokens, f"must be >= --seq-len ({d.seq_len})")
    check_pipeline(config, ranks.world)
    rows = d.batch_tokens // d.seq_len
    world = data_world(config, ranks.world)     # under --pp, the ranks of one stage split each batch
    over = f"{world} ranks" if par.pp == 1 else f"{world} data-parallel ranks (world / --pp)"
    if rows % world:
        raise ConfigError("--batch-tokens", d.batch_tokens,
                          f"is global: its {rows} sequences (--batch-tokens / --seq-len) must split evenly over {over}")
    mine = rows // world
    given = par.micro_batches if par.pp == 1 else micro_batches(config)
    if given is not None and mine % given:
        raise ConfigError("--micro-batches", given,
                          f"must divide the step's {rows} sequences (--batch-tokens / --seq-len)" if world == 1
                          else f"must divide each rank's {mine} sequences of the step ({rows} over {over})")
    if m.tokenizer:
        from ..tokenizer_files import check_tokenizer_dir

        check_tokenizer_dir(m.tokenizer)
    if o.output:
        from ..hf.export import max_shard_bytes

        max_shard_bytes(o.max_shard_size)


def rank_paths(config: TrainConfig, ranks: Ranks) -> list[str]:
    """This rank's --nvme-path directories: {rank}/{local_rank} filled in (and, under several ranks,
    a rank<N> subdirectory for a path with neither), as the engine expands them."""
    from ..distributed import Sharding, expand_rank

    sharding = Sharding(ranks.rank, ranks.world, ranks.local_rank) if ranks.many else None
    return list(expand_rank(config.budgets.nvme_path, sharding) or ())


def check_paths(config: TrainConfig, ranks: Ranks) -> None:
    """The NVMe directories exist (their per-rank subdirectories are made here) and --output is
    writable."""
    for given in config.budgets.nvme_path:
        if "{" in given:
            continue                          # a per-rank template: its expansion is checked below
        if not os.path.isdir(given):
            why = "is not a directory" if os.path.exists(given) else \
                "does not exist (create it, or check that its drive is mounted)"
            raise ConfigError("--nvme-path", given, why)
    for path in rank_paths(config, ranks):
        try:
            Path(path).mkdir(exist_ok=True)  # one level only: never a tree on the wrong disk
        except FileNotFoundError:
            raise ConfigError("--nvme-path", path, "cannot be created: its parent directory does not exist "
                                                   "(create it, or check that its drive is mounted)") from None
        except OSError as exc:
            raise ConfigError("--nvme-path", path, f"cannot be created: {exc.strerror}") from exc
        if not os.path.isdir(path):
            raise ConfigError("--nvme-path", path, "cannot be created: File exists")
    if config.checkpoint.checkpoint_dir:
        writable_dir(config.checkpoint.checkpoint_dir, "--checkpoint-dir")
    if config.output.output:
        from ..hf.export import StagedDirectory

        not_inside_output(config)
        writable_dir(config.output.output, "--output")
        adapter = config.model.lora_rank is not None and not config.output.merge
        StagedDirectory.check(config.output.output, "adapter_config.json" if adapter else "config.json")


def not_inside_output(config: TrainConfig) -> None:
    """Writing --output replaces its directory whole: checkpoints and logs must live elsewhere."""
    out = Path(config.output.output).resolve()
    for flag, path in (("--checkpoint-dir", config.checkpoint.checkpoint_dir),
                       ("--json-log", config.logging.json_log), ("--tensorboard", config.logging.tensorboard)):
        if path is not None and Path(path).resolve().is_relative_to(out):
            raise ConfigError(flag, path, f"is inside --output ({config.output.output}), which each write of the "
                                          "output replaces whole: put it beside the output")
    # The source is read again when the output is written (its config, tokenizer, a LoRA base), and
    # replacing it would lose the model the user fine-tuned from.
    for flag, path in (("--model", config.model.model), ("--tokenizer", config.model.tokenizer)):
        if path is not None and Path(path).resolve().is_relative_to(out):
            raise ConfigError("--output", config.output.output, f"would replace {flag} {path}, the source this "
                                                                "run reads: name a new directory")


def writable_dir(path: str, flag: str) -> None:
    """``path`` is (or can be created as) a directory this process can write into."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(flag, path, "is not a directory")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(flag, path, f"cannot be written ({existing} is not writable)")


def lora_settings(config: TrainConfig):
    """The LoRA adapters asked for, or None."""
    m = config.model
    if m.lora_rank is None:
        return None
    from ..hf.lora import LoraSettings

    targets = tuple(t.strip() for t in m.lora_targets.split(",")) if m.lora_targets else None
    return LoraSettings(rank=m.lora_rank, alpha=m.lora_alpha, targets=targets, dropout=m.lora_dropout)


def tokenizer_source(config: TrainConfig) -> tuple[str | None, str, bool]:
    """(directory, flag, bytes allowed) of the run's tokenizer: --tokenizer, else the --model
    directory's, else none (a preset, from scratch: byte ids). A --model directory without
    tokenizer files is an error unless --byte-tokens: 256 byte ids on a model with a 128k
    vocabulary train garbage, and the output would have no tokenizer."""
    m = config.model
    if m.tokenizer:
        return m.tokenizer, "--tokenizer", m.byte_tokens
    if m.model:
        return m.model, "--model", m.byte_tokens
    return None, "--preset", True


def load_dataset(config: TrainConfig, vocab_size: int, seq_len: int | None = None):
    """(tokenizer, the tokenized data set): the vocabulary must fit the model's. ``seq_len``: the
    run's sequence length (--seq-len, capped at the model's positions), default --seq-len."""
    from ..data import load_data
    from ..tokenizer_files import ByteTokenizer, load_tokenizer

    directory, flag, allow_bytes = tokenizer_source(config)
    tokenizer = load_tokenizer(directory, flag, allow_bytes=allow_bytes, vocab_size=vocab_size)
    data = load_data(config.data.path, tokenizer, data_format=config.data.data_format,
                     seq_len=seq_len or config.data.seq_len)
    if data.vocab_size > vocab_size:
        raise ConfigError(flag if directory else "--data", directory or config.data.path,
                          f"has {data.vocab_size} tokens; the model's vocabulary is {vocab_size}")
    return (None if isinstance(tokenizer, ByteTokenizer) else tokenizer), data


def tokens_line(config: TrainConfig, tokenizer) -> str:
    """What the start-up log says about the tokens."""
    if tokenizer is not None:
        return f"tokens: the tokenizer of {config.model.tokenizer or config.model.model}"
    why = "--byte-tokens" if config.model.model else "a preset trains from scratch"
    return f"tokens: bytes (256 ids; {why})"


def data_line(config: TrainConfig, data) -> str:
    """What the start-up log says about the data: the file (or that none was given: the corpus
    shipped with offload, which a fine-tune would not want unawares), its kind and size."""
    if config.data.data is None:
        return "data: the corpus shipped with offload (no --data given)"
    if getattr(data, "stream", None) is not None:
        return f"data: {config.data.data} (text, {data.size:,} tokens)"
    return f"data: {config.data.data} ({getattr(data, 'kind', 'records')}, {getattr(data, 'size', 0):,} examples)"


def cpu_without_fast_bf16(dtype: str) -> str | None:
    """A note when the run computes bf16 on a CPU without bf16 matrix instructions (no
    avx512_bf16 / amx_bf16): torch then runs bf16 matmuls one to two orders of magnitude slower
    than fp32 (0.9 vs 105 GFLOPS measured on a 2-core AVX2 EPYC)."""
    import torch

    if dtype != "bf16" or torch.cuda.is_available():
        return None
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    if flags & {"avx512_bf16", "amx_bf16"}:
        return None
    return ("this CPU has no bf16 matrix instructions (avx512_bf16, amx_bf16): torch computes bf16 here far "
            "slower than fp32; --dtype fp32 trains faster on a CPU-only run")
