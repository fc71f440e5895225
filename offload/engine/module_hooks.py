"""Forward and backward module hooks: which chunks each module needs, pinned around its compute.

Forward: a pre-hook pins the module's chunks on the compute device (after their update from the
last step) and a post-hook unpins them and wraps the outputs so that their backward pins the chunks
again (``hooks.wrap_for_backward``). Backward pins go once every parameter of the module has its
gradient (for a parameter with several uses, after each use), or when backward ends. Each pin tells
the trace prefetcher where the iteration is, and it fetches what comes next (``pins.py``). The root
module's forward begins an iteration; the first backward hook begins a backward, and an autograd
callback ends it (or the next forward or ``zero_grad`` finds it abandoned).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ConfigError, OffloadError, UnsupportedError
from .gradients import GradCapture
from .hooks import autograd_running, map_tensors, register_forward_hooks, weak_grad_hook, wrap_for_backward
from .pins import DevicePins
from .pipeline import Parking, StepPipeline
from .progress import StepProgress
from .saved import SavedParameterViews
from .stepper import ScaleGrad
from .updates import ReadyGradients, UpdateQueue


class ModuleHooks:
    """The hooks on one wrapped model's modules and parameters.

    ``pin_budget``: elements a module's pin set may hold with its descendants' parameters
    (see ``install``). ``gather`` (None in a single process) brings a chunk's parameters from
    the rank that owns it before the first pin. ``streams`` (None on the CPU): each forward's
    current stream becomes the compute stream. ``timeline``: the GPU timeline, when tracing.
    """

    def __init__(self, model: nn.Module, params, pins: DevicePins, progress: StepProgress, updates: UpdateQueue,
                 ready: ReadyGradients, grads: GradCapture, pipeline: StepPipeline, parking: Parking,
                 saved: SavedParameterViews, tracer, *, pin_budget: int, gather=None, scaler=None,
                 streams=None, timeline=None):
        self.model = model
        self.params = params
        self.pins = pins
        self.progress = progress
        self.updates = updates
        self.ready = ready
        self.grads = grads
        self.pipeline = pipeline
        self.parking = parking
        self.saved = saved
        self.tracer = tracer
        self.pin_budget = pin_budget
        self.gather = gather
        self.scaler = scaler
        self.streams = streams
        self.timeline = timeline
        self.closed = False
        self.called: set[nn.Module] = set()      # modules called so far in this forward
        self.splitting: str | None = None        # "input" / "weight": in a split backward's pass
        self._handles: list = []
        self._new_backward()
        self.install()

    def install(self) -> None:
        """Hook every module that owns parameters (and the root).

        A module's *pin set* is its own parameters plus, until its first forward has shown
        otherwise, those of its descendants: some modules use a child's parameters without
        calling the child (``nn.MultiheadAttention`` reads ``out_proj.weight``). After the first
        call, descendants whose own forward ran inside it are dropped from the set.
        """
        for h in self._handles:
            h.remove()
        self.pin_sets: dict[nn.Module, list[nn.Parameter]] = {}
        self.module_chunks: dict[nn.Module, list[int]] = {}
        self.module_params: dict[nn.Module, list[nn.Parameter]] = {}
        self.grad_counts: dict[nn.Module, int] = {}      # trainable parameters a module owns
        self.param_modules: dict[int, list[nn.Module]] = defaultdict(list)
        self.discovering: set[nn.Module] = set()
        self.called_within: dict[nn.Module, set[nn.Module]] = defaultdict(set)
        self.active: list[nn.Module] = []
        self.fwd_pinned: list[tuple[nn.Module, list[int], float]] = []
        self._handles = []
        for module in self.model.modules():
            own = self._own_params(module)
            if not own and module is not self.model:
                continue
            pin_set = list(own)
            if module is not self.model:
                below = [q for d in module.modules() if d is not module for q in self._own_params(d)]
                if below and sum(q.numel() for q in below) <= self.pin_budget:
                    pin_set = list(dict.fromkeys(own + below))
                    self.discovering.add(module)
            self.module_params[module] = own
            self.grad_counts[module] = sum(p.requires_grad for p in own)
            self._set_pin_set(module, pin_set)
            for p in own:
                self.param_modules[id(p)].append(module)
            self._handles += register_forward_hooks(module, self._pre_forward, self._post_forward)
        for p in self.params.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(weak_grad_hook(self)))
        self.tied = {m for m, own in self.module_params.items() if any(len(self.param_modules[id(p)]) > 1 for p in own)}

    def close(self) -> None:
        """The engine closed: a forward from now on raises."""
        self.closed = True

    def _own_params(self, module: nn.Module) -> list[nn.Parameter]:
        own = list(module.parameters(recurse=False)) + list(getattr(module, "_offload_external", []))
        return [p for p in dict.fromkeys(own) if self.params.owns(p)]

    def _set_pin_set(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.pin_sets[module] = params
        self.module_chunks[module] = sorted({self.params.ref(p).slot.chunk for p in params})

    def _finish_discovery(self, module: nn.Module) -> None:
        called = self.called_within.pop(module, set())
        keep = list(self.module_params[module])
        for d in module.modules():
            if d is not module and d not in called:
                keep += self._own_params(d)
        self._set_pin_set(module, list(dict.fromkeys(keep)))
        self.discovering.discard(module)

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        """Make ``module``'s hooks also fetch ``param`` (a parameter it uses but does not own)."""
        if not self.params.owns(param):
            raise ConfigError("param", tuple(param.shape), "is not a parameter of the wrapped model")
        ext = list(getattr(module, "_offload_external", []))
        if any(q is param for q in ext):
            return
        ext.append(param)
        module._offload_external = ext
        self.install()

    # ---- pins --------------------------------------------------------------------------
    def pin_updated(self, chunks: list[int]) -> None:
        """Pin ``chunks`` once their updates from the last step are done (all waits first: one
        that raises leaves nothing pinned)."""
        for c in chunks:
            self.updates.wait(c)
        for c in chunks:
            if self.gather is not None and not self.pins.pinned(c):
                self.gather.ensure(c)
            self.pins.pin(c)

    def unpin(self, c: int) -> None:
        if self.pins.unpin(c):
            self.ready.unpinned(c)

    def _unpin_all(self) -> None:
        for c in self.pins.pinned_chunks():
            while self.pins.pinned(c):
                self.unpin(c)

    # ---- forward --------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args) -> None:
        p = self.progress
        if module is self.model and p.in_backward and not autograd_running():
            self.abort_backward()
        if module is self.model and not p.in_backward:
            if self.closed:
                raise OffloadError("this model's offload engine was closed (engine.close()): its values "
                                   "and swap files are gone; wrap a model again to train")
            if self.gather is not None:
                self._refuse_ddp()
            self._begin_iteration()
            if torch.is_grad_enabled():
                self.saved.enter()
        chunks = self.module_chunks[module]
        self.pin_updated(chunks)
        args = self._release_after_own_backward(module, args)
        if p.in_backward:        # a checkpoint recompute: these pins belong to the backward
            self.bwd_pins[module] += 1
            if module not in self.bwd_remaining:
                self.bwd_remaining[module] = self.grad_counts[module]
            return args
        args = self._release_after_each_use(module, args)
        for outer in self.active:
            if outer in self.discovering:
                self.called_within[outer].add(module)
        self.active.append(module)
        self.saved.module_started(module, self.grad_counts[module] > 0, args)
        self.fwd_pinned.append((module, chunks, time.perf_counter()))
        if self.timeline is not None:
            self.timeline.start(("forward", module))
        return args

    def _refuse_ddp(self) -> None:
        """DistributedDataParallel around a wrapped model would all-reduce gradients the engine
        already reduces, into buckets sized for the placeholder parameters (autograd then fails
        with a shape error nobody can place): say what to do instead."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        outer = DDP._get_active_ddp_module()
        if outer is not None and outer.module is self.model:
            raise UnsupportedError(
                "the offloaded model runs inside torch's DistributedDataParallel: offload.wrap already "
                "shards it across the process group's ranks and averages its gradients; train the "
                "wrapped model itself (HF Trainer and accelerate.prepare leave a model wrapped under "
                "N ranks as it is: wrap it after the process group exists, and add no DDP yourself)")

    def _release_after_own_backward(self, module: nn.Module, args):
        """A module with no trainable parameter (a LoRA base layer) gets no gradient that would
        release its backward pins: route its inputs' gradients through a hook that releases them
        once its backward has run, rather than hold its frozen chunks until backward ends."""
        if self.grad_counts[module] or module is self.model or not torch.is_grad_enabled():
            return args
        return wrap_for_backward(args, lambda m=module: self._release_backward_pins(m))

    def _release_after_each_use(self, module: nn.Module, args):
        """Parameters with several uses in a forward (a layer called at every depth, or tied) get their
        gradients after the first use's backward: each later use's pin goes once it reaches its inputs."""
        if (module in self.called or module in self.tied) and self.grad_counts[module] and torch.is_grad_enabled():
            args = wrap_for_backward(args, lambda m=module: self._release_one_use(m))
        self.called.add(module)
        return args

    def _post_forward(self, module: nn.Module, args, output):
        if self.progress.in_backward:
            return output
        self.saved.module_ended(module)
        for i in range(len(self.fwd_pinned) - 1, -1, -1):
            if self.fwd_pinned[i][0] is module:
                _, chunks, started = self.fwd_pinned.pop(i)
                if self.tracer.enabled:
                    self.tracer.complete(f"forward {type(module).__name__}", "compute", started,
                                         time.perf_counter(), "compute")
                if self.timeline is not None:
                    self.timeline.stop(("forward", module), f"forward {type(module).__name__}")
                break
        else:
            chunks = []
        if module in self.active:
            self.active.remove(module)
        for c in chunks:
            self.unpin(c)
        if module in self.discovering:
            self._finish_discovery(module)
        if module is self.model:
            self.saved.exit()
        if torch.is_grad_enabled():
            output = wrap_for_backward(output, lambda m=module: self._pre_backward(m))
            if module is self.model and self.scaler is not None:
                output = map_tensors(output, self._scale_if_needed)
        return output

    def _scale_if_needed(self, t: torch.Tensor) -> torch.Tensor:
        return ScaleGrad.apply(self.scaler, t) if t.requires_grad and t.is_floating_point() else t

    def _begin_iteration(self) -> None:
        # A forward that raised never reached its post-hooks: let go of what it held.
        self.saved.exit()
        for _, chunks, _ in self.fwd_pinned:
            for c in chunks:
                self.unpin(c)
        self.active.clear()
        self.fwd_pinned.clear()
        self.called.clear()
        self.pipeline.check_intact()        # a failed NVMe request may have left half a step
        if self.progress.applied:
            raise OffloadError(
                "a new forward started after backward already applied an optimizer update that "
                "optimizer.step() has not committed: call optimizer.step() after each backward, or "
                "set OffloadConfig(gradient_accumulation_steps=N) when accumulating N micro-batches")
        if self.progress.reduced and self.progress.micro_batches and torch.is_grad_enabled():
            # Under N ranks the window's last backward (by the config's count) reduce-scattered every
            # gradient into the ranks' pieces: another micro-batch's gradients would be summed with the wrong ones.
            # (step() sets micro_batches back to 0, also when an fp16 overflow skipped it.)
            raise OffloadError(
                "a new forward started after the accumulation window's last micro-batch (by "
                "OffloadConfig.gradient_accumulation_steps) was reduced across the ranks, before "
                "optimizer.step(): call optimizer.step() after it, or set "
                "OffloadConfig(gradient_accumulation_steps=N) when accumulating N micro-batches "
                "(under HF Trainer or accelerate, their gradient_accumulation_steps)")
        if self.streams is not None:
            self.streams.capture()     # this forward's stream is the compute stream
        self.pins.begin_iteration()
        if self.gather is not None:
            self.gather.begin_iteration()
        self.parking.forward_started()

    # ---- backward ----------------------------------------------------------------------
    def _pre_backward(self, module: nn.Module) -> None:
        if not self.progress.in_backward:
            self.pipeline.begin_backward(input_only=self.splitting == "input")
            # Run once this backward ends. torch has no public API for it; FSDP2 and DDP use this one.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.pin_updated(self.module_chunks[module])
        self.bwd_pins[module] += 1
        if module not in self.bwd_remaining:
            self.bwd_remaining[module] = self.grad_counts[module]
        if module not in self.bwd_started:
            self.bwd_started[module] = time.perf_counter()
            if self.timeline is not None:
                self.timeline.start(("backward", module))

    def _on_grad(self, p: nn.Parameter) -> None:
        # Autograd runs this hook with p.grad None too, when no path carried a gradient to p (an
        # output the loss ignores): p is done with for this backward all the same.
        self.grads.capture(p)
        for module in self.param_modules[id(p)]:
            if module in self.bwd_remaining:
                self.bwd_remaining[module] -= 1
                if self.bwd_remaining[module] <= 0:
                    self._release_backward_pins(module)

    def _release_one_use(self, module: nn.Module) -> None:
        if self.bwd_pins.get(module, 0) > 0:
            self.bwd_pins[module] -= 1
            for c in self.module_chunks[module]:
                self.unpin(c)

    def _release_backward_pins(self, module: nn.Module) -> None:
        started = self.bwd_started.pop(module, None)
        if started is not None and self.tracer.enabled:
            self.tracer.complete(f"backward {type(module).__name__}", "compute", started,
                                 time.perf_counter(), "compute")
        if started is not None and self.timeline is not None:
            self.timeline.stop(("backward", module), f"backward {type(module).__name__}")
        for _ in range(self.bwd_pins.pop(module, 0)):
            for c in self.module_chunks[module]:
                self.unpin(c)
        self.bwd_remaining.pop(module, None)

    def _end_backward(self) -> None:
        self.grads.end_backward()
        for module in list(self.bwd_pins):
            self._release_backward_pins(module)
        self._unpin_all()
        self.pipeline.end_backward()
        self._new_backward()

    # ---- a split backward (zero-bubble schedules) -------------------------------------------
    @contextmanager
    def input_pass(self):
        """The first half of a split backward: ``torch.autograd.grad`` of the outputs by the inputs
        only. No parameter gets a gradient, so it is not one of the window's micro-batches (the
        window's last would otherwise end before its weight gradients came); its pins, and what
        it unpacked, are let go when it ends (its end-of-backward callback, as for any backward)."""
        if self.splitting is not None:
            raise OffloadError(f"a split backward's input pass began inside its {self.splitting} pass")
        self.splitting = "input"
        try:
            yield
        finally:
            self.splitting = None

    @contextmanager
    def weight_pass(self):
        """The second half: ``torch.autograd.grad`` by the parameters, from the gradients the input
        pass kept, then ``p.grad = dw`` (or ``+=``) -- no accumulation hook runs, so the gradients
        are captured into their chunks here, when the pass is done, and the pass ends the
        backward: one micro-batch of the window (the last one's updates may start). A pass that
        runs a whole backward itself (torch's first stage) is captured by the hooks as usual."""
        if self.splitting is not None:
            raise OffloadError(f"a split backward's weight pass began inside its {self.splitting} pass")
        if self.progress.in_backward and not autograd_running():
            self.abort_backward()       # a backward raised: its end never ran
        if not self.progress.in_backward:
            self.pipeline.begin_backward()
        self.splitting = "weight"
        try:
            yield
        except BaseException:
            self.splitting = None
            self.abort_backward()
            raise
        self.splitting = None
        try:
            for p in self.params.params:
                if p.requires_grad and p.grad is not None:
                    self._on_grad(p)
        except BaseException:
            self.abort_backward()
            raise
        self._end_backward()

    def abort_backward(self) -> None:
        """A backward raised, so its end-of-backward callback never ran: release what it held.
        Gradients accumulated so far stay, as they would in ``.grad`` with plain PyTorch."""
        self.grads.abort()
        for module in list(self.bwd_pins):
            self._release_backward_pins(module)
        self._unpin_all()
        self.progress.ready.clear()
        self.progress.new_backward()
        self._new_backward()

    def _new_backward(self) -> None:
        self.bwd_pins: dict[nn.Module, int] = defaultdict(int)
        self.bwd_remaining: dict[nn.Module, int] = {}
        self.bwd_started: dict[nn.Module, float] = {}
