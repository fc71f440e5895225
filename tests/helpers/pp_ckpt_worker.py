"""One rank of a pipeline-checkpoint test: ``launch("tests.helpers.pp_ckpt_worker:main", spec, world, tmp)``.

spec: {"pp", "dp", "schedule", "micro_batches", "batch", "seq", "steps", "config": {...OffloadConfig},
"save_at": step after which to save into "ckpt" (or None), "resume": a checkpoint root to resume
from first (or None), "start": the first step to take}. ``pp == 0`` means no stages at all: one
process trains the whole model wrapped by one engine (``offload.wrap``), with the same number of
micro-batches as gradient accumulation -- the ``--pp 1`` path. Every rank builds the untied tiny
LLaMA from seed 0 (``pp_worker.tiny_llama``) and trains on ``pp_worker.llama_batches``. Returns
each step's loss (summed over micro-batches; the last stage's ranks, else None) and the rank's
final parameters under the whole model's names.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import offload
from offload.pipeline import StagedModel, causal_lm_loss, pipeline_mesh, split_llama, stage_count
from offload.pipeline.checkpoint import Target, load_pipeline_checkpoint, save_pipeline_checkpoint

from .pp_worker import llama_batches, tiny_llama
from .reference import LR, WD


def main(spec: dict) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    pp, dp, m = spec["pp"], spec.get("dp", 1), spec["micro_batches"]
    model = tiny_llama()
    names = {id(p): n for n, p in model.named_parameters()}
    config = offload.OffloadConfig(**spec["config"])
    batch, seq = spec["batch"], spec["seq"]
    if pp:
        mesh = pipeline_mesh(pp, dp)
        staged = StagedModel(split_llama(model, stage_count(spec["schedule"], pp)), schedule=spec["schedule"],
                             micro_batches=m, config=config, micro_batch=(batch // dp // m, seq), mesh=mesh)
        modules, targets = staged.modules, staged.targets()
        d = mesh["dp"].get_local_rank()
    else:
        wrapped = offload.wrap(model, config.replace(gradient_accumulation_steps=m))
        modules, targets, d = [wrapped], [Target(0, 1, wrapped)], 0
    opt = offload.AdamW([p for mod in modules for p in mod.parameters()], lr=LR, weight_decay=WD)
    if spec.get("resume"):
        loaded = load_pipeline_checkpoint(targets, opt, spec["resume"])
    losses = []
    for step, x in enumerate(llama_batches(spec["steps"], batch, seq)):
        if step < spec.get("start", 0):
            continue
        x = x[d::dp].contiguous()
        if pp:
            out = staged.step(x, x)
            loss = sum(v.item() for v in out) if out is not None else None
        else:
            loss = 0.0
            for part in x.chunk(m):
                value = causal_lm_loss(m)(wrapped(part).logits, part)
                value.backward()
                loss += value.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        if spec.get("save_at") == step + 1:
            if pp:
                save_pipeline_checkpoint(staged, opt, spec["ckpt"], step=step + 1, extra={"step": step + 1})
            else:
                offload.save_checkpoint(wrapped, opt, spec["ckpt"], step=step + 1, extra={"step": step + 1})
    state = {}
    for module in modules:
        sd = module.state_dict()
        for local, p in module.named_parameters():
            state[names[id(p)]] = sd[local].detach().clone()
    out = {"losses": losses, "state": state}
    if spec.get("resume"):
        out["loaded"] = {k: loaded[k] for k in ("step", "extra", "resharded")}
    dist.destroy_process_group()
    return out
