"""What a wrapped model refuses, or answers for its placeholders: copies, dtype casts, parameter counts.

After ``offload.wrap`` a parameter's ``.data`` is an empty placeholder (or, while its chunk is on
the compute device, a view of it): its values, gradient and Adam state live in the engine's
chunks, behind open files, threads and locks. Four everyday idioms went wrong there:

- ``copy.deepcopy(model)``, ``pickle`` / ``torch.save(model)`` and
  ``torch.optim.swa_utils.AveragedModel(model)`` (which deep-copies) failed deep in the engine
  ("cannot pickle memoryview objects"), and a deep copy of one layer would have copied
  placeholders. Each is refused with ``UnsupportedError`` naming what to do instead.
- ``model.half()`` / ``.bfloat16()`` / ``.to(torch.float16)`` changed the placeholders' dtype while
  the engine went on computing in its own: refused with ``ConfigError`` naming
  ``OffloadConfig(dtype=...)``, before anything changed. A cast to the dtype the engine computes
  in and every device move (``.to("cpu")``, the HF Trainer's ``model.to(device)``) leave the
  wrapped parameters to the engine; buffers move only to the engine's compute device (anywhere
  else the next forward would fail), with a warning when the move asked for another.
- a user's full backward (pre-)hook reading ``module.weight`` read a placeholder: its module's
  ``register_full_backward_hook`` / ``register_full_backward_pre_hook`` (and ``register_forward_hook``)
  now pin the module's chunks around the user's hook (``offload.engine.user_hooks``).
- ``sum(p.numel() for p in model.parameters())`` counts placeholders: ``num_parameters(model)``
  counts the values, and answers a Hugging Face model's own ``num_parameters()`` and PEFT's
  ``get_nb_trainable_parameters()`` (behind ``print_trainable_parameters()``).

``install`` sets them as instance attributes of the wrapped model's modules: ``__deepcopy__`` and
``__reduce_ex__`` (looked up on the instance by ``copy`` and ``pickle``), ``_apply`` (torch's
one funnel for ``to`` / ``half`` / ``float`` / ``cuda`` / ``type``) and three hook registrations.
Other models are untouched, and no forward pays for them. Each holds its module weakly (no
reference cycle through the module's own dict).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from .engine import user_hooks
from .engine.access import engine_of
from .errors import ConfigError, UnsupportedError

_INSTEAD = ("copy the model before offload.wrap, or build a fresh one and load model.state_dict() into it "
            "(offload.wrap that one to train it too); save it with torch.save(model.state_dict()) or "
            "offload.save_checkpoint(model, optimizer, dir). An average of the weights "
            "(torch.optim.swa_utils.AveragedModel deep-copies its model) is kept the same way: over a copy "
            "made before wrap, updated from model.state_dict()")
PEFT_COUNTS = ("PeftModel.get_nb_trainable_parameters", "PeftMixedModel.get_nb_trainable_parameters")


def install(model: nn.Module, engine) -> None:
    """Guard every module of ``model`` (wrapped by ``engine``) against copies and dtype casts, pin
    its chunks around users' hooks (``offload.engine.user_hooks``), and answer Hugging Face's
    ``num_parameters()`` and PEFT's ``get_nb_trainable_parameters()``."""
    dtype, dtype_name = engine.dtype, engine.config.dtype
    device = torch.empty(0, device=engine.device).device      # "cuda" -> "cuda:0": tensors report an index
    for module in model.modules():
        if next(module.parameters(), None) is None:
            continue        # nothing wrapped in it (an activation, a dropout): copies and casts stay torch's
        name = type(module).__name__
        module.__deepcopy__ = _refusal(f"copy.deepcopy of {name}, a module of a model wrapped by offload.wrap")
        # pickle, torch.save and copy.copy all ask __reduce_ex__ (a shallow copy would share the
        # parameters, but the engine's hooks know the original model only)
        module.__reduce_ex__ = _refusal(f"pickling or copying {name} (pickle, torch.save or copy.copy of the "
                                        "module), a module of a model wrapped by offload.wrap")
        module._apply = _guarded_apply(module, dtype, dtype_name, device)
        user_hooks.guard_registered(engine.hooks, module)
        user_hooks.guard(engine.hooks, module)
        hf = getattr(type(module), "num_parameters", None)
        if getattr(hf, "__qualname__", "") == "ModuleUtilsMixin.num_parameters":
            module.num_parameters = _hf_num_parameters(module)
        # PEFT's print_trainable_parameters() asks this; its own count reads a zero-element
        # parameter's size from DeepSpeed's ``ds_numel``, which offload does not set: with it, PEFT
        # would take the model for a ZeRO-3 one (and gather it with deepspeed) elsewhere.
        peft = getattr(type(module), "get_nb_trainable_parameters", None)
        if getattr(peft, "__qualname__", "") in PEFT_COUNTS:
            module.get_nb_trainable_parameters = _peft_counts(module)


def num_parameters(model: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """Elements of ``model``'s parameters, each counted once (tied ones too); a wrapped one counts
    its values in the engine's chunks, not its empty placeholder. ``only_trainable``: those that
    require a gradient; ``exclude_embeddings``: leave out ``nn.Embedding`` weights (both as Hugging
    Face's ``num_parameters`` does)."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
    total = 0
    for p in model.parameters():
        if (only_trainable and not p.requires_grad) or id(p) in skip:
            continue
        engine = engine_of(p)
        info = engine.chunks.param(p) if engine is not None else None
        total += info.slot.numel if info is not None else p.numel()
    return total


def _peft_counts(module: nn.Module):
    ref = weakref.ref(module)

    def counts() -> tuple[int, int]:
        return num_parameters(ref(), only_trainable=True), num_parameters(ref())
    return counts


def _refusal(what: str):
    def refuse(*args):
        raise UnsupportedError(f"{what}: its values, gradients and optimizer state live in the engine's chunks "
                               f"(with open files and threads), its parameters are empty placeholders. "
                               f"Instead, {_INSTEAD}")
    return refuse


def _hf_num_parameters(module: nn.Module):
    ref = weakref.ref(module)

    def count(only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        return num_parameters(ref(), only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    return count


def _guarded_apply(module: nn.Module, dtype: torch.dtype, dtype_name: str, device: torch.device):
    ref = weakref.ref(module)

    def _apply(fn, recurse=True):
        m = ref()
        if not getattr(fn, "_offload_checked", False):      # the outermost call: its children get the checked fn
            fn = _checked(fn, type(m).__name__, dtype, dtype_name, device)
        return type(m)._apply(m, fn, recurse)
    return _apply


def _checked(fn, name: str, dtype: torch.dtype, dtype_name: str, device: torch.device):
    """``fn`` (what ``_apply`` applies to every tensor) refused when it changes the compute dtype,
    else made to leave the wrapped parameters alone and every tensor on ``device``."""
    probe = fn(torch.empty(0, dtype=dtype, device=device))
    if isinstance(probe, torch.Tensor) and probe.dtype != dtype:
        got = str(probe.dtype).removeprefix("torch.")
        raise ConfigError("dtype", got, f"{name}.half() / .bfloat16() / .float() / .to({got}) after offload.wrap: "
                                        f"the wrapped model computes in {str(dtype).removeprefix('torch.')} "
                                        f"(OffloadConfig(dtype={dtype_name!r})), in which its values live in the "
                                        f"engine's chunks, so the cast would change nothing but its placeholders; "
                                        f"to compute in another dtype, wrap the model with OffloadConfig(dtype=...) "
                                        f"('bf16', 'fp16' or 'fp32')")
    if isinstance(probe, torch.Tensor) and probe.device != device:
        warnings.warn(f"{name}.to({probe.device}) after offload.wrap: the wrapped model stays on {device}, where "
                      f"OffloadConfig(device=...) has it compute (its values live in the engine's chunks, which "
                      f"move between the tiers themselves)", stacklevel=4)

    def apply(t: torch.Tensor) -> torch.Tensor:
        if engine_of(t) is not None:
            return t            # the engine places its parameters (their .data follows their chunk)
        out = fn(t)
        return out if not isinstance(out, torch.Tensor) or out.device == device else t
    apply._offload_checked = True
    return apply
