"""The tracer's GPU timeline: spans from events on the compute and copy streams, placed on the
tracer's clock. CUDA events are stood in for by host-clock events with the same methods (the
arithmetic and the bookkeeping are what is tested here; the GPU suite runs the real ones)."""

from __future__ import annotations

import time

import pytest

from offload.tiers.gpu_timeline import COMPUTE_TRACK, GpuTimeline
from offload.tracer import Tracer


class HostEvent:
    """A CUDA-event look-alike on the host clock; ``pending`` events have not happened yet."""

    def __init__(self):
        self.t = None
        self.pending = False

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return not self.pending

    def elapsed_time(self, other):        # milliseconds from self to other, as torch.cuda.Event
        return (other.t - self.t) * 1e3


class Streams:
    def __init__(self):
        self.compute = type("S", (), {"synchronize": lambda self: None})()
        self.timing = False
        self.copy_spans = []


def _timeline(tmp_path):
    tracer = Tracer(str(tmp_path / "t.json"))
    streams = Streams()
    return GpuTimeline(streams, tracer, make_event=HostEvent), tracer, streams


def test_spans_land_on_the_tracer_clock_and_tracks(tmp_path):
    tl, tracer, streams = _timeline(tmp_path)
    assert streams.timing, "copies must record start events while the timeline is on"
    before = time.perf_counter()
    tl.start(("forward", "outer"))
    tl.start(("forward", "inner"))
    time.sleep(0.01)
    tl.stop(("forward", "inner"), "forward Inner")
    tl.stop(("forward", "outer"), "forward Outer")
    s, e = HostEvent(), HostEvent()
    s.record(), e.record()
    streams.copy_spans.append(("param3 cpu->device", s, e, "h2d"))
    after = time.perf_counter()
    assert tl.resolve() == 3
    events = {ev["name"]: ev for ev in tracer.events}
    inner, outer = events["forward Inner"], events["forward Outer"]
    assert inner["tid"] == outer["tid"] == COMPUTE_TRACK
    assert events["param3 cpu->device"]["tid"] == "gpu h2d"
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3
    assert inner["dur"] >= 9e3          # microseconds: the 10 ms sleep
    # The timeline's anchor reads the host clock just after recording its event: every span lands
    # later by that gap (microseconds, more when the thread is preempted in between).
    gap = (tl._anchor_host - tl._anchor.t) * 1e6
    lo, hi = (before - tracer._t0) * 1e6, (after - tracer._t0) * 1e6
    for ev in tracer.events:
        assert lo - 1 <= ev["ts"] <= ev["ts"] + ev["dur"] <= hi + gap + 1
    assert not streams.copy_spans and tl.resolve() == 0


def test_unfinished_spans_wait_for_a_later_resolve(tmp_path):
    tl, tracer, _ = _timeline(tmp_path)
    tl.start("k")
    tl.stop("k", "backward Layer")
    tl._spans[0][2].pending = True
    assert tl.resolve() == 0 and not tracer.events
    tl._spans[0][2].pending = False
    assert tl.resolve() == 1 and tracer.events[0]["name"] == "backward Layer"


def test_stop_without_start_is_ignored(tmp_path):
    tl, tracer, _ = _timeline(tmp_path)
    tl.stop("never", "x")
    assert tl.resolve() == 0


@pytest.mark.gpu
def test_real_cuda_events_give_a_gpu_timeline(tmp_path):
    import torch

    from offload.tiers.streams import DeviceStreams

    tracer = Tracer(str(tmp_path / "t.json"))
    streams = DeviceStreams(torch.device("cuda"))
    tl = GpuTimeline(streams, tracer)
    a = torch.randn(2048, 2048, device="cuda")
    tl.start("mm")
    for _ in range(20):
        a = a @ a / 2048
    tl.stop("mm", "matmuls")
    host = torch.empty(1 << 24, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    streams.copy(dev, host, (), upload=True, name="upload")
    torch.cuda.synchronize()
    assert tl.resolve() == 2
    names = {ev["name"]: ev for ev in tracer.events}
    assert names["matmuls"]["dur"] > 0 and names["upload"]["tid"] == "gpu h2d"
