"""``offload bench pipeline``: pipeline stages over gloo ranks, measured in one run.

``pp x dp`` processes (spawned; gloo on the CPU) each build the same preset LLaMA (untied, fp32,
seed 0), cut it into each schedule's stages (``offload.pipeline.split_llama``, balanced by
parameters) and train their own through ``StagedModel`` + ``offload.AdamW``, state in memory
(``--path`` and budgets put it on NVMe), on the same global batch of ``--batch`` sequences of
``--seq`` tokens in ``--micro-batches`` micro-batches. Per schedule: ``--warmup`` untimed steps
(the first records the engines' traces), then ``--steps`` timed ones. Reported, as medians over
those steps (``offload.bench.pipeline_report``):

* the **bubble**: each rank's time in a step outside its stages' compute, as a fraction of the
  schedule's wall time (``offload.bench.pipeline_rank``'s busy clock), against the schedule's theory;
* the **step time** (the slowest rank's, optimizer included) against **pure data parallelism** on
  the same ``pp x dp`` ranks and the same global batch (the whole model wrapped on each rank,
  its chunks sliced over all of them, each rank its rows in one pass);
* the **activation memory per stage** under ``--memory-schedules`` (gpipe and 1f1b by default),
  with each stage recomputing its layers: the most bytes of layer inputs the stage held at once —
  what stays on the device without activation offload — and the most the stage kept on the device
  with pipeline-aware offload (``activation_offload="cpu"``, ``activation_backward_order=
  "micro-batches"``; ``offload.activations.order``). On a CPU the copies are synchronous, so read-
  backs wait for their backward; on a GPU they run ``activation_prefetch`` tensors ahead.

The ranks share this machine's cores (each gets cores / ranks threads, at least one): on a small
CPU box the times are contended and the bubble includes the other ranks' compute crowding a
rank's own. The figures do not fail the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile

from ..config import parse_bytes
from ..errors import ConfigError
from ..pipeline.schedules import SCHEDULES, check_name
from .pipeline_report import print_report, summarize_memory, summarize_schedule
from .pipeline_rank import run_rank
from .spawn import spawn_ranks
from .workload import BYTES_PER_PARAM

MEMORY_SCHEDULES = ("gpipe", "1f1b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="LLaMA preset of offload.models.llama (default tiny)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks per stage (default 1; 2 x 2: --dp 2)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per global batch (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated schedules to time (default all: {','.join(SCHEDULES)})")
    parser.add_argument("--memory-schedules", default=",".join(MEMORY_SCHEDULES),
                        help="schedules whose activation memory per stage is measured (default gpipe,1f1b; "
                             "one stage per rank)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per schedule (median; default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--path", default=None, help="NVMe directory: with --cpu-budget, state beyond it goes there")
    parser.add_argument("--cpu-budget", default=None, help="per rank (default: all state in memory)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the JSON here")


def _names(text: str, field: str, allowed=None) -> list[str]:
    names = [check_name(n.strip()) for n in str(text).split(",") if n.strip()]
    if not names:
        raise ConfigError(field, text, "names no schedule")
    for n in names:
        if allowed is not None and n not in allowed:
            raise ConfigError(field, n, f"activation memory is measured for {', '.join(allowed)} (one stage per rank)")
    return names


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "must be an integer >= 1")
    return value


def _spawn(world: int, spec: dict) -> list[dict]:
    """Run ``world`` ranks to completion; their results, by rank. A rank's failure is a BenchStepError."""
    return spawn_ranks(run_rank, world, spec, prefix=".offload-bench-pp-")


def measure(*, preset="tiny", pp: int = 2, dp: int = 1, micro_batches: int = 4, batch: int = 8, seq: int = 64,
            schedules=tuple(SCHEDULES), memory_schedules=MEMORY_SCHEDULES, steps: int = 5, warmup: int = 2,
            path=None, cpu_budget=None, lr: float = 1e-4) -> dict:
    """Run the pipeline benchmark; returns the JSON dict described in the module doc. ``preset``:
    a preset name or an ``offload.models.llama.LlamaConfig``."""
    from ..models.llama import LlamaConfig, get_preset
    from ..native import physical_cores
    from ..pipeline import stage_count

    for name, value in (("--pp", pp), ("--dp", dp), ("--micro-batches", micro_batches), ("--batch", batch),
                        ("--seq", seq), ("--steps", steps), ("--warmup", warmup)):
        _positive(name, value)
    if pp < 2:
        raise ConfigError("--pp", pp, "a pipeline needs at least 2 ranks")
    if batch % (dp * micro_batches):
        raise ConfigError("--batch", batch, f"must split into --dp {dp} x --micro-batches {micro_batches} "
                                            f"equal micro-batches: use a multiple of {dp * micro_batches}")
    cfg = preset if isinstance(preset, LlamaConfig) else get_preset(preset)
    if seq > cfg.max_seq_len:
        raise ConfigError("--seq", seq, f"exceeds the preset's max_seq_len {cfg.max_seq_len}")
    units = cfg.num_layers + 2
    for s in schedules:
        if stage_count(s, pp) > units:
            raise ConfigError("--schedules", s, f"needs {stage_count(s, pp)} stages of the model's {units} units "
                                                f"over --pp {pp}: fewer pipeline ranks or a larger preset")
    world = pp * dp
    params = _params(cfg)
    state = BYTES_PER_PARAM * params
    big = 2 * state + (256 << 20)
    nvme = cpu_budget is not None
    if nvme and (path is None or not os.path.isdir(path)):
        raise ConfigError("--path", path, "with --cpu-budget, must be an existing directory for the NVMe tier")
    cpu_b = parse_bytes(cpu_budget, "--cpu-budget") if nvme else big
    work = tempfile.mkdtemp(prefix=".offload-bench-pp-", dir=path) if nvme else None
    threads = max(1, physical_cores() // world)
    spec = {"cfg": cfg, "pp": pp, "dp": dp, "micro_batches": micro_batches, "rows": batch, "seq": seq,
            "schedules": list(schedules), "memory_schedules": list(memory_schedules), "steps": steps,
            "warmup": warmup, "lr": lr, "threads": threads, "nvme": nvme, "path": work,
            "cpu_budget": cpu_b, "device_budget": cpu_b // 2 if nvme else big, "activation_budget": big}
    try:
        ranks = _spawn(world, spec)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    dp_step_s = statistics.median(max(r["data_parallel_s"][i] for r in ranks) for i in range(steps))
    first_dp = [r for r in ranks if r["dp_rank"] == 0]
    return {
        "pp": pp, "dp": dp, "micro_batches": micro_batches, "global_batch": [batch, seq], "params": params,
        "threads_per_rank": threads, "data_parallel_step_s": dp_step_s,
        "schedules": {s: summarize_schedule(s, first_dp, pp, micro_batches, dp_step_s) for s in schedules},
        "activations": {s: summarize_memory(s, ranks, pp, micro_batches) for s in memory_schedules},
        "run": {"preset": preset if isinstance(preset, str) else "custom", "steps": steps, "warmup": warmup,
                "nvme": nvme, "cpu_budget": cpu_b},
    }


def _params(cfg) -> int:
    import torch

    from ..models.llama import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(cfg.replace(tie_embeddings=False)).parameters())


def run(args) -> int:
    result = measure(preset=args.preset, pp=args.pp, dp=args.dp, micro_batches=args.micro_batches,
                     batch=args.batch, seq=args.seq, schedules=_names(args.schedules, "--schedules"),
                     memory_schedules=_names(args.memory_schedules, "--memory-schedules", MEMORY_SCHEDULES),
                     steps=args.steps, warmup=args.warmup, path=args.path, cpu_budget=args.cpu_budget)
    print_report(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0
