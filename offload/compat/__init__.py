"""Configs written for other training stacks, read as offload's. Today one: DeepSpeed.

A DeepSpeed ZeRO / ZeRO-Infinity config (a dict, or the path of its JSON file) gives an
``OffloadConfig`` and the keyword arguments of ``offload.AdamW``::

    cfg = OffloadConfig.from_deepspeed("ds_config.json")
    model = offload.wrap(model, cfg)
    optimizer = offload.AdamW(model.parameters(), **deepspeed_optimizer_kwargs("ds_config.json"))

* ``deepspeed`` — the entry points (``from_deepspeed``, ``deepspeed_optimizer_kwargs``,
  ``load_deepspeed_config``), each section mapped to ``OffloadConfig`` fields, and the rules:
  which keys are mapped, listed with the reason in one logged line, or refused; what the ZeRO stage and
  each section's ``device`` become.
* ``deepspeed_optimizer`` — ``optimizer`` and ``gradient_clipping`` read as ``offload.AdamW``'s
  arguments.
* ``deepspeed_keys`` — DeepSpeed's vocabulary: the keys each section may hold, those accepted
  without effect and why, and value readers whose errors name the DeepSpeed key path.

Only ``deepspeed`` imports ``offload.config``. ``OffloadConfig.from_deepspeed`` imports it back
when called (not at import time), so ``import offload`` never loads this package.
"""

from .deepspeed import deepspeed_optimizer_kwargs, from_deepspeed, load_deepspeed_config

__all__ = ["from_deepspeed", "deepspeed_optimizer_kwargs", "load_deepspeed_config"]
