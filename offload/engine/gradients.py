"""Gradient capture: each parameter's gradient goes into its chunk the moment autograd makes it.

A chunk whose trainable parameters all have their gradients is complete: it leaves the device
tier and, when the update can overlap backward, goes to the CPU Adam at once (or is parked to
run during the next forward); otherwise ``step()`` takes it later with the global norm known.
"""

from __future__ import annotations

import torch
from torch import nn

from ..chunks.states import ChunkState
from ..scheduler import NextUsePolicy


class GradCapture:
    """The gradient half of ``OffloadEngine`` (a mixin: state lives on the engine)."""

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
            view = None
            with self.store.lock:   # a new chunk is pinned before the optimizer's thread could evict it
                if self.store.records[key].state is ChunkState.FREE:
                    # Only the gaps need zeros: every parameter's slice is written by its first gradient.
                    self.store.initialize(key, "device", lambda v, c=c: self._zero_gaps(v, c))
                    view = self.store.access(key, "device")
            # An accumulated one may be on NVMe: brought back outside the lock.
            self.grad_views[c] = view if view is not None else self.store.access(key, "device")
        target = self.grad_views[c][ref.slot.offset:ref.slot.end]
        with self._on_compute(g):
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
        if at < self.layout.chunk_numel(c):
            gaps.append((at, self.layout.chunk_numel(c)))
        return gaps

    def _zero_gaps(self, view: torch.Tensor, c: int) -> None:
        for start, end in self._grad_gaps[c]:
            view[start:end].zero_()

    def _finish_grad_chunk(self, c: int) -> None:
        view = self.grad_views.pop(c)
        with self._on_compute():
            for p in self.params.chunk_members[c]:      # trainable but no gradient yet this window
                ref = self.params.ref(p)
                if p.requires_grad and ref.index not in self.with_grad:
                    view[ref.slot.offset:ref.slot.end].zero_()
        if self.reducer is not None and self.final_micro_batch:
            # Data parallel: the owner goes on (_grad_chunk_ready) once the group is reduced.
            self.reducer.chunk_finished(c, view)
            return
        self._grad_chunk_ready(c, view, reduced=self.reducer is None)

    def _grad_chunk_ready(self, c: int, view: torch.Tensor, *, reduced: bool) -> None:
        """Chunk ``c``'s gradients (``view``, pinned on the device) are final for this window:
        ``reduced`` says they are this rank's to update (always, in a single process)."""
        if not self.eager and reduced:
            # The update waits for backward: clipping or overflow checks need the norm.
            with self._on_compute():
                v = view if view.dtype == torch.float32 else view.float()
                self.sumsq[c] = torch.dot(v, v)
        self.store.release(("grad", c), "device", dirty=True)
        if self.eager and reduced:
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
            if self._may_update(c):
                self._submit(c)

    def _submit(self, c: int) -> None:
        # The update rewrites chunk c's parameters on the CPU: only once nothing uses them on the device.
        self.ready.discard(c)
        self.updated_chunks.add(c)
        self.adam.submit(c, self._runs(c), 1.0)

    def _may_update(self, c: int) -> bool:
        """Nothing reads chunk ``c``'s parameters on the device (a module, or a collective
        sending them to the other ranks)."""
        return self.params.pins[c] == 0 and (self.gather is None or not self.gather.holds(c))

    def _on_unpinned(self, c: int) -> None:
        if c in self.ready and self._may_update(c):
            self._submit(c)

