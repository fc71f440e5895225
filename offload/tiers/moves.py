"""Copies between tiers, as handles: a move completes (``wait``) before its source may be released.

On a GPU, "released" means handed back to its tier with the copy's fence: the buffer's next user
is ordered after the copy on the GPU (``MemoryTier.free``), so a download's source goes back at
once and only whoever reads the bytes it lands waits for them.

Memory-to-memory copies run on CUDA copy streams (``streams.py``) when a GPU is involved, and
synchronously on the CPU otherwise; NVMe moves wrap the AIO handles.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch


class Move:
    """One in-flight copy, in two halves so nobody waits on I/O while holding the store's lock.

    ``wait_io()`` blocks until the bytes are in place (or the copy failed) and takes no lock but
    the move's own: any number of threads may call it. ``finish()`` then runs ``on_done`` once
    (or ``on_fail`` once and re-raises) and is called with the store's lock held. ``wait()`` is
    both, for callers that already hold that lock.
    """

    __slots__ = ("src", "dst", "nbytes", "_wait", "_poll", "on_done", "on_fail", "_finished", "_error",
                 "_io_lock", "_io_done")

    def __init__(self, src: str, dst: str, nbytes: int, wait: Callable[[], None] | None,
                 on_done: Callable[[], None] | None = None, on_fail: Callable[[], None] | None = None,
                 poll: Callable[[], bool] | None = None):
        self.src, self.dst, self.nbytes = src, dst, nbytes
        self._wait = wait
        self._poll = poll           # True once the bytes are in place (never blocks)
        self.on_done = on_done
        self.on_fail = on_fail
        self._finished = False
        self._error: BaseException | None = None
        self._io_lock = threading.Lock()
        self._io_done = wait is None

    @property
    def synchronous(self) -> bool:
        return self._wait is None

    def io_ready(self) -> bool:
        """The bytes are in place (or the copy failed): ``finish()`` would not block."""
        return self._io_done or (self._poll is not None and self._poll())

    def wait_io(self) -> None:
        if not self._io_done:
            with self._io_lock:
                if not self._io_done:
                    try:
                        self._wait()
                    except BaseException as exc:
                        self._error = exc
                    finally:
                        self._io_done = True
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        if self._finished:
            return
        try:
            self.wait_io()
        except BaseException:
            self._finished = True
            if self.on_fail is not None:
                self.on_fail()
            raise
        self._finished = True
        if self.on_done is not None:
            self.on_done()

    def wait(self) -> None:
        if self._finished and self._error is not None:
            raise self._error
        self.finish()


def copy_between(dst: torch.Tensor, src: torch.Tensor, src_name: str, dst_name: str, *,
                 streams=None, upload: bool = False, after=(), name: str = ""):
    """Copy ``src`` into ``dst`` (same byte size).

    Without ``streams``: a synchronous copy, returns its (already finished) ``Move``. With
    ``streams`` (``offload.tiers.streams``): the copy starts on the stream of its direction once
    ``after`` have happened, and ``(move, fence)`` is returned. An upload's move is finished for
    the compute that needs it by making the compute stream wait (the host goes on); a download's
    by the host waiting, as the host is what reads it.
    """
    nbytes = dst.numel() * dst.element_size()
    if streams is None:
        dst.copy_(src)
        return Move(src_name, dst_name, nbytes, None)
    fence = streams.copy(dst, src, after, upload=upload, name=name)
    wait = (lambda: streams.compute_wait(fence)) if upload else fence.synchronize
    return Move(src_name, dst_name, nbytes, wait, poll=fence.query), fence
