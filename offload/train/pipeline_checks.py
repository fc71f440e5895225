"""The checks of ``offload finetune --pp P --schedule NAME --micro-batches M``, before anything is
built: each failure a ``ConfigError`` naming the flag (``inputs.check_config`` runs them).

The rules are those of the library (``offload.pipeline``) and of torch's schedules, said in the
trainer's terms: the ranks split as pp x dp; fp16 and tied embeddings are refused under stages
(a tied preset is built untied instead: it trains from scratch); 1F1B needs at least as many
micro-batches as stages; the interleaved schedules split the micro-batches into rounds of P.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..models.llama import get_preset
from .config import TrainConfig


def data_world(config: TrainConfig, world: int) -> int:
    """The data-parallel ranks of a run over ``world`` ranks: world / pp (the ranks of one
    pipeline stage, each taking its own slice of every global batch)."""
    return max(1, world // config.parallel.pp)


def micro_batches(config: TrainConfig) -> int:
    """The pipeline's micro-batches per step of each data-parallel rank: --micro-batches, else P."""
    return config.parallel.micro_batches or config.parallel.pp


def schedule(config: TrainConfig) -> str:
    """The pipeline's schedule: --schedule, else 1F1B."""
    return config.parallel.schedule or "1f1b"


def check_pipeline(config: TrainConfig, world: int) -> None:
    """The --pp run's settings against each other and the world size (under --pp 1: only that no
    --schedule was given, which would otherwise be ignored without a word)."""
    par, m = config.parallel, config.model
    pp = par.pp
    if pp == 1:
        if par.schedule is not None:
            raise ConfigError("--schedule", par.schedule, "schedules pipeline stages: give --pp 2 or more with it "
                                                          "(under --pp 1 there is no pipeline to schedule)")
        return
    if world % pp:
        raise ConfigError("--pp", pp, f"must divide the {world} ranks torchrun started (world = pp x dp)")
    if m.model:
        raise ConfigError("--pp", pp, "trains --preset models only yet (an HF --model directory is not streamed "
                                      "into pipeline stages)")
    if m.dtype == "fp16":
        raise ConfigError("--dtype", "fp16", "is refused under --pp: each stage's loss scale would compound with "
                                             "the next one's; use bf16 or fp32")
    if config.output.output:
        raise ConfigError("--output", config.output.output,
                          "is not written under --pp yet: save a checkpoint (--checkpoint-dir) and resume it "
                          "with --pp 1 and more --steps (it reshards by layer) to go on and write it there")
    several = schedule(config) in ("interleaved-1f1b", "looped-bfs", "zero-bubble")
    stages = 2 * pp if several else pp
    # Caught here, before every rank builds the preset, and said with the flag (the cut itself
    # would refuse it only after the build, naming its own argument): each stage needs a unit.
    units = get_preset(m.preset_name).num_layers + 2        # embedding, the layers, norm + LM head
    if stages > units:
        name = "llama-" + m.preset_name.lower().removeprefix("llama-")
        raise ConfigError("--pp", pp, f"{stages} stages under --schedule {schedule(config)} exceed {name}'s {units} "
                                      f"units to cut (embedding, {units - 2} layers, norm + LM head: each stage "
                                      "needs one)")
    mb = micro_batches(config)
    if schedule(config) == "1f1b" and mb < stages:
        raise ConfigError("--micro-batches", mb, f"must be >= the {stages} stages under --schedule 1f1b")
    if schedule(config) in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, mb // pp)
        if mb % rounds:
            raise ConfigError("--micro-batches", mb, f"must be a multiple of its {rounds} rounds of --pp {pp} "
                                                     f"under --schedule {schedule(config)} (e.g. {rounds * pp})")
