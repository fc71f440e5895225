#!/usr/bin/env python3
"""NVMe space and bytes moved per step: a LoRA fine-tune against the full fine-tune of the same model.

    python benchmarks/lora_vs_full.py DIR --nvme-path NVME [--cpu-budget 6M --device-budget 6M --rank 8]

DIR is an HF model directory (``benchmarks/hf_load_rss.py make`` writes one). Both runs load it with
the same budgets (the state should be several times the CPU budget), take ``--steps`` optimizer
steps on random tokens and report the NVMe space reserved, the bytes moved per step by direction
(median over the steps after the first) and the median step time. One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def run(args, lora: bool) -> dict:
    import torch

    import offload
    from offload.hf import load_pretrained
    from offload.hf.lora import LoraSettings, apply_lora

    config = offload.OffloadConfig(device="cpu", dtype=args.dtype, device_budget=args.device_budget,
                                   cpu_budget=args.cpu_budget, nvme_paths=[args.nvme_path])
    adapt = (lambda m: apply_lora(m, LoraSettings(rank=args.rank))) if lora else None
    model = load_pretrained(args.dir, config, adapt=adapt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = offload.AdamW(trainable, lr=1e-4)
    engine = model.offload_engine
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    model.train()
    moved, times = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.rows, args.seq), generator=gen)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        engine.adam.drain()
        times.append(time.perf_counter() - t0)
        moved.append(model.offload_stats()["moved_bytes"])
    report = engine.store.memory_report()["tiers"]
    state = sum(sum(t["bytes_by_kind"].values()) for t in report.values())
    out = {"run": f"lora r={args.rank}" if lora else "full",
           "trainable_params": sum(engine.params.ref(p).slot.numel for p in trainable),
           "params": engine.layout.total_params,
           "nvme_reserved_bytes": report["nvme"]["reserved"],
           "state_bytes_all_tiers": state,
           "cpu_budget": report["cpu"]["budget"],
           "moved_per_step": {k: int(statistics.median(m.get(k, 0) for m in moved[1:]))
                              for k in sorted({k for m in moved[1:] for k in m})},
           "median_step_s": round(statistics.median(times[1:]), 3)}
    out["moved_per_step_total"] = sum(out["moved_per_step"].values())
    engine.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--cpu-budget", default="6M")
    p.add_argument("--device-budget", default="6M")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lora-first", action="store_true")
    args = p.parse_args(argv)
    for lora in (True, False) if args.lora_first else (False, True):
        print(json.dumps(run(args, lora)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
