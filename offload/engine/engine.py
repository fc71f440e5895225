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

import time
import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ..chunks import ChunkLayout, ChunkStore
from ..chunks.layout import auto_max_chunk
from ..config import OffloadConfig
from ..distributed import Sharding, expand_rank
from ..distributed.agree import agreed_budgets, check_same_layout
from ..errors import ConfigError
from ..lazy import lazy_record
from ..scheduler import TracePrefetcher, make_policy
from ..tiers import MemoryTier, NvmeTier, resolve_budgets
from ..tiers.budgets import compute_device, min_cpu_bytes, min_device_bytes_sharded
from ..tiers.gpu_timeline import GpuTimeline
from ..tracer import Tracer
from . import build
from .gradients import GradCapture
from .activation_hooks import make_activation_store
from .module_hooks import ModuleHooks
from .params import DTYPES, ChunkedParams
from .pipeline import StepPipeline
from .saved import SavedParameterViews
from .stepper import ChunkAdam, LossScaler


class OffloadEngine(ModuleHooks, GradCapture, StepPipeline):
    """One wrapped model: its chunk layout and store, hooks, gradient capture and optimizer pipeline.

    The three halves live in their own modules (module_hooks, gradients, pipeline); this one
    sets them up, reports statistics and closes.
    """

    def __init__(self, model: nn.Module, config: OffloadConfig):
        self.model = model
        self.config = config
        # Under torchrun, this rank's own GPU (see compute_device): before anything touches CUDA.
        self.device = compute_device(config, [*model.parameters(), *model.buffers()])
        self.dtype = DTYPES[config.dtype]
        self.tracer = Tracer()
        # Under a process group of N ranks, each owns 1/N of the chunks (offload.distributed).
        self.dp = Sharding.from_process_group()
        budgets = resolve_budgets(config, self.device, self.dp.local_world if self.dp is not None else 1)
        device_budget, cpu_budget = budgets.device, budgets.cpu
        if self.dp is not None:
            # The chunk size follows the budgets: every rank must build the same layout.
            device_budget, cpu_budget = agreed_budgets(device_budget, cpu_budget)
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
                                        max_chunk=auto_max_chunk(device_budget, cpu_budget),
                                        frozen={n for n, p in named if not p.requires_grad})
        if self.dp is not None:
            check_same_layout(self.layout, self.dtype)
        self._check_budgets(device_budget, cpu_budget)
        # The engine moves the next-use clock itself (its prefetcher follows the trace).
        self.policy = make_policy(config.eviction, auto_advance=False)
        self.device_budget = device_budget
        self.cpu_budget = cpu_budget
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
            tiers.append(NvmeTier(expand_rank(config.nvme_paths, self.dp), config.aio,
                                  prefix=f"offload-{id(self):x}"))
        streams = build.copy_streams(self.device)
        self.store = ChunkStore(tiers, self.policy, aliases=aliases, streams=streams, tracer=self.tracer,
                                on_free=lambda key, tier: self.params.on_store_free(key, tier),
                                urgent_kinds=frozenset({"param"}))
        # With tracing on a GPU, the trace also shows when kernels and copies ran (not only queued).
        self.gpu_timeline = (GpuTimeline(self.store.streams, self.tracer)
                             if self.store.streams is not None and self.tracer.enabled else None)
        self.prefetcher = TracePrefetcher(config.prefetch_depth)
        self.params = ChunkedParams(named, self.layout, self.store, self.dtype, self.device, on_pin=self._on_pin,
                                    on_unpinned=self._on_unpinned, tracer=self.tracer, sharding=self.dp)
        self.params.register_chunks()
        # Without accumulation a gradient chunk only holds copies of what autograd produced: keep
        # autograd's dtype (lossless, and half of fp32's bytes for bf16/fp16). Adding micro-batches
        # together is done in fp32. Frozen chunks get neither gradients nor optimizer state.
        trainable = self.params.trainable_sizes()
        kept = self.params.trainable_sizes(kept_only=True)
        grad_dtype = self.dtype if config.gradient_accumulation_steps == 1 else torch.float32
        if config.gradient_accumulation_steps == 1:
            # Another rank's gradient chunk lives from its first gradient until its group is
            # reduced, pinned all along: it never needs an NVMe slot. Accumulated ones may.
            self.store.register_chunks("grad", kept, grad_dtype)
            others = {c: n for c, n in trainable.items() if c not in kept}
            if others:
                self.store.register_chunks("grad", others, grad_dtype, nvme=False)
        else:
            self.store.register_chunks("grad", trainable, grad_dtype)
        for kind in ("exp_avg", "exp_avg_sq"):
            self.store.register_chunks(kind, kept, torch.float32)
        persistent = sum(r.nbytes for r in self.store.records.values()
                         if r.key[0] != "grad" and self.params.keeps(r.key[1]))
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
        if threads is None and self.dp is not None and self.dp.local_world > 1:
            # Ranks on one host share its cores: each runs its Adam on its share of them.
            from ..native import physical_cores

            threads = max(1, physical_cores() // self.dp.local_world)
        self.adam = ChunkAdam(self, threads)
        self.scaler = LossScaler(config.initial_loss_scale, config.loss_scale_window) if config.dtype == "fp16" else None
        self.optimizer = None
        self._setup_data_parallel()
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
        self.activations = make_activation_store(self, budgets.activations)
        self.saved = SavedParameterViews(self.params, self.device, self.activations)
        self.last_stats: dict = {}
        self._closed = False

    def drop_gathered(self) -> None:
        """Under several ranks, free the parameter chunks gathered from other ranks: their owners
        are about to change them (an update, a load). A no-op in a single process."""
        if self.gather is not None:
            self.gather.drop_all()

    # ---- set-up -------------------------------------------------------------------------
    def _setup_data_parallel(self) -> None:
        """Collectives, the parameter gather and the gradient reducer (None in a single process)."""
        self.comms = self.gather = self.reducer = None
        self.comm_device = torch.device("cpu")
        if self.dp is None:
            return
        from ..distributed import failure
        from ..distributed.comms import Collectives, collective_device
        from ..distributed.gather import GroupGather
        from ..distributed.reduce import GradReducer

        failure.install(self.dp.rank)
        self.comm_device = collective_device()
        self.comms = Collectives(self.dp, streams=self.store.streams, device=self.device)
        self.gather = GroupGather(self, self.comms, prefetch=1 if self.config.prefetch_depth > 0 else 0)
        self.reducer = GradReducer(self, self.comms)
        self.params.ensure = self.gather.ensure
        self.params.comms = self.comms
        self.params.comm_device = self.comm_device

    def _check_budgets(self, device_budget: int, cpu_budget: int) -> None:
        """Refuse up front budgets that cannot hold the minimum working set of one step.

        See ``min_device_bytes`` and ``min_cpu_bytes``: the planner refuses by the same rules.
        """
        from ..units import format_bytes

        lay = self.layout
        n = lay.chunk_size
        e = self.dtype.itemsize
        need_device = min_device_bytes_sharded(n, e, lay.largest_chunk, self.dp.world if self.dp else 1)
        trainable = [lay.sizes[c] for c in lay.trainable_chunks]
        need_cpu = max(min_cpu_bytes(max(trainable, default=0), e), lay.largest_chunk * e)
        groups = (f"; under {self.dp.world} ranks, 4 gathered groups of {self.dp.world} parameter chunks and "
                  f"2 of gradient chunks being reduced" if self.dp else "")
        why = (f"chunks are {n} elements (the largest has {lay.largest_chunk}); "
               "raise the budget or lower chunk_size")
        if device_budget < need_device:
            raise ConfigError("device_budget", device_budget,
                              f"holds less than the {format_bytes(need_device)} one backward step needs "
                              f"(the largest chunk and 2 bulk chunks, parameters and fp32 gradients"
                              f"{groups}): {why}")
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
            for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if not p.is_meta:
                    continue
                if id(p) not in new:
                    q = nn.Parameter(placeholder, requires_grad=p.requires_grad)
                    new[id(p)] = q
                    self._shapes[id(q)] = p.shape
                setattr(module, name, new[id(p)])
        for module in self.model.modules():
            for name, b in module.named_buffers(recurse=False, remove_duplicate=False):
                if b.is_meta:
                    raise ConfigError("buffer", f"{type(module).__name__}.{name}",
                                      "was built on the meta device; lazy_init materializes parameters "
                                      "only: create buffers with an explicit device")
        return [(n, p) for n, p in self.model.named_parameters()]

    def _move_buffers(self) -> None:
        """Buffers go to the compute device in the dtype the model made them: an fp32 ``inv_freq``
        in a bf16 run keeps RoPE exact at long positions (as HF loads keep it). A user who wants
        them in another dtype casts them before wrapping."""
        for module in self.model.modules():
            for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                setattr(module, name, buf.to(self.device))      # a buffer stays a buffer, persistence kept

    @contextmanager
    def _on_compute(self, received: torch.Tensor | None = None) -> Iterator[None]:
        """Device work issued inside runs on the compute stream (a no-op without CUDA streams);
        ``received``: a tensor made on the calling thread's current stream that it reads."""
        streams = self.store.streams
        if streams is None:
            yield
            return
        if received is not None:
            streams.receive(received)
        with streams.on_compute():
            yield

    # ---- statistics --------------------------------------------------------------------------
    def _finish_step_stats(self, applied: bool) -> None:
        if self.gpu_timeline is not None:
            self.gpu_timeline.resolve()
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
            "activations": self.activations.take_stats() if self.activations is not None else None,
        }
        if self.comms is not None:
            self.last_stats["collectives"] = {**self.comms.take_stats(), **self.gather.take_stats()}
            self.last_stats["rank"] = self.dp.rank
            self.last_stats["world_size"] = self.dp.world
        self.prefetcher.hits = self.prefetcher.misses = 0
        self.store.reset_counters()
        self.tracer.dump()

    def stats(self) -> dict:
        """Statistics of the last optimizer step plus the current memory report."""
        return {**self.last_stats, "memory": self.store.memory_report(),
                "layout": {"chunks": self.layout.num_chunks, "chunk_size": self.layout.chunk_size,
                           "params": self.layout.total_params,
                           "trainable_chunks": len(self.layout.trainable_chunks),
                           "largest_chunk": self.layout.largest_chunk}}

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
            if self.comms is not None:
                self.comms.close()
            if self.activations is not None:
                self.activations.close()
            nvme = self.store.tiers.get("nvme")
            if nvme is not None:
                nvme.close(remove=not keep_files)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
