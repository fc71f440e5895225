"""Which saved tensors leave the compute device: checkpoint boundaries, told from the order of events.

A checkpoint boundary is a tensor ``torch.utils.checkpoint`` saves for its recompute: each
checkpointed layer's inputs. Nothing in the tensor says so, and the code that saves it is private
to torch and changes between versions (2.11 saves through an autograd Function, 2.13 through a
method of its checkpoint frame), so ``BoundaryFinder`` reads only what the engine sees itself:
every call of its pack hook, and its forward hooks on the modules that own parameters.

- Non-reentrant checkpointing saves the inputs through the pack hook in force (ours), then runs
  the layer under saved-tensor hooks of its own: nothing the layer saves reaches ours. So a module
  that saves tensors when it runs with grad enabled (it owns trainable parameters, or an input
  requires grad) and during whose forward our hook received nothing ran inside such a region, and
  the tensors our hook received just before that quiet stretch began (since the module event
  before it) are what the checkpoint saved: its inputs. They are known only once that module has
  returned, so until then the store holds them *pending* (the device tensor itself).
- Reentrant checkpointing runs the layer with grad disabled and saves its inputs as it returns:
  tensors packed after a module that ran with grad disabled, before the next module starts, are
  boundaries as they are packed.

Either way a boundary is found only where a module with parameters runs inside the checkpointed
function; a checkpointed stretch of parameter-free code goes unnoticed (and stays on the device).
"""

from __future__ import annotations

from typing import Callable

import torch


class BoundaryFinder:
    """Fed by the engine (``packed`` on every pack, ``module_started``/``module_ended`` around each
    hooked module's forward, ``reset`` when a forward starts or ends); calls ``claim(entries)``
    with the pending entries it finds to be boundaries, and says through ``after_no_grad``
    whether the tensor being packed now is one."""

    def __init__(self, claim: Callable[[list], None]):
        self.claim = claim
        self.reset()

    def reset(self) -> None:
        self.packs = 0                   # tensors the pack hook received (parameter views included)
        self.at_event = 0                # ``packs`` at the last module event
        self.window: list = []           # pending entries packed since the last module event
        self.candidates: list = []       # the window before the current stretch without packs
        self.at_candidates = -1          # ``packs`` when ``candidates`` were taken
        self.after_no_grad = False       # the last event ended a module that ran with grad disabled
        self.running: list = []          # (module, packs at its start, whether it saves when run)

    def packed(self) -> None:
        self.packs += 1

    def pending(self, entry) -> None:
        """``entry`` was just packed and is not known to be a boundary yet."""
        self.window.append(entry)

    def module_started(self, module, saves: bool) -> None:
        """``saves``: the module owns trainable parameters or is given a tensor that requires grad."""
        grad = torch.is_grad_enabled()
        if grad and self.packs != self.at_event:
            # A stretch without packs may begin here: what came just before it is kept to be claimed.
            self.candidates, self.at_candidates = self.window, self.packs
        self._event()
        self.running.append((module, self.packs, grad and saves))

    def module_ended(self, module) -> None:
        started, saves = -1, False
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i][0] is module:
                _, started, saves = self.running.pop(i)
                break
        if saves and self.packs == started == self.at_candidates and self.candidates:
            # It saved nothing through our hook: it ran under a checkpoint's own hooks.
            self.claim(self.candidates)
            self.candidates = []
        grad = torch.is_grad_enabled()
        self._event()
        self.after_no_grad = not grad

    def _event(self) -> None:
        self.window = []
        self.at_event = self.packs
        self.after_no_grad = False


def module_saves(trainable: bool, args) -> bool:
    """Whether a module run with grad enabled saves tensors for backward: it owns trainable
    parameters, or one of its positional inputs requires grad."""
    return trainable or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


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
