"""``offload bench step --state A,B --master X,Y``: optimizer-state precisions side by side.

Each precision (``OffloadConfig.optimizer_state`` for the Adam moments, ``.master`` for the master
weights) trains its own copy of the same model (same seed, same batch) through its own engine,
swap files and budgets. All engines live through the whole run and take turns: sample ``i`` runs
every precision once, starting with the ``i``-th (the disk and the neighbours drift by a quarter
within minutes, and whoever goes first after a pause meets a colder page cache). A sample is
``offload.bench.workload.offload_steps``: two steps timed until the engine is idle, so nothing of
one precision's sample spills into the next one's. Reported per precision: the median step time,
the median NVMe bytes read and written per step (``model.offload_stats()``), and both as ratios
against the first precision listed (``speedup`` = its step time / this one's).

The CPU budget defaults to each precision's own state / 5 (the benchmark's "state >= 4x the CPU
budget"), so every precision keeps the same share of its state in memory and its NVMe bytes
follow its bytes per parameter; ``--cpu-budget`` gives all of them one budget instead (what a
fixed machine sees: the smaller state then also fits better).

``--state`` and ``--master`` are comma-separated lists paired position by position; a single value
applies to every position: ``--state fp32,8bit --master fp32,bf16`` compares fp32 Adam with 8-bit
moments + bf16 master, ``--state fp32,8bit`` both with an fp32 master.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

from ..config import MASTERS, OPTIMIZER_STATES, AioConfig, OffloadConfig
from ..errors import ConfigError
from .step_bound import breakdown_of, default_budgets
from .workload import (DISK_MARGIN, STEPS_PER_SAMPLE, BenchStepError, build_model, bytes_per_param, offload_steps,
                       token_batch)


def parse_precisions(state: str | None, master: str | None) -> list[tuple[str, str]]:
    """``--state``/``--master`` texts -> [(state, master), ...] paired by position (a single value
    repeats); None is "fp32". A bad name, lists of different lengths or a pair given twice is a
    ConfigError naming the flag."""
    def split(text, flag, choices):
        values = [v.strip() for v in (text or "fp32").split(",")]
        for v in values:
            if v not in choices:
                raise ConfigError(flag, v, f"must be one of {', '.join(choices)} (comma-separated to compare)")
        return values

    states = split(state, "--state", OPTIMIZER_STATES)
    masters = split(master, "--master", MASTERS)
    n = max(len(states), len(masters))
    for flag, values in (("--state", states), ("--master", masters)):
        if len(values) not in (1, n):
            raise ConfigError(flag, ",".join(values), f"has {len(values)} values where the other flag has {n}: "
                                                      f"give one value, or one per compared precision")
    pairs = list(zip(states * n if len(states) == 1 else states, masters * n if len(masters) == 1 else masters))
    for i, pair in enumerate(pairs):
        if pair in pairs[:i]:
            raise ConfigError("--state/--master", "/".join(pair), "is listed twice")
    return pairs


def label(state: str, master: str) -> str:
    return f"state {state} / master {master}"


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[bench step] {msg}", file=sys.stderr, flush=True)


def compare(path: str | os.PathLike, precisions: list[tuple[str, str]], preset: str = "small", steps: int = 10,
            warmup: int = 3, batch_tokens: int = 512, cpu_budget=None, device_budget=None, device: str = "auto",
            quiet: bool = True, lr: float = 1e-4) -> dict:
    """Train one engine per (state, master) in ``precisions`` on the same model and batch, taking
    turns (module doc); returns {"params", "batch_tokens", "steps", "results": [per precision]}.

    ``path`` must exist; everything written under it is removed before returning. Raises
    ConfigError for bad arguments (and for a precision the engine refuses) and BenchStepError when
    the disk lacks space.
    """
    import torch

    import offload
    from ..aio import free_bytes

    for name, value in (("steps", steps), ("warmup", warmup), ("batch_tokens", batch_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "must be an integer >= 1")
    if not precisions:
        raise ConfigError("precisions", precisions, "name at least one (state, master)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", device, "CUDA is not available on this machine")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ConfigError("path", path, "is not a directory")

    model, cfg = build_model(preset, "cpu")
    params = sum(p.numel() for p in model.parameters())
    del model
    runs = []
    for state, master in precisions:
        state_bytes = int(bytes_per_param(state, master) * params)
        cpu_b, dev_b = default_budgets(state_bytes, cpu_budget, device_budget)
        runs.append({"state": state, "master": master, "bytes_per_param": round(bytes_per_param(state, master), 3),
                     "state_bytes": state_bytes, "cpu_budget": cpu_b, "device_budget": dev_b})
    need = int(sum(r["state_bytes"] for r in runs) * DISK_MARGIN)
    free = free_bytes(path)
    if need > free:
        raise BenchStepError(f"{path} has {free / 1e9:.2f} GB free but {len(runs)} precisions side by side need "
                             f"about {need / 1e9:.2f} GB of swap files: free space, compare fewer or pick a "
                             f"smaller --preset")

    ids = token_batch(cfg, batch_tokens, device)
    work = tempfile.mkdtemp(prefix=".offload-bench-step-", dir=path)
    models, opts = [], []
    try:
        for i, r in enumerate(runs):
            where = os.path.join(work, str(i))
            os.mkdir(where)
            _say(f"{preset}: {params / 1e6:.1f}M params, {label(r['state'], r['master'])}: "
                 f"{r['bytes_per_param']} B/param, state {r['state_bytes'] / 1e6:.0f} MB, CPU budget "
                 f"{r['cpu_budget'] / 1e6:.0f} MB, device budget {r['device_budget'] / 1e6:.0f} MB", quiet)
            model, _ = build_model(preset, device)
            model = model.cpu() if device == "cuda" else model
            config = OffloadConfig(device=device, dtype="bf16", device_budget=r["device_budget"],
                                   cpu_budget=r["cpu_budget"], nvme_paths=[where], aio=AioConfig(),
                                   optimizer_state=r["state"], master=r["master"])
            models.append(offload.wrap(model, config))
            opts.append(offload.AdamW(models[-1].parameters(), lr=lr))
        _say(f"{len(runs)} precisions: {warmup} warm-up steps each, then {steps} samples of "
             f"{STEPS_PER_SAMPLE} steps each, taking turns", quiet)
        for model, opt in zip(models, opts):
            for _ in range(warmup):
                offload_steps(model, opt, ids, device, 1)
        times = [[] for _ in runs]
        stats = [[] for _ in runs]
        for i in range(steps):
            for k in range(len(runs)):
                j = (i + k) % len(runs)      # sample i starts with precision i mod n
                times[j].append(offload_steps(models[j], opts[j], ids, device))
                stats[j].append(models[j].offload_stats())
    finally:
        for model in models:
            model.offload_engine.close()
        shutil.rmtree(work, ignore_errors=True)

    for r, t, s in zip(runs, times, stats):
        b = breakdown_of(s)
        r.update(step_s=statistics.median(t), step_times_s=[round(x, 4) for x in t],
                 nvme_read_bytes=b["nvme_read_bytes"], nvme_write_bytes=b["nvme_write_bytes"],
                 optimizer_s=b["optimizer_s"], wait_s=b["wait_s"])
    base = runs[0]
    base_nvme = base["nvme_read_bytes"] + base["nvme_write_bytes"]
    for r in runs:
        nvme = r["nvme_read_bytes"] + r["nvme_write_bytes"]
        r["speedup"] = base["step_s"] / r["step_s"]
        r["nvme_bytes_ratio"] = nvme / base_nvme if base_nvme else None
        r["bytes_per_param_ratio"] = r["bytes_per_param"] / base["bytes_per_param"]
    return {"device": device, "preset": preset, "params": params, "batch_tokens": int(ids.numel()),
            "steps": steps, "warmup": warmup, "baseline": label(base["state"], base["master"]), "results": runs}


def print_report(report: dict) -> None:
    """One line per precision: step time, NVMe bytes per step, both against the first one."""
    print(f"offload bench step: {report['preset']} ({report['params'] / 1e6:.1f}M params) on {report['device']}, "
          f"{report['batch_tokens']} tokens/step, median of {report['steps']} samples of {STEPS_PER_SAMPLE} "
          f"steps, precisions taking turns; ratios against {report['baseline']}")
    for r in report["results"]:
        nvme = r["nvme_read_bytes"] + r["nvme_write_bytes"]
        ratio = "-" if r["nvme_bytes_ratio"] is None else f"{r['nvme_bytes_ratio']:.2f}x"
        print(f"{label(r['state'], r['master']):<28} step {r['step_s'] * 1e3:8.1f} ms  {r['speedup']:.2f}x faster  "
              f"NVMe/step {r['nvme_read_bytes'] / 1e6:.0f} MB read + {r['nvme_write_bytes'] / 1e6:.0f} MB written "
              f"= {nvme / 1e6:.0f} MB ({ratio}; {r['bytes_per_param']} B/param = {r['bytes_per_param_ratio']:.2f}x)  "
              f"CPU budget {r['cpu_budget'] / 1e6:.0f} MB")
