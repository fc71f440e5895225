"""Which saved tensors leave the compute device.

A checkpoint boundary is a tensor ``torch.utils.checkpoint`` saves for its recompute: each
checkpointed layer's inputs. Non-reentrant checkpointing saves them in
``_CheckpointFrame.save_inputs`` before it installs its own hooks for the layer's inside, and the
reentrant ``CheckpointFunction`` saves them with ``ctx.save_for_backward``; either way the saving
call is a few frames above the pack hook, which is the only way the hook can tell them from
the other tensors saved outside checkpointed regions (the lm_head input, the loss's logits).
"""

from __future__ import annotations

import sys

import torch

_CHECKPOINT_FILE = "checkpoint.py"
_FUNCTION_FILE = "function.py"
# pack hook <- our composition (one or two frames) <- torch's list comprehension or C++ <- the saver
_MAX_FRAMES = 8


def checkpoint_boundary() -> bool:
    """Whether the tensor being packed right now is saved by ``torch.utils.checkpoint`` for its
    recompute (a checkpointed function's input)."""
    from torch.utils.checkpoint import CheckpointFunction

    f = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if f is None:
            return False
        code = f.f_code
        if code.co_name == "save_inputs" and code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        if code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_FILE):
            cls = f.f_locals.get("cls")
            return isinstance(cls, type) and issubclass(cls, CheckpointFunction)
        f = f.f_back
    return False


def offloadable(t: torch.Tensor, device: torch.device) -> bool:
    """A saved tensor that can be parked and rebuilt bit for bit with its strides: a floating
    point, dense (non-overlapping, no gaps) tensor on the compute device that is not a parameter."""
    return (isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.device == device
            and t.layout == torch.strided and t.is_floating_point() and t.numel() > 0
            and not t.is_meta and dense(t))


def dense(t: torch.Tensor) -> bool:
    """Its elements fill ``numel`` consecutive slots from its first, in some order of dimensions
    (contiguous, transposed, permuted): the raw span can be copied and rebuilt with the strides."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.size(), t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
