"""Gradient capture: each parameter's gradient goes into its chunk the moment autograd makes it.

A hook after gradient accumulation copies (or, accumulating micro-batches, adds) ``p.grad`` into
the parameter's slice of its chunk's gradient buffer, pinned on the device, and drops ``p.grad``.
When every trainable parameter of a chunk has its gradient the chunk is complete: in a single
process it goes straight to ``ReadyGradients`` (``updates.py``); with several ranks it goes to the
reducer, which reduce-scatters it into this rank's piece (``grad``, what Adam reads) -- on every
micro-batch, adding into the piece, so that a rank never holds more than its 1/N of the window's
gradients (the whole ``grad_full`` chunk filled here lives only until it is reduced). When
backward ends, chunks some of whose parameters got no gradient are completed with zeros there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, ContextManager

import torch
from torch import nn

from ..chunks.states import ChunkState
from .progress import StepProgress
from .updates import ReadyGradients, UpdateQueue


class GradCapture:
    """Autograd's gradients into gradient chunks, one backward at a time.

    ``on_compute(received=None)``: a context in which device work runs on the compute stream
    (``received``: a tensor made on the calling thread's stream that the work reads). ``spills``
    and ``read_ahead``: an eager backward runs at most the optimizer's read-ahead ahead of it
    when optimizer state goes to NVMe (``ChunkAdam.wait_backlog``).
    """

    def __init__(self, params, store, progress: StepProgress, adam, updates: UpdateQueue,
                 ready: ReadyGradients, *, reducer=None, on_compute: Callable[..., ContextManager],
                 spills: bool, read_ahead: int):
        self.params = params
        self.store = store
        self.progress = progress
        self.adam = adam
        self.updates = updates
        self.ready = ready
        self.reducer = reducer
        self.on_compute = on_compute
        self.spills = spills
        self.read_ahead = read_ahead
        layout = params.layout
        self.kind = params.capture_kind
        self._expected = [sum(p.requires_grad for p in m) for m in params.chunk_members]
        self._gaps = [self._gaps_of(c, params.whole_numel(c)) for c in range(layout.num_chunks)]
        self._reset()

    def _reset(self) -> None:
        self.grads_seen: dict[int, int] = defaultdict(int)      # chunk -> gradients this backward
        self.captured: set[int] = set()                         # parameter indices with a gradient this backward
        self.views: dict[int, torch.Tensor] = {}                # chunk -> its pinned gradient buffer

    def capture(self, p: nn.Parameter) -> bool:
        """Take ``p.grad`` into its chunk; False when there was none."""
        g = p.grad
        if g is None:
            return False
        p.grad = None
        ref = self.params.ref(p)
        c = ref.slot.chunk
        if c not in self.views:
            key = (self.kind, c)
            self.updates.wait(c)        # the last step's update still holds this chunk's gradients
            if self.progress.eager and self.spills:
                # Backward may run ahead of the optimizer by its read-ahead window, no further:
                # gradients waiting beyond it only take the room the state being read needs,
                # and when the disk is the bottleneck they are written down and read back.
                self.adam.wait_backlog(max(1, self.read_ahead + 1))
            view = None
            with self.store.lock:   # a new chunk is pinned before the optimizer's thread could evict it
                if self.store.records[key].state is ChunkState.FREE:
                    # Only the gaps need zeros: every parameter's slice is written by its first gradient.
                    self.store.initialize(key, "device", lambda v, c=c: self._zero_gaps(v, c))
                    view = self.store.access(key, "device")
            # An accumulated one may be on NVMe: brought back outside the lock.
            self.views[c] = view if view is not None else self.store.access(key, "device")
        target = self.views[c][ref.slot.offset:ref.slot.end]
        # A single process adds the window's micro-batches in its chunk; under several ranks each
        # backward's whole chunk is fresh (the pieces accumulate).
        seen = self.captured if self.reducer is not None else self.progress.with_grad
        with self.on_compute(g):
            if ref.index in seen:
                target.add_(g.reshape(-1))       # accumulating
            else:
                target.copy_(g.reshape(-1))
        self.progress.with_grad.add(ref.index)
        self.captured.add(ref.index)
        self.progress.grad_chunks.add(c)
        self.grads_seen[c] += 1
        if self.grads_seen[c] == self._expected[c]:
            self._finish(c)
        return True

    def end_backward(self) -> None:
        """Complete the chunks still open (zeros for what got no gradient); under several ranks,
        reduce every chunk still due and wait for it."""
        for c in list(self.views):
            self._finish(c)
        if self.reducer is not None:
            self.reducer.flush()
            self.progress.reduced = self.progress.final_micro_batch
        self._reset()

    def abort(self) -> None:
        """A backward raised: let go of the open chunks. Gradients accumulated so far stay, as
        they would in ``.grad`` with plain PyTorch."""
        for c in list(self.views):
            self.views.pop(c)
            self.store.release((self.kind, c), "device", dirty=True)
        if self.reducer is not None:
            self.reducer.abort()
        self._reset()

    def _gaps_of(self, c: int, numel: int) -> list[tuple[int, int]]:
        """Element ranges of grad chunk ``c`` that no trainable parameter's gradient writes."""
        gaps, at = [], 0
        for p in self.params.chunk_members[c]:
            s = self.params.ref(p).slot
            if not p.requires_grad:
                continue
            if s.offset > at:
                gaps.append((at, s.offset))
            at = s.end
        if at < numel:
            gaps.append((at, numel))
        return gaps

    def _zero_gaps(self, view: torch.Tensor, c: int) -> None:
        for start, end in self._gaps[c]:
            view[start:end].zero_()

    def _finish(self, c: int) -> None:
        view = self.views.pop(c)
        seen = self.captured if self.reducer is not None else self.progress.with_grad
        with self.on_compute():
            for p in self.params.chunk_members[c]:      # trainable but no gradient in this buffer yet
                ref = self.params.ref(p)
                if p.requires_grad and ref.index not in seen:
                    view[ref.slot.offset:ref.slot.end].zero_()
        if self.reducer is not None:
            # Data parallel: this rank's piece goes on (ReadyGradients.take) once reduced.
            self.reducer.chunk_finished(c, view)
            return
        self.ready.take(c, view)
