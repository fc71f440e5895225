"""A wrapped PeftModel's ``load_adapter`` (what HF Trainer's resume calls) keeps the engine's parameters.

peft's ``load_adapter`` loads the adapter's values through ``model.load_state_dict`` (which
``offload.wrap`` routes into the chunks) and then, by default, "autocasts" the adapter: every
bf16/fp16 adapter parameter is replaced by a new fp32 ``nn.Parameter``. On a wrapped model the
adapters compute in the engine's dtype and keep their fp32 (or bf16) master in the engine, so the
replacements would be parameters the engine does not hold: forward would meet an empty placeholder
and the optimizer would go on updating the old objects. The engine already keeps the precision the
cast is for, so the wrapped ``load_adapter`` skips it. A new adapter name would add modules the
engine never laid out: refused, naming it.
"""

from __future__ import annotations

import functools

from torch import nn

from ..errors import UnsupportedError


def keep_adapters_in_place(model: nn.Module) -> None:
    """Route ``model.load_adapter`` (a ``peft.PeftModel``'s) so it loads values into the existing
    adapter parameters and never replaces them. No-op for a model without ``load_adapter``."""
    original = getattr(model, "load_adapter", None)
    if original is None or not hasattr(model, "peft_config"):
        return

    @functools.wraps(original)
    def load_adapter(model_id, adapter_name, *args, **kwargs):
        if adapter_name not in model.peft_config:
            raise UnsupportedError(
                f"load_adapter({str(model_id)!r}, adapter_name={adapter_name!r}): the model was wrapped by offload "
                f"with adapters {sorted(model.peft_config)} and cannot grow new parameters; add the adapter "
                f"before offload.wrap, or load it into an existing adapter name")
        if len(args) >= 3:            # (is_trainable, torch_device, autocast_adapter_dtype, ...) by position
            args = (*args[:2], False, *args[3:])
        else:
            kwargs["autocast_adapter_dtype"] = False
        return original(model_id, adapter_name, *args, **kwargs)

    model.load_adapter = load_adapter
