"""One tracer for timing and tracing: totals per category always, Chrome/Perfetto events on demand.

``OFFLOAD_TRACE=file.json`` turns on event recording; ``dump()`` writes the trace (open it in
https://ui.perfetto.dev or chrome://tracing). Totals (seconds per category) are always kept:
the engine's per-step statistics read them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path


class Tracer:
    def __init__(self, path: str | None = None):
        self.path = path if path is not None else os.environ.get("OFFLOAD_TRACE") or None
        self.events: list[dict] = []
        self.totals: Counter = Counter()
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._pid = os.getpid()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def span(self, name: str, cat: str, **args) -> "_Span":
        """Time a block: adds to ``totals[cat]`` and, when tracing, records a complete event."""
        return _Span(self, name, cat, args)

    def complete(self, name: str, cat: str, start: float, end: float, track: str, **args) -> None:
        """Record an interval measured elsewhere (``time.perf_counter`` stamps) on a named track,
        e.g. an asynchronous NVMe read from its submission to its completion."""
        self._interval(name, cat, start, end, track, args)

    def _interval(self, name: str, cat: str, start: float, end: float, tid, args: dict) -> None:
        with self._lock:
            self.totals[cat] += end - start
            if self.path is not None:
                self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self._pid, "tid": tid,
                                    "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6,
                                    "args": args})

    def instant(self, name: str, cat: str, **args) -> None:
        if self.path is None:
            return
        with self._lock:
            self.events.append({"name": name, "cat": cat, "ph": "i", "s": "t", "pid": self._pid,
                                "tid": threading.get_ident() % 100000,
                                "ts": (time.perf_counter() - self._t0) * 1e6, "args": args})

    def take_totals(self) -> dict:
        """Totals since the last call (seconds per category), then reset them."""
        with self._lock:
            out = dict(self.totals)
            self.totals.clear()
            return out

    def dump(self, path: str | None = None) -> str | None:
        """Write the recorded events as a Chrome trace; returns the path (None when not tracing)."""
        target = path or self.path
        if target is None:
            return None
        with self._lock:
            data = {"traceEvents": list(self.events), "displayTimeUnit": "ms"}
        tmp = Path(str(target) + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, target)
        return str(target)


class _Span:
    """``Tracer.span``'s context: a plain class, not a generator (the engine opens several a chunk)."""

    __slots__ = ("tracer", "name", "cat", "args", "start")

    def __init__(self, tracer: Tracer, name: str, cat: str, args: dict):
        self.tracer, self.name, self.cat, self.args = tracer, name, cat, args

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.tracer._interval(self.name, self.cat, self.start, time.perf_counter(),
                              threading.get_ident() % 100000, self.args)
