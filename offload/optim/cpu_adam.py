"""``CPUAdamW`` and ``CPUAdam``: drop-in replacements for ``torch.optim.AdamW`` / ``Adam`` on
CPU float32 parameters, running the native SIMD kernel (``kernel.adam_step``).

Same constructor arguments, param groups, lr schedulers (lr is read from ``param_groups``
every step, a float or a one-element tensor) and the same ``state_dict`` layout as torch
(per parameter: ``step`` as a 0-dim float tensor, ``exp_avg``, ``exp_avg_sq``), so states
move between torch's optimizers and these both ways. ``foreach`` and ``fused`` are accepted
and ignored (the update is always fused); ``amsgrad``, ``capturable`` and ``differentiable``
are not supported and say so.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, UnsupportedError
from .kernel import adam_step, check_hparams, resolve_threads


def scalar_dtype() -> torch.dtype:
    """The dtype of an Adam state's ``step`` tensor, as torch makes it."""
    # torch keeps 'step' as float32 unless the default dtype is float64 (_get_scalar_dtype)
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_group(group: dict) -> None:
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ConfigError("betas", betas, "must be a pair (beta1, beta2)")
    check_hparams(lr=group["lr"], beta1=betas[0], beta2=betas[1], eps=group["eps"],
                  weight_decay=group["weight_decay"])
    if group.get("amsgrad", False):
        raise UnsupportedError("amsgrad=True is not supported by offload's CPU Adam; "
                               "use amsgrad=False or torch.optim.AdamW(amsgrad=True)")
    for flag in ("capturable", "differentiable"):
        if group.get(flag, False):
            raise UnsupportedError(f"{flag}=True is not supported by offload's CPU Adam "
                                   "(it runs outside autograd and CUDA graphs); leave it False")


def _check_param(p: torch.Tensor, index: int) -> None:
    where = f"param_groups param {index}"
    if p.device.type != "cpu":
        raise ConfigError("params", f"{where} on {p.device}",
                          "offload's CPU Adam updates CPU tensors only")
    if p.dtype != torch.float32:
        raise UnsupportedError(f"{where} has dtype {p.dtype}: offload's CPU Adam updates "
                               "float32 parameters (fp32 master weights) only")
    if p.grad is not None:
        g = p.grad
        if g.is_sparse or g.layout != torch.strided:
            raise ConfigError("grad", f"{where} ({g.layout})",
                              "sparse gradients are not supported (nor by torch.optim.AdamW)")
        if g.device.type != "cpu":
            raise ConfigError("grad", f"{where} on {g.device}", "must be a CPU tensor")
        if g.shape != p.shape:
            raise ConfigError("grad", f"{where} shape {tuple(g.shape)}",
                              f"must match the parameter's shape {tuple(p.shape)}")


class _CPUAdamBase(torch.optim.Optimizer):
    """Shared body of ``CPUAdamW`` (decoupled weight decay) and ``CPUAdam`` (L2)."""

    _decoupled_default = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=None, threads=None):
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        _check_group(defaults)
        self._threads = resolve_threads(threads)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_group(group)

    @property
    def threads(self) -> int:
        """Worker threads per native call (0: physical cores)."""
        return self._threads

    @threads.setter
    def threads(self, value) -> None:
        self._threads = resolve_threads(value or None)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", self._decoupled_default)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every parameter with a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # check everything first: a bad group or tensor raises before anything changes
        index = 0
        for group in self.param_groups:
            _check_group(group)
            for p in group["params"]:
                if not self._updated_elsewhere(p):
                    _check_param(p, index)
                index += 1
        self._before_step()
        for group in self.param_groups:
            mine = [p for p in group["params"] if not self._updated_elsewhere(p)]
            if mine:
                self._step_group(group if len(mine) == len(group["params"]) else {**group, "params": mine})
        return loss

    def _updated_elsewhere(self, p: torch.Tensor) -> bool:
        """Subclasses: True for parameters another engine updates (offload.AdamW's chunked ones)."""
        return False

    def _before_step(self) -> None:
        """Subclasses: work that must happen once per step, after the checks, before the updates."""

    def _step_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=scalar_dtype(), device="cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step_t = state["step"]
            step_t += 1
            tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
            flat = [t.contiguous() for t in tensors]
            adam_step(flat[0], flat[1], flat[2], flat[3], lr=group["lr"], beta1=beta1,
                      beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                      step=int(step_t.item()), decoupled=group["decoupled_weight_decay"],
                      maximize=group["maximize"], threads=self._threads or None)
            for i in (0, 2, 3):  # a non-contiguous tensor was updated in a contiguous copy
                if flat[i] is not tensors[i]:
                    tensors[i].copy_(flat[i])


class CPUAdamW(_CPUAdamBase):
    """Drop-in ``torch.optim.AdamW`` for CPU float32 parameters (decoupled weight decay).

    Extra keyword: ``threads`` (None: physical cores) for the native kernel.
    """

    _decoupled_default = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, threads=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, threads=threads)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


class CPUAdam(_CPUAdamBase):
    """Drop-in ``torch.optim.Adam`` for CPU float32 parameters (L2 weight decay unless
    ``decoupled_weight_decay=True``, as in torch). Extra keyword: ``threads``."""

    _decoupled_default = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False, threads=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=decoupled_weight_decay,
                         threads=threads)
