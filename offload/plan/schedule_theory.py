"""What pipeline schedules cost in theory: the bubble (the share of a step a pipeline rank's compute
idles) and the micro-batches whose activations the first rank holds at once, for the schedules
``offload.pipeline`` runs (torch.distributed.pipelining's), over P pipeline ranks, M micro-batches
per step and v stages per rank (1 for gpipe and 1f1b).

Bubble fractions, with equal forward/backward time on every stage and free communication (each
paper's own assumptions):

* ``gpipe``: (P - 1) / (M + P - 1) — Huang et al. 2019, "GPipe", §2.3 (the bubble is
  O((K - 1) / (M + K - 1)) of the step, K partitions).
* ``1f1b``: the same bubble as GPipe, fewer activations in flight — PipeDream-Flush (Narayanan et
  al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training", PipeDream-2BW, ICML) and Megatron-LM
  (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", SC,
  §2.2.1: bubble time (p - 1)/m of the ideal step, i.e. (p - 1)/(m + p - 1) of the whole).
* ``interleaved-1f1b``: (P - 1) / (v M + P - 1) — the same paper, §2.2.2: v model chunks per rank
  cut the bubble time by v (at v times the point-to-point traffic).
* ``looped-bfs``: (P - 1) / (v M + P - 1) — Lamy-Poirier 2023, "Breadth-First Pipeline
  Parallelism" (MLSys): the looping placement shrinks the bubble by the loops per rank like the
  interleaved schedule, running each local stage's micro-batches breadth-first (all M held).
* ``zero-bubble``: torch's ``ScheduleInterleavedZeroBubble`` is ZB1P of Qi et al. 2024, "Zero Bubble
  Pipeline Parallelism" (ICLR; arXiv 2401.10241): the backward split into input gradients (B)
  and weight gradients (W), W filling the bubble, within 1F1B's activation memory. Its handcrafted
  form ZB-H1 leaves (P - 1)(T_F + T_B - T_W) of idle time against 1F1B's (P - 1)(T_F + T_B + T_W):
  a third of it with T_F = T_B = T_W, the paper's assumption. So (P - 1)/3 / (v M + (P - 1)/3)
  here; the bubble is ~0 only in the paper's ZB-H2 / ZB-2p, which hold twice the activations and
  which torch's schedule does not run.

Micro-batches in flight on a pipeline rank (rank 0 holds the most), counted in units of "one
micro-batch's activations of all of this rank's layers" (a stage of an interleaved rank holds 1/v
of them): GPipe runs every forward before any backward (M); 1F1B warms up P - rank (min(M, P - rank));
torch's interleaved schedules warm up ``_get_warmup_ops`` stage-micro-batches ((v - 1) x the
micro-batches per round + 2 (P - 1 - rank) for interleaved 1F1B, + (P - 1 - rank) for zero-bubble)
and hold one more in the steady state; LoopedBFS runs all M through a local stage before the backward (M).
"""

from __future__ import annotations

from ..errors import ConfigError

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble")
"""``offload.pipeline.SCHEDULES``' names (not imported: that package loads torch.distributed)."""
STAGES_PER_RANK = 2
"""v for the multi-stage schedules: ``offload.pipeline.stage_count``'s default; more cuts the bubble
further but multiplies the point-to-point traffic."""
ZB_BUBBLE_SHARE = 1 / 3
"""ZB-H1's idle time against 1F1B's, with T_F = T_B = T_W (Qi et al. 2024, §3)."""


def stages_per_rank(schedule: str) -> int:
    """v: stages each pipeline rank holds under ``schedule``."""
    return 1 if check(schedule) in ("gpipe", "1f1b") else STAGES_PER_RANK


def check(schedule: str) -> str:
    """``schedule`` if the planner knows it (ConfigError otherwise)."""
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError("schedule", schedule, f"unknown pipeline schedule; known: {', '.join(SCHEDULE_NAMES)}")
    return schedule


def _rounds(pp: int, micro_batches: int) -> tuple[int, int]:
    """torch's interleaved schedules: (rounds, micro-batches per round)."""
    rounds = max(1, micro_batches // pp)
    return rounds, micro_batches // rounds


def runnable(schedule: str, pp: int, micro_batches: int) -> bool:
    """Does torch's schedule accept ``micro_batches`` over ``pp`` ranks? (The interleaved ones want
    M to be a multiple of max(1, M // P); 1F1B at least P.)"""
    if schedule == "1f1b":
        return micro_batches >= pp
    if stages_per_rank(schedule) == 1 or schedule == "looped-bfs":
        return micro_batches >= 1
    rounds, _ = _rounds(pp, micro_batches)
    return micro_batches % rounds == 0


def bubble_fraction(schedule: str, pp: int, micro_batches: int) -> float:
    """Share of the step a pipeline rank's compute idles (0 for one stage)."""
    if pp < 1 or micro_batches < 1:
        raise ConfigError("pp" if pp < 1 else "micro_batches", pp if pp < 1 else micro_batches, "must be >= 1")
    v = stages_per_rank(schedule)
    idle = float(pp - 1)
    if schedule == "zero-bubble":
        idle *= ZB_BUBBLE_SHARE
    return idle / (v * micro_batches + idle) if idle else 0.0


def in_flight(schedule: str, pp: int, micro_batches: int, rank: int = 0) -> float:
    """Micro-batches of activations (of all of its layers) pipeline rank ``rank`` holds at once
    (rank 0 the most)."""
    v, m = stages_per_rank(schedule), micro_batches
    if not 0 <= rank < pp:
        raise ConfigError("rank", rank, f"must be a pipeline rank of {pp}")
    if schedule in ("gpipe", "looped-bfs"):
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    _, per_round = _rounds(pp, m)
    factor = 2 if schedule == "interleaved-1f1b" else 1
    warmup = min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)
    return min(warmup + 1, m * v) / v
