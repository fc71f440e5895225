"""The per-chunk optimizer: native Adam over each chunk's master, exp_avg and exp_avg_sq, in the
precision the config chose (``precision``: fp32, bf16 or 8-bit moments with their per-block
scales, an fp32 or bf16 master; 8-bit pieces go through ``quant_step``).

For chunk ``c`` (this rank's piece of it under several ranks) it pins grad/master/exp_avg/exp_avg_sq on the CPU tier (their fetches were
started ahead), runs the SIMD kernel over runs of parameters that share hyper-parameters and
step count, writes the new compute-precision parameters into the CPU parameter chunk in the
same pass, and unpins (the store writes state back down when a tier needs the room). A worker
thread runs updates while backward is still producing gradients for earlier layers (LoHan's
active gradient offloading), reading ahead of its queue; backward waits (``wait_backlog``)
rather than run further ahead than that read-ahead. What is still queued when backward ends is
taken in the order the next forward uses the chunks (``reorder``) and may run on after
``optimizer.step()`` returns: the engine waits per chunk (``wait_for``) before using it.
``drain`` waits for the whole queue and re-raises the worker's first error.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from dataclasses import dataclass

import torch

from ..chunks.states import ChunkState
from ..errors import OffloadError
from ..optim.kernel import adam_step
from ..tiers.streams import use_device
from .precision import SIGNED, SR_SEED
from .quant_step import update_8bit, zero_code

STATE_KINDS = ("exp_avg", "exp_avg_sq")
# wait_backlog gives up after this long without a single update finishing.
BACKLOG_STALL_S = 0.5
# How often a drain looks whether the worker it waits for still runs.
WORKER_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool


def hyper_of(group: dict) -> Hyper:
    lr = group["lr"]
    lr = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
    b1, b2 = group["betas"]
    return Hyper(lr, float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                 bool(group.get("decoupled_weight_decay", True)), bool(group.get("maximize", False)))


class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow (and skip the step), double after a run of good steps."""

    def __init__(self, initial: float = 2.0**16, growth_interval: int = 1000, min_scale: float = 1.0):
        self.scale = float(initial)
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= 2.0
                self.good_steps = 0


class ScaleGrad(torch.autograd.Function):
    """Identity forward (an alias, so users may modify the output in place, as with
    ``PreBackward``); multiplies the incoming gradient by the loss scale on the way back."""

    @staticmethod
    def forward(ctx, scaler, t):
        ctx.scaler = scaler
        ctx.set_materialize_grads(False)
        return t.detach()

    @staticmethod
    def backward(ctx, grad):
        return None, (grad * ctx.scaler.scale if grad is not None else None)


class ChunkAdam:
    """Runs Adam on whole chunks of ``params`` in ``store``, inline or on a worker thread.

    ``threads``: the kernel's (None: all cores). ``read_ahead``: how many queued chunks' inputs
    are fetched ahead. ``device``: the engine's, made current on the worker. ``spills``: the
    persistent state does not all fit in memory, so each update writes its state down at once.
    """

    def __init__(self, params, store, tracer, *, threads: int | None, read_ahead: int, device: torch.device,
                 spills: bool):
        self.params = params
        self.store = store
        self.tracer = tracer
        self.threads = threads
        self.read_ahead = read_ahead
        self.device = device
        self.spills = spills
        self.steps = [0] * len(params.params)     # per parameter, as torch counts them
        self._queue: queue.PriorityQueue | None = None
        self._order = itertools.count()             # ties between equal deadlines go first come, first served
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self.failure: BaseException | None = None   # the first update that failed (never cleared)
        self._progress = threading.Condition()      # notified as the worker finishes each chunk
        self._finished = 0
        self._pending: set[int] = set()             # chunks submitted and not yet updated (under _progress)
        self._idle_since: float | None = None       # when the worker last ran out of work
        self.update_s = 0.0                         # moving average of one queued update's wall time
        self.backlog_wait_s = 0.0                   # time callers spent in wait_backlog (reset by them)

    # ---- one chunk -------------------------------------------------------------
    def runs(self, c: int, with_grad: set[int], groups: dict[int, Hyper]) -> list[tuple[int, int, Hyper, int]]:
        """(start, end, hyper, step) runs of consecutive parameters of chunk ``c`` updated together.

        A parameter without a gradient this step is skipped, as torch skips it; padding between
        merged parameters holds zeros in every kind, which Adam maps to zeros. Offsets are in this
        rank's piece of the chunk (the whole chunk in a single process): a parameter that crosses
        a piece boundary is updated in part here, the rest on the neighbouring rank.
        """
        out: list[list] = []
        params = self.params
        for p, start, end in params.piece_members(c):
            ref = params.ref(p)
            if ref.index not in with_grad or ref.index not in groups:   # no gradient, or not ours to update
                out.append(None)
                continue
            h, step = groups[ref.index], self.steps[ref.index] + 1
            last = out[-1] if out else None
            if last is not None and last[2] == h and last[3] == step:
                last[1] = end
            else:
                out.append([start, end, h, step])
        return [tuple(r) for r in out if r is not None]

    def prefetch(self, c: int, *, grad: bool = True) -> None:
        """Start bringing chunk ``c``'s optimizer inputs to host memory (asynchronous); ``grad=False``
        leaves its gradient where it is (backward has not completed it yet)."""
        master = "master" if self.params.has_master else "param"
        precision = self.params.precision
        # Resident kinds (8-bit scales) never leave host memory: nothing to fetch or to hint.
        state = [k for k in precision.state_kinds() if k not in precision.resident_kinds()]
        kinds = ["grad"] * grad + [master, *state]
        for kind in kinds:
            self.store.prefetch((kind, c), "cpu", soon=True)
        if not grad:
            # Its update comes soon: not written down to make room meanwhile (CI saw a waiting
            # gradient go to NVMe), nor downloaded while backward still fills it.
            self.store.hint_soon(("grad", c))

    def update(self, c: int, runs, grad_scale: float) -> None:
        if not runs:
            return
        store, params = self.store, self.params
        tracer = self.tracer
        master_kind = "master" if params.has_master else "param"
        pinned = []

        def take(key, dirty, overwrite=False):
            view = store.access(key, "cpu", overwrite=overwrite)
            pinned.append((key, dirty))
            return view

        try:
            with tracer.span(f"fetch opt {c}", "optimizer_wait", chunk=c):
                grad = take(("grad", c), False)
                master = take((master_kind, c), True)
                states = []
                for kind in params.precision.state_kinds():     # moments (codes), then their scales
                    key = (kind, c)
                    if store.records[key].state is ChunkState.FREE:
                        # torch creates zeros at the first step (8-bit: zero's code, zero scales)
                        code = zero_code(SIGNED[kind]) if kind in SIGNED and params.precision.quantized else 0
                        store.initialize(key, "cpu", (lambda v, code=code: v.fill_(code)) if code else None)
                    states.append(take(key, True))
                out = take(("param", c), True, overwrite=True) if params.has_master else None
            with tracer.span(f"adam {c}", "adam", chunk=c):
                if params.precision.quantized:
                    update_8bit(master, grad, states, out, runs, params.piece_members(c),
                                index_base=params.chunk_base[c] + params.span(c)[0], grad_scale=grad_scale,
                                threads=self.threads)
                base = params.chunk_base[c] + params.span(c)[0]      # the piece's place in the whole layout
                for start, end, h, step in ([] if params.precision.quantized else runs):
                    adam_step(master[start:end], grad[start:end], states[0][start:end], states[1][start:end],
                              lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                              step=step, decoupled=h.decoupled, grad_scale=grad_scale, maximize=h.maximize,
                              out=None if out is None else out[start:end], threads=self.threads,
                              seed=SR_SEED, index_base=base + start)     # bf16 state: rounding bits
                if out is not None:
                    # Parameters skipped this step keep their values in the rewritten chunk.
                    self._copy_skipped(c, master, out, runs)
        finally:
            for key, dirty in reversed(pinned):
                store.release(key, "cpu", dirty=dirty)
        # The update consumed the window's gradients (optimizer.step() does, as DeepSpeed's engine
        # does): free their chunk now rather than let a tier write it down to make room.
        store.release_storage(("grad", c))
        if self.spills:
            # The state will not stay in memory until the next step: start writing it down now,
            # while the next chunk is updated, so that its eviction later costs nothing.
            for key, dirty in pinned:
                if dirty:
                    store.start_writeback(key)

    def _copy_skipped(self, c, master, out, runs) -> None:
        # Runs and parameters are both in offset order: walk them together.
        i = 0
        for _, start, end in self.params.piece_members(c):
            while i < len(runs) and runs[i][1] <= start:
                i += 1
            if i == len(runs) or runs[i][0] > start:
                out[start:end].copy_(master[start:end])

    def commit_steps(self, with_grad: set[int]) -> None:
        for i in with_grad:
            self.steps[i] += 1

    # ---- the worker -------------------------------------------------------------------------
    def submit(self, c: int, runs, grad_scale: float) -> None:
        """Queue chunk ``c``'s update; the worker takes chunks in the order queued until ``reorder``."""
        if self._worker is None:
            self._queue = queue.PriorityQueue()
            self._worker = threading.Thread(target=self._run, name="offload-adam", daemon=True)
            self._worker.start()
        # Chunk c's own inputs were asked for when its gradients completed (ReadyGradients.take);
        # these are the next ones backward will complete.
        # Their gradients are not final yet (under accumulation they hold partial sums backward
        # will add to): a copy taken now would be thrown away as stale, so only their state comes.
        for ahead in range(c - 1, max(-1, c - 1 - self.read_ahead), -1):
            self.prefetch(ahead, grad=False)      # backward completes chunks in reverse order
        with self._progress:
            self._pending.add(c)
            self._idle_since = None
        self._queue.put((0.0, next(self._order), c, runs, grad_scale))

    def reorder(self, deadline) -> None:
        """From now on take the queued chunks by earliest ``deadline(c)`` first.

        Called when backward ends. Until then first come, first served keeps the chunks whose
        inputs were fetched first from waiting behind newer ones. After it, what is still queued
        races the next forward, which needs its chunks in the order it uses them.
        """
        if self._queue is None:
            return
        with self._queue.mutex:
            heap = self._queue.queue
            heap[:] = [(deadline(item[2]) if item[2] is not None else item[0], *item[1:]) for item in heap]
            heapq.heapify(heap)

    def pending(self, c: int) -> bool:
        """Whether chunk ``c`` has an update queued or running (its parameters are not yet new)."""
        return c in self._pending

    def pending_chunks(self) -> set[int]:
        with self._progress:
            return set(self._pending)

    def wait_for(self, c: int) -> None:
        """Wait until chunk ``c``'s queued update is done; re-raises the worker's error."""
        with self._progress:
            while c in self._pending and self._error is None:
                self._progress.wait()
        if self._error is not None:
            self.drain()

    def idle_s(self) -> float:
        """How long the worker has had nothing queued (0 while it has)."""
        since = self._idle_since
        return 0.0 if since is None else time.perf_counter() - since

    def check_intact(self) -> None:
        """Raise once an update has failed on the worker (``drain`` reports it once): the chunks
        updated before it hold that step and the rest do not, so nothing may build on them."""
        if self.failure is not None:
            raise OffloadError(f"an optimizer update failed ({self.failure!r}): this model's chunks may hold "
                               f"part of that step, so it neither steps, saves nor runs forward any more: "
                               f"close it and resume from the last checkpoint") from self.failure

    def raise_error(self) -> None:
        """Re-raise the worker's first error now, without waiting for its queue."""
        if self._error is not None:
            self.drain()

    def _run(self) -> None:
        # First of all: this thread's CUDA calls (event queries, the copies of the chunks it
        # accesses) go to the engine's GPU, not to GPU 0 where they would create a context.
        use_device(self.device)
        # The kernel runs on its own pthreads; the few torch ops here stay on this thread. Letting
        # them fork an OpenMP team of their own would give libgomp more threads than cores, and it
        # then stops spinning between parallel regions: every op of forward and backward on the
        # training thread pays a sleep and a wake-up (in memory, steps took 1.3x as long).
        torch.set_num_threads(1)
        while True:
            _, _, c, runs, grad_scale = self._queue.get()
            try:
                if c is None:
                    return
                if self._error is None:
                    started = time.perf_counter()
                    self._prefetch_queued()
                    self.update(c, runs, grad_scale)
                    took = time.perf_counter() - started
                    self.update_s = took if self.update_s == 0 else 0.8 * self.update_s + 0.2 * took
            except BaseException as exc:  # re-raised in the training thread by drain()
                self._error = exc
                if self.failure is None:    # kept: some chunks may have this step's update, others not
                    self.failure = exc
            finally:
                with self._progress:        # before task_done: drain() returning means nothing pending
                    self._pending.discard(c)
                    if not self._pending:
                        self._idle_since = time.perf_counter()
                    self._finished += 1
                    self._progress.notify_all()
                self._queue.task_done()

    def _prefetch_queued(self) -> None:
        # Once backward has run ahead of the updates (always, when compute is faster than the
        # disk), the chunks queued here are the next ones to update: keep their inputs coming.
        # The fetches asked for when they were submitted were skipped if there was no room then,
        # and nothing else would ask again before the update waits for them one by one.
        depth = self.read_ahead
        with self._queue.mutex:     # the training thread may be queueing more meanwhile
            queued = [item[2] for item in heapq.nsmallest(depth, self._queue.queue) if item[2] is not None]
        for c in queued:
            self.prefetch(c)

    def wait_backlog(self, limit: int, stall_s: float | None = None) -> None:
        """Wait until at most ``limit`` submitted chunks are still to be updated.

        Back-pressure, not a barrier: it also returns when the worker failed (``drain`` reports
        that) or finished nothing for ``stall_s`` (should an update ever need room that only the
        waiting thread can free, that thread goes on rather than deadlock; it then spills).
        """
        if self._queue is None:
            return
        stall_s = BACKLOG_STALL_S if stall_s is None else stall_s
        started = time.perf_counter()
        try:
            self._wait_backlog(limit, stall_s)
        finally:
            self.backlog_wait_s += time.perf_counter() - started

    def _wait_backlog(self, limit: int, stall_s: float) -> None:
        with self._progress:
            while len(self._pending) > limit and self._error is None:
                before = self._finished
                self._progress.wait(stall_s)
                if self._finished == before:
                    return

    def drain(self) -> None:
        if self._queue is not None:
            self._join()
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, OffloadError):
                raise err
            raise OffloadError(f"the optimizer worker failed: {err!r}") from err

    def _join(self) -> None:
        """``Queue.join``, but a worker that is gone with updates still queued (Python stops daemon
        threads at interpreter exit) is an error, not a wait forever."""
        q = self._queue
        with q.all_tasks_done:
            while q.unfinished_tasks:
                worker = self._worker
                if worker is None or not worker.is_alive():
                    raise OffloadError(f"the optimizer worker stopped with {q.unfinished_tasks} chunk updates "
                                       f"still queued (the interpreter is exiting?): they are lost")
                q.all_tasks_done.wait(WORKER_POLL_S)

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put((float("inf"), next(self._order), None, None, None))
            self._worker.join(timeout=30)
            self._worker = None
