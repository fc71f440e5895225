"""HF Trainer and accelerate on N ranks: a wrapped model is already data parallel.

Under torchrun, ``accelerate.Accelerator.prepare`` (which ``transformers.Trainer`` calls too)
wraps every trainable model in ``DistributedDataParallel``. The engine already shards the model
over the process group and averages each chunk's gradient over the ranks (DDP's mean, so
Trainer's ``loss * num_processes`` correction holds as under DDP); DDP on top would reduce
gradients a second time, into buckets sized for the placeholder parameters, and the engine
refuses it at the first forward.

``mark_data_parallel`` marks a model wrapped under N ranks the way accelerate marks a model it
has prepared (``_is_accelerate_prepared``: the attribute ``prepare_model`` reads first to avoid
wrapping a model twice), so ``prepare`` hands it back as it is: no DDP, no ``.to(device)`` (the
engine places its chunks), and no autocast wrapper around ``forward`` (the engine's ``dtype`` is
the compute precision; under one process accelerate still adds its autocast). Trainer's own
``_wrap_model`` adds no DDP (it leaves that to accelerate), and accelerate still shards the data
loaders over the ranks, so each rank trains on its slice of the global batch. No library code is
patched: one attribute on the user's model, set by ``offload.wrap``.
"""

from __future__ import annotations

from torch import nn

# What accelerate's ``Accelerator.prepare_model`` checks before wrapping a model (accelerate >= 0.20).
PREPARED_FLAG = "_is_accelerate_prepared"


def mark_data_parallel(model: nn.Module, world: int) -> None:
    """Tell accelerate (and Trainer through it) that ``model``, wrapped by offload over ``world``
    ranks, needs no DDP; a single process is left alone (nothing to average there)."""
    if world > 1:
        setattr(model, PREPARED_FLAG, True)
