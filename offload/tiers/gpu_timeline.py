"""The GPU's own timeline in the Perfetto trace: when kernels and copies ran, not when they were queued.

On a GPU the host only launches work: a module's forward "takes" the few microseconds its
launches take, and a chunk copy is queued long before it runs. With tracing on
(``OFFLOAD_TRACE``), the engine therefore also records CUDA events around each module's forward
and backward on the compute stream, and the copy streams record start and end events on each
copy (``DeviceStreams.timing``). At the end of each step the events that have completed are
turned into spans on three more tracks, "gpu compute", "gpu h2d" and "gpu d2h", placed on the
tracer's clock through one anchor event whose host time is known (recorded on an idle stream
and waited for).

The host-side "wait" spans the engine's parking reads stay host-only: uploads finish by the
compute stream waiting on their event (``DeviceStreams.compute_wait``), not by the host, so a
wait span never includes queued compute.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

COMPUTE_TRACK = "gpu compute"


class GpuTimeline:
    def __init__(self, streams, tracer, make_event: Callable | None = None):
        self.streams = streams
        self.tracer = tracer
        self._make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._open: dict = {}           # key -> start events of spans begun and not yet ended
        self._spans: list = []          # (name, start event, end event, track) not yet resolved
        self._anchor = None
        self._anchor_host = 0.0
        streams.timing = True

    def _set_anchor(self) -> None:
        # Recorded on an idle stream and waited for: the host time right after is the event's
        # time (to within the wake-up latency, microseconds).
        stream = self.streams.compute
        stream.synchronize()
        event = self._make_event()
        event.record(stream)
        event.synchronize()
        self._anchor, self._anchor_host = event, time.perf_counter()

    def start(self, key) -> None:
        """A span keyed ``key`` begins at this point of the compute stream."""
        if self._anchor is None:
            self._set_anchor()
        event = self._make_event()
        event.record(self.streams.compute)
        self._open.setdefault(key, []).append(event)

    def stop(self, key, name: str) -> None:
        """The innermost open span keyed ``key`` ends here; it appears as ``name``."""
        starts = self._open.get(key)
        if not starts:
            return
        start = starts.pop()
        if not starts:
            del self._open[key]
        end = self._make_event()
        end.record(self.streams.compute)
        self._spans.append((name, start, end, COMPUTE_TRACK))

    def resolve(self) -> int:
        """Hand every span whose end event has happened to the tracer; returns how many. Spans
        still running stay for the next call."""
        spans = self._spans + list(self.streams.copy_spans)
        self.streams.copy_spans.clear()
        self._spans = []
        if not spans:
            return 0
        if self._anchor is None:
            self._set_anchor()
        done = 0
        for name, start, end, track in spans:
            if not end.query():
                self._spans.append((name, start, end, track))
                continue
            t0 = self._anchor_host + self._anchor.elapsed_time(start) / 1e3
            t1 = self._anchor_host + self._anchor.elapsed_time(end) / 1e3
            self.tracer.complete(name, "gpu", t0, t1, track if track == COMPUTE_TRACK else f"gpu {track}")
            done += 1
        return done
