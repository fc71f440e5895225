"""The collectives the engine issues, through torch.distributed, with their bytes counted.

**Order.** Every rank must issue the same collectives in the same order (NCCL and gloo both pair
them by position). All of the engine's are issued by one thread per rank, the communication thread
(``offload-comm``), in the order they were submitted (``submit``): the order of the training
loop, the same on every rank. A job may first wait for what is this rank's own to finish — its
chunk's Adam update, an NVMe read — which delays the collective but never reorders it, so the
thread that submitted it (compute) goes on and waits (``wait``) only where it needs the data.
Nothing a job waits for waits in turn for a collective submitted after it, so no rank can hold
up another's progress through the queue: the k-th collective of every rank is issued once each
rank's jobs up to k have met their own inputs.

**Streams.** On a GPU each collective starts *and* is waited for on the engine's compute stream
(``streams.on_compute``), whichever thread issues or waits: NCCL's stream then waits for what
compute queued before it (the writes into the buffers it sends), and compute for the collective.
With gloo on the CPU, ``wait`` blocks the waiting thread instead.

**No hidden temporaries.** A chunk is gathered by one ``all_gather_into_tensor`` of the ranks'
pieces straight into the chunk's own (budgeted) buffer, and its gradient summed by one
``reduce_scatter_tensor`` from the chunk's own buffer into this rank's piece: no staging copy
outside the budgets (the list forms of all_gather / reduce_scatter would have NCCL stage a flat
temporary). torch 2.13 renames them ``all_gather_single`` / ``reduce_scatter_single``; whichever
this torch has is used.

**Bytes** are counted per rank the way bandwidth is usually reported (nccl-tests' bus bytes): an
all-gather into (a reduce-scatter from) a whole chunk of b bytes moves (N-1)/N·b per rank (a ring:
each rank sends and receives every piece but its own), as does a broadcast of b bytes; an
all-reduce moves 2(N-1)/N of its size.

A failed collective (a dead peer, a timeout) becomes a ``DistributedError`` naming this rank,
the collective, and the failed rank when that rank left its name in the process group's store
(see ``failure``).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..tiers.streams import use_device
from . import failure
from .sharding import Sharding

# A job: waits for this rank's own inputs, starts collectives, returns their works.
Job = Callable[[], list]


def collective_device(group=None) -> torch.device:
    """Where ``group``'s collectives take their tensors: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Collectives:
    """The engine's collectives over ``sharding``'s group, issued in submission order by the
    communication thread. ``streams``: the engine's CUDA streams (None on the CPU); ``device``:
    the engine's, made current on the communication thread."""

    def __init__(self, sharding: Sharding, *, streams=None, device: torch.device = torch.device("cpu")):
        self.sharding = sharding
        self.world = sharding.world
        self.group = sharding.group
        self.streams = streams
        self.device = torch.device(device)
        self.bytes_by_op: Counter = Counter()
        self.ops = 0
        self._count_lock = threading.Lock()     # counted on the communication thread, taken on another
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # ---- submitting and waiting -----------------------------------------------------------
    def submit(self, job: Job) -> Future:
        """Run ``job`` on the communication thread after every job submitted before it; the
        future's result is the list of works it started (its error, if it raised)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="offload-comm", daemon=True)
            self._thread.start()
        future: Future = Future()
        self._jobs.put((future, job))
        return future

    def wait(self, pending: Future | None, what: str) -> None:
        """Wait until ``pending``'s collectives are done for this thread's compute: raises the
        job's own error, or a ``DistributedError`` for a failed collective."""
        if pending is None:
            return
        works = pending.result()
        try:
            with self._on_compute():
                for work in works:
                    work.wait()
        except Exception as exc:      # DistBackendError, a gloo "Connection closed", a timeout
            raise self._error(what, exc) from exc

    def close(self) -> None:
        """Stop the communication thread once the jobs submitted so far have run."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    # ---- the collectives: submitted (any thread) ---------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Future:
        return self.submit(lambda: [self.start_broadcast(tensor, src)])

    def all_gather(self, whole: torch.Tensor, piece: torch.Tensor) -> Future:
        """Every rank's ``piece`` into ``whole`` (world x piece elements), in rank order."""
        return self.submit(lambda: [self.start_all_gather(whole, piece)])

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place and waited for (small tensors: norms, flags)."""
        self.wait(self.submit(lambda: [self.start_all_reduce(tensor, op)]), "all_reduce")
        return tensor

    # ---- the collectives: started by a job, on the communication thread -----------------------
    def start_broadcast(self, tensor: torch.Tensor, src: int):
        return self._start("broadcast", (self.world - 1) * _nbytes(tensor) // self.world,
                           lambda: dist.broadcast(tensor, src, group=self.group, async_op=True),
                           f"broadcast from rank {src}")

    def start_all_gather(self, whole: torch.Tensor, piece: torch.Tensor):
        return self._start("all_gather", (self.world - 1) * _nbytes(whole) // self.world,
                           lambda: _ALL_GATHER(whole, piece, group=self.group, async_op=True))

    def start_reduce_scatter(self, piece: torch.Tensor, whole: torch.Tensor):
        """Sum ``whole`` over ranks; this rank's ``piece`` of the sum lands in ``piece``."""
        return self._start("reduce_scatter", (self.world - 1) * _nbytes(whole) // self.world,
                           lambda: _REDUCE_SCATTER(piece, whole, group=self.group, async_op=True))

    def start_all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM):
        return self._start("all_reduce", 2 * (self.world - 1) * _nbytes(tensor) // self.world,
                           lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True))

    # ---- accounting ----------------------------------------------------------------------
    def take_stats(self) -> dict:
        """Bytes this rank sent (= received, under the bus-bytes model) since the last call."""
        with self._count_lock:
            total = sum(self.bytes_by_op.values())
            out = {"sent_bytes": total, "received_bytes": total, "by_op": dict(self.bytes_by_op), "ops": self.ops}
            self.bytes_by_op.clear()
            self.ops = 0
        return out

    def _count(self, op: str, nbytes: int) -> None:
        with self._count_lock:
            self.bytes_by_op[op] += nbytes
            self.ops += 1

    # ---- internals -------------------------------------------------------------------------
    def _run(self) -> None:
        use_device(self.device)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            future, job = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:    # re-raised in the thread that waits for it
                future.set_exception(exc)

    def _start(self, op: str, nbytes: int, call, what: str | None = None):
        self._count(op, nbytes)
        try:
            with self._on_compute():
                return call()
        except Exception as exc:
            raise self._error(what or op, exc) from exc

    def _on_compute(self):
        return self.streams.on_compute() if self.streams is not None else nullcontext()

    def _error(self, what: str, exc: Exception) -> DistributedError:
        failed, why = failure.failed_peer()
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if why:
            detail = f"{why} (here: {detail})"
        return DistributedError(self.sharding.rank, what, detail, failed)


# torch 2.13 names them *_single (the *_tensor names warn there); older torch has only those.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
