#!/usr/bin/env python3
"""Fine-tune a Hugging Face checkpoint, or a LLaMA-architecture model of any size, on one GPU (or the CPU).

The model is never materialized whole: a --model directory (config.json + safetensors shards +
tokenizer) is built on the meta device and each tensor streamed into its chunk; a --preset is
built lazily from random weights. Parameters, gradients and Adam state live in chunks over the
compute device, CPU memory and NVMe directories, and the planner checks — before anything is
allocated — that the box can hold it and predicts the step time.

    python scripts/finetune_100b.py --model ./Llama-3-8B --data chat.jsonl --output ./tuned --nvme-path /mnt/nvme
    python scripts/finetune_100b.py --model ./Llama-3-8B --lora-rank 16 --output ./adapter   # peft format
    python scripts/finetune_100b.py --model ./Llama-3-8B --lora-rank 16 --merge --output ./merged
    python scripts/finetune_100b.py --preset tiny --steps 50 --nvme-path ./offload-nvme
    python scripts/finetune_100b.py --preset 100b --nvme-path /mnt/nvme0 --nvme-path /mnt/nvme1 --dry-run

--model DIR: any architecture transformers' AutoModelForCausalLM builds (LLaMA, Qwen2, Mistral,
Gemma, GPT-2, GPT-NeoX, OPT, ...); its tokenizer is used when the directory has one. --output DIR
writes an HF directory (config, tokenizer, sharded safetensors + index) at the end and every
--save-every steps; with --lora-rank the peft adapter, or with --merge the merged full weights.
Presets (parameters, from scratch): tiny 2.97 M, small 23.7 M, 1b 1.10 B, 7b 6.74 B, 13b 13.0 B,
70b 69.0 B, 100b 100.7 B. Data (--data): a .txt file (one stream of text) or a .jsonl file of
{"text"}, {"prompt", "completion"} (loss on the completion only) or {"messages"} (the tokenizer's
chat template; loss on the assistant turns only); by default the small corpus in scripts/data/.
Tokens are bytes unless there is a tokenizer (--tokenizer DIR or the --model directory's).

Preemption: SIGTERM or SIGINT (Ctrl-C) finishes the step in flight, writes a checkpoint to
--checkpoint-dir and exits with status 143 (SIGTERM) or 130 (SIGINT); a second signal exits at
once with the same status, leaving the previous checkpoint intact. `--resume` then continues
from it; a checkpoint that does not verify is skipped (with a line saying which and why) for
the newest one that does. Exit status 1: a one-line error (bad input, I/O failure).

Several GPUs or hosts (ZeRO-3 data parallelism; see README "More than one GPU"):

    torchrun --nproc-per-node 8 scripts/finetune_100b.py --preset 70b --nvme-path '/mnt/nvme{local_rank}' ...

Each rank owns 1/N of the chunks (parameters, master, Adam moments, NVMe slots). --batch-tokens
is global (tokens per optimizer step over all ranks: each rank takes its 1/N slice of every batch,
so N ranks see the batches one process would); --micro-batches, --device-budget and --cpu-budget
are per rank; the planner plans one rank's share of its host (RAM, drives and CPU cores divided
by the ranks on the host). Rank 0 alone prints; every rank saves and exports (they are collective).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_DATA = ROOT / "data" / "corpus.txt"


def parse_args(argv=None, quiet: bool = False) -> argparse.Namespace:
    """``quiet``: exit 2 without a word on a bad command line (ranks other than 0: rank 0 says it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    if quiet:
        p.error = lambda message: sys.exit(2)
    p.add_argument("--model", metavar="DIR", help="a local Hugging Face model directory to fine-tune")
    p.add_argument("--preset", help="train from scratch: tiny, small, 1b, 7b, 13b, 70b, 100b (default tiny)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (default 50)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="a .txt or .jsonl file (default: the shipped corpus)")
    p.add_argument("--tokenizer", help="a local Hugging Face tokenizer directory (default: the --model "
                                       "directory's, else bytes)")
    p.add_argument("--output", metavar="DIR", help="write the fine-tuned model here (HF format; LoRA: the adapter)")
    p.add_argument("--save-every", type=int, default=0, help="also write --output every N steps (0: at the end)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard of --output (default 5GB)")
    p.add_argument("--lora-rank", type=int, help="train LoRA adapters of this rank (peft) instead of all weights")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--lora-targets", help="comma-separated module names to adapt (default: peft's for the architecture)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input (default 0)")
    p.add_argument("--merge", action="store_true", help="with --lora-rank: --output the merged full weights")
    p.add_argument("--nvme-path", action="append", default=[], metavar="DIR",
                   help="directory for the NVMe tier (repeat to stripe over drives)")
    p.add_argument("--device-budget", default="auto", help="bytes of chunks on the compute device, e.g. 60G")
    p.add_argument("--cpu-budget", default="auto", help="bytes of chunks in CPU memory, e.g. 400G")
    p.add_argument("--batch-tokens", type=int, default=2048,
                   help="tokens per optimizer step, over all ranks under torchrun (default 2048)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="gradient accumulation: forward/backward passes per step, dividing its sequences "
                        "(each rank's share under torchrun; default: the planner's choice, 1 with --no-plan)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=5, help="linear warm-up steps, then cosine decay")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--no-checkpointing", action="store_true", help="turn activation checkpointing off")
    p.add_argument("--checkpoint-dir", help="where to write checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                   help="keep the newest K checkpoints (default 2; a resume falls back to an older one "
                        "when the newest does not verify)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--no-plan", action="store_true", help="skip the planner's measurements (no fit check!)")
    p.add_argument("--json-log", metavar="FILE", help="one JSON line per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-nvme", action="store_true",
                   help="keep the NVMe swap files at exit, named offload-<id>-<kind>.swp in each NVMe "
                        "directory (offload doctor --path DIR --clean removes them)")
    return p.parse_args(argv)


# ---- ranks (torchrun) ---------------------------------------------------------------------
class QuietExit(SystemExit):
    """This rank stops with status 1 and says nothing: rank 0 reports what went wrong."""

    def __init__(self):
        super().__init__(1)


class Ranks:
    """This process's place among the ranks torchrun started (world 1: a single process).

    (A plain class: tests load this script with importlib, where a dataclass cannot find its module.)"""

    __slots__ = ("rank", "world", "local_rank", "local_world")

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, local_world: int = 1):
        self.rank, self.world, self.local_rank, self.local_world = rank, world, local_rank, local_world

    @classmethod
    def from_env(cls) -> "Ranks":
        """From torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (absent: one process)."""
        from offload import ConfigError

        env = os.environ
        values = {}
        for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", None)):
            raw = env.get(name, default)
            if raw is None:
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                raise ConfigError(name, raw, "(an environment variable torchrun sets) must be an integer") from None
        world = values["WORLD_SIZE"]
        if world < 1 or not 0 <= values["RANK"] < world:
            raise ConfigError("RANK", values["RANK"], f"must be in [0, WORLD_SIZE={world})")
        local_world = values.get("LOCAL_WORLD_SIZE", world)
        return cls(values["RANK"], world, values["LOCAL_RANK"], max(1, min(local_world, world)))

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def many(self) -> bool:
        return self.world > 1

    def say(self, message: str = "", end: str = "\n") -> None:
        """One log for the whole run: rank 0 prints, the others stay quiet."""
        if self.lead:
            print(message, end=end, file=sys.stderr, flush=True)

    def start(self) -> None:
        """Join the process group: NCCL with a GPU per rank (``cuda:LOCAL_RANK``), else gloo."""
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend)
        from offload.distributed import failure

        failure.install(self.rank)          # a peer blocked on this rank can then name it

    def _collective(self, what: str, call):
        """Run a collective; a peer's failure becomes a one-line DistributedError naming it."""
        from offload.distributed import failure
        from offload.errors import DistributedError

        try:
            return call()
        except Exception as exc:
            failed, why = failure.failed_peer()
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DistributedError(self.rank, what, f"{why} (here: {detail})" if why else detail, failed) from exc

    def failed(self, exc: BaseException) -> None:
        """Leave this rank's failure where its peers, blocked in a collective, can name it."""
        if self.many and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            from offload.distributed import failure

            failure.mark_failed(self.rank, exc)

    def stop(self, clean: bool = True) -> None:
        """Leave the process group. After a failure NCCL may still hold collectives that wait for
        this rank: then the process just ends (torchrun stops the others)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and (clean or dist.get_backend() != "nccl"):
            dist.destroy_process_group()

    @contextmanager
    def together(self):
        """A stretch every rank runs up to the same point: when it fails on any rank, every rank
        stops there — rank 0 with the first failure's one-line error, the others quietly (a rank's
        own programming error keeps its traceback). No rank is left waiting in a collective."""
        if not self.many:
            yield
            return
        try:
            yield
        except BaseException as exc:
            self._agree(exc)
            raise
        self._agree(None)

    def _agree(self, error: BaseException | None) -> None:
        import torch.distributed as dist

        from offload import OffloadError

        mine = None if error is None else (isinstance(error, OffloadError), f"{error}" if isinstance(
            error, OffloadError) else f"{type(error).__name__}: {error}")
        everyone = [None] * self.world
        self._collective("all_gather_object (setup)", lambda: dist.all_gather_object(everyone, mine))
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if not failed:
            return
        if error is not None and (self.lead or not isinstance(error, OffloadError)):
            return                                    # the caller raises its own error
        if not self.lead:
            raise QuietExit()
        rank, (_, message) = failed[0]
        raise OffloadError(f"rank {rank}: {message}")

    def broadcast(self, value):
        """Rank 0's ``value`` on every rank (a picklable object)."""
        if not self.many:
            return value
        import torch.distributed as dist

        box = [value]
        self._collective("broadcast_object_list (the plan)", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def mean(self, value: float, device) -> float:
        """The mean of ``value`` over the ranks (every rank calls it)."""
        if not self.many:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=device)
        self._collective("all_reduce (the logged loss)", lambda: dist.all_reduce(t))
        return t.item() / self.world


# ---- model and data -----------------------------------------------------------------------
def check_args(args, ranks: Ranks = Ranks()) -> None:
    from offload import ConfigError

    if args.model and args.preset:
        raise ConfigError("--preset", args.preset, "and --model exclude each other (a preset trains from scratch)")
    if not args.model:
        args.preset = args.preset or "tiny"
        for flag, value in (("--lora-rank", args.lora_rank), ("--output", args.output)):
            if value is not None:
                raise ConfigError(flag, value, "needs --model DIR (a Hugging Face model directory)")
    if args.merge and args.lora_rank is None:
        raise ConfigError("--merge", True, "needs --lora-rank (it merges the trained adapter into the base)")
    if args.save_every < 0 or (args.save_every and not args.output):
        raise ConfigError("--save-every", args.save_every, "needs --output and a number >= 0")
    if args.seq_len < 2 or args.batch_tokens < args.seq_len:
        raise ConfigError("--batch-tokens", args.batch_tokens, f"must be >= --seq-len ({args.seq_len})")
    rows = args.batch_tokens // args.seq_len
    if rows % ranks.world:
        raise ConfigError("--batch-tokens", args.batch_tokens,
                          f"is global: its {rows} sequences (--batch-tokens / --seq-len) must split evenly over "
                          f"{ranks.world} ranks")
    mine = rows // ranks.world
    if args.micro_batches is not None and (args.micro_batches < 1 or mine % args.micro_batches):
        raise ConfigError("--micro-batches", args.micro_batches,
                          f"must divide the step's {rows} sequences (--batch-tokens / --seq-len)" if ranks.world == 1
                          else f"must divide each rank's {mine} sequences of the step ({rows} over {ranks.world} ranks)")
    if args.resume and not args.checkpoint_dir:
        raise ConfigError("--resume", True, "needs --checkpoint-dir")
    if args.keep_checkpoints < 1:
        raise ConfigError("--keep-checkpoints", args.keep_checkpoints, "must be >= 1")
    if args.tokenizer:
        from offload.tokenizer_files import check_tokenizer_dir

        check_tokenizer_dir(args.tokenizer)
    if args.output:
        from offload.hf.export import max_shard_bytes

        max_shard_bytes(args.max_shard_size)


def lora_settings(args):
    if args.lora_rank is None:
        return None
    from offload.hf.lora import LoraSettings

    targets = tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None
    return LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, targets=targets, dropout=args.lora_dropout)


def build_model(args, config):
    """The wrapped model: a checkpoint streamed in (+ LoRA adapters), or a preset built lazily."""
    import offload

    if args.model:
        from offload.hf import load_pretrained
        from offload.hf.lora import apply_lora
        from offload.hf.load import enable_checkpointing

        lora = lora_settings(args)

        def adapt(model):
            model.config.use_cache = False
            if not args.no_checkpointing:
                enable_checkpointing(model)
            return apply_lora(model, lora) if lora is not None else model

        return load_pretrained(args.model, config, adapt=adapt)
    from offload.models.llama import LlamaForCausalLM, get_preset

    with offload.lazy_init(config):
        model = LlamaForCausalLM(get_preset(args.preset))
    model.gradient_checkpointing = not args.no_checkpointing
    return offload.wrap(model)


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


def rng_state() -> dict:
    """torch's random generators (CPU, and every GPU's), for a checkpoint."""
    import torch

    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["cpu"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_dataset(args, vocab_size: int):
    from offload import ConfigError
    from offload.data import load_data, load_tokenizer

    directory, flag = (args.tokenizer, "--tokenizer") if args.tokenizer else (None, None)
    if directory is None and args.model and args.model_info.has_tokenizer:
        directory, flag = args.model, "--model"
    tokenizer = load_tokenizer(directory, flag) if directory else None
    data = load_data(args.data, tokenizer)
    if data.vocab_size > vocab_size:
        raise ConfigError(flag or "--data", directory or args.data,
                          f"has {data.vocab_size} tokens; the model's vocabulary is {vocab_size}")
    return data


# ---- planning -----------------------------------------------------------------------------
def rank_paths(args, ranks: Ranks) -> list[str]:
    """This rank's --nvme-path directories: {rank}/{local_rank} filled in (and, under several ranks,
    a rank<N> subdirectory for a path with neither), as the engine expands them."""
    from offload.distributed import Sharding, expand_rank

    sharding = Sharding(ranks.rank, ranks.world, ranks.local_rank) if ranks.many else None
    return list(expand_rank(args.nvme_path, sharding) or ())


def make_plan(args, cfg, config, described=None, ranks: Ranks = Ranks()):
    """Run the planner on this box (it measures NVMe, Adam and compute) for one rank's share of it;
    returns (plan, sources, notes)."""
    from offload.plan import Policy, choose
    from offload.plan.cli import add_arguments
    from offload.plan.figures import gather_hardware

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", args.model or args.preset, "--dtype", args.dtype, "--batch-tokens", str(args.batch_tokens),
            "--seq-len", str(args.seq_len)]
    for path in rank_paths(args, ranks):
        argv += ["--nvme-path", path]
    pargs = parser.parse_args(argv)
    hardware, sources, notes = gather_hardware(pargs)
    if ranks.many and hardware.gpu_mem is None and sources.get("compute_tflops", "").startswith("measured"):
        # The planner takes the box's figures and gives each rank 1/local_world. A CPU-only rank
        # computes with its own threads (torchrun: OMP_NUM_THREADS=1), as measured here: the box
        # runs local_world of them at once.
        import dataclasses

        import torch

        hardware = dataclasses.replace(hardware, compute_tflops=hardware.compute_tflops * ranks.local_world)
        sources["compute_tflops"] += f", {torch.get_num_threads()} thread(s) a rank x {ranks.local_world} ranks"
    policy = Policy(batch_tokens=args.batch_tokens, seq_len=args.seq_len, dtype=args.dtype,
                    activation_checkpointing=not args.no_checkpointing,
                    device_budget=None if config.device_budget == "auto" else int(config.device_budget),
                    cpu_budget=None if config.cpu_budget == "auto" else int(config.cpu_budget),
                    defer_step=args.max_grad_norm is not None,
                    world=ranks.world, local_world=ranks.local_world)
    # The planner chooses where activations wait, the device budget, and how many passes a step
    # takes (among those that split each rank's sequences evenly).
    rows = args.batch_tokens // min(args.seq_len, cfg.max_seq_len) // ranks.world
    micro = [args.micro_batches] if args.micro_batches else [k for k in range(1, rows + 1) if rows % k == 0]
    if described is not None:
        choice = choose(described.shape, hardware, policy, micro_batches=micro, name=described.name,
                        params=described.params)
    else:
        choice = choose(cfg, hardware, policy, micro_batches=micro, name=f"llama-{args.preset}")
    return choice.best or choice.given, sources, notes


def shared_budgets(config, ranks: Ranks):
    """``config`` with "auto" budgets turned into bytes once, by rank 0, for one rank's share of the
    host (the ranks on it split its RAM; each has a GPU of its own): every rank then lays out the
    same chunks, and N ranks do not each take the engine's share of the whole host."""
    if not ranks.many or (config.device_budget != "auto" and config.cpu_budget != "auto"):
        return config
    budgets = None
    if ranks.lead:
        from offload.tiers.budgets import compute_device, resolve_budgets

        device = compute_device(config)
        device_budget, cpu_budget, _ = resolve_budgets(config, device)
        if config.device_budget == "auto" and device.type == "cpu":
            device_budget //= ranks.local_world
        if config.cpu_budget == "auto":
            cpu_budget //= ranks.local_world
        budgets = (device_budget, cpu_budget)
    device_budget, cpu_budget = ranks.broadcast(budgets)
    return config.replace(device_budget=device_budget, cpu_budget=cpu_budget)


# ---- the run ------------------------------------------------------------------------------
def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM), so the planner's probes do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress(step, total, loss, tok_s, tflops, eta, tty):
    width = 24
    done = int(width * step / total)
    line = (f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  "
            f"{tok_s:,.0f} tok/s  {tflops:.3f} TFLOPS  ETA {fmt_time(eta)}")
    if tty:
        print("\r" + line, end="", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ranks = Ranks.from_env()
    args = parse_args(argv, quiet=not ranks.lead)
    if ranks.many:
        ranks.start()
    if not ranks.lead:
        import warnings

        warnings.simplefilter("ignore")     # rank 0 shows the same ones: one log for the run
    clean = False
    try:
        code = train(args, ranks)
        clean = True
        return code
    except BaseException as exc:
        ranks.failed(exc)
        raise
    finally:
        ranks.stop(clean)


def train(args, ranks: Ranks) -> int:
    import torch

    import offload
    from offload import OffloadError
    from offload.models.llama import flops_per_token, get_preset, param_count
    from offload.units import format_size

    say = ranks.say
    with ranks.together():
        check_args(args, ranks)
        described = None
        if args.model:
            from offload.hf import read_checkpoint
            from offload.hf.describe import describe

            args.model_info = read_checkpoint(args.model)        # every shard's header checked up front
            described = describe(args.model, lora_settings(args))
            cfg, name, n_params = described.shape, described.name, described.total
        else:
            cfg = get_preset(args.preset)
            name, n_params = f"llama-{args.preset}", param_count(cfg)
        seq = min(args.seq_len, cfg.max_seq_len)
        batch = args.batch_tokens // seq                  # sequences per step, all ranks together
        if batch % ranks.world:
            raise offload.ConfigError("--batch-tokens", args.batch_tokens,
                                      f"is global: its {batch} sequences of {seq} tokens must split evenly "
                                      f"over {ranks.world} ranks")
        config = offload.OffloadConfig(
            dtype=args.dtype, device_budget=args.device_budget, cpu_budget=args.cpu_budget,
            nvme_paths=args.nvme_path or None)
        for path in rank_paths(args, ranks):
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise offload.ConfigError("--nvme-path", path, f"cannot be created: {exc.strerror}") from exc
    slow_bf16 = cpu_without_fast_bf16(args.dtype)
    if slow_bf16:
        say(f"finetune: note: {slow_bf16}")
    trainable = f" ({described.trainable / 1e6:,.3f} M trainable)" if described and args.lora_rank is not None else ""
    on_ranks = f" over {ranks.world} ranks ({batch // ranks.world} each)" if ranks.many else ""
    say(f"finetune: {name}, {n_params / 1e6:,.1f} M parameters{trainable}, {args.dtype}, "
        f"{batch} x {seq} tokens per step{on_ranks}, {args.steps} steps")

    predicted = None
    if not args.no_plan:
        # Rank 0 measures and plans one rank's share of its host; every rank follows that plan (the
        # chunk layout depends on the budgets, so all ranks must take the same ones).
        decided = None
        with ranks.together():
            if ranks.lead:
                result, sources, notes = make_plan(args, cfg, config, described, ranks)
                from offload.plan import format_plan

                decided = {"text": format_plan(result, sources), "fits": result.fits, "reason": result.reason,
                           "predicted": result.predicted_step_s, "policy": result.policy,
                           "budgets": (result.breakdown["device_budget"], result.breakdown["cpu_budget"])}
        decided = ranks.broadcast(decided)
        say(decided["text"])
        if not decided["fits"]:
            say(f"finetune: refused by the planner: {decided['reason']}")
            return 1
        predicted = decided["predicted"]
        chosen = decided["policy"]      # the plan's activation placement, and the device budget it assumed
        config = config.replace(activation_offload=chosen["activation_offload"],
                                device_budget=chosen["device_budget"] or config.device_budget,
                                gradient_accumulation_steps=chosen["micro_batches"])
        if ranks.many:                  # the plan's budgets, the same bytes on every rank
            config = config.replace(device_budget=decided["budgets"][0], cpu_budget=decided["budgets"][1])
    elif args.micro_batches:
        config = config.replace(gradient_accumulation_steps=args.micro_batches)
    with ranks.together():
        if (batch // ranks.world) % config.gradient_accumulation_steps:
            raise offload.ConfigError("--micro-batches", config.gradient_accumulation_steps,
                                      f"must divide the step's {batch} sequences" if not ranks.many else
                                      f"must divide each rank's {batch // ranks.world} sequences")
        if args.dry_run:
            return 0
        config = shared_budgets(config, ranks)

        from offload.data import Batches

        data = load_dataset(args, cfg.vocab_size)
        batches = Batches(data, batch, seq, rank=ranks.rank, world=ranks.world)
    torch.manual_seed(args.seed)
    reset_peak_rss()
    base_rss = current_rss()
    built = time.perf_counter()
    model = build_model(args, config)
    optimizer = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=args.weight_decay,
                              betas=(0.9, 0.95), max_grad_norm=args.max_grad_norm)

    def lr_at(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress_ = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress_, 1.0)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    start_step = 0
    if args.resume:
        from offload.checkpoint import resume

        manifest = resume(model, optimizer, args.checkpoint_dir, say=lambda m: say(f"finetune: {m}"))
        start_step = int(manifest["extra"]["step"])
        scheduler.load_state_dict(manifest["extra"]["scheduler"])
        if "rng" in manifest["extra"]:          # dropout and other random layers go on as they would have
            set_rng_state(manifest["extra"]["rng"])
        # Older checkpoints have no data position: batch i was the i-th step's.
        changed = batches.restore(manifest["extra"].get("data", {"next_batch": start_step, "rows": batch,
                                                                 "seq_len": seq, "path": None, "bytes": None}))
        if changed and "data" in manifest["extra"]:
            say(f"finetune: note: {changed}")
        say(f"finetune: resumed from {manifest['path']} at step {start_step}")
    say(f"finetune: model ready in {time.perf_counter() - built:.1f} s; {model.offload_engine.chunks.layout}")

    flops_tok = flops_per_token(cfg, seq)
    log = open(args.json_log, "a") if args.json_log and ranks.lead else None
    tty = sys.stderr.isatty()
    losses, times = [], []
    t_start = time.perf_counter()
    model.train()
    from offload.checkpoint import save_checkpoint
    from offload.preempt import Preemption

    at = {"done": start_step, "saved": start_step if args.resume else None}

    def save():
        if at["saved"] == at["done"]:
            return                          # a preemption right after a scheduled save
        # collective under torchrun: every rank writes its chunks
        path = save_checkpoint(model, optimizer, args.checkpoint_dir, step=at["done"],
                               extra={"step": at["done"], "scheduler": scheduler.state_dict(),
                                      "data": batches.state(), "rng": rng_state()},
                               keep=args.keep_checkpoints)
        at["saved"] = at["done"]
        if tty:
            say()
        say(f"finetune: checkpoint {path}")

    # SIGTERM/SIGINT: the step in flight finishes, then save + exit 143/130 (see the docstring).
    # torchrun passes a signal on to every rank, so all of them save together.
    preempt = Preemption(save if args.checkpoint_dir else None, name="finetune",
                         **({} if ranks.lead else {"notify": None})).install()
    try:
        for step in range(start_step, args.steps):
            t0 = time.perf_counter()
            ids, labels = (t.to(model.offload_engine.device) for t in batches.next())
            k = config.gradient_accumulation_steps
            value = 0.0
            for part_ids, part_labels in zip(ids.chunk(k), labels.chunk(k)):
                loss = model(input_ids=part_ids, labels=part_labels).loss / k
                loss.backward()
                value += loss.item()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            # every rank logs (and judges) the same loss: the mean of the ranks' slices of the batch
            value = ranks.mean(value, model.offload_engine.device)
            dt = time.perf_counter() - t0
            losses.append(value)
            times.append(dt)
            tok_s = batch * seq / dt
            tflops = flops_tok * batch * seq / dt / 1e12
            eta = (args.steps - step - 1) * (sum(times[-10:]) / len(times[-10:]))
            if ranks.lead:
                progress(step + 1, args.steps, value, tok_s, tflops, eta, tty)
            if log:
                log.write(json.dumps({"step": step + 1, "loss": value, "tokens_per_s": tok_s, "tflops": tflops,
                                      "step_s": dt, "peak_rss_bytes": peak_rss()}) + "\n")
                log.flush()
            if not math.isfinite(value) and args.dtype != "fp16":
                raise OffloadError(f"the loss became {value} at step {step + 1}")
            done = at["done"] = step + 1
            if args.checkpoint_dir and (done == args.steps or
                                        (args.checkpoint_every and done % args.checkpoint_every == 0)):
                save()
            if args.output and (done == args.steps or (args.save_every and done % args.save_every == 0)):
                from offload.hf.output import write_output

                # collective under torchrun: every rank gathers its chunks
                path = write_output(model, args.output, merge=args.merge, max_shard_size=args.max_shard_size)
                if tty:
                    say()
                say(f"finetune: wrote {'merged weights' if args.merge else 'the adapter' if args.lora_rank else 'the model'}"
                    f" to {path}")
            preempt.after_step()
        if tty:
            say()
        if ranks.lead:
            summary(args, model, losses, times, predicted, t_start, batch * seq, format_size, base_rss, ranks)
    finally:
        preempt.uninstall()
        if log:
            log.close()
        model.offload_engine.close(keep_files=args.keep_nvme)
    return 0


def summary(args, model, losses, times, predicted, t_start, tokens_per_step, format_size, base_rss,
            ranks: Ranks = Ranks()):
    if not losses:
        print("finetune: nothing to do (already at --steps)", file=sys.stderr)
        return
    report = model.offload_stats()["memory"]
    steady = sorted(times[1:] or times)
    median = steady[len(steady) // 2]
    first = sum(losses[: min(5, len(losses))]) / min(5, len(losses))
    last = sum(losses[-5:]) / len(losses[-5:])
    print("\nsummary", file=sys.stderr)
    print(f"  steps          {len(losses)} in {time.perf_counter() - t_start:.1f} s "
          f"(median step {median:.3f} s, {tokens_per_step / median:,.0f} tokens/s)", file=sys.stderr)
    print(f"  loss           {first:.4f} (first 5 steps) -> {last:.4f} (last 5)", file=sys.stderr)
    if predicted is not None:
        print(f"  step time      measured {median:.3f} s, planner predicted {predicted:.3f} s "
              f"({median / predicted:.2f}x)", file=sys.stderr)
    budgets = sum(t["budget"] for n, t in report["tiers"].items() if n != "nvme")
    if ranks.many:
        print(f"  (memory and tiers below: rank 0's; each of the {ranks.world} ranks holds its own share)",
              file=sys.stderr)
    print(f"  peak RSS       {format_size(peak_rss())}: {format_size(base_rss)} before the model was built "
          f"(Python, torch) + {format_size(peak_rss() - base_rss)} for the run; device + CPU budgets "
          f"{format_size(budgets)}", file=sys.stderr)
    for name, tier in report["tiers"].items():
        held = sum(tier["bytes_by_kind"].values())
        where = f" in {', '.join(tier['paths'])}" if "paths" in tier else ""
        print(f"  {name:<6} tier    {format_size(held)} of state{where} "
              f"(budget {format_size(tier['budget'])})", file=sys.stderr)


if __name__ == "__main__":
    # Under torchrun rank 0 speaks for all; a rank's own failure outside the stretches the ranks
    # agree on (``Ranks.together``) is said by that rank, naming it.
    rank = os.environ.get("RANK", "0")
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        if rank == "0":
            print("\nfinetune: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # user mistakes: one line, no traceback
        from offload import OffloadError

        if isinstance(exc, OffloadError):
            who = "" if rank == "0" else f" (rank {rank})"
            print(f"finetune: error{who}: {exc}", file=sys.stderr)
            sys.exit(1)
        raise
