"""The pipeline schedules by name: ``torch.distributed.pipelining``'s, no runtime of our own.

``gpipe`` and ``1f1b`` hold one stage per rank; ``interleaved-1f1b``, ``looped-bfs`` and
``zero-bubble`` (torch's ScheduleInterleavedZeroBubble) hold ``stages_per_rank`` (>= 2) stages per
rank, stage ``s`` on pipeline rank ``s % P`` (the looped placement those schedules expect).
Gradients are never scaled by the schedule (``scale_grads=False``): the stages' engines keep
them in their chunks, where torch's ``scale_grads`` cannot reach, so the loss function divides
by the number of micro-batches instead (``offload.pipeline.stages.causal_lm_loss``).
"""

from __future__ import annotations

from ..errors import ConfigError

# name -> (torch class name, whether it takes a list of several stages per rank)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", True),
    "looped-bfs": ("ScheduleLoopedBFS", True),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", True),
}


def check_name(name: str) -> str:
    key = name.lower()
    if key not in SCHEDULES:
        raise ConfigError("schedule", name, f"unknown pipeline schedule; known: {', '.join(SCHEDULES)}")
    return key


def multi_stage(name: str) -> bool:
    """Whether schedule ``name`` runs several stages on each rank."""
    return SCHEDULES[check_name(name)][1]


def make_schedule(name: str, stages: list, micro_batches: int, loss_fn):
    """Schedule ``name`` over this rank's ``stages`` (``PipelineStage`` objects)."""
    from torch.distributed.pipelining import schedules

    cls_name, several = SCHEDULES[check_name(name)]
    if micro_batches < 1:
        raise ConfigError("micro_batches", micro_batches, "must be at least 1")
    cls = getattr(schedules, cls_name)
    if several:
        return cls(stages, micro_batches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ConfigError("schedule", name, f"holds one stage per rank, not {len(stages)}")
    return cls(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)
