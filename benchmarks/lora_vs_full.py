"""LoRA vs full fine-tune of the same model on NVMe: bytes reserved and bytes moved per step.

    python benchmarks/lora_vs_full.py [--path DIR] [--steps 6] [--rank 8] [--json FILE]

Builds a small HF Llama (transformers, random weights: sizes are what matter), wraps it once as is
and once after peft's ``get_peft_model`` (LoRA on q_proj and v_proj), with budgets smaller than
either run's state (the full fine-tune's is ~12x the CPU budget), and trains a few bf16 steps of each. Reports
the NVMe tier's reserved bytes, and the NVMe and device<->CPU bytes moved per step (median of the
steps after the first, whose trace is being recorded). Frozen chunks cost only their bf16
parameters: no gradient, fp32 master or moments, and no NVMe slots for them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

import offload


def build(use_lora: bool, rank: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    if use_lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                           target_modules=["q_proj", "v_proj"]))
    return model


def run(path: str, use_lora: bool, steps: int, rank: int, device_budget: int, cpu_budget: int) -> dict:
    model = build(use_lora, rank)
    cfg = offload.OffloadConfig(device="cpu", dtype="bf16", device_budget=device_budget, cpu_budget=cpu_budget,
                                nvme_paths=[path], chunk_size=1 << 15)
    model = offload.wrap(model, cfg)
    engine = model.offload_engine
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    nvme, host = [], []
    for _ in range(steps):
        ids = torch.randint(0, 512, (2, 128), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        moved = model.offload_stats()["moved_bytes"]
        nvme.append(sum(n for d, n in moved.items() if "nvme" in d))
        host.append(sum(n for d, n in moved.items() if "nvme" not in d))
    engine.adam.drain()
    out = {
        "params": engine.layout.total_params,
        "trainable_params": sum(s.numel for s in engine.layout.slots
                                if engine.layout.trainable[s.chunk]),
        "state_bytes": sum(r.nbytes for r in engine.store.records.values() if r.key[0] != "grad"),
        "nvme_reserved_bytes": engine.store.tiers["nvme"].in_use,
        "nvme_moved_bytes_per_step": statistics.median(nvme[1:]),
        "other_moved_bytes_per_step": statistics.median(host[1:]),
        "chunks": engine.layout.num_chunks, "trainable_chunks": len(engine.layout.trainable_chunks),
    }
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="NVMe directory (default: a temp dir under the cwd)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--device-budget", type=float, default=1.5, help="MiB")
    ap.add_argument("--cpu-budget", type=float, default=3.5, help="MiB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, cpu = int(args.device_budget * 2**20), int(args.cpu_budget * 2**20)
    with tempfile.TemporaryDirectory(dir=args.path or ".") as d:
        full = run(d, False, args.steps, args.rank, dev, cpu)
        lora = run(d, True, args.steps, args.rank, dev, cpu)
    result = {"device_budget": dev, "cpu_budget": cpu, "full": full, "lora": lora,
              "full_state_over_cpu_budget": full["state_bytes"] / cpu,
              "lora_state_over_cpu_budget": lora["state_bytes"] / cpu,
              "nvme_reserved_ratio": lora["nvme_reserved_bytes"] / full["nvme_reserved_bytes"],
              "nvme_moved_ratio": lora["nvme_moved_bytes_per_step"] / max(full["nvme_moved_bytes_per_step"], 1)}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
