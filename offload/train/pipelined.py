"""``PipelineTrainer``: ``offload finetune --pp P --schedule NAME --micro-batches M`` under torchrun.

The world's ranks form a (pp, dp) mesh (``offload.pipeline.pipeline_mesh``): rank r is pipeline
rank r // dp of data-parallel rank r % dp. Every rank builds the preset (untied: a tied weight's
two gradients are not summed across stages yet) from the run's seed, cuts it into the schedule's
stages (``split_llama``) and keeps its own, each wrapped by an engine sliced over its
data-parallel group (``StagedModel``); one ``offload.AdamW`` serves the rank's stages. A step:
the data-parallel rank's slice of the global batch goes through the schedule's forwards and
backwards of M micro-batches (the first stage's ranks feed the ids, the last stage's the labels),
``--max-grad-norm`` clips by the whole model's norm across the stages, Adam runs once.

The logged loss is the last stage's (the mean of its micro-batches' means, over the data-parallel
ranks), summed over the world so that rank 0 -- which holds the first stage -- prints it. Metrics
of the engine (bytes moved, prefetch, the step split) are rank 0's first stage's. Checkpoints are
a pipeline run's (``offload.pipeline.checkpoint``): they resume under any pp x dp, --pp 1 included.

Not yet: --model (HF directories), --output (resume the checkpoint at --pp 1 to write it), the
planner (skipped, said once); each is refused or said by name (``pipeline_checks``).
"""

from __future__ import annotations

import time

from .pipeline_checks import data_world, micro_batches, schedule
from .trainer import Trainer


class PipelineTrainer(Trainer):
    """A ``Trainer`` whose model is this rank's pipeline stages (a ``StagedModel``)."""

    @property
    def data_world(self) -> int:
        return data_world(self.config, self.ranks.world)

    @property
    def data_rank(self) -> int:
        return self.ranks.rank % self.data_world

    def prepare(self) -> None:
        super().prepare()
        # The engines accumulate the step's M micro-batches (StagedModel sets it on each stage too).
        self.engine_config = self.engine_config.replace(gradient_accumulation_steps=micro_batches(self.config))

    def describe_run(self) -> None:
        super().describe_run()
        from ..pipeline import stage_count

        p, name = self.config.parallel, schedule(self.config)
        stages = stage_count(name, p.pp)        # two per pipeline rank under the interleaved schedules
        self.say(f"finetune: {p.pp} pipeline ranks ({stages} stages) x {self.data_world} data-parallel ranks, "
                 f"--schedule {name}, {micro_batches(self.config)} micro-batches of "
                 f"{self.rows // self.data_world // micro_batches(self.config)} sequences per step; the preset is "
                 "built with an untied LM head (a tied one's gradients are not summed across stages yet)")

    def plan(self) -> bool:
        self.say("finetune: note: the planner does not plan --pp runs yet: no fit check (as --no-plan)")
        return True

    def build_model(self):
        import torch

        from ..models.llama import LlamaForCausalLM
        from ..pipeline import StagedModel, pipeline_mesh, split_llama, stage_count

        c = self.config
        # Built whole on the CPU from the seed (the weights --pp 1 builds lazily, untied), then cut:
        # each rank wraps only its stages' parameters; the rest is dropped with ``model``.
        with torch.device("cpu"):
            model = LlamaForCausalLM(self.shape.replace(tie_embeddings=False))
        model.gradient_checkpointing = not c.model.no_checkpointing
        mesh = pipeline_mesh(c.parallel.pp, self.data_world, device_type=self.device_type())
        m = micro_batches(c)
        modules = split_llama(model, stage_count(schedule(c), c.parallel.pp))
        return StagedModel(modules, schedule=schedule(c), micro_batches=m, config=self.engine_config,
                           micro_batch=(self.rows // self.data_world // m, self.seq), mesh=mesh)

    @staticmethod
    def device_type() -> str:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def build_optimizer(self):
        import offload

        o = self.config.optimizer
        # clipping by the whole model's norm is the staged model's (train_step), not each engine's
        return offload.AdamW(list(self.model.parameters()), lr=o.lr, weight_decay=o.weight_decay, betas=(0.9, 0.95))

    def lead_module(self):
        return self.model.modules[0]

    def close_model(self) -> None:
        for module in self.model.modules:
            module.offload_engine.close(keep_files=self.config.budgets.keep_nvme)

    def train_step(self, batch) -> float:
        """One pipeline step over this data-parallel rank's slice of the global batch; returns the
        last stage's loss (mean over the data-parallel ranks) on every rank."""
        staged = self.model
        device = self.lead_module().offload_engine.device
        ids, labels = (t.to(device) for t in batch)
        losses = staged.step(ids if staged.has_first else None, labels if staged.has_last else None)
        max_norm = self.config.optimizer.max_grad_norm
        if max_norm is not None:
            staged.clip_grad_norm_(max_norm)
        t0 = time.perf_counter()
        self.optimizer.step()
        self.optimizer_step_s = time.perf_counter() - t0
        self.optimizer.zero_grad()
        self.scheduler.step()
        return self.shared_loss(losses)

    def shared_loss(self, losses: list | None) -> float:
        """The last stage's loss on every rank: its ranks' sums of micro-batch losses (each already
        divided by M), summed over the world and divided by the data-parallel ranks."""
        import torch
        import torch.distributed as dist

        mine = sum(v.item() for v in losses) if losses is not None else 0.0
        total = torch.tensor([mine], dtype=torch.float64, device=self.lead_module().offload_engine.device)
        dist.all_reduce(total)
        return total.item() / self.data_world

    def step_metrics(self, loss: float, seconds: float, tok_s: float, tflops: float) -> dict:
        from . import report
        from .step_split import step_values

        return {"loss": loss, "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": tok_s, "tflops": tflops,
                "step_s": seconds, "predicted_step_s": self.predicted, "peak_rss_bytes": report.peak_rss(),
                **step_values(self.lead_module().offload_stats(), step_s=seconds,
                              optimizer_step_s=self.optimizer_step_s)}
