"""``offload bench step``: an offloaded training step against its lower bound, measured in one run.

The model is the reference LLaMA (``offload.models.llama``) at ``--preset``, in bf16, with a total
state (14 bytes per parameter: bf16 parameter, fp32 master, ``exp_avg``, ``exp_avg_sq``) at least 4x
the CPU budget, so most of it lives on NVMe under ``--path``. It is trained through
``offload.wrap`` + ``offload.AdamW`` on a batch of random token ids (``model(ids, labels=ids).loss``):
``--warmup`` steps (the first records the trace), then ``--steps`` timed samples. ``optimizer.step()``
returns with updates still queued (they run on into the next forward, as in training), so a sample
is two steps back to back, timed from the first forward until every update and write either
started has finished, halved: nothing spills into what is timed next, and one tail in two is paid
without overlap (slightly pessimistic against a long run). The report is the median sample, the
breakdown from ``model.offload_stats()`` (medians per step), and the lower bound measured in the
same run::

    bound = max(compute, PCIe, NVMe reads / read GB/s + NVMe writes / write GB/s, params / Adam roofline)
    PCIe  = max(host->device bytes / H2D GB/s, device->host bytes / D2H GB/s)    (on CUDA; 0 on CPU)

* compute: the same model's forward + backward in plain PyTorch (bf16, same batch, no offload),
  each timed right next to one offloaded step, alternating which goes first (the machine drifts);
* NVMe: ``offload.bench.nvme.measure`` on the same directory with the engine's AioConfig, one
  pass beside each sample as the compute timing is (median); reads and writes share one device,
  so their times add;
* PCIe (CUDA only): the step's chunk bytes into and out of the device tier (``moved_bytes``), each
  direction over its rate from ``offload.bench.pcie.measure`` (host memory pinned as the engine
  pins its CPU tier); the two directions run on separate copy engines, so the larger counts;
* Adam: ``offload.bench.adam.measure``'s roofline loop (Adam's own 4-read/3-write streams, bf16
  gradient, bf16 copy written, as the engine's step) for the model's parameter count.

Beside the bound, one more sample's NVMe requests are recorded and replayed alone, back to back
(``offload.bench.replay``): ``nvme_replay_s`` is what this disk needs for exactly the step's
traffic, reads and writes interleaved as the engine issued them. ``step / replay`` is then the
engine's own share of the gap (waits between requests, compute the I/O did not overlap) and
``replay / bound`` the disk's (mixed traffic done slower than each direction alone).

The "everything fits in memory" comparison wraps the same model with budgets larger than its state
and no NVMe tier, and alternates its steps with plain PyTorch doing the same mixed-precision update
a PyTorch user would write: bf16 model, fp32 master copy, gradients copied to fp32,
``torch.optim.AdamW`` (fused where the build has it, else foreach), new values copied back to
bf16 — on a GPU that update runs on the GPU, while offload's runs on the CPU beside the GPU's
compute. ``ratio`` = torch step time / offload step time, i.e. offload's relative throughput.
``--batch-curve 512,2048,8192`` repeats that comparison at each batch size (tokens per step):
the ratio approaches 1 as compute grows to hide the host side.

The swap files and the NVMe probe file live in a private subdirectory of ``--path`` that is removed
on exit, also on Ctrl-C or SIGTERM.

This module is the command and the run; the model, batch and sample timing are
``offload.bench.workload``'s, the bound arithmetic ``offload.bench.step_bound``'s, the in-memory
comparison ``offload.bench.in_memory``'s, the printed report ``offload.bench.step_report``'s, and
``--nproc N`` hands over to ``offload.bench.distributed``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

from ..config import AioConfig, OffloadConfig, parse_bytes
from ..errors import ConfigError
from .common import scratch_dir, write_json
from .in_memory import compare_in_memory
from .step_bound import breakdown_of, default_budgets, step_bound
from .step_report import print_report
from .workload import (
    DISK_MARGIN,
    STEPS_PER_SAMPLE,
    BenchStepError,
    build_model,
    bytes_per_param,
    offload_steps,
    time_compute,
    token_batch,
)

MIN_STATE_OVER_CPU = 4        # the "total state >= 4x the CPU budget"
PER_RANK_TOKENS = 512         # --batch-tokens' default, per rank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", default="./offload-nvme",
                        help="directory on the NVMe drive for swap files (default ./offload-nvme; "
                             "created and removed when missing)")
    parser.add_argument("--preset", default="small", help="LLaMA preset of offload.models.llama (default small)")
    parser.add_argument("--steps", type=int, default=10, help="timed samples of two steps each (median; default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="tokens per step (global under --nproc); sequences of min(this, the preset's "
                             f"max_seq_len) (default {PER_RANK_TOKENS} per rank: {PER_RANK_TOKENS} x --nproc)")
    parser.add_argument("--cpu-budget", default=None,
                        help="CPU tier bytes (default: state / 5, so the state is >= 4x the budget)")
    parser.add_argument("--device-budget", default=None,
                        help="device tier bytes (default: half the CPU budget)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="compute device (default auto: cuda when available)")
    parser.add_argument("--nvme-size", default="256M", help="bytes the NVMe probe writes and reads (default 256M)")
    parser.add_argument("--no-in-memory", action="store_true", help="skip the everything-in-memory comparison")
    parser.add_argument("--batch-curve", default=None, metavar="TOKENS,...",
                        help="also compare in memory at each of these tokens/step, e.g. 512,2048,8192")
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks of a data-parallel run (default 1: the single-process benchmark); N > 1 "
                             "measures collective bytes against ZeRO-3 and FSDP2 and step time against "
                             "N=1 instead (offload.bench.distributed)")
    parser.add_argument("--chunk-size", default="auto", metavar="ELEMENTS",
                        help="with --nproc > 1: elements per chunk (default: the least wasteful size that "
                             "leaves each rank >= 4 chunks)")
    parser.add_argument("--state", default=None, metavar="fp32|bf16|8bit[,...]",
                        help="precision of the Adam moments (default fp32); several, comma-separated, are "
                             "compared side by side in one run, taking turns (offload.bench.step_precision)")
    parser.add_argument("--master", default=None, metavar="fp32|bf16[,...]",
                        help="precision of the master weights (default fp32; bf16: stochastic rounding); "
                             "paired with --state position by position, one value applies to all")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the JSON here")


def _replay_one_sample(model, opt, ids, device: str, repeats: int, quiet: bool) -> tuple[float | None, int]:
    """Record the NVMe requests of one more (untimed) sample, replay them ``repeats`` times with
    nothing else running (``offload.bench.replay``): (median seconds per step, bytes per step).
    The replay writes into the engine's swap files: call it only right before closing it."""
    from .replay import replay

    tier = model.offload_engine.chunks.nvme()
    if tier is None:
        return None, 0
    tier.recording = []
    try:
        offload_steps(model, opt, ids, device)
        records = tier.recording
    finally:
        tier.recording = None
    if not records:
        return None, 0
    _say(f"NVMe replay: this sample's {len(records)} requests x {repeats}, nothing else running", quiet)
    seconds = statistics.median(replay(tier, records) for _ in range(repeats))
    return seconds / STEPS_PER_SAMPLE, sum(r.slot.nbytes for r in records) // STEPS_PER_SAMPLE


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[bench step] {msg}", file=sys.stderr, flush=True)


def measure(path: str | os.PathLike = "./offload-nvme", preset: str = "small", steps: int = 10,
            warmup: int = 3, batch_tokens: int = 512, cpu_budget=None, device_budget=None,
            device: str = "auto", nvme_size="256M", replay_repeats: int = 3, adam_repeats: int = 3,
            in_memory: bool = True, quiet: bool = True, lr: float = 1e-4,
            batch_curve: list[int] | None = None, state: str = "fp32", master: str = "fp32") -> dict:
    """Run the benchmark; returns the JSON dict described in the module doc.

    ``path`` must exist (the command creates it); everything written under it is removed before
    returning. Raises ``ConfigError`` for bad arguments and ``BenchStepError`` when the disk lacks
    space or the budgets do not make the run an offload run. ``state``/``master``: the optimizer
    state's precision (``OffloadConfig.optimizer_state``/``.master``; ``compare`` in
    ``offload.bench.step_precision`` runs several side by side).
    """
    import torch

    import offload
    from ..native import physical_cores, simd_level
    from . import adam as adam_bench
    from . import nvme as nvme_bench

    for name, value, lo in (("steps", steps, 1), ("warmup", warmup, 1), ("batch_tokens", batch_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ConfigError(name, value, f"must be an integer >= {lo}")
    for value in batch_curve or ():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError("batch_curve", value, "each entry must be an integer >= 1 (tokens per step)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError("device", device, "must be auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", device, "CUDA is not available on this machine")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ConfigError("path", path, "is not a directory")

    ref_model, cfg = build_model(preset, device)
    params = sum(p.numel() for p in ref_model.parameters())
    state_bytes = int(bytes_per_param(state, master) * params)
    cpu_b, dev_b = default_budgets(state_bytes, cpu_budget, device_budget)
    notes = []
    if state_bytes < MIN_STATE_OVER_CPU * cpu_b:
        notes.append(f"state {state_bytes} B is only {state_bytes / cpu_b:.1f}x the CPU budget "
                     f"(the benchmark asks for >= {MIN_STATE_OVER_CPU}x)")
    aio = AioConfig()
    nvme_size = parse_bytes(nvme_size, "nvme_size")
    unit = aio.block_size * aio.threads
    nvme_size = max(unit, nvme_size // unit * unit)
    from ..aio import free_bytes

    need = int(state_bytes * DISK_MARGIN) + nvme_size
    free = free_bytes(path)
    if need > free:
        raise BenchStepError(f"{path} has {free / 1e9:.2f} GB free but the benchmark needs about "
                             f"{need / 1e9:.2f} GB (model state {state_bytes / 1e9:.2f} GB x {DISK_MARGIN} "
                             f"plus the {nvme_size / 1e9:.2f} GB NVMe probe): free space or pick a smaller --preset")

    ids = token_batch(cfg, batch_tokens, device)
    work = tempfile.mkdtemp(prefix=".offload-bench-step-", dir=path)
    try:
        _say(f"{preset}: {params / 1e6:.1f}M params, state {state_bytes / 1e6:.0f} MB, "
             f"CPU budget {cpu_b / 1e6:.0f} MB, device budget {dev_b / 1e6:.0f} MB, {device}", quiet)
        model, _ = build_model(preset, device)
        model = model.cpu() if device == "cuda" else model
        config = OffloadConfig(device=device, dtype="bf16", device_budget=dev_b, cpu_budget=cpu_b,
                               nvme_paths=[work], aio=aio, optimizer_state=state, master=master)
        model = offload.wrap(model, config)
        try:
            opt = offload.AdamW(model.parameters(), lr=lr)
            _say(f"offloaded: {warmup} warm-up + {steps} timed samples, alternating with plain "
                 f"PyTorch forward+backward and an NVMe probe ({nvme_size >> 20} MiB written, then read)", quiet)
            for _ in range(warmup):
                offload_steps(model, opt, ids, device, 1)
            time_compute(ref_model, ids, device, 1)
            # Alternate an offloaded sample with the plain forward+backward (and who goes first):
            # the bus, the disk and the neighbours drift, and both sides should see the same.
            # A sample ends with the engine idle, so nothing of it slows the plain run beside it.
            # The NVMe probe alternates with the samples as well: this disk's rates drift by a
            # quarter within minutes, and a probe taken after all samples can miss what they saw.
            step_times, compute_times, stats, probes = [], [], [], []

            def beside():
                compute_times.extend(time_compute(ref_model, ids, device, 1))
                probes.append(nvme_bench.measure(work, size=nvme_size, block_size=aio.block_size,
                                                 queue_depth=aio.queue_depth, threads=aio.threads,
                                                 repeats=1, with_fio=False))

            for i in range(steps):
                if i % 2:
                    beside()
                step_times.append(offload_steps(model, opt, ids, device))
                stats.append(model.offload_stats())
                if i % 2 == 0:
                    beside()
            layout = stats[-1].get("layout", {})
            replay_s, replay_bytes = _replay_one_sample(model, opt, ids, device, replay_repeats, quiet)
        finally:
            model.offload_engine.close()
        del model, opt

        nvme = {"read_gbps": round(statistics.median(p["read_gbps"] for p in probes), 3),
                "write_gbps": round(statistics.median(p["write_gbps"] for p in probes), 3),
                "backend": probes[-1]["backend"]}

        # 5. Adam roofline for this parameter count, streaming what the engine's update streams:
        # bf16 gradient chunks (no accumulation), the bf16 copy written
        threads = physical_cores()
        _say(f"Adam roofline: {params / 1e6:.1f}M params, {threads} threads", quiet)
        # 8-bit: the roofline's bandwidth over the 8-bit kernel's own bytes per parameter; bf16
        # moments have no kernel of their own in that benchmark: fp32's roofline stands in
        adam = adam_bench.measure(params=params, threads=threads, grad_dtype="bf16", out_dtype="bf16",
                                  repeats=adam_repeats, with_torch=False, levels=[simd_level()],
                                  state="8bit" if state == "8bit" else "fp32",
                                  master=master if state == "8bit" else "fp32")
        roof = adam["results"]["roofline"]["gbps"] * 1e9 / adam["bytes_per_param"]
        pcie = None
        if device == "cuda":
            from . import pcie as pcie_bench

            _say("PCIe: 256 MiB copies each way from engine-pinned host memory", quiet)
            pcie = pcie_bench.measure()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    breakdown = breakdown_of(stats)
    compute_s = statistics.median(compute_times)
    bound = step_bound(compute_s, breakdown["nvme_read_bytes"], breakdown["nvme_write_bytes"],
                       nvme["read_gbps"], nvme["write_gbps"], params, roof,
                       h2d_bytes=breakdown["h2d_bytes"], d2h_bytes=breakdown["d2h_bytes"],
                       h2d_gbps=pcie and pcie["h2d_gbps"], d2h_gbps=pcie and pcie["d2h_gbps"])
    step_s = statistics.median(step_times)
    breakdown.update(bound)
    breakdown.update({
        "nvme_read_gbps": nvme["read_gbps"], "nvme_write_gbps": nvme["write_gbps"],
        "nvme_backend": nvme["backend"], "adam_roofline_params_per_s": roof,
        "pcie_h2d_gbps": pcie and round(pcie["h2d_gbps"], 2), "pcie_d2h_gbps": pcie and round(pcie["d2h_gbps"], 2),
        "adam_offload_params_per_s": adam["results"]["offload"]["params_per_s"],
        "step_times_s": [round(t, 4) for t in step_times],
        "compute_times_s": [round(t, 4) for t in compute_times],
        "nvme_read_runs_gbps": [p["read_gbps"] for p in probes],
        "nvme_write_runs_gbps": [p["write_gbps"] for p in probes],
        "chunks": layout.get("chunks"), "chunk_size": layout.get("chunk_size"),
        "nvme_replay_s": replay_s,
        "nvme_replay_gbps": replay_bytes / replay_s / 1e9 if replay_s else None,
    })
    breakdown["run"] = {"state": state, "master": master, "preset": preset, "device_budget": dev_b, "batch_tokens": int(ids.numel()),
                        "steps": steps, "warmup": warmup, "notes": notes}
    report = {
        "device": device, "params": params, "state_bytes": state_bytes, "cpu_budget": cpu_b,
        "step_s": step_s, "bound_s": bound["bound_s"], "bound_ratio": step_s / bound["bound_s"],
        "breakdown": breakdown, "in_memory": None,
    }
    ref_model = None        # free the reference before the in-memory models are built
    if in_memory:
        _say(f"in memory: offload vs torch AdamW, {warmup} + {steps} alternating steps", quiet)
        summary, detail = compare_in_memory(preset, device, ids, state_bytes, steps, warmup, lr)
        report["in_memory"] = summary
        breakdown["in_memory"] = detail
    if batch_curve:
        curve = []
        for tokens in batch_curve:
            _say(f"in memory at {tokens} tokens/step", quiet)
            summary, _ = compare_in_memory(preset, device, token_batch(cfg, tokens, device), state_bytes,
                                           steps, warmup, lr)
            curve.append({"batch_tokens": tokens, **summary})
        report["batch_curve"] = curve
    return report


def parse_batch_curve(text: str | None) -> list[int] | None:
    """"512,2048" -> [512, 2048]; a bad entry is a ConfigError naming it."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise ConfigError("--batch-curve", part.strip(), "must be comma-separated integers (tokens per step)") from None
        if value < 1:
            raise ConfigError("--batch-curve", value, "each entry must be >= 1 (tokens per step)")
        out.append(value)
    return out


def default_tokens(args) -> int:
    """--batch-tokens, else one sequence of PER_RANK_TOKENS a rank: the default splits over any --nproc."""
    return args.batch_tokens if args.batch_tokens is not None else PER_RANK_TOKENS * max(1, args.nproc)


def run(args) -> int:
    from . import step_precision

    precisions = step_precision.parse_precisions(args.state, args.master)
    if args.nproc != 1:
        if precisions != [("fp32", "fp32")]:
            raise ConfigError("--state/--master", "/".join(precisions[0]), "is measured with --nproc 1 only")
        return _run_distributed(args)
    if len(precisions) > 1:
        return _run_precisions(args, precisions)
    (state, master), = precisions
    with scratch_dir(args.path, remove_tree=True) as path:
        report = measure(path, state=state, master=master, preset=args.preset, steps=args.steps, warmup=args.warmup,
                         batch_tokens=default_tokens(args), cpu_budget=args.cpu_budget,
                         device_budget=args.device_budget, device=args.device, nvme_size=args.nvme_size,
                         in_memory=not args.no_in_memory, quiet=False,
                         batch_curve=parse_batch_curve(args.batch_curve))
    print_report(report)
    write_json(args.json, report)
    return 0


def _run_precisions(args, precisions) -> int:
    from . import step_precision

    if args.batch_curve:
        raise ConfigError("--batch-curve", args.batch_curve, "is not measured when several --state/--master are "
                                                             "compared")
    with scratch_dir(args.path, remove_tree=True) as path:
        report = step_precision.compare(path, precisions, preset=args.preset, steps=args.steps, warmup=args.warmup,
                                        batch_tokens=default_tokens(args), cpu_budget=args.cpu_budget,
                                        device_budget=args.device_budget, device=args.device, quiet=False)
    step_precision.print_report(report)
    write_json(args.json, report)
    return 0


def _run_distributed(args) -> int:
    from . import distributed

    distributed.check_nproc(args.nproc)
    if args.batch_curve:
        raise ConfigError("--batch-curve", args.batch_curve, "is not measured with --nproc > 1")
    with scratch_dir(args.path, remove_tree=True) as path:
        report = distributed.measure(path, nproc=args.nproc, preset=args.preset, steps=args.steps,
                                     warmup=args.warmup, batch_tokens=default_tokens(args),
                                     cpu_budget=args.cpu_budget, device_budget=args.device_budget,
                                     device=args.device, fsdp=not args.no_in_memory,
                                     chunk_size=distributed.parse_chunk_size(args.chunk_size), quiet=False)
    distributed.print_report(report)
    write_json(args.json, report)
    return 0
