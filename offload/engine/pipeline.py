"""The optimizer step pipeline: the accumulation window, parking, clipping, ``step()`` and ``zero_grad()``.

The chunks' updates run on ``ChunkAdam`` (stepper.py) through the ``UpdateQueue`` (updates.py).
This part decides when: whether a backward is eager (updates queued as its gradient chunks
complete, when nothing needs the global norm) or not (``step()`` then updates every chunk with
the norm applied); which updates wait to overlap the next forward (``Parking``); and what a step
leaves behind (gradients consumed, a new window).
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from ..chunks.states import ChunkState
from ..errors import ConfigError, OffloadError
from .progress import StepProgress
from .updates import UpdateQueue

# Most chunks one step adds to the parked count (see Parking.choose).
PARK_GROWTH = 4


class Parking:
    """How many chunks' updates wait for the end of backward and then overlap the next forward.

    When the disk bounds the optimizer, backward outruns it and waits (``wait_backlog``), while
    during forward the disk only reads parameters. The chunks backward finishes first are the ones
    the next forward uses last: their updates can run while that forward runs, and backward, with
    fewer updates ahead of it, waits less. How many is learned step by step: more by the updates
    that would have fit in the time the worker sat idle during forward (at most PARK_GROWTH a
    step), one fewer when forward stalled longer than an update or the last backward did not wait
    for the optimizer (compute is the bottleneck: parking would only add traffic).
    """

    def __init__(self, adam, tracer, prefetcher, trainable: list[int], deadline):
        self.adam = adam
        self.tracer = tracer
        self.prefetcher = prefetcher
        self.trainable = list(trainable)        # frozen chunks have no update to park
        self.deadline = deadline                # chunk -> when the next forward first uses it
        self.count = 0
        self.forward_started()

    def forward_started(self) -> None:
        """A forward begins: its stalls are measured from here."""
        self.tail_wait_s = 0.0          # this forward's waits for updates it needed (not parked ones)
        self.wait_at_start = self.tracer.totals["wait"]
        self.started_at = time.perf_counter()

    def forward_waited(self, seconds: float) -> None:
        self.tail_wait_s += seconds

    def choose(self) -> set[int]:
        """The chunks to park in the backward starting now (none before there is a trace)."""
        if self.prefetcher.trace is None:
            return set()
        u = self.adam.update_s
        stall = self.tracer.totals["wait"] - self.wait_at_start - self.tail_wait_s
        # Idle time before this forward began (an eval loop, a checkpoint) says nothing about it.
        idle = min(self.adam.idle_s(), time.perf_counter() - self.started_at)
        # Parking only pays when the last backward waited for the optimizer (wait_backlog).
        throttled, self.adam.backlog_wait_s = self.adam.backlog_wait_s, 0.0
        if u > 0:
            if stall > u or throttled < u:
                self.count -= 1
            else:
                self.count += min(PARK_GROWTH, int(idle / (2 * u)))
        self.count = min(max(self.count, 0), len(self.trainable) // 2)
        if self.count == 0:
            return set()
        by_deadline = sorted(self.trainable, key=self.deadline)
        return set(by_deadline[-self.count:])


class StepPipeline:
    """The optimizer side of each backward, ``step()`` and ``zero_grad()`` for one engine.

    ``gather`` and ``reducer`` (None in a single process) move parameters and gradients between
    ranks; ``comms`` (on ``comm_device``) sums the norm's parts.
    """

    def __init__(self, progress: StepProgress, store, policy, adam, updates: UpdateQueue, parking: Parking,
                 pins, *, config, layout, scaler, spills: bool, gather=None, reducer=None, comms=None,
                 comm_device: torch.device = torch.device("cpu")):
        self.progress = progress
        self.store = store
        self.policy = policy
        self.adam = adam
        self.updates = updates
        self.parking = parking
        self.pins = pins
        self.config = config
        self.layout = layout
        self.scaler = scaler
        self.spills = spills
        self.gather = gather
        self.reducer = reducer
        self.comms = comms
        self.comm_device = comm_device
        self.optimizer = None

    def attach_optimizer(self, optimizer) -> None:
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise ConfigError("optimizer", type(optimizer).__name__,
                              "this model already has an offload optimizer; create one per wrapped model")
        self.optimizer = optimizer
        self.updates.attach(optimizer)

    def drop_gathered(self) -> None:
        """Under several ranks, free the parameter chunks gathered from the ranks' pieces: the ranks
        are about to change them (an update, a load). A no-op in a single process."""
        if self.gather is not None:
            self.gather.drop_all()

    # ---- each backward ----------------------------------------------------------------------
    def begin_backward(self, *, input_only: bool = False) -> None:
        """A backward begins; ``input_only``: a split backward's input pass (``ModuleHooks.input_pass``),
        which gives no parameter a gradient: it neither ends the window nor updates anything."""
        p = self.progress
        p.in_backward = True
        if input_only:
            p.input_only = True
            return
        p.final_micro_batch = p.micro_batches + 1 >= self.config.gradient_accumulation_steps
        p.eager = (self.optimizer is not None and self.config.overlap_optimizer and self.scaler is None
                   and not self.optimizer.defers_update() and p.final_micro_batch)
        if self.optimizer is not None:
            # Read at every backward, also when the update waits: step() then sees whether they
            # changed after the window's last backward (which need not be the configured last
            # micro-batch: Trainer ends an epoch's short window with a step).
            self.updates.refresh_hypers(self.optimizer.param_groups)
        p.parked = self.parking.choose() if p.eager and self.spills else set()

    def end_backward(self) -> None:
        """After the gradients are captured and the pins let go: queue what waits, in the order
        the next forward uses the chunks."""
        if self.progress.input_only:        # its micro-batch ends with its weight pass
            self.progress.new_backward()
            return
        if self.progress.final_micro_batch:
            self.drop_gathered()        # the ranks update their pieces now
        self.updates.submit_waiting()
        self.adam.reorder(self.pins.deadline)
        self.progress.micro_batches += 1
        self.progress.new_backward()

    # ---- the step ---------------------------------------------------------------------------
    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) gradients of this accumulation window."""
        sumsq = self.progress.sumsq
        # One device sync for all chunks, not one per chunk.
        local = torch.stack(list(sumsq.values())).sum().float() if sumsq else torch.zeros(())
        if self.comms is not None:      # each rank holds its own chunks' part: one all-reduce
            local = self.comms.all_reduce(local.reshape(1).to(self.comm_device)).cpu()
        total = float(local.sum())
        norm = math.sqrt(total) if math.isfinite(total) else float("inf")
        return norm / self.scaler.scale if self.scaler is not None else norm

    def check_intact(self) -> None:
        """Raise once a request of the NVMe tier (``NvmeTier.check_intact``) or an update on the
        worker (``ChunkAdam.check_intact``) has failed in a model that trains: some chunks may hold a
        step others do not. A model without an optimizer (inference) has no step to break: a failed
        read only fails the forward that needed it."""
        if self.optimizer is None:
            return
        nvme = self.store.tiers.get("nvme")
        if nvme is not None:
            nvme.check_intact()
        self.adam.check_intact()

    def step(self) -> bool:
        """Finish this window's update; returns False when an fp16 overflow skipped it."""
        if self.optimizer is None:
            raise OffloadError("no offload optimizer is attached to this model")
        p = self.progress
        if p.applied and not (p.grad_chunks - p.updated_chunks):
            # Every chunk's update is queued already: those still running finish while the next
            # forward runs, each before that forward first uses its chunk (UpdateQueue.wait). Their
            # parameters read as the empty placeholder until then, never half-updated values.
            self.adam.raise_error()
            for c in self.adam.pending_chunks():
                self.pins.detach(c)
        else:
            self.adam.drain()
        self.drop_gathered()            # the ranks update their pieces now
        if p.micro_batches:             # a backward began this window (and read the hyper-parameters)
            self._hypers_set_late(p.applied)
        applied = True
        clip = self.optimizer.clip_this_step     # (max_norm, global norm) of a clip_grad_norm_ call
        max_norm = self.optimizer.max_grad_norm if clip is None else clip[0]
        # A clip_grad_norm_ call brought the global norm already: only an fp16 overflow check, or a
        # max_grad_norm clip, needs this window's.
        own_norm = self.scaler is not None or (max_norm is not None and clip is None)
        norm = self.grad_norm() if own_norm else 0.0
        overflow = self.scaler is not None and not math.isfinite(norm)
        if overflow:
            applied = False
        else:
            self.updates.refresh_hypers(self.optimizer.param_groups)
            scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
            if max_norm is not None:
                total = norm if clip is None else clip[1]
                self.optimizer.last_grad_norm = total
                scale *= min(1.0, max_norm / (total + 1e-6))
            todo = sorted(p.grad_chunks - p.updated_chunks)
            depth = max(1, self.config.prefetch_depth)
            for i, c in enumerate(todo):
                for nxt in todo[i + 1:i + 1 + depth]:
                    self.adam.prefetch(nxt)
                self.adam.update(c, self.updates.runs(c), scale)
                p.updated_chunks.add(c)      # a step retried after an error skips it
            self.updates.commit_steps()
        if self.scaler is not None:
            self.scaler.update(overflow)
        with self.store.lock:
            # Hints of chunks whose update is still queued hold until it runs (then it accesses them).
            self.policy.keep_hints(lambda key: self.adam.pending(key[1]))
        if applied:
            # The update consumed this window's gradients: the next backward starts from zero,
            # whether or not zero_grad() is called (as with DeepSpeed's engine).
            self.release_grads()
            p.new_window()
        p.applied = False
        p.micro_batches = 0
        p.updated_chunks = set()
        return applied

    def _hypers_set_late(self, applied: bool) -> None:
        """Hyper-parameters set between backward and step() (torch reads them at step()): from now
        on updates wait for step(); when this window's already ran during backward, say so."""
        late = self.updates.changed_since_read(self.optimizer.param_groups)
        if not late:
            return
        self.optimizer.hypers_set_late = True
        if applied:
            warnings.warn(f"offload: {', '.join(late)} changed between backward and optimizer.step(), after "
                          f"this step's updates had run during backward with the values read when it "
                          f"began; they apply from the next step, whose updates now wait for step() (set "
                          f"hyper-parameters before backward, e.g. scheduler.step() after "
                          f"optimizer.step(), to keep the overlap)", RuntimeWarning, stacklevel=4)

    def zero_grad(self) -> None:
        self.adam.raise_error()
        self.release_grads()
        self.progress.new_window()

    def release_grads(self) -> None:
        for c in self.layout.trainable_chunks:
            rec = self.store.records[("grad", c)]
            if rec.state is not ChunkState.FREE and not self.adam.pending(c):   # a queued update frees its own
                self.store.release_storage(("grad", c))
