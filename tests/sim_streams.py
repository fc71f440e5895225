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
