"""Replaying a step's NVMe requests with nothing else running: what the disk alone needs for them.

The step bound divides a step's NVMe bytes by read and write rates measured one direction at a
time on one sequential file. The step's own traffic differs: chunk-sized requests to several
swap files, reads and writes interleaved. Replaying exactly those requests (same files,
offsets, sizes, directions and urgency, in the order the engine started them) back to back,
with the queue kept full and no compute or dependency between them, measures how fast this disk
does that traffic at all. No schedule can beat it, so ``step / replay`` is what the engine's
waits cost and ``replay / bound`` what the traffic's mix costs on this disk.

Writes land in the recorded slots with arbitrary bytes: replay only on swap files whose contents
are no longer needed (the benchmark replays right before it closes its engine).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

from ..errors import ConfigError
from ..tiers.nvme import IoRecord, NvmeTier

# Bytes of requests kept in flight: twice the default AIO queue (32 x 1 MiB), so the kernel
# queue never drains while completed requests wait to be reaped.
DEFAULT_INFLIGHT_BYTES = 64 << 20


def replay(tier: NvmeTier, records: Sequence[IoRecord], inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> float:
    """Start ``records`` on ``tier``'s AIO engine in order, at most ``inflight_bytes`` in flight
    (at least one request); seconds from the first start until the last completes."""
    from ..aio import aligned_empty

    if not records:
        raise ConfigError("records", 0, "nothing to replay (no NVMe request was recorded)")
    if isinstance(inflight_bytes, bool) or not isinstance(inflight_bytes, int) or inflight_bytes < 1:
        raise ConfigError("inflight_bytes", inflight_bytes, "must be an integer >= 1")
    largest = max(r.slot.nbytes for r in records)
    # One buffer per request in flight, reused in order (every request fits the largest).
    free = [aligned_empty(largest, populate=True) for _ in range(max(1, inflight_bytes // largest))]
    inflight: deque = deque()
    io = tier.aio
    started = time.perf_counter()
    try:
        for r in records:
            if not free:
                handle, buf = inflight.popleft()
                io.wait(handle)
                free.append(buf)
            buf = free.pop()
            view = buf[:r.slot.nbytes]
            handle = io.write_from(view, r.slot.file, r.slot.offset) if r.write else \
                io.read_into(view, r.slot.file, r.slot.offset, urgent=r.urgent)
            inflight.append((handle, buf))
        io.wait([h for h, _ in inflight])
        inflight.clear()
        return time.perf_counter() - started
    finally:
        if inflight:    # an error mid-way: no buffer may go while the kernel still writes into it
            try:
                io.wait([h for h, _ in inflight])
            except Exception:
                pass
