"""The libaio backend: kernel AIO contexts, each kept full by its own reaper thread.

Callers queue pieces and submit what fits right away (one ``io_submit`` per batch); the
reaper collects completions with a timeout (so it always notices shutdown) and refills the
queue from the pending list. With ``threads`` > 1 there is one context (and reaper) per
thread and pieces are dealt round-robin.
"""

from __future__ import annotations

import errno
import itertools
import threading
from collections import deque

from .. import native
from .request import Piece

REAP_TIMEOUT_NS = 100_000_000   # 100 ms: how often an idle reaper looks at the shutdown flag


class _Ring:
    def __init__(self, depth: int, name: str):
        self.ctx = native.AioContext(depth)
        self.depth = depth
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._pending: deque[Piece] = deque()
        self._inflight: dict[int, Piece] = {}
        self._tags = itertools.count(1)
        self._closing = False
        self._thread = threading.Thread(target=self._reap_loop, name=name, daemon=True)
        self._thread.start()

    def enqueue(self, pieces: list[Piece]) -> None:
        failed: list[tuple[Piece, int]] = []
        with self._lock:
            self._pending.extend(pieces)
            self._pump(failed)
            self._work.notify()
        for piece, err in failed:
            piece.fail(err, "refused by io_submit")

    def _pump(self, failed: list) -> None:
        """Submit pending pieces while slots are free (lock held). Refusals go to ``failed``."""
        while self._pending and len(self._inflight) < self.depth:
            room = self.depth - len(self._inflight)
            batch = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            tagged = [(next(self._tags), p) for p in batch]
            rc = self.ctx.submit([(t, p.fd, p.op, p.address, p.offset, p.length) for t, p in tagged])
            queued = max(rc, 0)
            for t, p in tagged[:queued]:
                self._inflight[t] = p
            rest = batch[queued:]
            if rc == -errno.EAGAIN and self._inflight:
                self._pending.extendleft(reversed(rest))   # retried when a completion frees room
                return
            if rc < 0:
                # io_submit refused the first request of the batch: that one fails, the rest retry.
                failed.append((rest[0], -rc))
                rest = rest[1:]
            self._pending.extendleft(reversed(rest))

    def _reap_loop(self) -> None:
        while True:
            with self._lock:
                while not self._inflight and not self._pending and not self._closing:
                    self._work.wait()
                if self._closing and not self._inflight and not self._pending:
                    return
                idle = not self._inflight
            if idle:
                # Pending work but nothing in flight: the last submit failed; try again now.
                failed: list = []
                with self._lock:
                    self._pump(failed)
                for piece, err in failed:
                    piece.fail(err, "refused by io_submit")
                continue
            got = self.ctx.reap(1, self.depth, REAP_TIMEOUT_NS)
            if isinstance(got, int):
                if got == -errno.EINTR:
                    continue
                self._abort(-got)
                return
            done: list[tuple[Piece, int, int]] = []
            failed = []
            with self._lock:
                for tag, result, moved in got:
                    done.append((self._inflight.pop(tag), result, moved))
                self._pump(failed)
            for piece, result, moved in done:
                piece.finish(result, moved)
            for piece, err in failed:
                piece.fail(err, "refused by io_submit")

    def _abort(self, err: int) -> None:
        # io_getevents itself failed (should not happen): fail what is queued; destroying the
        # context waits for the requests still in flight, then they are failed too.
        with self._lock:
            pending, self._pending = list(self._pending), deque()
            inflight, self._inflight = list(self._inflight.values()), {}
            self._closing = True
        self.ctx.destroy()
        for piece in pending + inflight:
            piece.fail(err, "io_getevents failed")

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._work.notify()
        self._thread.join()
        self.ctx.destroy()


class LibaioBackend:
    name = "libaio"
    direct = True

    def __init__(self, queue_depth: int, threads: int):
        self._rings: list[_Ring] = []
        try:
            for i in range(threads):
                self._rings.append(_Ring(queue_depth, f"offload-aio-{i}"))
        except BaseException:
            self.close()
            raise
        self._next = 0

    def submit(self, pieces: list[Piece]) -> None:
        n = len(self._rings)
        if n == 1:
            self._rings[0].enqueue(pieces)
            return
        start, self._next = self._next, (self._next + len(pieces)) % n
        for i, ring in enumerate(self._rings):
            share = pieces[(i - start) % n::n]
            if share:
                ring.enqueue(share)

    def close(self) -> None:
        """Wait for every request queued so far, then free the contexts."""
        for ring in self._rings:
            ring.close()
        self._rings = []
