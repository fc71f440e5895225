"""CUDA copy streams simulated on the CPU, for exercising the GPU path's ordering without a GPU.

Same protocol as ``offload.tiers.streams.DeviceStreams``: each copy direction is a thread that
runs its copies in order, each after the fences it was given and after a delay (the bus), so
copies really are in flight while the engine goes on. Compute is the host itself (the CPU
computes synchronously): a compute fence has already happened, and "compute waits for a fence"
means the host waits. A copy that reads a buffer the engine has meanwhile reused or rewritten
gives different numbers, which the equivalence tests catch.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter

FENCE_TIMEOUT_S = 30.0


class SimFence:
    def __init__(self, done: bool = False):
        self._done = threading.Event()
        if done:
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(FENCE_TIMEOUT_S):
            raise TimeoutError("a simulated copy never finished (a fence waits on a later one?)")


class SimStreams:
    def __init__(self, delay_s: float = 0.002):
        self.delay_s = delay_s
        self.copies: Counter = Counter()        # "h2d" / "d2h" -> copies started
        self.compute_waits = 0
        self._queues = {True: queue.Queue(), False: queue.Queue()}
        self._threads = [threading.Thread(target=self._run, args=(q,), daemon=True) for q in self._queues.values()]
        for t in self._threads:
            t.start()

    def copy(self, dst, src, after, *, upload: bool, name: str = ""):
        fence = SimFence()
        self.copies["h2d" if upload else "d2h"] += 1
        self._queues[upload].put((dst, src, list(after), fence))
        return fence

    def _run(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            dst, src, after, fence = item
            for f in after:
                f.synchronize()
            time.sleep(self.delay_s)
            dst.copy_(src)
            fence._done.set()

    def compute_fence(self):
        return SimFence(done=True)

    def compute_wait(self, fence) -> None:
        self.compute_waits += 1
        fence.synchronize()

    def on_compute(self):
        return contextlib.nullcontext()

    def capture(self) -> None:
        pass

    def receive(self, t) -> None:
        pass

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)


class GatedFence:
    """A fence of ``GatedStreams``. ``landed``: its copy ran (work ordered after it on the GPU
    sees the bytes); ``done``: the host sees it as finished (``query``). Never by time passing."""

    def __init__(self, streams: "GatedStreams | None" = None, done: bool = False):
        self._streams = streams
        self.landed = self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self._streams.host_wait(self)


class GatedStreams:
    """Copy streams whose copies run only when the test says so, or when something waits for
    one: deterministic, with no timing window.

    Copies run in the order they were queued (which keeps each after the fences it was given:
    those come from work queued before it). ``run(n)``: the GPU gets through ``n`` more copies,
    and the host sees every copy run so far as finished; with ``lag``, that happens by itself
    whenever more than ``lag`` copies are queued (a GPU that keeps up, ``lag`` copies behind). Compute is the host, as in
    ``SimStreams``: "compute waits for a fence" (``compute_waits``) runs the copies up to it, as
    the GPU would before that compute, but the host does not see them finish (``query`` stays
    False), as on a GPU whose host has run ahead. A host wait (``synchronize``) on a copy the
    host has not seen finish runs the copies up to it, so code that waits completes rather than
    hangs, and is recorded in ``host_waits``: the copy's name and whether the chunk store's
    ``lock`` was held (by any thread: checked from another one, so it means "under the lock"
    where one thread drives the store)."""

    def __init__(self, lock=None, lag: int | None = None):
        self.lock = lock
        self.lag = lag                  # if set: the GPU is never more than this many copies behind
        self.copies: Counter = Counter()
        self.compute_waits = 0
        self.host_waits: list[tuple[bool, str]] = []     # (store lock held, the copy's name)
        self._queue: list = []          # (dst, src, after, fence, name), in order, until seen done
        self._mutex = threading.RLock()  # threads issuing copies and waiting (the Adam worker's too)

    @property
    def host_waits_under_lock(self) -> int:
        return sum(1 for locked, _ in self.host_waits if locked)

    def copy(self, dst, src, after, *, upload: bool, name: str = ""):
        fence = GatedFence(self)
        with self._mutex:
            self.copies["h2d" if upload else "d2h"] += 1
            self._queue.append((dst, src, list(after), fence, name))
            if self.lag is not None and len(self._queue) > self.lag:
                self.run(len(self._queue) - self.lag)
        return fence

    def pending(self) -> int:
        """Copies that have not run yet."""
        with self._mutex:
            return sum(1 for item in self._queue if not item[3].landed)

    def run(self, count: int | None = None) -> None:
        """The GPU gets through ``count`` more copies (all by default); the host sees every copy
        run so far finish."""
        with self._mutex:
            todo = self.pending() if count is None else min(count, self.pending())
            self._land(len(self._queue) - self.pending() + todo)     # run copies are a prefix
            for item in self._queue:
                item[3].done = item[3].landed
            self._queue = [item for item in self._queue if not item[3].done]

    def _land(self, upto: int) -> None:
        """Run the first ``upto`` queued copies that have not run."""
        for dst, src, after, fence, _ in self._queue[:upto]:
            if fence.landed:
                continue
            if not all(f.landed for f in after):
                raise RuntimeError("a copy was queued before a fence it waits for")
            dst.copy_(src)
            fence.landed = True

    def _index(self, fence) -> int:
        return next(i for i, item in enumerate(self._queue) if item[3] is fence)

    def host_wait(self, fence) -> None:
        locked = self._lock_held()
        with self._mutex:
            if fence.done:
                return
            i = self._index(fence)
            self.host_waits.append((locked, self._queue[i][4]))
            self._land(i + 1)
            for item in self._queue[:i + 1]:
                item[3].done = True
            del self._queue[:i + 1]

    def _lock_held(self) -> bool:
        if self.lock is None:
            return False
        free = []

        def probe():
            if self.lock.acquire(blocking=False):
                self.lock.release()
                free.append(True)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return not free

    def compute_fence(self):
        return GatedFence(done=True)

    def compute_wait(self, fence) -> None:
        with self._mutex:
            self.compute_waits += 1
            if not fence.landed:
                self._land(self._index(fence) + 1)

    def on_compute(self):
        return contextlib.nullcontext()

    def capture(self) -> None:
        pass

    def receive(self, t) -> None:
        pass

    def close(self) -> None:
        self.run()
