"""``OffloadEngine``: one wrapped model's components, each built with its collaborators.

The order below is the order of their dependencies (the store before the parameters in it, the
update queue before the gather whose collectives hold updates back, ... up to the module hooks,
which drive them all). A step through them is told in ``offload/engine/__init__.py``.
"""

from __future__ import annotations

import weakref
from functools import partial

from torch import nn

from ..chunks import ChunkStore
from ..config import OffloadConfig
from ..distributed import Sharding
from ..distributed.agree import agreed_budgets
from ..lazy import lazy_record
from ..scheduler import TracePrefetcher, make_policy
from ..tiers import resolve_budgets
from ..tiers.budgets import compute_device
from ..tiers.gpu_timeline import GpuTimeline
from ..tiers.streams import compute_on
from ..tracer import Tracer
from . import build, lifetime
from .access import EngineChunks
from .activation_hooks import make_activation_store
from .gradients import GradCapture
from .hooks import autograd_running
from .module_hooks import ModuleHooks
from .params import DTYPES, ChunkedParams
from .pins import DevicePins, ParamViews
from .pipeline import Parking, StepPipeline
from .progress import StepProgress
from .saved import SavedParameterViews
from .stats import StepStats
from .stepper import ChunkAdam, LossScaler
from .updates import ReadyGradients, UpdateQueue


class OffloadEngine:
    """One wrapped model: its chunk layout and store, and the components of its training step."""

    def __init__(self, model: nn.Module, config: OffloadConfig, *, process_group=None):
        self.model = model
        self.config = config
        # Under torchrun, this rank's own GPU (see compute_device): before anything touches CUDA.
        self.device = compute_device(config, [*model.parameters(), *model.buffers()])
        self.dtype = DTYPES[config.dtype]
        self.tracer = Tracer()
        # Under a process group of N ranks, each keeps a 1/N piece of every chunk (offload.distributed):
        # the default group, or the one given (a pipeline stage's data-parallel group).
        self.precision = build.state_precision(config, self.dtype)
        self.dp = dp = build.with_quantum(Sharding.from_process_group(process_group), self.precision)
        # The processes on this host share its memory and cores whatever their groups (pipeline
        # stages are groups of one rank each): the default group says how many there are.
        host = dp if dp is not None and dp.group is None else Sharding.from_process_group()
        budgets = resolve_budgets(config, self.device, host.local_world if host is not None else 1)
        self.device_budget, self.cpu_budget = budgets.device, budgets.cpu
        if dp is not None:      # the chunk size follows the budgets: every rank must build the same layout
            self.device_budget, self.cpu_budget = agreed_budgets(self.device_budget, self.cpu_budget, dp.group)
        lazy = lazy_record(model)
        named, shapes = build.offloaded_parameters(model, self.dtype, self.device, lazy)
        staged = config.nvme_paths is not None and not (self.device.type == "cpu" and config.merge_host_tiers)
        self.layout = build.build_layout(named, shapes, config, self.dtype, self.device_budget, self.cpu_budget, dp,
                                         self.precision, staged=staged)
        self.policy = make_policy(config.eviction, auto_advance=False)    # the prefetcher moves its clock
        streams = build.copy_streams(self.device)
        # With tracing on a GPU, the trace also shows when kernels and copies ran (not only queued).
        self.gpu_timeline = GpuTimeline(streams, self.tracer) if streams is not None and self.tracer.enabled else None
        self.comms, comm_device = build.collectives(dp, streams, self.device)

        # The chunks: parameters (their device copies viewed by the parameters), gradients, Adam state.
        tiers, aliases = build.make_tiers(config, self.device, self.device_budget, self.cpu_budget, dp,
                                          prefix=f"offload-{id(self):x}")
        views = ParamViews(named, self.layout, self.dtype, self.device, (aliases or {}).get("device", "device"),
                           kind="param" if dp is None else "gathered")
        self.store = ChunkStore(tiers, self.policy, aliases=aliases, streams=streams, tracer=self.tracer,
                                on_free=views.on_store_free, urgent_kinds=frozenset({"param", "gathered"}))
        self.params = ChunkedParams(named, self.layout, self.store, self.dtype, placeholder=views.placeholder,
                                    sharding=dp, comms=self.comms, comm_device=comm_device,
                                    precision=self.precision)
        self.spills = build.register_optimizer_state(self.store, self.params, config, self.dtype,
                                                     self.device_budget + self.cpu_budget)
        # Every chunk is registered and nothing allocated yet: a pinned CPU tier maps (and page-locks)
        # only what they can take, and its budget says so (the stats and the trainer report that one).
        build.fit_pinned_tier(self.store)
        if lazy is not None:
            self.params.fill_lazily("cpu", lazy, model)
        else:
            self.params.fill_from_model("cpu")
        build.move_buffers(model, self.device)
        for _, p in named:
            p._offload_engine = weakref.ref(self)

        # The step's components.
        self.adam = ChunkAdam(self.params, self.store, self.tracer, threads=build.optimizer_threads(config, host),
                              read_ahead=config.prefetch_depth, device=self.device, spills=self.spills)
        self.scaler = LossScaler(config.initial_loss_scale, config.loss_scale_window) if config.dtype == "fp16" else None
        self.prefetcher = TracePrefetcher(config.prefetch_depth)
        self.pins = DevicePins(self.store, views, self.prefetcher, self.policy, self.tracer, pending=self.adam.pending)
        self.progress = StepProgress()
        self.parking = Parking(self.adam, self.tracer, self.prefetcher, self.layout.trainable_chunks, self.pins.deadline)
        self.updates = UpdateQueue(self.progress, self.params, self.adam, self.pins, self.tracer,
                                   forward_waited=self.parking.forward_waited)
        on_compute = partial(compute_on, streams)
        self.gather = self.reducer = None
        if dp is not None:
            from ..distributed.gather import ChunkGather

            self.gather = ChunkGather(self.comms, self.store, tier=self.pins.tier, in_use=self.pins.pinned,
                                      wait_for_update=self.adam.wait_for, on_sent=self.updates.submit_if_ready,
                                      prefetch=1 if config.prefetch_depth > 0 else 0,
                                      keep=build.gathered_window(self.params, self.device_budget))
        self.ready = ReadyGradients(self.progress, self.updates, self.adam, self.pins, self.store, self.policy,
                                    self.prefetcher, holds=self.gather.holds if self.gather else None,
                                    on_compute=on_compute)
        if dp is not None:
            from ..distributed.reduce import GradReducer

            self.reducer = GradReducer(self.comms, self.store, self.layout.trainable_chunks, tier=self.pins.tier,
                                       on_compute=on_compute, on_reduced=self.ready.take,
                                       whole_kind=self.params.capture_kind)
        self.grads = GradCapture(self.params, self.store, self.progress, self.adam, self.updates, self.ready,
                                 reducer=self.reducer, on_compute=on_compute, spills=self.spills,
                                 read_ahead=config.prefetch_depth)
        self.activations = make_activation_store(config, self.device, budgets.activations, self.store, self.tracer)
        self.saved = SavedParameterViews(self.pins, self.dtype, self.device, self.activations,
                                         ensure=self.gather.ensure if self.gather else None)
        self.pipeline = StepPipeline(self.progress, self.store, self.policy, self.adam, self.updates, self.parking,
                                     self.pins, config=config, layout=self.layout, scaler=self.scaler,
                                     spills=self.spills, gather=self.gather, reducer=self.reducer, comms=self.comms,
                                     comm_device=comm_device)
        pin_budget = self.device_budget // (2 * self.dtype.itemsize)
        self.hooks = ModuleHooks(model, self.params, self.pins, self.progress, self.updates, self.ready, self.grads,
                                 self.pipeline, self.parking, self.saved, self.tracer, pin_budget=pin_budget,
                                 gather=self.gather, scaler=self.scaler, streams=streams, timeline=self.gpu_timeline)
        self.statistics = StepStats(self.tracer, self.prefetcher, self.store, scaler=self.scaler,
                                    activations=self.activations, timeline=self.gpu_timeline, comms=self.comms,
                                    gather=self.gather, sharding=dp)
        self.step_count = 0
        self.last_stats: dict = {}
        self._closed = False
        # What code outside the engine may use of its chunks (offload.chunks.access).
        self.chunks = EngineChunks(self)
        lifetime.track(self)

    # ---- what offload.AdamW, grad clipping, checkpoints and loaders call ------------------------
    def attach_optimizer(self, optimizer) -> None:
        self.pipeline.attach_optimizer(optimizer)

    def step(self) -> bool:
        """Finish this window's update; returns False when an fp16 overflow skipped it."""
        self.check_intact()
        applied = self.pipeline.step()
        if applied:
            self.step_count += 1
        self.last_stats = self.statistics.finish_step(self.step_count, applied)
        return applied

    def check_intact(self) -> None:
        """Raise once a failure may have left a step half applied (``StepPipeline.check_intact``)."""
        self.pipeline.check_intact()

    def zero_grad(self) -> None:
        if self.progress.in_backward and not autograd_running():
            self.hooks.abort_backward()     # a backward raised: its end never ran
        self.pipeline.zero_grad()

    def grad_norm(self) -> float:
        return self.pipeline.grad_norm()

    def drop_gathered(self) -> None:
        self.pipeline.drop_gathered()

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        self.hooks.register_external_parameter(module, param)

    def input_pass(self):
        """Context of a split backward's input pass (see ``ModuleHooks.input_pass``)."""
        return self.hooks.input_pass()

    def weight_pass(self):
        """Context of a split backward's weight pass (see ``ModuleHooks.weight_pass``)."""
        return self.hooks.weight_pass()

    # Where the step is, for checkpoints and clipping (see StepProgress).
    optimizer = property(lambda self: self.pipeline.optimizer)
    micro_batches = property(lambda self: self.progress.micro_batches)
    window_applied = property(lambda self: self.progress.applied)
    updated_chunks = property(lambda self: self.progress.updated_chunks)

    # ---- statistics and the end ----------------------------------------------------------------
    def stats(self) -> dict:
        """Statistics of the last optimizer step plus the current memory report."""
        return self.statistics.report(self.last_stats, self.layout)

    def close(self, *, keep_files: bool = False) -> None:
        """Stop the worker and delete the NVMe swap files (the model's values are gone with them);
        ``keep_files`` leaves them on disk under names ``offload doctor`` lists (see
        ``NvmeTier.close``)."""
        if self._closed:
            return
        self._closed = True
        lifetime.forget(self)
        self.hooks.close()
        try:
            self.adam.drain()       # updates still queued from the last step: finish, or report their error
        finally:
            self.adam.close()
            if self.comms is not None:
                self.comms.close()
            if self.activations is not None:
                self.activations.close()
            try:
                # The values are gone with the engine: so is their memory, also while the model
                # object lives on (a notebook keeping ``model``; on a GPU, the device chunks).
                self.store.close()
            finally:
                nvme = self.store.tiers.get("nvme")
                if nvme is not None:
                    nvme.close(remove=not keep_files)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
