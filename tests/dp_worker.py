"""One rank of a data-parallel test run: ``python tests/dp_worker.py SPEC.json`` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (see tests/dp_launch.py).

SPEC: {"steps", "accumulate", "clip", "overflow_at", "fail_at", "config": {...OffloadConfig},
"out": path prefix, "seed", "checkpointing"}. Each rank trains TinyGPT on its 1/N slice of the
same global batches the single-process reference sees and writes ``<out>.rank<r>.pt``:
its per-step losses, its statistics, and (every rank, through the collective state_dict) the
final fp32 parameters. ``fail_at``: [rank, step] — that rank raises inside backward then.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload  # noqa: E402
from tiny_gpt import TinyGPT, batches  # noqa: E402

LR, WD = 1e-2, 0.1


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.get("timeout_s", 60)))
    torch.manual_seed(spec.get("seed", 0))
    model = TinyGPT(checkpointing=spec.get("checkpointing", True))
    model = offload.wrap(model, offload.OffloadConfig(**spec["config"]))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=spec.get("clip"))
    accumulate = spec.get("accumulate", 1)
    fail_rank, fail_step = spec.get("fail_at") or (None, None)
    data = iter(batches(spec["steps"] * accumulate, batch=spec.get("batch", 4)))
    losses, stats = [], []
    for step in range(spec["steps"]):
        total = torch.zeros(())
        for _ in range(accumulate):
            x, y = next(data)
            n = x.shape[0] // world
            x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
            loss = model(x, y) / accumulate
            if step == spec.get("overflow_at") and rank == spec.get("overflow_rank", rank):
                loss = loss * float("inf")
            if rank == fail_rank and step == fail_step:
                loss = FailInBackward.apply(loss)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
        stats.append(model.offload_stats())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine = model.offload_engine
    nvme = engine.store.tiers.get("nvme")
    torch.save({"losses": losses, "stats": stats, "state": state, "step_count": engine.step_count,
                "skipped": engine.scaler.skipped if engine.scaler is not None else 0,
                "nvme_reserved": nvme.describe()["reserved"] if nvme is not None else 0,
                "nvme_dirs": [str(d) for d in nvme.dirs] if nvme is not None else []},
               f"{spec['out']}.rank{rank}.pt")
    model.offload_engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception as exc:
        # What the test reads: the error this rank ended with, on one line.
        print(f"RANK-ERROR {type(exc).__name__}: {exc}", flush=True)
        raise
