"""The trainer as a library: configuration, the training loop, checkpoints of a run, and its metrics.

``offload finetune`` and ``scripts/finetune_100b.py`` are ``cli.main``; everything they do is here,
to reuse or override::

    from offload.train import Trainer, load_config

    class MyTrainer(Trainer):
        def compute_loss(self, input_ids, labels):      # a step's loss, per micro-batch
            ...

    MyTrainer(load_config("run.toml")).train()

The modules, in the order a run uses them:

- ``config``: ``TrainConfig``, one documented dataclass per section (model, data, optimizer,
  checkpoint, output, parallel, budgets, logging); ``load_config(path)`` reads TOML.
- ``checks``: the checks single values pass (command line and TOML alike).
- ``flags``: the command line, built from the config's fields; flags override ``--config``.
- ``ranks``: this process among torchrun's ranks; stretches every rank finishes together.
- ``inputs``: checks across fields, paths, tokenizer and data -- all before planning.
- ``planning``: the planner's verdict for one rank's share of the box.
- ``trainer``: ``Trainer`` (``build_model``, ``build_data``, ``compute_loss``, ``train_step``,
  ``after_step``, ``train``).
- ``checkpointing``: ``CheckpointManager`` (interval, keep, RNG, data position, scheduler, resume).
- ``metrics``: JSON lines, TensorBoard, the PNG at the end.  ``report``: progress and summary.
- ``cli``: ``main(argv)``, and ``offload finetune``'s ``add_arguments`` / ``run``.
"""

from .checkpointing import CheckpointManager
from .config import TrainConfig, load_config
from .trainer import Trainer

__all__ = ["CheckpointManager", "TrainConfig", "Trainer", "load_config"]
