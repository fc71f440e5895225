"""The CUDA streams chunk copies run on, and how they are ordered against the model's compute.

Three streams per engine: the **compute** stream the model runs on (captured when the engine is
made and again at the start of every forward, so a user training under ``torch.cuda.stream(s)``
gets ``s``), and one copy stream **per direction**, so uploads of parameters never queue behind
downloads of gradients and the two directions overlap on the bus.

Copies are ordered by events, never by waiting for the whole compute queue and never by the
host blocking where the GPU can wait instead:

- a copy waits only for the events it is given: the end of the work that wrote its source
  (``ChunkRecord.ready``) and the end of the last users of its destination buffer (the
  tier's fences);
- an upload is finished, for the compute that needs it, by ``compute.wait_event`` (the host goes
  on issuing work); a download is finished by the host waiting, because the host (the CPU Adam)
  is what reads it;
- whichever thread issues work (the training thread, autograd's, the Adam worker, a checkpoint
  writer), ordering goes through the captured compute stream, not that thread's current stream.

The same small protocol (``CopyStreams``) is what the chunk store and the engine use; tests drive
it with simulations that run copies on threads or only when told (``tests/sim_streams.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

import torch


class Fence(Protocol):
    """A point in a stream's work: done (``query``) or waited for by the host (``synchronize``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CopyStreams(Protocol):
    """What the chunk store and the engine need of copy streams (``DeviceStreams`` on a GPU)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Fence], *, upload: bool,
             name: str = "") -> Fence: ...

    def compute_fence(self) -> Fence: ...

    def compute_wait(self, fence: Fence) -> None: ...

    def on_compute(self): ...

    def capture(self) -> None: ...

    def receive(self, t: torch.Tensor) -> None: ...


class DeviceStreams:
    """The compute stream and the two copy streams of one CUDA device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.compute = torch.cuda.current_stream(self.device)
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)
        self.timing = False         # record start events on copies too (the tracer's GPU timeline)
        self.copy_spans: list = []  # (name, start event, end event, track) while timing

    def capture(self) -> None:
        """Take the calling thread's current stream as the compute stream (each forward's start)."""
        self.compute = torch.cuda.current_stream(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence = (), *, upload: bool,
             name: str = "") -> torch.cuda.Event:
        """Start ``dst.copy_(src)`` on the stream of its direction (``upload``: host to device) once
        ``after`` have happened; returns the event it ends with. A device source may be dropped
        as soon as this returns: the caching allocator keeps its memory from every other tensor
        until the copy has read it (``record_stream``)."""
        stream = self.h2d if upload else self.d2h
        for fence in after:
            stream.wait_event(fence)
        if src.is_cuda:
            src.record_stream(stream)
        with torch.cuda.stream(stream):
            start = None
            if self.timing:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=self.timing)
            done.record(stream)
        if start is not None:
            self.copy_spans.append((name, start, done, "h2d" if upload else "d2h"))
        return done

    def compute_fence(self) -> torch.cuda.Event:
        """An event after every piece of compute queued so far."""
        event = torch.cuda.Event()
        event.record(self.compute)
        return event

    def compute_wait(self, fence: torch.cuda.Event) -> None:
        """Compute queued from now on waits for ``fence`` (on the GPU: the host goes on)."""
        self.compute.wait_event(fence)

    def receive(self, t: torch.Tensor) -> None:
        """``t`` was made on the calling thread's current stream (autograd's, for a gradient) and
        compute is about to read it: compute waits for that stream, and the caching allocator
        keeps ``t``'s memory until compute is done with it."""
        current = torch.cuda.current_stream(self.device)
        if current != self.compute:
            self.compute.wait_stream(current)
            t.record_stream(self.compute)

    @contextmanager
    def on_compute(self) -> Iterator[None]:
        """Device work issued inside runs on the compute stream, whatever thread issues it."""
        with torch.cuda.stream(self.compute):
            yield


@contextmanager
def compute_on(streams: CopyStreams | None, received: torch.Tensor | None = None) -> Iterator[None]:
    """Device work issued inside runs on ``streams``' compute stream (a no-op without streams);
    ``received``: a tensor made on the calling thread's current stream that it reads."""
    if streams is None:
        yield
        return
    if received is not None:
        streams.receive(received)
    with streams.on_compute():
        yield


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for a CPU device).

    A thread starts on CUDA device 0 whatever its process chose: a thread the engine starts
    (the Adam worker, the communication thread, a checkpoint's fetch thread) calls this first, so
    that its event queries and copies do not create a context on GPU 0 on every rank of a node.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
