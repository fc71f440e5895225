"""One rank of ``offload bench step --nproc N`` (``offload.bench.distributed`` spawns them): its share
of the global batch, both systems built the same way on every rank (ours: ``offload.wrap`` +
``offload.AdamW``; FSDP2: ``fully_shard`` per decoder layer and on the root), samples alternating
between them, each sample's collective bytes counted per phase (forward, backward, step) by
``offload.bench.collectives``, and the figures written as JSON for the launcher to read.
"""

from __future__ import annotations

import datetime
import json
import os
import time

from ..config import OffloadConfig
from ..errors import OffloadError
from .collectives import CollectiveCounter
from .workload import STEPS_PER_SAMPLE, build_model, sync, token_batch

TIMEOUT_S = 600               # a rank that dies must not leave the others waiting for gloo's 30 min


def split_rows(rows: int, world: int, rank: int) -> slice:
    """The rows of a global batch of ``rows`` sequences that rank ``rank`` of ``world`` takes."""
    per = rows // world
    return slice(rank * per, (rank + 1) * per)


class _Phases:
    """Bytes sent per phase of a step (forward, backward, optimizer step): where a system's
    collectives happen, read off the counter between the phases (a lock and a dict copy each)."""

    def __init__(self, counter: CollectiveCounter):
        self.counter = counter
        self.sent = {"forward": 0, "backward": 0, "step": 0}
        self._last = counter.snapshot()["sent_bytes"]

    def mark(self, phase: str) -> None:
        now = self.counter.snapshot()["sent_bytes"]
        self.sent[phase] += now - self._last
        self._last = now


def _sample(kind: str, model, opt, ids, device: str, counter: CollectiveCounter,
            n: int = STEPS_PER_SAMPLE) -> tuple[float, list, dict, dict | None]:
    """``n`` steps back to back: (seconds per step, the losses, bytes sent per step by phase, the
    engine's own ``collectives`` summed over the steps and divided by ``n`` — ours only). Ours
    is timed until its queued updates and their writes have finished (``offload.bench.step``);
    reading the engine's statistics is taken off the clock."""
    sync(device)
    phases = _Phases(counter)
    engine = {"sent_bytes": 0, "received_bytes": 0, "ops": 0, "by_op": {}} if kind == "ours" else None
    off_clock = adam_s = 0.0
    t0 = time.perf_counter()
    losses = []
    for _ in range(n):
        phases.mark("step")               # the previous step's optimizer step and zero_grad
        loss = model(ids, labels=ids).loss
        phases.mark("forward")
        loss.backward()
        phases.mark("backward")
        opt.step()
        if kind == "ours":
            t = time.perf_counter()
            stats = model.offload_stats()
            _add_stats(engine, stats.get("collectives"))
            adam_s += float(stats.get("optimizer_s") or 0.0)
            off_clock += time.perf_counter() - t
            opt.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if kind == "ours":
        model.offload_engine.chunks.drain(moves=True)
    sync(device)
    seconds = (time.perf_counter() - t0 - off_clock) / n
    phases.mark("step")
    if engine is not None:
        # This rank's Adam kernel time per step (its pieces): the ranks' balance is reported.
        engine = {**_per_step(engine, n), "adam_s": adam_s / n} if engine["ops"] else None
    return seconds, [float(x) for x in losses], {k: v // n for k, v in phases.sent.items()}, engine


def _add_stats(total: dict, step: dict | None) -> None:
    if not step:
        return
    for key in ("sent_bytes", "received_bytes", "ops"):
        total[key] += int(step.get(key, 0))
    for op, nbytes in (step.get("by_op") or {}).items():
        total["by_op"][op] = total["by_op"].get(op, 0) + int(nbytes)


def _build_ours(spec: dict, rank: int):
    import offload

    model, _ = build_model(spec["cfg"], spec["device"])
    model = model.cpu() if spec["device"] == "cuda" else model
    nvme = [os.path.join(spec["path"], f"rank{rank}")] if spec["nvme"] else None
    config = OffloadConfig(device=spec["device"], dtype="bf16", device_budget=spec["device_budget"],
                           cpu_budget=spec["cpu_budget"], nvme_paths=nvme,
                           optimizer_threads=spec["threads"], chunk_size=spec["chunk_size"])
    model = offload.wrap(model, config)
    return model, offload.AdamW(model.parameters(), lr=spec["lr"])


def _build_fsdp(spec: dict, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model, _ = build_model(spec["cfg"], spec["device"])     # the same bf16 values ours starts from
    model = model.float()
    mesh = init_device_mesh(spec["device"], (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=spec["lr"])


def run_rank(rank: int, world: int, port: int, spec: dict, outdir: str) -> None:
    """One rank of a phase, writing its figures to ``outdir``/rank<r>.json: world == 1 runs ours
    alone, without a process group. ``spec`` is what ``offload.bench.distributed.measure`` asks."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        ids = token_batch(spec["cfg"], spec["batch_tokens"], device)[split_rows(spec["rows"], world, rank)]
        out = {"rank": rank, "world": world, "local_tokens": int(ids.numel()), "ours": {}, "fsdp2": None}
        with CollectiveCounter() as counter:
            systems = {}
            try:
                systems["ours"] = _build_ours(spec, rank)
            except OffloadError as exc:
                # the core refuses (or cannot shard) under this group: report it, keep FSDP2's figures
                out["ours"] = {"error": f"{type(exc).__name__}: {exc}"}
            if world > 1 and spec["fsdp"]:
                systems["fsdp2"] = _build_fsdp(spec, world)
            for name in systems:
                out[name] = {"step_times_s": [], "collectives": [], "losses": [], "engine_collectives": []}
            names = list(systems)
            for _ in range(spec["warmup"]):
                for name in names:
                    model, opt = systems[name]
                    out[name]["losses"] += _sample(name, model, opt, ids, device, counter, 1)[1]
            for i in range(spec["steps"]):
                for name in (names if i % 2 == 0 else names[::-1]):   # alternate who goes first
                    model, opt = systems[name]
                    before = counter.snapshot()
                    seconds, losses, phases, engine = _sample(name, model, opt, ids, device, counter)
                    per_step = _per_step(CollectiveCounter.since(counter.snapshot(), before))
                    per_step["by_phase"] = phases
                    r = out[name]
                    r["step_times_s"].append(seconds)
                    r["collectives"].append(per_step)
                    r["losses"] += losses
                    if name == "ours":
                        r["engine_collectives"].append(engine)
            if "ours" in systems:
                out["ours"]["layout"] = {k: v for k, v in systems["ours"][0].offload_stats().get("layout", {}).items()
                                         if k in ("chunks", "chunk_size")}
                systems["ours"][0].offload_engine.close()
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
            json.dump(out, fh)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _per_step(delta: dict, n: int = STEPS_PER_SAMPLE) -> dict:
    out = {"sent_bytes": delta["sent_bytes"] // n, "received_bytes": delta["received_bytes"] // n,
           "ops": delta["ops"] // n, "by_op": {k: v // n for k, v in delta["by_op"].items()}}
    if "by_op_received" in delta:
        out["by_op_received"] = {k: v // n for k, v in delta["by_op_received"].items()}
    return out
