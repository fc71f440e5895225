#!/usr/bin/env python3
"""Peak RSS while ``offload.hf.load_pretrained`` streams a checkpoint in, against its bound.

    python benchmarks/hf_load_rss.py make DIR [--hidden 1024 --layers 8 --vocab 32000]
    python benchmarks/hf_load_rss.py load DIR --cpu-budget 64M --device-budget 64M --nvme-path NVME

``make`` saves a random tiny-Llama (fp32, 200 MB shards) with transformers; ``load`` runs in a fresh
process, reads VmHWM (reset after imports via /proc/self/clear_refs) around the load alone and
prints one JSON line: peak RSS growth, the budgets, the largest tensor, the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def make(args) -> None:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                   num_key_value_heads=args.hidden // 128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(args.dir, max_shard_size="200MB")
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters saved to {args.dir}")


def load(args) -> None:
    import offload
    from offload.hf import load_pretrained, read_checkpoint

    from offload.hf.load import build_meta_model

    ckpt = read_checkpoint(args.dir)
    build_meta_model(ckpt)          # imports transformers' modeling code: not part of the load
    config = offload.OffloadConfig(device="cpu", dtype=args.dtype, device_budget=args.device_budget,
                                   cpu_budget=args.cpu_budget, nvme_paths=args.nvme_path or None)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = vm("VmRSS")
    t0 = time.perf_counter()
    model = load_pretrained(args.dir, config)
    seconds = time.perf_counter() - t0
    peak = vm("VmHWM")
    engine = model.offload_engine
    budgets = engine.store.tiers["cpu"].budget + (engine.store.tiers["device"].budget
                                                  if "device" in engine.store.tiers else 0)
    largest = ckpt.largest_tensor_bytes
    files = sum(p.stat().st_size for p in Path(args.dir).glob("*.safetensors"))
    engine.close()
    print(json.dumps({"checkpoint_bytes": files, "base_rss": base, "peak_growth": peak - base,
                      "budgets": budgets, "largest_tensor_bytes": largest,
                      "overhead": peak - base - budgets - largest, "chunk_bytes": engine.layout.chunk_size * 4,
                      "load_s": round(seconds, 2)}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--hidden", type=int, default=1024)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--vocab", type=int, default=32000)
    l_ = sub.add_parser("load")
    l_.add_argument("dir")
    l_.add_argument("--cpu-budget", default="64M")
    l_.add_argument("--device-budget", default="64M")
    l_.add_argument("--dtype", default="fp32")
    l_.add_argument("--nvme-path", action="append", default=[])
    args = p.parse_args(argv)
    make(args) if args.cmd == "make" else load(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
