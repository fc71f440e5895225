"""``offload plan``: gather the box's figures (measured here, read from bench JSON, or stated for a box
you are not on), run ``offload.plan.planner.plan`` and print the plan; exit 1 when it does not fit.

Any of ``--nvme-capacity``, ``--nvme-gbps`` or ``--gpu-tflops`` means "describe another box": then
nothing is measured, figures not given take the stated assumptions below, and the ones without an
honest default (``--cpu-mem``, a compute rate) are required. Otherwise each figure not given is
measured: free space on the ``--nvme-path`` directories, NVMe GB/s (``offload.bench.nvme.measure``),
CPU Adam params/s (``offload.bench.adam.measure``), available RAM, and with a GPU its free memory, a
bf16 matmul and a pinned copy; without one, a CPU matmul probe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..bench.common import seconds_per_call
from ..config import read_json_object
from ..errors import ConfigError, OffloadError
from ..tiers.nvme import nvme_capacity
from ..units import format_size, parse_bytes
from .choice import choice_json, choose, format_choice
from .planner import DTYPE_BYTES, Hardware, Plan, Policy

ASSUMED_PCIE_GBPS = 25.0          # PCIe Gen4 x16 with pinned buffers, each way
ASSUMED_ADAM_PARAMS_PER_S = 4e9   # a fused CPU AdamW on a server socket (~110 GB/s at 28 B/param)
NVME_PROBE_BYTES = 256 << 20
ADAM_PROBE_PARAMS = 20_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", required=True, help="preset: tiny, small, 1b, 7b, 13b, 70b, 100b (or llama-100b, ...), "
                                     "or a local Hugging Face model directory (its config.json is read)")
    a("--lora-rank", type=int, help="with a model directory: plan a LoRA fine-tune of this rank as well "
                                    "(frozen weights cost only their parameter chunks)")
    a("--lora-targets", help="LoRA target modules, comma-separated (default: peft's for the architecture)")
    a("--gpu-mem", help="GPU memory, e.g. 80G (default: measured; none = CPU-only)")
    a("--cpu-mem", help="RAM for the run, e.g. 512G (default: measured available RAM)")
    a("--nvme-path", action="append", default=[], metavar="DIR",
      help="an NVMe directory (repeat to stripe): free space and bandwidth are measured there")
    a("--nvme-capacity", help="free NVMe bytes on the box described, e.g. 8T")
    a("--nvme-gbps", type=float, help="NVMe read bandwidth of the box, GB/s (aggregate)")
    a("--nvme-write-gbps", type=float, help="NVMe write bandwidth, GB/s (default: --nvme-gbps)")
    a("--nvme-bench", metavar="FILE", help="read NVMe GB/s from saved `offload bench nvme --json` output")
    a("--gpu-tflops", type=float, help="achieved bf16 matmul TFLOPS of the GPU")
    a("--cpu-gflops", type=float, help="achieved matmul GFLOPS of the CPU (CPU-only boxes)")
    a("--pcie-gbps", type=float,
      help=f"host<->GPU GB/s each way (default: measured, or {ASSUMED_PCIE_GBPS:g})")
    a("--adam-params-per-s", type=float, help="CPU Adam throughput, parameters/s")
    a("--adam-bench", metavar="FILE", help="read Adam params/s from saved `offload bench adam --json` output")
    a("--batch-tokens", type=int, help="tokens per step (default 16384)")
    a("--seq-len", type=int, help="sequence length (default: the model's, capped at --batch-tokens)")
    a("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="compute precision (default bf16)")
    a("--device-budget", help="engine's device budget: chunk bytes on the compute device, activations "
                              "not included (default: the engine's auto, 50%% of GPU memory; CPU-only 25%% of RAM)")
    a("--cpu-budget", help="engine's CPU budget: chunk bytes in RAM (default: the engine's auto, 50%% of "
                           "the RAM the device did not take)")
    a("--no-checkpointing", action="store_true", help="plan without activation checkpointing")
    a("--defer-step", action="store_true", help="hold all gradients until backward ends (grad clipping)")
    a("--activation-offload", default="auto", choices=("auto", "none", "cpu", "nvme"),
      help="where checkpointed layers' inputs wait for backward (default auto: the planner picks the "
           "fastest way that fits, also weighing gradient accumulation)")
    a("--micro-batches", type=int, help="gradient accumulation: passes per step (default: the planner picks)")
    a("--world", type=int, default=1, help="data parallelism: ranks training together (torchrun's "
                                          "WORLD_SIZE); the plan is one rank's, --batch-tokens the whole step's")
    a("--local-world", type=int, help="ranks on this box, sharing its RAM, NVMe and CPU cores (default: "
                                      "--world, all on one box); each has a GPU of its own")
    a("--json", metavar="FILE", help="also write the plan as JSON to FILE ('-' for stdout only)")


def run(args: argparse.Namespace) -> int:
    hardware, sources, notes = gather_hardware(args)
    batch = _positive_int(args.batch_tokens, "--batch-tokens")
    policy = Policy(
        **({} if batch is None else {"batch_tokens": batch}),
        seq_len=_positive_int(args.seq_len, "--seq-len"),
        dtype=args.dtype,
        activation_checkpointing=not args.no_checkpointing,
        device_budget=_size(args.device_budget, "--device-budget"),
        cpu_budget=_size(args.cpu_budget, "--cpu-budget"),
        defer_step=args.defer_step,
        **_fixed_way(args),
        **_ranks(args),
    )
    described = describe_models(args)
    modes = None if args.activation_offload == "auto" else [args.activation_offload]
    micro = None if args.micro_batches is None else [args.micro_batches]
    if described:
        choices = [choose(d.shape, hardware, policy, modes=modes, micro_batches=micro, name=d.name, params=d.params)
                   for d in described]
    else:
        choices = [choose(args.model, hardware, policy, modes=modes, micro_batches=micro)]
    for earlier in choices[:-1]:        # the full fine-tune first, then the LoRA one
        if args.json != "-":
            print(format_plan(earlier.best or earlier.given, sources))
            print()
    choice = choices[-1]
    result = choice.best or choice.given
    data = result.to_json_dict()
    data["hardware_sources"] = sources
    data["ways"] = choice_json(choice)
    if args.json == "-":
        print(json.dumps(data, indent=2))
    else:
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(format_plan(result, sources))
        print(format_choice(choice))
        if args.json:
            try:
                Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
            except OSError as exc:
                raise ConfigError("--json", args.json, f"cannot be written: {exc.strerror}") from exc
    if not result.fits:
        print(f"offload plan: refused: {result.reason}", file=sys.stderr)
        return 1
    return 0


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


def _ranks(args: argparse.Namespace) -> dict:
    """``world`` and ``local_world`` of the policy (one box of ``--world`` ranks unless told)."""
    world = _positive_int(getattr(args, "world", 1), "--world") or 1
    local = _positive_int(getattr(args, "local_world", None), "--local-world") or world
    if local > world:
        raise ConfigError("--local-world", local, f"is more than --world={world}")
    return {"world": world, "local_world": local}


def _fixed_way(args: argparse.Namespace) -> dict:
    """The policy fields the user fixed (the rest the planner chooses)."""
    out = {}
    if args.micro_batches is not None:
        out["micro_batches"] = _positive_int(args.micro_batches, "--micro-batches")
    if args.activation_offload != "auto":
        out["activation_offload"] = args.activation_offload
    return out


# ------------------------------------------------------------------ figures

def _size(value, flag: str) -> int | None:
    if value is None:
        return None
    n = parse_bytes(value, flag)
    if n == 0:
        raise ConfigError(flag, value, "must be > 0")
    return n


def _positive_int(value, flag: str) -> int | None:
    if value is None:
        return None
    if value <= 0:
        raise ConfigError(flag, value, "must be > 0")
    return value


def _positive(value: float | None, flag: str) -> float | None:
    if value is not None and not value > 0:
        raise ConfigError(flag, value, "must be > 0")
    return value


def gather_hardware(args: argparse.Namespace) -> tuple[Hardware, dict, list[str]]:
    """The box's figures, where each came from ("given", "measured", "assumed", "FILE"), and notes."""
    describe = any(v is not None for v in (args.nvme_capacity, args.nvme_gbps, args.gpu_tflops))
    src: dict[str, str] = {}
    notes: list[str] = []
    for flag in ("nvme_gbps", "nvme_write_gbps", "gpu_tflops", "cpu_gflops", "pcie_gbps",
                 "adam_params_per_s"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))

    # GPU: memory, compute, PCIe
    gpu_mem = _size(args.gpu_mem, "--gpu-mem")
    cuda = None if describe else _cuda()
    if gpu_mem is not None:
        src["gpu_mem"] = "given"
    elif cuda is not None:
        gpu_mem, src["gpu_mem"] = cuda.mem_get_info()[0], "measured (free)"
    if gpu_mem is not None:
        if args.gpu_tflops is not None:
            tflops, src["compute_tflops"] = args.gpu_tflops, "given"
        elif cuda is not None:
            tflops, src["compute_tflops"] = _gpu_tflops(cuda, args.dtype), f"measured ({args.dtype} matmul)"
        else:
            raise _missing("--gpu-tflops", "with --gpu-mem when there is no GPU here to probe")
    elif args.gpu_tflops is not None:
        raise _missing("--gpu-mem", "with --gpu-tflops (how much memory has that GPU?)")
    elif args.cpu_gflops is not None:
        tflops, src["compute_tflops"] = args.cpu_gflops / 1000.0, "given (--cpu-gflops)"
    elif describe:
        raise _missing("--cpu-gflops", "to describe a CPU-only box (or --gpu-mem and --gpu-tflops)")
    else:
        gflops, how = probe_cpu_gflops(model_shape(args), args.dtype, args.seq_len, args.batch_tokens)
        tflops, src["compute_tflops"] = gflops / 1000.0, f"measured ({how})"
    pcie = args.pcie_gbps
    if pcie is not None:
        src["pcie_gbps"] = "given"
    elif gpu_mem is None:
        pcie, src["pcie_gbps"] = 0.0, "no GPU"
    elif cuda is not None:
        pcie, src["pcie_gbps"] = _pcie_gbps(cuda), "measured (pinned copy)"
    else:
        pcie, src["pcie_gbps"] = ASSUMED_PCIE_GBPS, "assumed (PCIe Gen4 x16)"

    # RAM
    cpu_mem = _size(args.cpu_mem, "--cpu-mem")
    if cpu_mem is not None:
        src["cpu_mem"] = "given"
    elif describe:
        raise _missing("--cpu-mem", "to describe another box")
    else:
        import psutil
        cpu_mem, src["cpu_mem"] = psutil.virtual_memory().available, "measured (available)"

    # NVMe: space and bandwidth
    paths = [str(p) for p in args.nvme_path]
    where = ", ".join(paths) if paths else "the NVMe paths"
    capacity = _size(args.nvme_capacity, "--nvme-capacity")
    if capacity is not None:
        src["nvme_capacity"] = "given"
    elif paths:
        for p in paths:
            if not Path(p).is_dir():
                why = "is not a directory" if Path(p).exists() else "does not exist here"
                raise ConfigError("--nvme-path", p, why + (" (give --nvme-capacity)" if describe else ""))
        capacity, src["nvme_capacity"] = nvme_capacity(paths), "measured (free space)"
    else:
        capacity, src["nvme_capacity"], where = 0, "no --nvme-path", "no NVMe path"
    read = write = 0.0
    if args.nvme_gbps is not None:
        read = args.nvme_gbps
        write = args.nvme_write_gbps or read
        src["nvme_gbps"] = "given"
    elif args.nvme_bench:
        bench = read_json_object(args.nvme_bench, "--nvme-bench")
        read = _number(bench, "read_gbps", args.nvme_bench)
        write = _number(bench, "write_gbps", args.nvme_bench)
        src["nvme_gbps"] = args.nvme_bench
    elif capacity > 0:
        if describe or not paths:
            raise _missing("--nvme-gbps", "for the NVMe tier of the box described (its GB/s)")
        read, write = _measure_nvme(paths, notes)
        src["nvme_gbps"] = "measured (offload.bench.nvme)"
    if args.nvme_write_gbps is not None:
        write = args.nvme_write_gbps

    # CPU Adam
    if args.adam_params_per_s is not None:
        adam, src["adam_params_per_s"] = args.adam_params_per_s, "given"
    elif args.adam_bench:
        bench = read_json_object(args.adam_bench, "--adam-bench")
        adam = _number(bench, "params_per_s", args.adam_bench)
        src["adam_params_per_s"] = args.adam_bench
    elif describe:
        adam, src["adam_params_per_s"] = ASSUMED_ADAM_PARAMS_PER_S, "assumed (server socket)"
    else:
        adam, src["adam_params_per_s"] = _measure_adam(args.dtype, notes), "measured (offload.bench.adam)"

    hw = Hardware(gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme_capacity=capacity, nvme_read_gbps=read,
                  nvme_write_gbps=write, pcie_gbps=pcie, compute_tflops=tflops,
                  adam_params_per_s=adam, nvme_where=where)
    return hw, src, notes


def _missing(flag: str, why: str) -> OffloadError:
    return OffloadError(f"{flag} is needed {why}")


def _number(data: dict, key: str, where: str) -> float:
    """A positive ``key`` of a bench result: at the top, else under ``results.offload`` (ours, not
    the baseline's), else the first one found breadth-first."""
    def ok(d):
        return isinstance(d, dict) and isinstance(d.get(key), (int, float)) and d[key] > 0

    results = data.get("results")
    ours = results.get("offload") if isinstance(results, dict) else None
    queue = [data, ours]
    while queue:
        d = queue.pop(0)
        if ok(d):
            return float(d[key])
        if isinstance(d, dict):
            queue.extend(v for v in d.values() if isinstance(v, dict))
    raise OffloadError(f"no positive {key!r} found in {where}")


def _measure_nvme(paths: list[str], notes: list[str]) -> tuple[float, float]:
    """Aggregate read/write GB/s: one small run per distinct filesystem, summed (striping)."""
    try:
        from ..bench.nvme import measure
        seen, read, write = set(), 0.0, 0.0
        for p in paths:
            dev = os.stat(p).st_dev
            if dev in seen:
                continue
            seen.add(dev)
            r = measure(p, size=NVME_PROBE_BYTES, block_size=1 << 20, queue_depth=32, threads=1, repeats=1)
            read += _number(r, "read_gbps", "offload.bench.nvme.measure()")
            write += _number(r, "write_gbps", "offload.bench.nvme.measure()")
        return read, write
    except Exception as exc:  # a missing or failing bench: say so, ask for the figure
        raise OffloadError(f"could not measure NVMe bandwidth ({type(exc).__name__}: {exc}); "
                           "give --nvme-gbps or --nvme-bench FILE") from exc


def _measure_adam(dtype: str, notes: list[str]) -> float:
    try:
        import inspect

        from ..bench.adam import measure
        extra = {"with_torch": False} if "with_torch" in inspect.signature(measure).parameters else {}
        r = measure(params=ADAM_PROBE_PARAMS, threads=None, grad_dtype=dtype,
                    out_dtype="none" if dtype == "fp32" else dtype, repeats=3, **extra)
        return _number(r, "params_per_s", "offload.bench.adam.measure()")
    except Exception as exc:  # a missing or failing bench: say so, ask for the figure
        raise OffloadError(f"could not measure CPU Adam ({type(exc).__name__}: {exc}); "
                           "give --adam-params-per-s or --adam-bench FILE") from exc


def _cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def _median_time(fn, min_s: float = 1.5, min_calls: int = 5) -> float:
    """Median seconds per call of ``fn`` after a warm-up call, over at least ``min_s`` and ``min_calls``.

    A median of many calls, like a training run's median step: on a shared box one call that
    lands on a busy (or an idle) moment does not set the rate.
    """
    fn()
    times, t_end = [], time.perf_counter() + min_s
    while len(times) < min_calls or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _gpu_tflops(cuda, dtype: str) -> float:
    """The GPU's matmul rate in the run's compute dtype (fp32 runs at TF32 or full fp32 speed, as
    ``torch.backends.cuda.matmul.allow_tf32`` says: a 10x difference on Hopper)."""
    import torch

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=tdtype)
    b = torch.randn(n, n, device="cuda", dtype=tdtype)
    return 2 * n**3 / seconds_per_call(lambda: torch.mm(a, b), sync=cuda.synchronize) / 1e12


def _pcie_gbps(cuda) -> float:
    """min(H2D, D2H) of a 256 MiB copy, GB/s, from host memory pinned the way the engine pins its
    CPU tier (mmap + cudaHostRegister)."""
    from ..bench import pcie

    rates = pcie.measure()
    return min(rates["h2d_gbps"], rates["d2h_gbps"])


def probe_cpu_gflops(model: str, dtype: str, seq_len: int | None,
                     batch_tokens: int | None) -> tuple[float, str]:
    """Achieved CPU GFLOPS for this model: forward + backward of one of its decoder layers at up
    to 4096 tokens when a layer is small enough to build here (it counts the norms, RoPE, SiLU and
    attention that a bare matmul leaves out, which matter on small models), else a matmul of the
    model's MLP shape capped at 4096 (a CPU-only 100B plan only needs the order of magnitude).

    The backward is seeded with a dense gradient, as a loss gives it (``out.sum().backward()``
    seeds an expanded, stride-0 one, which sends the matmuls down other kernels), and the rate is
    the median call over ~1.5 s. The planner adds the checkpoint recompute (x4/3) itself."""
    import torch

    from ..models.llama import (LlamaDecoderLayer, get_preset, layer_matmul_params,
                               layer_param_count, rope_tables)

    cfg = get_preset(model) if isinstance(model, str) else model
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    tokens = min(batch_tokens or 4096, 4096)
    seq = min(seq_len or cfg.max_seq_len, tokens)
    tokens = tokens // seq * seq
    if layer_param_count(cfg) * 4 <= 256 << 20:
        layer = LlamaDecoderLayer(cfg).to(tdtype)
        x = torch.randn(tokens // seq, seq, cfg.hidden_size, dtype=tdtype, requires_grad=True)
        grad = torch.randn_like(x) * 1e-3
        cos, sin = rope_tables(cfg, seq, "cpu", tdtype)
        flops = (6 * layer_matmul_params(cfg) + 12 * cfg.hidden_size * seq) * tokens

        def call():
            layer(x, cos, sin).backward(grad)
            layer.zero_grad(set_to_none=True)
            x.grad = None

        return flops / _median_time(call) / 1e9, "one decoder layer, fwd + bwd"
    m, k, n = min(tokens, 2048), min(cfg.hidden_size, 4096), min(cfg.intermediate_size, 4096)
    a, b = torch.randn(m, k, dtype=tdtype), torch.randn(k, n, dtype=tdtype)
    return 2 * m * k * n / _median_time(lambda: torch.mm(a, b), min_s=0.5) / 1e9, f"{m}x{k}x{n} matmul"


# ------------------------------------------------------------------ output

def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s" if s < 100 else f"{s:.0f} s"


def _way_text(po: dict, b: dict) -> str:
    out = ""
    if po.get("activation_offload", "none") != "none":
        out += f", activations parked in {'RAM' if po['activation_offload'] == 'cpu' else 'RAM + NVMe'}"
    if po.get("micro_batches", 1) > 1:
        out += f", {po['micro_batches']} micro-batches of {b['micro_batch_tokens']} tokens"
    return out


def _ranks_text(p: Plan) -> list[str]:
    b = p.breakdown
    world = b.get("world", 1)
    if world == 1:
        return []
    local = b["local_world"]
    coll = b["collective_bytes"]
    return [f"data parallel: {world} ranks, {local} on this box; the plan below is one rank's: it owns "
            f"{b['owned_chunks']} of the {b['num_chunks']} chunks and computes {b['rank_tokens']} tokens of each "
            f"step; " + (f"the box's RAM, NVMe and CPU Adam below are split {local} ways" if local > 1 else
                         "the box below is this rank's alone") + "; collectives per step "
            f"(not timed): all-gather {format_size(coll['all_gather'])}, reduce-scatter "
            f"{format_size(coll['reduce_scatter'])} per rank"]


def format_plan(p: Plan, sources: dict | None = None) -> str:
    """The plan as a readable table (what ``offload plan`` prints)."""
    sources = sources or {}
    hw, b, t, tiers = p.hardware, p.breakdown, p.step_terms_s, p.tiers
    gpu = hw["gpu_mem"] is not None
    po = p.policy
    lines = [f"offload plan: {p.model}, {p.params / 1e9:.2f} B parameters ({p.params:,}), "
             f"{po['dtype']}, {po['batch_tokens']} tokens/step, seq {b['seq_len']}, "
             f"{'activation checkpointing' if po['activation_checkpointing'] else 'no checkpointing'}"
             + (f"; {b['trainable_params']:,} trainable ({b['trainable_chunks']} of {b['num_chunks']} chunks "
                "carry gradient, master and moments)" if b.get("trainable_params", p.params) != p.params else "")
             + _way_text(po, b),
             "(sizes in decimal units: 1 GB = 1e9 bytes; on the command line 8T = 8 TiB = 8.80 TB)",
             *_ranks_text(p),
             "", "hardware"]
    rows = [("GPU memory", format_size(hw["gpu_mem"]) if gpu else "none (CPU-only)", "gpu_mem"),
            ("compute", f"{hw['compute_tflops']:.4g} TFLOPS", "compute_tflops"),
            ("PCIe each way", f"{hw['pcie_gbps']:.3g} GB/s" if gpu else "-", "pcie_gbps"),
            ("RAM", format_size(hw["cpu_mem"]), "cpu_mem"),
            ("NVMe free", f"{format_size(hw['nvme_capacity'])} at {hw['nvme_where']}", "nvme_capacity"),
            ("NVMe read/write", f"{hw['nvme_read_gbps']:.3g} / {hw['nvme_write_gbps']:.3g} GB/s", "nvme_gbps"),
            ("CPU Adam", f"{hw['adam_params_per_s'] / 1e9:.3g} G params/s", "adam_params_per_s")]
    for label, value, key in rows:
        lines.append(f"  {label:<16} {value:<36} {sources.get(key, '')}".rstrip())

    kinds = ["params", "grads", "master", "exp_avg", "exp_avg_sq", "activations", "working"]
    dev_name = "device (GPU)" if gpu else "device (RAM)"
    lines += ["", "bytes per tier and kind",
              f"  {'':<12} {dev_name:>14} {'cpu':>14} {'nvme':>14}"]
    for kind in kinds + ["bytes"]:
        cells = [tiers[tier].get(kind) for tier in ("device", "cpu", "nvme")]
        if not any(cells) and kind != "bytes":
            continue
        label = "total" if kind == "bytes" else kind
        lines.append(f"  {label:<12} " + " ".join(f"{format_size(c) if c else '-':>14}" for c in cells))
    budgets = (format_size(b["device_budget"]), format_size(b["cpu_budget"]),
               format_size(hw["nvme_capacity"]))
    lines.append(f"  {'budget':<12} " + " ".join(f"{x:>14}" for x in budgets))
    lines += [f"  (budgets are chunk storage: activations are outside the device budget; 'working' is CPU "
              f"room for the chunk Adam updates and the next one; chunks of {b['chunk_size']:,} elements x "
              f"{b['num_chunks']}, device minimum {format_size(b['device_min_bytes'])}, CPU minimum "
              f"{format_size(b['cpu_min_bytes'])})",
              "", f"NVMe space needed: {format_size(p.nvme_bytes_needed)} "
              f"(a slot for every chunk of every kind: {format_size(b['state_bytes'])}, "
              f"{b['state_bytes_per_param']} B/param incl. fp32 gradients and padding)"]

    bps, size = p.bytes_per_step, format_size
    lines += ["", "bytes moved per step",
              f"  NVMe read    {size(bps['nvme_read']):>10}   NVMe write {size(bps['nvme_write']):>10}",
              f"  PCIe H2D     {size(bps['pcie_h2d']):>10}   PCIe D2H   {size(bps['pcie_d2h']):>10}"]
    if not gpu:
        cp = b["device_cpu_copy_bytes"]
        lines.append(f"  (no GPU: device<->CPU chunk copies are memcpy in RAM, {size(cp['h2d'])} + "
                     f"{size(cp['d2h'])}, not timed)")

    why = {
        "compute": f"{b['train_flops_per_token']:.3g} FLOP/token x {b.get('rank_tokens', po['batch_tokens'])} tokens "
                   f"at {hw['compute_tflops']:.4g} TFLOPS"
                   f"{' (incl. the checkpoint recompute, x4/3)' if po['activation_checkpointing'] else ''}",
        "pcie": "max(H2D, D2H): the link is full duplex" if gpu else "no GPU",
        "nvme": "read/GBps + write/GBps: the drives share reads and writes",
        "adam": (f"{p.params / 1e9:.2f} G params at {hw['adam_params_per_s'] / 1e9:.3g} G params/s"
                 if b.get("world", 1) == 1 else
                 f"{b['adam_params'] / 1e9:.2f} G params (this rank's) at "
                 f"{b['rank_hardware']['adam_params_per_s'] / 1e9:.3g} G params/s (its share)"),
    }
    if not gpu:
        how = "compute + Adam + NVMe: without a GPU the same cores run all three and I/O waits stall compute"
    elif po["defer_step"]:
        how = "max(compute, PCIe, NVMe) + max(Adam, its NVMe): the step is deferred to after backward"
    elif po.get("micro_batches", 1) > 1:
        how = (f"{po['micro_batches'] - 1} micro-batches at max(compute, PCIe, NVMe) each, then the last "
               "beside the optimizer's NVMe traffic and Adam, which overlap only its backward")
    else:
        how = "max of the terms: Adam overlaps backward"
    lines += ["", f"predicted step time: {_seconds(p.predicted_step_s)} ({how}); "
              f"{po['batch_tokens'] / p.predicted_step_s:,.0f} tokens/s"]
    for term in ("compute", "pcie", "nvme", "adam"):
        mark = "  <- bottleneck" if term == p.bottleneck else ""
        lines.append(f"  {term:<8} {_seconds(t[term]):>10}   {why[term]}{mark}")
    lines.append("")
    if p.gpu_bound_batch_tokens is None:
        lines.append(f"bottleneck: {p.bottleneck} — the {'GPU' if gpu else 'CPU'} is already the limit")
    else:
        fit = "" if p.max_batch_tokens is None or p.gpu_bound_batch_tokens <= p.max_batch_tokens else (
            f"; but {'the GPU' if gpu else 'RAM'} holds activations for at most "
            f"{p.max_batch_tokens} tokens/step this way (see the other ways below)")
        lines.append(f"bottleneck: {p.bottleneck}; compute becomes the bottleneck from "
                     f"{p.gpu_bound_batch_tokens} tokens/step{fit}")
    lines.append(("verdict: " if p.fits else "verdict: REFUSED: ") + p.reason)
    return "\n".join(lines)
