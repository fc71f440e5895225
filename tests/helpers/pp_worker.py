"""One rank of a pipeline-stages test run: ``launch("tests.helpers.pp_worker:main", spec, world, tmp)``.

spec: {"schedule", "pp", "dp", "micro_batches", "steps", "batch", "seq", "config": {...OffloadConfig},
"model": "llama" (default: offload's preset) or "hf" (``tiny_hf``),
"clip": max_norm (staged.clip_grad_norm_ every step), "checkpointing": recompute layers in backward, "fail_at": [global rank, step] (that rank's last stage raises in its forward then), "timeout_s"}.
Every rank builds the preset tiny LLaMA (untied: pipeline stages refuse tied embeddings) from
seed 0, cuts it into the schedule's stages (offload.pipeline.split_llama), keeps its own, and
trains them with one offload.AdamW on the global batches of ``llama_batches`` (data-parallel rank
d takes rows d::dp). Returns each step's summed micro-batch losses (last stage's ranks; else
None) and the final values of the rank's parameters under the full model's names.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import offload
from offload.models.llama import LlamaForCausalLM, get_preset
from offload.pipeline import StagedModel, pipeline_mesh, split_hf, split_llama, stage_count

from .reference import LR, WD


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(get_preset("tiny").replace(tie_embeddings=False))


def tiny_hf(seed: int = 0):
    """A 4-layer untied HF LlamaForCausalLM (tests/helpers/hf_models.py's tiny config), from ``seed``."""
    import transformers

    from .hf_models import tiny_config

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_config("llama", num_hidden_layers=4, tie_word_embeddings=False))


def llama_batches(n: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, seq), generator=gen) for _ in range(n)]


class FailingForward(torch.nn.Module):
    """Wraps a stage's last layer: raises in its forward at the ``at``-th call."""

    def __init__(self, inner, at: int):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, *args):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected failure in a pipeline stage's forward")
        return self.inner(*args)


def main(spec: dict) -> dict:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.get("timeout_s", 60)))
    pp, dp, m = spec["pp"], spec.get("dp", 1), spec["micro_batches"]
    hf = spec.get("model") == "hf"
    model = tiny_hf() if hf else tiny_llama()
    if spec.get("checkpointing"):
        model.gradient_checkpointing = True
    names = {id(p): n for n, p in model.named_parameters()}
    mesh = pipeline_mesh(pp, dp)
    modules = (split_hf if hf else split_llama)(model, stage_count(spec["schedule"], pp))
    fail_rank, fail_step = spec.get("fail_at") or (None, None)
    if fail_rank == rank:
        mine = modules[rank // dp]
        mine.layers[-1] = FailingForward(mine.layers[-1], fail_step * m + 1)
    batch, seq = spec["batch"], spec["seq"]
    staged = StagedModel(modules, schedule=spec["schedule"], micro_batches=m,
                         config=offload.OffloadConfig(**spec["config"]), micro_batch=(batch // dp // m, seq),
                         mesh=mesh)
    opt = offload.AdamW(list(staged.parameters()), lr=LR, weight_decay=WD)
    d = mesh["dp"].get_local_rank()
    losses = []
    for x in llama_batches(spec["steps"], batch, seq):
        x = x[d::dp].contiguous()
        out = staged.step(x, x)
        if spec.get("clip"):
            staged.clip_grad_norm_(spec["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(float(sum(loss.detach() for loss in out)) if out is not None else None)
    state = {}
    for module in staged.modules:
        sd = module.state_dict()
        for local, p in module.named_parameters():
            state[names[id(p)]] = sd[local].detach().clone()
    stats = [mod.offload_stats() for mod in staged.modules]
    return {"losses": losses, "state": state, "stages": staged.indices,
            "moved": [s.get("moved_bytes", {}) for s in stats],
            "hit_rate": [s.get("prefetch_hit_rate") for s in stats],
            "activations": [s.get("activations") for s in stats]}
