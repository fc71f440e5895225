"""The optimizer step pipeline: the accumulation window, parking, clipping, ``step()`` and ``zero_grad()``.

The chunks' updates run on ``ChunkAdam`` (stepper.py). This half of the engine decides when:
queued during backward when nothing needs the global norm, else here in ``step()`` with the
norm applied; which updates wait to overlap the next forward (parking); and what a step
leaves behind (gradients consumed, statistics).
"""

from __future__ import annotations

import math
import time

import torch

from ..chunks.states import ChunkState
from ..errors import ConfigError, OffloadError
from .stepper import hyper_of

# Most chunks one step adds to the parked count (see _chunks_to_park).
PARK_GROWTH = 4


class StepPipeline:
    """The optimizer half of ``OffloadEngine`` (a mixin: state lives on the engine)."""

    def _reset_window(self) -> None:
        self.micro_batches = 0
        self.with_grad: set[int] = set()
        self.grad_chunks: set[int] = set()
        self.updated_chunks: set[int] = set()
        self.ready: set[int] = set()
        self.sumsq: dict[int, torch.Tensor] = {}
        self.window_applied = False
        self.window_reduced = False     # data parallel: this window's gradients are with their owners

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
        trainable = self.layout.trainable_chunks         # frozen chunks have no update to park
        self.park_count = min(max(self.park_count, 0), len(trainable) // 2)
        if self.park_count == 0:
            return set()
        by_deadline = sorted(trainable, key=self._deadline)
        return set(by_deadline[-self.park_count:])

    def _runs(self, c: int):
        return self.adam.runs(c, self.with_grad, self._hyper_of)

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) gradients of this accumulation window."""
        # One device sync for all chunks, not one per chunk.
        local = torch.stack(list(self.sumsq.values())).sum().float() if self.sumsq else torch.zeros(())
        if self.comms is not None:      # each rank holds its own chunks' part: one all-reduce
            local = self.comms.all_reduce(local.reshape(1).to(self.comm_device)).cpu()
        total = float(local.sum())
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
        if self.reducer is not None and not self.window_reduced and self.grad_chunks:
            # No final micro-batch ran (step() came before the configured accumulation count):
            # the gradients are still each rank's own. Every rank has some (the same chunks).
            self.reducer.flush()
            self.window_reduced = True
        self.drop_gathered()            # the owners update their chunks now
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
            self._refresh_hypers()
            scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
            if max_norm is not None:
                total = norm if clip is None else clip[1]
                self.optimizer.last_grad_norm = total
                scale *= min(1.0, max_norm / (total + 1e-6))
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
        for c in self.layout.trainable_chunks:
            rec = self.store.records[("grad", c)]
            if rec.state is not ChunkState.FREE and not self.adam.pending(c):   # a queued update frees its own
                self.store.release_storage(("grad", c))

