"""The drop-in surface: ``offload.wrap(model, config)`` and ``offload.AdamW(model.parameters(), ...)``.

Two lines change in a normal PyTorch loop; ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad()``, lr schedulers, ``state_dict()`` / ``load_state_dict()`` of both the
model and the optimizer keep working. Parameters that were not wrapped are updated exactly as
``offload.optim.CPUAdamW`` would.
"""

from __future__ import annotations

import torch
from torch import nn

from . import foreign_optimizers, grad_clip, wrapped_guards
from .config import MASTERS, OPTIMIZER_STATES, OffloadConfig
from .distributed.arrival import arrive
from .engine import OffloadEngine
from .engine.access import engine_of
from .errors import ConfigError, OffloadError
from .hf.accelerate_ranks import mark_data_parallel
from .hf.peft_adapters import keep_adapters_in_place
from .lazy import lazy_record
from .optim.cpu_adam import CPUAdamW, scalar_dtype
from .optim.quantized import bound_moment

MOMENTS = ("exp_avg", "exp_avg_sq")


def wrap(model: nn.Module, config: OffloadConfig | None = None, *, process_group=None) -> nn.Module:
    """Move ``model``'s parameters into offloaded chunks and install the engine's hooks.

    Returns the same module object. Its parameters keep their identity; their values now live in
    the engine (``model.state_dict()`` gathers them). ``model.offload_stats()`` reports the last
    step; ``model.offload_engine`` is the engine itself. Under N ranks the model is marked as
    already data parallel, so HF Trainer and ``accelerate.prepare`` add no DDP
    (``offload.hf.accelerate_ranks``).

    ``process_group``: the ranks that share this model's state (each keeps a 1/N piece of every
    chunk). None: torch.distributed's default group (all ranks), as before. A pipeline stage
    passes its data-parallel group (``offload.pipeline``); a group of one rank is a single process.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "expected a torch.nn.Module")
    if any(engine_of(p) is not None for p in model.parameters()):
        raise ConfigError("model", type(model).__name__, "is already wrapped by offload")
    if config is None:
        record = lazy_record(model)
        config = record.config if record is not None and record.config is not None else OffloadConfig()
    engine = OffloadEngine(model, config, process_group=process_group)
    chunks = engine.chunks
    original_state_dict = model.state_dict
    original_load = model.load_state_dict

    def state_dict(*args, destination=None, prefix="", keep_vars=False):
        arrive("state_dict", chunks.sharding)     # a collective: every rank, or a one-line error
        chunks.drain()
        sd = original_state_dict(*args, destination=destination, prefix=prefix, keep_vars=True)
        values = chunks.gather()
        for k, v in list(sd.items()):
            if id(v) in values:
                sd[k] = values[id(v)]
            elif not keep_vars and isinstance(v, torch.Tensor):
                sd[k] = v.detach()
        return sd

    def load_state_dict(state: dict, strict: bool = True, assign: bool = False):
        arrive("load_state_dict", chunks.sharding)
        chunks.drain()
        by_name = dict(model.named_parameters(remove_duplicate=False))
        values, rest = {}, {}
        for k, v in state.items():
            p = by_name.get(k)
            place = chunks.param(p) if p is not None else None
            if place is not None:
                if tuple(v.shape) != tuple(p.shape if p.numel() else place.slot.shape):
                    raise ConfigError(k, tuple(v.shape), f"shape differs from the parameter's {place.slot.shape}")
                values[id(p)] = v
            else:
                rest[k] = v
        # By name, as torch reports them: a tied alias (lm_head.weight) absent from ``state`` is
        # missing even when its twin was loaded (safetensors' load_model, behind accelerate's
        # load_state, drops such names from its unexpected ones only when reported missing).
        missing = [n for n, p in by_name.items() if chunks.param(p) is not None and n not in state]
        chunks.scatter(values)
        engine.drop_gathered()          # copies gathered from other ranks hold the old values
        result = original_load(rest, strict=False, assign=assign)
        missing_all = sorted(set(result.missing_keys) - set(by_name)) + missing
        if strict and (missing_all or result.unexpected_keys):
            raise OffloadError(f"load_state_dict: missing keys {missing_all}, unexpected keys "
                               f"{list(result.unexpected_keys)}")
        return torch.nn.modules.module._IncompatibleKeys(missing_all, list(result.unexpected_keys))

    model.state_dict = state_dict
    model.load_state_dict = load_state_dict
    model.offload_engine = engine
    model.offload_stats = engine.stats
    # Under N ranks the engine averages gradients itself: accelerate and Trainer must not add DDP.
    mark_data_parallel(model, chunks.sharding.world if chunks.sharding is not None else 1)
    # HF Trainer resumes a PeftModel by load_adapter, which would swap in new adapter parameters.
    keep_adapters_in_place(model)
    # Trainer's and accelerate's clip must see offloaded gradients, and refuse when no
    # offload.AdamW holds them (Trainer's own torch AdamW would silently update nothing).
    grad_clip.install()
    # A torch optimizer left over the placeholders would update nothing, silently: refused.
    foreign_optimizers.install()
    # copy.deepcopy / pickle refused naming what to do, model.half() refused naming OffloadConfig(dtype=...),
    # model.to(device) left harmless, users' backward hooks reading real weights, and HF's
    # num_parameters() counting the values, not the placeholders.
    wrapped_guards.install(model, engine)
    return model


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Tell the engine that ``module``'s forward uses ``param`` although another module owns it."""
    engine = engine_of(param)
    if engine is None:
        raise ConfigError("param", tuple(param.shape), "belongs to no wrapped model")
    engine.register_external_parameter(module, param)


def _check_precision(config: OffloadConfig, state: str | None, master: str | None) -> None:
    for name, given, field, have, choices in (
            ("state", state, "optimizer_state", config.optimizer_state, OPTIMIZER_STATES),
            ("master", master, "master", config.master, MASTERS)):
        if given is not None and given not in choices:
            raise ConfigError(name, given, f"must be one of {', '.join(map(repr, choices))}")
        if given is not None and given != have:
            raise ConfigError(name, given, f"the model was wrapped with OffloadConfig({field}={have!r}), which "
                                           f"laid out its optimizer state: wrap it with "
                                           f"OffloadConfig({field}={given!r}) to train with {given} {name}")


def _refuse_thawed(owned) -> None:
    """A wrapped parameter that requires a gradient now but was frozen when its model was wrapped:
    its chunk was laid out without gradient, master or moments, so it would never be updated.
    ``owned``: ``(parameter, its engine or None)`` pairs."""
    for p, e in owned:
        info = e.chunks.param(p) if e is not None and p.requires_grad else None
        if info is not None and not e.chunks.layout.trainable[info.slot.chunk]:
            raise ConfigError(info.slot.name, "requires_grad=True",
                              "was frozen (requires_grad=False) when the model was wrapped, so its chunk holds "
                              "no gradient, master or moments and it cannot be trained: wrap it with "
                              "requires_grad=True and freeze it after offload.wrap (its chunk then stays "
                              "trainable until it is thawed)")


class AdamW(CPUAdamW):
    """AdamW for offloaded models (and, for any other CPU parameters, ``CPUAdamW``).

    Same arguments as ``torch.optim.AdamW`` plus ``max_grad_norm``: clip the global gradient
    norm to it every step (the update then waits for backward to end). Calling
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), n)`` between backward and ``step()``
    (as HF Trainer and accelerate do) clips the same way (see ``offload.grad_clip``): the first
    step's update waits for it, and when that step was clipped so do the later ones.

    ``state`` ("fp32" | "bf16" | "8bit") and ``master`` ("fp32" | "bf16"): the precision of the
    Adam moments and master weights. The wrapped model's chunks are laid out for them when it is
    wrapped, so they are set by ``OffloadConfig(optimizer_state=..., master=...)``; given here
    they must say the same (a check, so a script states what it trains with), or ``ConfigError``.
    ``state_dict()`` holds fp32 moments whatever the precision (they load into
    ``torch.optim.AdamW``), and ``load_state_dict`` quantises what it is given.
    """

    _decoupled_default = True
    steps_offloaded_parameters = True       # offload.foreign_optimizers lets its step() through

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, max_grad_norm: float | None = None, state: str | None = None,
                 master: str | None = None, **kwargs):
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ConfigError("max_grad_norm", max_grad_norm, "must be a positive number or None")
        self.max_grad_norm = max_grad_norm
        # (max_norm, global norm) set by a clip_grad_norm_ call, used by the next step.
        self.clip_this_step: tuple[float, float] | None = None
        self.last_grad_norm: float | None = None
        # Whether clip_grad_norm_ comes between backward and step(): unknown (None) until the
        # first step has shown it; until then, and then if so, updates wait for step().
        self.clips_expected: bool | None = None
        # Whether a hyper-parameter was seen set between backward and step(): then updates wait for it.
        self.hypers_set_late = False
        grad_clip.install()
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, **kwargs)
        self._precision = (state, master)
        self._engines: list[OffloadEngine] = []
        self._attach_engines()

    def _attach_engines(self) -> None:
        """Attach the engines of the wrapped parameters in ``param_groups``; each (re)reads which
        group each of its parameters is in."""
        engines = list(self._engines)
        for group in self.param_groups:
            for p in group["params"]:
                e = engine_of(p)
                if e is not None and e not in engines:
                    engines.append(e)
        for e in engines[len(self._engines):]:
            _check_precision(e.config, *self._precision)
        self._engines = engines
        for e in engines:
            e.attach_optimizer(self)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's; a group of wrapped parameters is updated by their engine from the next step
        (the engine maps each parameter to its group when the optimizer is attached: without a
        new attach it would leave the new group's parameters unchanged, silently)."""
        params = param_group["params"]
        if not isinstance(params, set):     # torch refuses sets (unordered) itself
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            _refuse_thawed((p, engine_of(p)) for p in params)
            param_group["params"] = params      # the caller's dict itself, as torch keeps it
        super().add_param_group(param_group)
        if hasattr(self, "_engines"):       # torch's __init__ adds the first groups before ours runs
            self._attach_engines()

    def _updated_elsewhere(self, p) -> bool:
        return engine_of(p) is not None

    def defers_update(self) -> bool:
        """Whether this window's updates must wait for ``step()``: a global norm will be applied
        (``max_grad_norm``, or a ``clip_grad_norm_`` call expected between backward and step), or
        hyper-parameters were seen set between backward and step (torch reads them at step)."""
        return self.max_grad_norm is not None or self.clips_expected is not False or self.hypers_set_late

    def _before_step(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        owners = list(map(engine_of, params))       # one look-up a parameter for both checks
        _refuse_thawed(zip(params, owners))
        # Built before offload.wrap (accelerate-style: optimizer, then prepare): the engines came
        # after __init__ attached none, and each would leave its parameters unchanged, silently.
        if any(e is not None and e not in self._engines for e in owners):
            self._attach_engines()
        try:
            for e in self._engines:
                e.step()
        finally:
            if self.clips_expected is None and any(e.step_count for e in self._engines):
                self.clips_expected = self.clip_this_step is not None
            self.clip_this_step = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for e in self._engines:
            e.zero_grad()
        super().zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's global gradient norm to ``max_norm``; returns the norm before clipping.

        Call it between ``loss.backward()`` and ``optimizer.step()``. With ``overlap_optimizer``
        the update may already have run during backward: pass ``max_grad_norm`` to the
        constructor instead, which keeps the update waiting for the norm every step.
        """
        return grad_clip.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], max_norm)

    # ---- state dicts interchangeable with torch.optim.AdamW ----------------------------------
    def _indexed(self):
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield i, p
                i += 1

    def state_dict(self):
        sd = super().state_dict()
        for e, entries in self._wrapped_by_engine().items():
            e.chunks.drain()
            steps = e.chunks.step_state().adam_steps
            stepped = [(i, p, steps[e.chunks.param(p).index]) for i, p in entries]
            stepped = [entry for entry in stepped if entry[2] > 0]
            moments = {kind: e.chunks.gather([p for _, p, _ in stepped], kind) for kind in MOMENTS}
            if e.chunks.precision["optimizer_state"] == "8bit":
                # The moments the next step uses: 8-bit exp_avg held to Adam's bound, as the
                # kernel holds it (an exp_avg_sq read back as 0 would make torch's next update m / eps).
                betas = {id(p): g["betas"] for g in self.param_groups for p in g["params"]}
                for _, p, _ in stepped:
                    m, v = moments["exp_avg"][id(p)], moments["exp_avg_sq"][id(p)]
                    moments["exp_avg"][id(p)] = bound_moment(m, v, *betas[id(p)])
            for i, p, step in stepped:
                # fp32 at every precision, as torch.optim.AdamW's (bf16 moments gather as bf16).
                sd["state"][i] = {"step": torch.tensor(float(step), dtype=scalar_dtype(), device="cpu"),
                                  **{kind: moments[kind][id(p)].float() for kind in MOMENTS}}
        return sd

    def load_state_dict(self, state_dict):
        mine = self._wrapped_by_engine(state_dict["state"])
        ours = {i for entries in mine.values() for i, _ in entries}
        super().load_state_dict({**state_dict, "state": {i: st for i, st in state_dict["state"].items()
                                                         if i not in ours}})
        # torch replaces the whole state: a parameter the dict has no state for starts afresh.
        absent = self._wrapped_by_engine([i for i, _ in self._indexed() if i not in state_dict["state"]])
        for e in {**mine, **absent}:
            e.chunks.drain()
            steps = list(e.chunks.step_state().adam_steps)
            given = {id(p): state_dict["state"][i] for i, p in mine.get(e, [])}
            for i, p in mine.get(e, []):
                steps[e.chunks.param(p).index] = int(float(state_dict["state"][i]["step"]))
            cleared = [p for _, p in absent.get(e, []) if steps[e.chunks.param(p).index] > 0]
            for p in cleared:
                steps[e.chunks.param(p).index] = 0
            e.chunks.restore_step_state(adam_steps=steps)
            zeros = {id(p): torch.zeros(e.chunks.param(p).slot.shape) for p in cleared}
            for kind in MOMENTS if given or zeros else ():
                e.chunks.scatter({**{k: st[kind] for k, st in given.items()}, **zeros}, kinds=[kind])

    def _wrapped_by_engine(self, indices=None) -> dict:
        """``{engine: [(state index, param)]}`` for the wrapped parameters among ``indices`` (all by default)."""
        index = dict(self._indexed())
        out: dict = {}
        for i in index if indices is None else indices:
            p = index.get(i)
            e = engine_of(p) if p is not None else None
            if e is not None:
                out.setdefault(e, []).append((i, p))
        return out
