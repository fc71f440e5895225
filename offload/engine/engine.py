"""The engine: one wrapped model's chunks, hooks, gradient capture, prefetch and optimizer steps.

The training loop reads like the paper: each module's chunks are pinned on the compute device
just before its forward (and again before its backward), the trace of the first iteration says
which chunks come next so they are fetched ahead (``prefetch(j + 1); compute(j); evict(j - 1)``),
each parameter's gradient is added into its chunk's gradient buffer the moment autograd
produces it, and a chunk whose gradients are complete goes to the CPU Adam while backward
continues — or, when the update needs every gradient first (global-norm clipping, fp16 overflow
checks, a micro-batch that is not the last of its accumulation window), at ``optimizer.step()``
with the same per-chunk pipeline. Both orders give the same numbers.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import defaultdict

import torch
from torch import nn

from ..chunks import ChunkLayout, ChunkStore
from ..chunks.layout import auto_max_chunk
from ..config import OffloadConfig
from ..chunks.states import ChunkState
from ..errors import ConfigError, OffloadError
from ..scheduler import NextUsePolicy, TracePrefetcher, make_policy
from ..tiers import MemoryTier, NvmeTier, resolve_budgets
from ..tiers.budgets import compute_device, min_cpu_bytes, min_device_bytes
from ..tracer import Tracer
from ..lazy import lazy_record
from .hooks import map_tensors, wrap_for_backward
from .params import DTYPES, ChunkedParams
from .saved import SavedParameterViews
from .stepper import ChunkAdam, LossScaler, ScaleGrad, hyper_of



# Most chunks one step adds to the parked count (see _chunks_to_park).
PARK_GROWTH = 4


class OffloadEngine:
    def __init__(self, model: nn.Module, config: OffloadConfig):
        self.model = model
        self.config = config
        self.device = compute_device(config)
        self.dtype = DTYPES[config.dtype]
        self.tracer = Tracer()
        device_budget, cpu_budget = resolve_budgets(config, self.device)
        self._shapes: dict[int, torch.Size] = {}
        lazy = lazy_record(model)
        named = [(n, p) for n, p in model.named_parameters()]
        if lazy is not None:
            named = self._replace_meta_parameters(named)
        if not named:
            raise ConfigError("model", type(model).__name__, "has no parameters to offload")
        for name, p in named:
            if not p.is_floating_point():
                raise ConfigError("model", name, f"parameter dtype {p.dtype} is not floating point")
        shapes = [(n, self._shapes.get(id(p), p.shape)) for n, p in named]
        self.layout = ChunkLayout.build(shapes, config.chunk_size,
                                        max_chunk=auto_max_chunk(device_budget, cpu_budget))
        self._check_budgets(device_budget, cpu_budget)
        # The engine moves the next-use clock itself (its prefetcher follows the trace).
        self.policy = make_policy(config.eviction, auto_advance=False)
        self.device_budget = device_budget
        aligned = config.nvme_paths is not None      # O_DIRECT reads and writes land in these buffers
        if self.device.type == "cpu" and config.merge_host_tiers:
            # Computing on the CPU, the device and CPU tiers would both be host memory: copying a
            # chunk between them costs time and holds it twice. They are one tier of both budgets,
            # still addressed as "device" where the engine means "where compute reads it".
            tiers = [MemoryTier("cpu", device_budget + cpu_budget, "cpu", aligned=aligned)]
            aliases = {"device": "cpu"}
        else:
            tiers = [MemoryTier("device", device_budget, self.device),
                     MemoryTier("cpu", cpu_budget, "cpu", aligned=aligned,
                                pin=self.device.type == "cuda" and config.pin_memory)]
            aliases = None
        if config.nvme_paths is not None:
            tiers.append(NvmeTier(config.nvme_paths, config.aio, prefix=f"offload-{id(self):x}"))
        self.store = ChunkStore(tiers, self.policy, aliases=aliases)
        self.store.tracer = self.tracer
        self.store.urgent_kinds = frozenset({"param"})
        self.prefetcher = TracePrefetcher(config.prefetch_depth)
        self.params = ChunkedParams(named, self.layout, self.store, self.dtype, self.device, on_pin=self._on_pin,
                                    on_unpinned=self._on_unpinned, tracer=self.tracer)
        self.store.on_free = self.params.on_store_free
        self.params.register_chunks()
        n, size = self.layout.num_chunks, self.layout.chunk_size
        # Without accumulation a gradient chunk only holds copies of what autograd produced: keep
        # autograd's dtype (lossless, and half of fp32's bytes for bf16/fp16). Adding micro-batches
        # together is done in fp32.
        self.store.register("grad", n, size,
                            self.dtype if config.gradient_accumulation_steps == 1 else torch.float32)
        for kind in ("exp_avg", "exp_avg_sq"):
            self.store.register(kind, n, size, torch.float32)
        persistent = sum(r.nbytes for r in self.store.records.values() if r.key[0] != "grad")
        # When the persistent state cannot all stay in memory, the optimizer writes each chunk's
        # new state down as soon as it is done (see ChunkAdam.update).
        self.spills = config.nvme_paths is not None and persistent > device_budget + cpu_budget
        if lazy is not None:
            self.params.fill_lazily("cpu", lazy, model)
        else:
            self.params.fill_from_model("cpu")
        self._move_buffers()
        for _, p in named:
            p._offload_engine = weakref.ref(self)
        threads = None if config.optimizer_threads == "auto" else config.optimizer_threads
        self.adam = ChunkAdam(self, threads)
        self.scaler = LossScaler(config.initial_loss_scale, config.loss_scale_window) if config.dtype == "fp16" else None
        self.optimizer = None
        self._grad_expected = [sum(p.requires_grad for p in m) for m in self.params.chunk_members]
        self._grad_gaps = [self._gaps(c) for c in range(self.layout.num_chunks)]
        self._reset_window()
        self._bwd_reset()
        self._install_hooks()
        self.step_count = 0
        self.park_count = 0             # see _chunks_to_park
        self.parked: set[int] = set()   # parked in the last backward (watched in the next forward)
        self.fwd_tail_wait_s = 0.0
        self.fwd_wait_start = 0.0
        self.fwd_started = time.perf_counter()
        self.saved = SavedParameterViews(self.params, self.device)
        self.last_stats: dict = {}
        self._closed = False

    # ---- set-up -------------------------------------------------------------------------
    def _check_budgets(self, device_budget: int, cpu_budget: int) -> None:
        """Refuse up front budgets that cannot hold the minimum working set of one step.

        See ``min_device_bytes`` and ``min_cpu_bytes``: the planner refuses by the same rules.
        """
        from ..units import format_bytes

        n = self.layout.chunk_size
        e = self.dtype.itemsize
        need_device = min_device_bytes(n, e)
        need_cpu = min_cpu_bytes(n, e)
        largest = max(s.numel for s in self.layout.slots)
        why = (f"chunks are {n} elements (the largest parameter has {largest}); "
               "raise the budget or lower chunk_size")
        if device_budget < need_device:
            raise ConfigError("device_budget", device_budget,
                              f"holds less than the {format_bytes(need_device)} one backward step needs "
                              f"(3 parameter and 3 fp32 gradient chunks): {why}")
        if cpu_budget < need_cpu:
            raise ConfigError("cpu_budget", cpu_budget,
                              f"holds less than the {format_bytes(need_cpu)} one chunk's optimizer update "
                              f"needs (gradient, master, exp_avg, exp_avg_sq, parameters): {why}")

    def _replace_meta_parameters(self, named):
        """Swap each meta parameter for a real one with placeholder data (ties kept).

        A meta tensor cannot take real ``.data``, so lazily built models get new Parameter
        objects here, before anyone (an optimizer) holds references to them.
        """
        placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        new: dict[int, nn.Parameter] = {}
        self._shapes = {}
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in new:
                    q = nn.Parameter(placeholder, requires_grad=p.requires_grad)
                    new[id(p)] = q
                    self._shapes[id(q)] = p.shape
                module._parameters[name] = new[id(p)]
        for module in self.model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.is_meta:
                    raise ConfigError("buffer", f"{type(module).__name__}.{name}",
                                      "was built on the meta device; lazy_init materializes parameters "
                                      "only: create buffers with an explicit device")
        return [(n, p) for n, p in self.model.named_parameters()]

    def _move_buffers(self) -> None:
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is None:
                    continue
                dtype = self.dtype if buf.is_floating_point() else buf.dtype
                module._buffers[name] = buf.to(self.device, dtype)

    def _install_hooks(self) -> None:
        """Hook every module that owns parameters (and the root).

        A module's *pin set* is its own parameters plus, until its first forward has shown
        otherwise, those of its descendants: some modules use a child's parameters without
        calling the child (``nn.MultiheadAttention`` reads ``out_proj.weight``). After the first
        call, descendants whose own forward ran inside it are dropped from the set.
        """
        self.pin_sets: dict[nn.Module, list[nn.Parameter]] = {}
        self.module_chunks: dict[nn.Module, list[int]] = {}
        self.module_params: dict[nn.Module, list[nn.Parameter]] = {}
        self.grad_counts: dict[nn.Module, int] = {}      # trainable parameters a module owns
        self.param_modules: dict[int, list[nn.Module]] = defaultdict(list)
        self.discovering: set[nn.Module] = set()
        self.called_within: dict[nn.Module, set[nn.Module]] = defaultdict(set)
        self.active: list[nn.Module] = []
        self.fwd_pinned: list[tuple[nn.Module, list[int]]] = []
        self._handles = []
        budget_elems = self.device_budget // (2 * self.params.dtype.itemsize)
        for module in self.model.modules():
            own = self._own_params(module)
            if not own and module is not self.model:
                continue
            pin_set = list(own)
            if module is not self.model:
                below = [q for d in module.modules() if d is not module for q in self._own_params(d)]
                if below and sum(q.numel() for q in below) <= budget_elems:
                    pin_set = list(dict.fromkeys(own + below))
                    self.discovering.add(module)
            self.module_params[module] = own
            self.grad_counts[module] = sum(p.requires_grad for p in own)
            self._set_pin_set(module, pin_set)
            for p in own:
                self.param_modules[id(p)].append(module)
            self._handles.append(module.register_forward_pre_hook(self._pre_forward))
            self._handles.append(module.register_forward_hook(self._post_forward))
        for p in self.params.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

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
        for h in self._handles:
            h.remove()
        self._install_hooks()

    # ---- forward --------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args) -> None:
        if module is self.model and self.in_backward and not self._autograd_running():
            self._abort_backward()
        if module is self.model and not self.in_backward:
            self._begin_iteration()
            if torch.is_grad_enabled():
                self.saved.enter()
        chunks = self.module_chunks[module]
        self._pin_updated(chunks)
        if self.in_backward:        # a checkpoint recompute: these pins belong to the backward
            self.bwd_pins[module] += 1
            if module not in self.bwd_remaining:
                self.bwd_remaining[module] = self.grad_counts[module]
            return
        for outer in self.active:
            if outer in self.discovering:
                self.called_within[outer].add(module)
        self.active.append(module)
        self.fwd_pinned.append((module, chunks, time.perf_counter()))

    def _post_forward(self, module: nn.Module, args, output):
        if self.in_backward:
            return output
        for i in range(len(self.fwd_pinned) - 1, -1, -1):
            if self.fwd_pinned[i][0] is module:
                _, chunks, started = self.fwd_pinned.pop(i)
                if self.tracer.enabled:
                    self.tracer.complete(f"forward {type(module).__name__}", "compute", started,
                                         time.perf_counter(), "compute")
                break
        else:
            chunks = []
        if module in self.active:
            self.active.remove(module)
        for c in chunks:
            self.params.unpin(c)
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
                self.params.unpin(c)
        self.active.clear()
        self.fwd_pinned.clear()
        if self.window_applied:
            raise OffloadError(
                "a new forward started after backward already applied an optimizer update that "
                "optimizer.step() has not committed: call optimizer.step() after each backward, or "
                "set OffloadConfig(gradient_accumulation_steps=N) when accumulating N micro-batches")
        self.prefetcher.begin_iteration()
        self.fwd_tail_wait_s = 0.0
        self.fwd_wait_start = self.tracer.totals["wait"]
        self.fwd_started = time.perf_counter()
        if isinstance(self.policy, NextUsePolicy):
            self.policy.set_trace(self.prefetcher.trace)

    def _pin_updated(self, chunks: list[int]) -> None:
        """Pin ``chunks`` once their updates from the last step are done (all waits first: one
        that raises leaves nothing pinned)."""
        for c in chunks:
            self._await_update(c)
        for c in chunks:
            self.params.pin(c)

    def _await_update(self, c: int) -> None:
        # The update of a chunk may still be running from the last step (optimizer.step() does
        # not wait for it): its parameters are new only once it is done.
        if self.adam.pending(c):
            started = time.perf_counter()
            with self.tracer.span(f"await update {c}", "wait", chunk=c):
                self.adam.wait_for(c)
            if not self.in_backward and c not in self.parked:
                self.fwd_tail_wait_s += time.perf_counter() - started

    def _deadline(self, c: int) -> float:
        """When the next iteration first uses chunk ``c`` (trace position; chunk order before a trace)."""
        trace = self.prefetcher.trace
        return trace.next_use(("param", c), 0) if trace is not None else float(c)

    def _on_pin(self, c: int, hit: bool) -> None:
        self.prefetcher.record_hit(hit)
        upcoming = self.prefetcher.on_access(("param", c))
        if isinstance(self.policy, NextUsePolicy):
            self.policy.position = self.prefetcher.position
        for key in upcoming:
            if key[0] == "param" and self.adam.pending(key[1]):
                continue        # its update writes the new values in memory; a read now would be stale
            self.store.prefetch(key, "device")

    # ---- backward ----------------------------------------------------------------------
    def _pre_backward(self, module: nn.Module) -> None:
        if not self.in_backward:
            self._begin_backward()
        self._pin_updated(self.module_chunks[module])
        self.bwd_pins[module] += 1
        if module not in self.bwd_remaining:
            self.bwd_remaining[module] = self.grad_counts[module]
        self.bwd_started.setdefault(module, time.perf_counter())

    def _begin_backward(self) -> None:
        self.in_backward = True
        final_micro_batch = self.micro_batches + 1 >= self.config.gradient_accumulation_steps
        self.eager = (self.optimizer is not None and self.config.overlap_optimizer and self.scaler is None
                      and self.optimizer.max_grad_norm is None and final_micro_batch)
        if self.eager:
            self._refresh_hypers()
        self.parked = self._chunks_to_park() if self.eager and self.spills else set()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, p: nn.Parameter) -> None:
        g = p.grad
        if g is None:
            return
        p.grad = None
        ref = self.params.ref(p)
        c = ref.slot.chunk
        if c not in self.grad_views:
            key = ("grad", c)
            self._await_update(c)       # the last step's update still holds this chunk's gradients
            if self.eager and self.spills:
                # Backward may run ahead of the optimizer by its read-ahead window, no further:
                # gradients waiting beyond it only take the room the state being read needs,
                # and when the disk is the bottleneck they are written down and read back.
                self.adam.wait_backlog(max(1, self.config.prefetch_depth + 1))
            if self.store.records[key].state is ChunkState.FREE:
                # Only the gaps need zeros: every parameter's slice is written by its first gradient.
                self.store.initialize(key, "device", lambda v, c=c: self._zero_gaps(v, c))
            self.grad_views[c] = self.store.access(key, "device")
        target = self.grad_views[c][ref.slot.offset:ref.slot.end]
        if ref.index in self.with_grad:
            target.add_(g.reshape(-1))       # accumulating micro-batches
        else:
            target.copy_(g.reshape(-1))
        self.with_grad.add(ref.index)
        self.grad_chunks.add(c)
        self.bwd_grads[c] += 1
        if self.bwd_grads[c] == self._grad_expected[c]:
            self._finish_grad_chunk(c)
        for module in self.param_modules[id(p)]:
            if module in self.bwd_remaining:
                self.bwd_remaining[module] -= 1
                if self.bwd_remaining[module] <= 0:
                    self._release_backward_pins(module)

    def _gaps(self, c: int) -> list[tuple[int, int]]:
        """Element ranges of grad chunk ``c`` that no trainable parameter's gradient writes."""
        gaps, at = [], 0
        for p in self.params.chunk_members[c]:
            s = self.params.ref(p).slot
            if not p.requires_grad:
                continue
            if s.offset > at:
                gaps.append((at, s.offset))
            at = s.end
        if at < self.layout.chunk_size:
            gaps.append((at, self.layout.chunk_size))
        return gaps

    def _zero_gaps(self, view: torch.Tensor, c: int) -> None:
        for start, end in self._grad_gaps[c]:
            view[start:end].zero_()

    def _finish_grad_chunk(self, c: int) -> None:
        view = self.grad_views.pop(c)
        for p in self.params.chunk_members[c]:      # trainable but no gradient yet this window
            ref = self.params.ref(p)
            if p.requires_grad and ref.index not in self.with_grad:
                view[ref.slot.offset:ref.slot.end].zero_()
        if not self.eager:   # the update waits for backward: clipping or overflow checks may need the norm
            v = view if view.dtype == torch.float32 else view.float()
            self.sumsq[c] = torch.dot(v, v)
        self.store.release(("grad", c), "device", dirty=True)
        if self.eager:
            self.window_applied = True
            if c in self.parked:
                # Queued when backward ends, to run while the next forward runs. Until then its
                # gradient ranks by that use (the trace does not show it), not as never used again.
                if isinstance(self.policy, NextUsePolicy):
                    with self.store.lock:
                        self.policy.hint(("grad", c), len(self.prefetcher.trace) + self._deadline(c))
                return
            # Its update comes soon: start fetching the optimizer state, and keep the gradient
            # (which the trace does not show) from being evicted to make room meanwhile.
            self.adam.prefetch(c)
            self.ready.add(c)
            if self.params.pins[c] == 0:
                self._submit(c)

    def _submit(self, c: int) -> None:
        # The update rewrites chunk c's parameters on the CPU: only once nothing uses them on the device.
        self.ready.discard(c)
        self.updated_chunks.add(c)
        self.adam.submit(c, self._runs(c), 1.0)

    def _on_unpinned(self, c: int) -> None:
        if c in self.ready:
            self._submit(c)

    def _release_backward_pins(self, module: nn.Module) -> None:
        started = self.bwd_started.pop(module, None)
        if started is not None and self.tracer.enabled:
            self.tracer.complete(f"backward {type(module).__name__}", "compute", started,
                                 time.perf_counter(), "compute")
        for _ in range(self.bwd_pins.pop(module, 0)):
            for c in self.module_chunks[module]:
                self.params.unpin(c)
        self.bwd_remaining.pop(module, None)

    def _end_backward(self) -> None:
        for c in list(self.grad_views):
            self._finish_grad_chunk(c)
        for module in list(self.bwd_pins):
            self._release_backward_pins(module)
        self.params.unpin_all()
        for c in sorted(self.ready | (self.parked & self.grad_chunks)):
            self._submit(c)
        self.adam.reorder(self._deadline)
        self.micro_batches += 1
        self._bwd_reset()

    @staticmethod
    def _autograd_running() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _abort_backward(self) -> None:
        """A backward raised, so its end-of-backward callback never ran: release what it held.
        Gradients accumulated so far stay, as they would in ``.grad`` with plain PyTorch."""
        for c in list(self.grad_views):
            self.grad_views.pop(c)
            self.store.release(("grad", c), "device", dirty=True)
        for module in list(self.bwd_pins):
            self._release_backward_pins(module)
        self.params.unpin_all()
        self.ready.clear()
        self._bwd_reset()

    def _bwd_reset(self) -> None:
        self.in_backward = False
        self.eager = False
        self.bwd_pins: dict[nn.Module, int] = defaultdict(int)
        self.bwd_remaining: dict[nn.Module, int] = {}
        self.bwd_started: dict[nn.Module, float] = {}
        self.bwd_grads: dict[int, int] = defaultdict(int)
        self.grad_views: dict[int, torch.Tensor] = {}

    def _reset_window(self) -> None:
        self.micro_batches = 0
        self.with_grad: set[int] = set()
        self.grad_chunks: set[int] = set()
        self.updated_chunks: set[int] = set()
        self.ready: set[int] = set()
        self.sumsq: dict[int, torch.Tensor] = {}
        self.window_applied = False

    # ---- optimizer --------------------------------------------------------------------------
    def attach_optimizer(self, optimizer) -> None:
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise ConfigError("optimizer", type(optimizer).__name__,
                              "this model already has an offload optimizer; create one per wrapped model")
        self.optimizer = optimizer
        self._group_of = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if self.params.owns(p):
                    self._group_of[self.params.ref(p).index] = gi

    def _refresh_hypers(self) -> None:
        """Read lr and friends from the param groups once (a scheduler may have changed them);
        every chunk updated until the next refresh uses these."""
        groups = [hyper_of(g) for g in self.optimizer.param_groups]
        self._hyper_of = {i: groups[gi] for i, gi in self._group_of.items()}

    def _chunks_to_park(self) -> set[int]:
        """The chunks whose updates wait for the end of backward and then overlap the next forward.

        When the disk bounds the optimizer, backward outruns it and waits (``wait_backlog``),
        while during forward the disk only reads parameters. The chunks backward finishes first
        are the ones the next forward uses last: their updates can run while that forward runs,
        and backward, with fewer updates ahead of it, waits less. How many is learned step by
        step: more by the updates that would have fit in the time the worker sat idle during
        forward (at most PARK_GROWTH a step), one fewer when forward stalled longer than an update
        or the last backward did not wait for the optimizer (compute is the bottleneck: parking
        would only add traffic).
        """
        trace = self.prefetcher.trace
        if trace is None:
            return set()
        u = self.adam.update_s
        stall = self.tracer.totals["wait"] - self.fwd_wait_start - self.fwd_tail_wait_s
        # Idle time before this forward began (an eval loop, a checkpoint) says nothing about it.
        idle = min(self.adam.idle_s(), time.perf_counter() - self.fwd_started)
        # Parking only pays when the last backward waited for the optimizer (wait_backlog).
        throttled, self.adam.backlog_wait_s = self.adam.backlog_wait_s, 0.0
        if u > 0:
            if stall > u or throttled < u:
                self.park_count -= 1
            else:
                self.park_count += min(PARK_GROWTH, int(idle / (2 * u)))
        self.park_count = min(max(self.park_count, 0), self.layout.num_chunks // 2)
        if self.park_count == 0:
            return set()
        by_deadline = sorted(range(self.layout.num_chunks), key=self._deadline)
        return set(by_deadline[-self.park_count:])

    def _runs(self, c: int):
        return self.adam.runs(c, self.with_grad, self._hyper_of)

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) gradients of this accumulation window."""
        # One device sync for all chunks, not one per chunk.
        total = float(torch.stack(list(self.sumsq.values())).sum()) if self.sumsq else 0.0
        norm = math.sqrt(total) if math.isfinite(total) else float("inf")
        return norm / self.scaler.scale if self.scaler is not None else norm

    def step(self) -> bool:
        """Finish this window's update; returns False when an fp16 overflow skipped it."""
        if self.optimizer is None:
            raise OffloadError("no offload optimizer is attached to this model")
        if self.window_applied and not (self.grad_chunks - self.updated_chunks):
            # Every chunk's update is queued already: those still running finish while the next
            # forward runs, each before that forward first uses its chunk (_await_update). Their
            # parameters read as the empty placeholder until then, never half-updated values.
            self.adam.raise_error()
            for c in self.adam.pending_chunks():
                self.params.detach(c)
        else:
            self.adam.drain()
        applied = True
        max_norm = self.optimizer.max_grad_norm or self.optimizer.clip_this_step
        norm = self.grad_norm() if self.scaler is not None or max_norm is not None else 0.0
        overflow = self.scaler is not None and not math.isfinite(norm)
        if overflow:
            applied = False
        else:
            self._refresh_hypers()
            scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
            if max_norm is not None:
                self.optimizer.last_grad_norm = norm
                scale *= min(1.0, max_norm / (norm + 1e-6))
            todo = sorted(self.grad_chunks - self.updated_chunks)
            depth = max(1, self.config.prefetch_depth)
            for i, c in enumerate(todo):
                for nxt in todo[i + 1:i + 1 + depth]:
                    self.adam.prefetch(nxt)
                self.adam.update(c, self._runs(c), scale)
                self.updated_chunks.add(c)      # a step retried after an error skips it
            self.adam.commit_steps({i for i in self.with_grad if i in self._group_of})
            self.step_count += 1
        if self.scaler is not None:
            self.scaler.update(overflow)
        with self.store.lock:
            # Hints of chunks whose update is still queued hold until it runs (then it accesses them).
            self.policy.keep_hints(lambda key: self.adam.pending(key[1]))
        self._finish_step_stats(applied)
        if applied:
            # The update consumed this window's gradients: the next backward starts from zero,
            # whether or not zero_grad() is called (as with DeepSpeed's engine).
            self._release_grads()
            self._reset_window()
        self.window_applied = False
        self.micro_batches = 0
        self.updated_chunks = set()
        return applied

    def zero_grad(self) -> None:
        if self.in_backward and not self._autograd_running():
            self._abort_backward()
        self.adam.raise_error()
        self._release_grads()
        self._reset_window()

    def _release_grads(self) -> None:
        for c in range(self.layout.num_chunks):
            rec = self.store.records[("grad", c)]
            if rec.state is not ChunkState.FREE and not self.adam.pending(c):   # a queued update frees its own
                self.store.release_storage(("grad", c))

    # ---- statistics --------------------------------------------------------------------------
    def _finish_step_stats(self, applied: bool) -> None:
        totals = self.tracer.take_totals()
        hits, misses = self.prefetcher.hits, self.prefetcher.misses
        self.last_stats = {
            "step": self.step_count,
            "applied": applied,
            "moved_bytes": self.store.moved_by_direction(),
            "prefetch_hit_rate": hits / (hits + misses) if hits + misses else None,
            "chunk_fetches": hits + misses,
            "wait_s": totals.get("wait", 0.0),
            "optimizer_s": totals.get("adam", 0.0),
            "optimizer_wait_s": totals.get("optimizer_wait", 0.0),
            "retraces": self.prefetcher.retraces,
            "loss_scale": self.scaler.scale if self.scaler is not None else None,
        }
        self.prefetcher.hits = self.prefetcher.misses = 0
        self.store.reset_counters()
        self.tracer.dump()

    def stats(self) -> dict:
        """Statistics of the last optimizer step plus the current memory report."""
        return {**self.last_stats, "memory": self.store.memory_report(),
                "layout": {"chunks": self.layout.num_chunks, "chunk_size": self.layout.chunk_size,
                           "params": self.layout.total_params}}

    def close(self, *, keep_files: bool = False) -> None:
        """Stop the worker and delete the NVMe swap files (the model's values are gone with them);
        ``keep_files`` leaves them on disk for inspection."""
        if self._closed:
            return
        self._closed = True
        try:
            self.adam.drain()       # updates still queued from the last step: finish, or report their error
        finally:
            self.adam.close()
            nvme = self.store.tiers.get("nvme")
            if nvme is not None:
                nvme.close(remove=not keep_files)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
