"""This rank's pipeline stages, each wrapped by an offload engine, driven by a torch schedule.

``StagedModel(stage_modules, schedule=..., micro_batches=M, config=..., micro_batch=(b, t),
mesh=pipeline_mesh(P, D))`` keeps the stages of this pipeline rank (stage ``s`` on rank
``s % P``), wraps each with ``offload.wrap`` over the mesh's data-parallel group (its own chunks,
tiers, prefetch trace and CPU Adam; sliced over D ranks, a single process for D = 1), and builds
a ``PipelineStage`` per stage with static shapes (no shape inference: that would run a forward
and backward through the engines outside any step) and the schedule. The engines count
``gradient_accumulation_steps = M``: the M micro-batches' gradients accumulate in the stages'
chunks and each engine's Adam runs once per ``step``, on the last micro-batch's backward (eager)
or at ``optimizer.step()``.

One ``offload.AdamW(staged.parameters(), ...)`` serves every stage of the rank. ``stage_units`` /
``stage_names`` (every stage's, from ``split_*``) and ``targets()`` (this rank's) are what
``offload.pipeline.checkpoint`` saves and loads by.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import api
from ..config import OffloadConfig
from ..distributed import failure
from ..errors import ConfigError, DistributedError, UnsupportedError
from . import clip
from .schedules import make_schedule, multi_stage


def pipeline_mesh(pp: int, dp: int = 1, device_type: str = "cpu"):
    """A ``(pp, dp)`` ``DeviceMesh`` over the default group (dims "pp" and "dp"): rank ``r`` is
    pipeline rank ``r // dp`` of data-parallel rank ``r % dp``. Every rank must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if pp < 1 or dp < 1 or pp * dp != world:
        raise ConfigError("pp", f"{pp} x dp {dp}", f"must multiply to the world size {world}")
    return init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))


def stage_count(schedule: str, pp: int, stages_per_rank: int = 2) -> int:
    """How many stages to cut the model into for ``schedule`` over ``pp`` pipeline ranks."""
    if multi_stage(schedule):
        if stages_per_rank < 2:
            raise ConfigError("stages_per_rank", stages_per_rank, f"schedule {schedule} needs at least 2")
        return pp * stages_per_rank
    return pp


def causal_lm_loss(micro_batches: int):
    """Next-token cross-entropy of one micro-batch (label -100 ignored), divided by the number of
    micro-batches: summed over the step, the mean of the micro-batches' means (the global
    batch's mean when they hold as many labelled tokens each)."""
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                               labels[:, 1:].reshape(-1), ignore_index=-100) / micro_batches
    return loss_fn


def io_meta(module: nn.Module, batch: int, seq: int, dtype: torch.dtype):
    """``(inputs, outputs)``: meta tensors of a stage module's micro-batch input and output. The
    hidden states require grad (torch derives from that which gradients cross between stages)."""
    hidden = torch.empty(batch, seq, module.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    inp = torch.empty(batch, seq, dtype=torch.long, device="meta") if module.is_first else hidden
    out = (torch.empty(batch, seq, module.vocab_size, dtype=dtype, device="meta", requires_grad=True)
           if module.is_last else hidden)
    return (inp,), (out,)


def offloaded_stage_class():
    """``PipelineStage`` whose split backward (zero-bubble schedules) tells the stage's engine which
    pass runs: torch computes the input gradients with ``autograd.grad`` (no parameter's
    gradient), then later the weight gradients, assigned to ``.grad`` where no accumulation hook
    sees them (``ModuleHooks.input_pass`` / ``weight_pass``). Built on first use: importing
    ``torch.distributed.pipelining`` is not free."""
    from torch.distributed.pipelining import PipelineStage

    class OffloadedStage(PipelineStage):
        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            if full_backward:
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            with self.submod.offload_engine.input_pass():
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            with self.submod.offload_engine.weight_pass():
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    return OffloadedStage


class StagedModel:
    """This pipeline rank's stages of a model cut by ``offload.pipeline.split_*``.

    ``stage_modules``: every stage of the model (all ranks build the same list; this rank keeps
    its own). ``micro_batch``: ``(batch, seq)`` of one micro-batch (the schedule splits each
    global batch into ``micro_batches`` along dim 0). ``mesh``: ``pipeline_mesh(P, D)``.
    """

    def __init__(self, stage_modules: list[nn.Module], *, schedule: str, micro_batches: int,
                 config: OffloadConfig, micro_batch: tuple[int, int], mesh, loss_fn=None):
        if config.dtype == "fp16":
            # Each engine scales the gradient flowing into its stage's outputs by its own loss scale
            # and unscales only its own: a stage's input gradients, already scaled, would be scaled
            # again by the stage before it.
            raise UnsupportedError("OffloadConfig(dtype='fp16') under pipeline stages: each stage's loss scale "
                                   "would compound with the next one's; use dtype='bf16' or 'fp32'")
        self.pp_group = pp_group = mesh["pp"].get_group()
        dp_group = mesh["dp"].get_group()
        self.pp, self.pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        count = len(stage_modules)
        per_rank = count // self.pp
        if count % self.pp or (per_rank > 1) != multi_stage(schedule):
            raise ConfigError("stage_modules", count,
                              f"schedule {schedule} over {self.pp} pipeline ranks needs "
                              f"{'a multiple of' if multi_stage(schedule) else 'exactly'} {self.pp} stages "
                              f"(offload.pipeline.stage_count)")
        # Several micro-batches in flight, their backwards in forward order: parked activations
        # spill and come back by that order (offload.activations.order).
        order = config.activation_backward_order
        self.config = dataclasses.replace(config, gradient_accumulation_steps=micro_batches,
                                          activation_backward_order="micro-batches" if order == "auto" else order)
        self.micro_batches = micro_batches
        self.batch_shape = (micro_batches * micro_batch[0], micro_batch[1])     # what step() takes
        self.schedule_name, self.dp = schedule, dist.get_world_size(dp_group)
        # every stage's units and parameter names (split_llama / split_hf record them): what a
        # checkpoint's manifest says each stage holds
        self.stage_units = [getattr(m, "units", None) for m in stage_modules]
        self.stage_names = [getattr(m, "full_names", None) for m in stage_modules]
        self.indices = list(range(self.pp_rank, count, self.pp))
        failure.install(dist.get_rank())        # a rank that fails names itself to the others
        self.modules = [api.wrap(stage_modules[s], self.config, process_group=dp_group) for s in self.indices]
        self.stages = []
        stage_class = offloaded_stage_class()
        for s, module in zip(self.indices, self.modules):
            inputs, outputs = io_meta(module, *micro_batch, module.offload_engine.dtype)
            self.stages.append(stage_class(module, s, count, module.offload_engine.device,
                                             input_args=inputs, output_args=outputs, group=pp_group))
        self.has_first = 0 in self.indices
        self.has_last = count - 1 in self.indices
        self.schedule = make_schedule(schedule, self.stages, micro_batches,
                                      loss_fn if loss_fn is not None else causal_lm_loss(micro_batches))

    def targets(self) -> list:
        """This rank's stages as ``offload.pipeline.checkpoint.Target``s (what a resume loads into)."""
        from .checkpoint import Target

        return [Target(s, len(self.stage_names), m, self.stage_names[s]) for s, m in zip(self.indices, self.modules)]

    def offload_stats(self) -> list[dict]:
        """Each of this rank's stages' ``offload_stats()`` (the engines' last step), in stage order."""
        return [m.offload_stats() for m in self.modules]

    def train(self, mode: bool = True) -> "StagedModel":
        for m in self.modules:
            m.train(mode)
        return self

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip this step's gradients to the whole model's L2 norm ``max_norm`` (every rank calls
        it, between ``step()`` and ``optimizer.step()``); returns the norm before clipping."""
        return clip.clip_grad_norm_([m.offload_engine for m in self.modules], max_norm, self.pp_group)

    def step(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> list | None:
        """One pipeline step over a global batch: forwards and backwards of its micro-batches as the
        schedule orders them. The first stage's rank passes ``input_ids``, the last stage's
        ``labels``; returns the micro-batches' losses on the last stage's rank (each divided by
        the number of micro-batches, as the loss function returns it), else None. Call
        ``optimizer.step()`` after it (the engines' updates may already be running).

        A failure on one rank ends every rank's step: the failing rank raises its own error, its
        peers (blocked sending or receiving activations) a ``DistributedError`` naming it."""
        if self.has_first and input_ids is None:
            raise ConfigError("input_ids", None, f"pipeline rank {self.pp_rank} holds the first stage")
        if self.has_last and labels is None:
            raise ConfigError("labels", None, f"pipeline rank {self.pp_rank} holds the last stage")
        clip.check_optimizer(m.offload_engine for m in self.modules)
        losses: list | None = [] if self.has_last else None
        args = (input_ids,) if self.has_first else ()
        try:
            # Inside the try: a refused batch marks this rank failed, so its peers (already waiting
            # for its activations) end with a DistributedError naming it.
            for name, x, mine in (("input_ids", input_ids, self.has_first), ("labels", labels, self.has_last)):
                if mine and tuple(x.shape) != self.batch_shape:
                    # The stages' shapes are static (built from micro_batch): another size would
                    # abort the receiving rank inside gloo, or fail in the loss.
                    b, t = self.batch_shape
                    raise ConfigError(name, f"tensor {tuple(x.shape)}",
                                      f"has shape {tuple(x.shape)} but the stages were built for {self.batch_shape} "
                                      f"(micro_batches {self.micro_batches} x micro_batch "
                                      f"({b // self.micro_batches}, {t}))")
            self.schedule.step(*args, target=labels if self.has_last else None, losses=losses)
        except DistributedError:
            raise
        except Exception as exc:
            peer, why = failure.failed_peer()
            me = dist.get_rank()
            if peer is not None and peer != me:
                raise DistributedError(me, "pipeline step (activations and gradients between stages)",
                                       why, peer) from exc
            failure.mark_failed(me, exc)        # before this rank's peers find its sockets closed
            raise
        return losses
