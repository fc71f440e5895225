"""One rank of a data-parallel test run: ``launch("tests.helpers.dp_worker:main", spec, world, tmp)``
(tests/helpers/ranks.py) calls ``main(spec)`` in each rank's process.

spec: {"steps", "accumulate", "clip", "overflow_at", "fail_at", "config": {...OffloadConfig},
"out": path prefix, "seed", "checkpointing", "backend", "set_device", "vocab", "freeze", "replicate"}. Each
rank trains TinyGPT (``vocab`` tokens: a large one makes the embedding an oversized chunk) on its
1/N slice of the same global batches the single-process reference sees and writes
``<out>.rank<r>.pt``: its per-step losses, statistics and gradient norms (with ``clip``), its
engine's device, the chunk layout (``sizes``, ``slots``) and this rank's ``spans`` of it, the
elements of Adam state it holds per trainable chunk (``adam_elems``: what its CPU Adam updates),
the warnings wrap gave, and (every rank, through the collective state_dict) the final fp32
parameters.
``replicate``: n -- every rank takes the batch's first n samples (the mean of N equal gradients is exact: the
run is bit for bit one process's on that slice).
``fail_at``: [rank, step] — that rank raises inside backward then. ``backend``: "gloo" (default)
or "nccl" (a GPU per rank; ``set_device``: the worker makes cuda:LOCAL_RANK current itself, as
torchrun scripts should, else the engine has to).
"""

from __future__ import annotations

import os
import signal
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import offload

from .reference import LR, WD
from .tiny_gpt import TinyGPT, batches


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")


def main(spec: dict) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = spec.get("backend", "gloo")
    if backend == "nccl" and spec.get("set_device"):
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.get("timeout_s", 60)))
    torch.manual_seed(spec.get("seed", 0))
    config = offload.OffloadConfig(**spec["config"])
    llama = spec.get("model") == "llama"
    if llama:       # offload's own Llama, built lazily (on meta, materialized chunk by chunk)
        from offload.models.llama import LlamaForCausalLM, get_preset

        with offload.lazy_init(config):
            model = LlamaForCausalLM(get_preset("tiny"))
        model.model.gradient_checkpointing = True
    else:
        layers = 3 if spec.get("odd_rank_differs") and rank % 2 else 4
        model = TinyGPT(checkpointing=spec.get("checkpointing", True), layers=layers, vocab=spec.get("vocab", 64))
    for name, p in model.named_parameters():
        if any(name.startswith(f) for f in spec.get("freeze", ())):
            p.requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = offload.wrap(model, config)
    device = model.offload_engine.device
    init_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if spec.get("init_state") else None
    module = torch.nn.parallel.DistributedDataParallel(model) if spec.get("ddp") else model
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                        max_grad_norm=spec.get("clip"))
    accumulate = spec.get("accumulate", 1)
    fail_rank, fail_step = spec.get("fail_at") or (None, None)
    vocab = 256 if llama else spec.get("vocab", 64)
    data = iter(batches(spec["steps"] * accumulate, batch=spec.get("batch", 4), vocab=vocab))
    losses, stats, norms = [], [], []
    preempt = None
    if spec.get("preempt_at"):
        def save():
            Path(f"{spec['out']}.rank{rank}.saved").write_text(str(len(losses)))
        preempt = offload.on_preempt(save).install()
    for step in range(spec["steps"]):
        if preempt is not None:
            if spec["preempt_at"] == [rank, step]:
                os.kill(os.getpid(), signal.SIGTERM)     # this rank alone is told to stop
            preempt.after_step()
        if step == spec.get("reload_at"):
            # Full state dicts (collective: every rank gathers every value), into a fresh model.
            model_state, opt_state = model.state_dict(), opt.state_dict()
            model.offload_engine.close()
            torch.manual_seed(1234)         # other initial values: the load must replace them all
            model = offload.wrap(TinyGPT(checkpointing=True), config)
            opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=spec.get("clip"))
            model.load_state_dict(model_state)
            opt.load_state_dict(opt_state)
            module = model
        total = 0.0
        for _ in range(accumulate):
            x, y = next(data)
            n = int(spec.get("replicate") or x.shape[0] // world)
            at = 0 if spec.get("replicate") else rank * n       # every rank the same slice: averaged exactly
            x, y = x[at:at + n].to(device), y[at:at + n].to(device)
            loss = (module(x, labels=y).loss if llama else module(x, y)) / accumulate
            if step == spec.get("overflow_at") and rank == spec.get("overflow_rank", rank):
                loss = loss * float("inf")
            if rank == fail_rank and step == fail_step:
                loss = FailInBackward.apply(loss)
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
        stats.append(model.offload_stats())
        norms.append(opt.last_grad_norm)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    engine = model.offload_engine
    nvme = engine.store.tiers.get("nvme")
    chunks = engine.chunks
    chunks.drain()
    # This rank's Adam state: the exp_avg it keeps of each trainable chunk (None: none yet).
    adam_elems = {}
    for info in chunks.chunks():
        held = chunks.read("exp_avg", info.index) if "exp_avg" in info.kinds else None
        adam_elems[info.index] = None if held is None else held.numel()
    torch.save({"losses": losses, "stats": stats, "grad_norms": norms, "state": state, "init_state": init_state, "step_count": engine.step_count,
                "skipped": engine.scaler.skipped if engine.scaler is not None else 0,
                "nvme_reserved": nvme.describe()["reserved"] if nvme is not None else 0,
                "nvme_dirs": [str(d) for d in nvme.dirs] if nvme is not None else [],
                "device": str(engine.device),
                "chunks": chunks.layout.num_chunks, "kept": sum(i.piece_numel for i in chunks.chunks()),
                "sizes": tuple(chunks.layout.sizes),
                "slots": [(s.name, s.chunk, s.offset, s.numel) for s in chunks.layout.slots],
                "spans": [tuple(info.span) for info in chunks.chunks()], "adam_elems": adam_elems,
                "current_device": torch.cuda.current_device() if engine.device.type == "cuda" else None,
                "warnings": [str(w.message) for w in caught]},
               f"{spec['out']}.rank{rank}.pt")
    model.offload_engine.close()
    dist.destroy_process_group()
