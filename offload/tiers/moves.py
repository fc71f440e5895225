"""Copies between tiers, as handles: a move completes (``wait``) before its source may be released.

Memory-to-memory copies run on a side CUDA stream with an event when a GPU is involved, and
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


_side_streams: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


def copy_between(dst: torch.Tensor, src: torch.Tensor, src_name: str, dst_name: str) -> Move:
    """Start copying ``src`` into ``dst`` (same byte size); returns the ``Move``."""
    cuda = dst.device.type == "cuda" or src.device.type == "cuda"
    if not cuda:
        dst.copy_(src)
        return Move(src_name, dst_name, dst.numel() * dst.element_size(), None)
    device = dst.device if dst.device.type == "cuda" else src.device
    stream = _side_stream(device)
    # The side stream must not read src (or overwrite dst) before work already queued on it is done.
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    # Keep both tensors alive for the caching allocator until the copy has run.
    for t in (dst, src):
        if t.device.type == "cuda":
            t.record_stream(stream)
    return Move(src_name, dst_name, dst.numel() * dst.element_size(), event.synchronize)
