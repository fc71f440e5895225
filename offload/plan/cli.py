"""``offload plan``: gather the box's figures (``figures``: measured here, read from bench JSON, or
stated for a box you are not on), choose the fastest way to the batch that fits (``choice``), print
the plan and the ways (``report``) and, with ``--json``, write them; exit 1 when nothing fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..errors import ConfigError
from .choice import choice_json, choose
from .cluster_cli import cluster_flags, run_cluster
from .figures import ASSUMED_NET_GBPS, ASSUMED_PCIE_GBPS, gather_hardware
from .stage_layout import ASSUMED_INTRA_BOX_GBPS
from .defaults import BATCH_TOKENS, SEQ_LEN
from .flags import (default_seq_len, describe_models, lora_targets, positive_int_flag, rate, size, size_flag,
                    whole)
from .inputs import DTYPE_BYTES, Policy
from .model import resolve_model
from .precision import MASTER_PRECISIONS, STATE_PRECISIONS
from .report import format_choice, format_plan, format_savings, savings_json
from .schedule_theory import SCHEDULE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags (every figure of the box can be given; those not given are measured)."""
    a = parser.add_argument
    a("--model", required=True, help="preset: tiny, small, 1b, 7b, 13b, 70b, 100b (or llama-100b, ...), 1t "
                                     "(planner only), or a local Hugging Face model directory (its config.json "
                                     "is read)")
    a("--lora-rank", type=whole, help="plan a LoRA fine-tune of this rank as well as the full one (frozen "
                                      "weights cost only their parameter chunks)")
    a("--lora-targets", help="LoRA target modules, comma-separated (default: peft's for the architecture; "
                             "q_proj,v_proj for a preset)")
    a("--gpu-mem", type=size, help="GPU memory, e.g. 80G (default: measured; without a GPU here, a CPU-only "
                                   "plan; given without one here: that GPU's TFLOPS assumed by its memory)")
    a("--cpu-mem", type=size, help="RAM for the run, e.g. 512G (default: measured available RAM)")
    a("--nvme-path", action="append", default=[], metavar="DIR",
      help="an NVMe directory (repeat to stripe): free space and bandwidth are measured there (the "
           "bandwidth once per filesystem: kept for the next plan, see --no-cache)")
    a("--nvme-capacity", type=size, help="free NVMe bytes on the box described, e.g. 8T")
    a("--nvme-gbps", type=rate, help="NVMe read bandwidth of the box, GB/s (aggregate)")
    a("--nvme-write-gbps", type=rate, help="NVMe write bandwidth, GB/s (default: --nvme-gbps)")
    a("--nvme-bench", metavar="FILE", help="read NVMe GB/s from saved `offload bench nvme --json` output")
    a("--gpu-tflops", type=rate, help="achieved matmul TFLOPS of the GPU in --dtype (default: measured; "
                                      "with --gpu-mem and no GPU here, assumed by its memory)")
    a("--cpu-gflops", type=rate, help="achieved matmul GFLOPS of the CPU (CPU-only boxes)")
    a("--pcie-gbps", type=rate,
      help=f"host<->GPU GB/s each way (default: measured, or {ASSUMED_PCIE_GBPS:g})")
    a("--adam-params-per-s", type=rate, help="CPU Adam throughput, parameters/s")
    a("--net-gbps", type=rate, help=f"with --world > 1: each rank's collective bandwidth, GB/s each way as NCCL's "
                                    f"bus bandwidth, the slowest link between the ranks (default: assumed "
                                    f"{ASSUMED_NET_GBPS:g}, a 200 Gb/s NIC per GPU; NVLink within one box is more)")
    a("--adam-bench", metavar="FILE", help="read Adam params/s from saved `offload bench adam --json` output")
    a("--batch-tokens", type=whole, default=BATCH_TOKENS,
      help=f"tokens per step, all ranks together (default {BATCH_TOKENS}, as `offload finetune`)")
    a("--seq-len", type=whole, help=f"sequence length (default {SEQ_LEN}, as `offload finetune`; capped at the "
                                  "model's maximum and at --batch-tokens)")
    a("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="compute precision (default bf16)")
    a("--device-budget", type=size, help="engine's device budget: chunk bytes on the compute device, activations "
                              "not included (default: the engine's auto, 50%% of GPU memory; CPU-only 25%% of RAM)")
    a("--cpu-budget", type=size, help="engine's CPU budget: chunk bytes in RAM (default: the engine's auto, 50%% of "
                           "the RAM the device did not take)")
    a("--state", default="fp32", choices=STATE_PRECISIONS,
      help="precision of Adam's moments: fp32 (exact, default), bf16, or 8bit (block-wise, 256-element "
           "blocks: 1 + 4/256 B each); the plan says what the choice buys against fp32")
    a("--master", default="fp32", choices=MASTER_PRECISIONS,
      help="precision of the master weights: fp32 (default) or bf16 (2 B, stochastic rounding; under bf16 "
           "compute the parameters themselves are the master)")
    a("--no-checkpointing", action="store_true", help="plan without activation checkpointing")
    a("--defer-step", action="store_true", help="hold all gradients until backward ends (grad clipping)")
    a("--activation-offload", default="auto", choices=("auto", "none", "cpu", "nvme"),
      help="where checkpointed layers' inputs wait for backward (default auto: the planner picks the "
           "fastest way that fits, also weighing gradient accumulation)")
    a("--micro-batches", type=whole, help="gradient accumulation: passes per step (default: the planner picks)")
    a("--world", type=whole, default=1, help="data parallelism: ranks training together (torchrun's "
                                          "WORLD_SIZE); the plan is one rank's, --batch-tokens the whole step's")
    a("--local-world", type=whole, help="ranks on this box, sharing its RAM, NVMe and CPU cores (default: "
                                      "--world, all on one box); each has a GPU of its own")
    a("--boxes", type=whole, help="plan a cluster of this many boxes (the other figures describe one box: "
                                  "--gpu-mem one GPU's, --cpu-mem, NVMe and CPU Adam the box's): pp x dp x "
                                  "micro-batches x pipeline schedule, against data parallelism over every GPU")
    a("--gpus-per-box", type=whole, help="with --boxes: GPUs in each box, one rank each (default 8)")
    a("--inter-box-gbps", type=rate, help=f"with --boxes: a GPU's bandwidth to other boxes, GB/s each way "
                                          f"(default: assumed {ASSUMED_NET_GBPS:g}, a 200 Gb/s NIC per GPU)")
    a("--intra-box-gbps", type=rate, help=f"with --boxes: a GPU's bandwidth to the GPUs of its box, GB/s each way "
                                          f"(default: assumed {ASSUMED_INTRA_BOX_GBPS:g}, NVLink)")
    a("--pp", type=whole, help="with --boxes: plan only this many pipeline stages (a divisor of the GPUs)")
    a("--schedule", choices=SCHEDULE_NAMES, help="with --boxes: plan only this pipeline schedule")
    a("--no-cache", action="store_true", help="measure this box again instead of reading the measurements "
                                             "kept from an earlier run ($OFFLOAD_CACHE_DIR, default ~/.cache/offload)")
    a("--json", metavar="FILE", help="also write the plan as JSON to FILE ('-' for stdout only)")


def run(args: argparse.Namespace) -> int:
    """Plan ``args``' model on the box described (or this one); 1 when the chosen plan does not fit."""
    cluster = cluster_flags(args)
    hardware, sources, notes = gather_hardware(args)
    batch = positive_int_flag(args.batch_tokens, "--batch-tokens")
    ranks = _ranks(args)
    precision = _precision(args)
    policy = Policy(
        batch_tokens=batch,
        seq_len=positive_int_flag(args.seq_len, "--seq-len") or default_seq_len(args, batch // ranks["world"]),
        dtype=args.dtype,
        activation_checkpointing=not args.no_checkpointing,
        device_budget=size_flag(args.device_budget, "--device-budget"),
        cpu_budget=size_flag(args.cpu_budget, "--cpu-budget"),
        defer_step=args.defer_step,
        **_fixed_way(args),
        **ranks,
        **precision,
    )
    if cluster is not None:
        return run_cluster(args, cluster, hardware, policy, notes)
    choices = _choices(args, hardware, policy)
    # what the compressed state buys: the same ways with exact fp32 state beside it
    baseline = None if policy.optimizer_state == "fp32" and policy.master == "fp32" else _choices(
        args, hardware, dataclasses.replace(policy, optimizer_state="fp32", master="fp32"))[-1]
    for earlier in choices[:-1]:        # the full fine-tune first, then the LoRA one
        if args.json != "-":
            print(format_plan(earlier.best or earlier.given, sources))
            print()
    choice = choices[-1]
    result = choice.best or choice.given
    data = result.to_json_dict()
    data["hardware_sources"] = sources
    data["ways"] = choice_json(choice)
    base = None if baseline is None else baseline.best or baseline.given
    if base is not None:
        data["versus_fp32"] = savings_json(result, base)
    if args.json == "-":
        print(json.dumps(data, indent=2))
    else:
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(format_plan(result, sources))
        print(format_choice(choice))
        if base is not None:
            print(format_savings(result, base))
        if args.json:
            try:
                Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
            except OSError as exc:
                raise ConfigError("--json", args.json, f"cannot be written: {exc.strerror}") from exc
    if not result.fits:
        print(f"offload plan: refused: {result.reason}", file=sys.stderr)
        return 1
    return 0


def _choices(args: argparse.Namespace, hardware, policy: Policy) -> list:
    """The choice for the model (a directory's full and LoRA fine-tunes, or a preset's, and with
    --lora-rank its LoRA one), the ways the flags leave open."""
    described = describe_models(args)
    modes = None if args.activation_offload == "auto" else [args.activation_offload]
    micro = None if args.micro_batches is None else [args.micro_batches]
    if described:
        return [choose(d.shape, hardware, policy, modes=modes, micro_batches=micro, name=d.name, params=d.params)
                for d in described]
    ways = [(policy, None)]
    if args.lora_rank:          # a preset's LoRA fine-tune: the planner's own adapter layout
        targets = lora_targets(args)
        lora = dataclasses.replace(policy, lora_rank=args.lora_rank, **({"lora_targets": targets} if targets else {}))
        ways.append((lora, f"{resolve_model(args.model)[0]} + LoRA r={args.lora_rank}"))
    return [choose(args.model, hardware, po, modes=modes, micro_batches=micro, name=name) for po, name in ways]


def _precision(args: argparse.Namespace) -> dict:
    """``optimizer_state`` and ``master`` of the policy (--state, --master), checked against --dtype."""
    state, master = getattr(args, "state", "fp32"), getattr(args, "master", "fp32")
    if state not in STATE_PRECISIONS:
        raise ConfigError("--state", state, f"must be one of {', '.join(STATE_PRECISIONS)}")
    if master not in MASTER_PRECISIONS:
        raise ConfigError("--master", master, f"must be one of {', '.join(MASTER_PRECISIONS)}")
    if master == "bf16" and args.dtype == "fp32":
        raise ConfigError("--master", master, "is for bf16/fp16 compute: under --dtype fp32 the parameters are "
                                              "the master already")
    return {"optimizer_state": state, "master": master}


def _ranks(args: argparse.Namespace) -> dict:
    """``world`` and ``local_world`` of the policy (one box of ``--world`` ranks unless told)."""
    world = positive_int_flag(getattr(args, "world", 1), "--world") or 1
    local = positive_int_flag(getattr(args, "local_world", None), "--local-world") or world
    if local > world:
        raise ConfigError("--local-world", local, f"is more than --world={world}")
    return {"world": world, "local_world": local}


def _fixed_way(args: argparse.Namespace) -> dict:
    """The policy fields the user fixed (the rest the planner chooses)."""
    out = {}
    if args.micro_batches is not None:
        out["micro_batches"] = positive_int_flag(args.micro_batches, "--micro-batches")
    if args.activation_offload != "auto":
        out["activation_offload"] = args.activation_offload
    return out
