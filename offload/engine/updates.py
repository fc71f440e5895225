"""When each chunk's update runs: the update queue, and what happens to a final gradient chunk.

A gradient chunk is *final* for the window once every trainable parameter in it has its
gradient (and, under several ranks, once it is reduce-scattered: this rank's piece of it).
``ReadyGradients.take`` gets it. When nothing needs every gradient first (no clipping, no fp16
overflow check, the last micro-batch of the window) the backward is *eager*: the chunk's update
is queued on the CPU Adam at once (``UpdateQueue.submit``), or as soon as nothing reads its
parameters on the device any more — no module pins the chunk and no collective is sending it
(then it waits in ``ready``) — or, when the chunk is parked, when backward ends. Otherwise the
gradient's squared norm is kept and ``step()`` updates the chunk later (``pipeline.py``).

The update rewrites chunk ``c``'s parameters on the CPU, so the next forward waits for it
before it uses the chunk (``UpdateQueue.wait``).
"""

from __future__ import annotations

import time
from typing import Callable, ContextManager

import torch

from ..scheduler import NextUsePolicy
from .progress import StepProgress
from .stepper import ChunkAdam, hyper_of

# Hyper's fields and the param group keys they are read from (for messages).
HYPER_KEYS = {"lr": "lr", "beta1": "betas", "beta2": "betas", "eps": "eps", "weight_decay": "weight_decay",
              "decoupled": "decoupled_weight_decay", "maximize": "maximize"}


class UpdateQueue:
    """Submits chunk updates to ``adam`` with their parameters' hyper-parameters and step counts.

    ``forward_waited(seconds)``: told how long a forward waited for an update it needed
    (``Parking`` learns from it).
    """

    def __init__(self, progress: StepProgress, params, adam: ChunkAdam, pins, tracer, *,
                 forward_waited: Callable[[float], None]):
        self.progress = progress
        self.params = params
        self.adam = adam
        self.pins = pins
        self.tracer = tracer
        self.forward_waited = forward_waited
        self._group_of: dict[int, int] = {}     # parameter index -> its optimizer param group
        self._hyper_of: dict = {}
        self._groups: list = []                 # each group's Hyper, as refresh_hypers last read it

    def attach(self, optimizer) -> None:
        """Take the param groups of ``optimizer`` (the wrapped model's parameters among them)."""
        self._group_of = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if self.params.owns(p):
                    self._group_of[self.params.ref(p).index] = gi

    def refresh_hypers(self, param_groups) -> None:
        """Read lr and friends from the param groups once (a scheduler may have changed them);
        every chunk updated until the next refresh uses these."""
        self._groups = [hyper_of(g) for g in param_groups]
        self._hyper_of = {i: self._groups[gi] for i, gi in self._group_of.items()}

    def changed_since_read(self, param_groups) -> list[str]:
        """``"param_groups[i]['field']"`` for each hyper-parameter that differs from what the last
        ``refresh_hypers`` read (a user may set the lr between backward and ``step()``)."""
        out: dict[str, None] = {}       # ordered, once each (both betas are one key)
        # Only the groups holding wrapped parameters: the others are updated at step() anyway.
        mine = set(self._group_of.values())
        if self._groups and any(gi >= len(self._groups) for gi in mine):
            out[f"param_groups (a group added: {len(self._groups)} -> {len(param_groups)})"] = None
        for gi, (group, was) in enumerate(zip(param_groups, self._groups)):
            if gi not in mine:
                continue
            now = hyper_of(group)
            for field, key in HYPER_KEYS.items():
                if getattr(now, field) != getattr(was, field):
                    out[f"param_groups[{gi}][{key!r}]"] = None
        return list(out)

    def runs(self, c: int):
        return self.adam.runs(c, self.progress.with_grad, self._hyper_of)

    def commit_steps(self) -> None:
        """Every parameter updated this window has taken one more step."""
        self.adam.commit_steps({i for i in self.progress.with_grad if i in self._group_of})

    def submit(self, c: int) -> None:
        """Queue chunk ``c``'s update: only once nothing uses its parameters on the device (the
        update rewrites them on the CPU)."""
        self.progress.ready.discard(c)
        self.progress.updated_chunks.add(c)
        self.adam.submit(c, self.runs(c), 1.0)

    def submit_if_ready(self, c: int) -> None:
        """No collective reads chunk ``c`` any more (the gather's ``on_sent``): its update, if it
        waits, goes now unless a module pins the chunk."""
        if c in self.progress.ready and self.pins.count(c) == 0:
            self.submit(c)

    def submit_waiting(self) -> None:
        """Backward ended: queue the updates still waiting and the parked ones."""
        p = self.progress
        for c in sorted(p.ready | (p.parked & p.grad_chunks)):
            self.submit(c)

    def wait(self, c: int) -> None:
        """Return once chunk ``c``'s update from the last step is done (``optimizer.step()``
        does not wait for it): its parameters are new only then."""
        if not self.adam.pending(c):
            return
        started = time.perf_counter()
        with self.tracer.span(f"await update {c}", "wait", chunk=c):
            self.adam.wait_for(c)
        if not self.progress.in_backward and c not in self.progress.parked:
            self.forward_waited(time.perf_counter() - started)


class ReadyGradients:
    """Final gradient chunks, pinned on the device: their norm, their release, their update.

    ``holds(c)``: whether a collective is sending chunk ``c``'s parameters (None: one process).
    ``on_compute()``: a context in which device work runs on the compute stream.
    """

    def __init__(self, progress: StepProgress, updates: UpdateQueue, adam: ChunkAdam, pins, store,
                 policy, prefetcher, *, holds: Callable[[int], bool] | None,
                 on_compute: Callable[[], ContextManager]):
        self.progress = progress
        self.updates = updates
        self.adam = adam
        self.pins = pins
        self.store = store
        self.policy = policy
        self.prefetcher = prefetcher
        self.holds = holds
        self.on_compute = on_compute

    def take(self, c: int, view: torch.Tensor) -> None:
        """Chunk ``c``'s gradients (``view``, pinned on the device: this rank's piece under
        several ranks) are final for this window."""
        p = self.progress
        if not p.eager:
            # The update waits for backward: clipping or overflow checks need the norm.
            with self.on_compute():
                v = view if view.dtype == torch.float32 else view.float()
                p.sumsq[c] = torch.dot(v, v)
        self.store.release(("grad", c), "device", dirty=True)
        if not p.eager:
            return
        p.applied = True
        if c in p.parked:
            # Queued when backward ends, to run while the next forward runs. Until then its
            # gradient ranks by that use (the trace does not show it), not as never used again.
            if isinstance(self.policy, NextUsePolicy):
                with self.store.lock:
                    self.policy.hint(("grad", c), len(self.prefetcher.trace) + self.pins.deadline(c))
            return
        # Its update comes soon: start fetching the optimizer state, and keep the gradient
        # (which the trace does not show) from being evicted to make room meanwhile.
        self.adam.prefetch(c)
        p.ready.add(c)
        if self.may_update(c):
            self.updates.submit(c)

    def may_update(self, c: int) -> bool:
        """Nothing reads chunk ``c``'s parameters on the device (a module, or a collective
        sending them to the other ranks)."""
        return self.pins.count(c) == 0 and (self.holds is None or not self.holds(c))

    def unpinned(self, c: int) -> None:
        """The last module pin of chunk ``c`` went: its update, if it waits, may go now."""
        if c in self.progress.ready and self.may_update(c):
            self.updates.submit(c)
