"""The libaio backend: kernel AIO contexts fed by native completion threads.

Each context (``native.AioContext``) accepts any number of requests and keeps
``queue_depth`` of them in the kernel from a native thread, so the device queue stays full
while Python is busy elsewhere. One Python thread per context collects completions (with a
timeout, so it always notices shutdown) and finishes the pieces. With ``threads`` > 1 there
is one context per thread and pieces are dealt round-robin.
"""

from __future__ import annotations

import errno
import itertools
import threading

from .. import native
from .request import Piece

REAP_TIMEOUT_NS = 100_000_000   # 100 ms: how often an idle collector looks at the shutdown flag


class _Ring:
    def __init__(self, depth: int, submit_batch: int, name: str, background_depth: int):
        self.ctx = native.AioContext(depth, submit_batch)
        if background_depth:
            native.check(self.ctx.set_background_limit(background_depth), "off_aio_set_background_limit")
        self._lock = threading.Lock()
        self._inflight: dict[int, Piece] = {}
        self._tags = itertools.count(1)
        self._closing = False
        self._thread = threading.Thread(target=self._collect, name=name, daemon=True)
        self._thread.start()

    def enqueue(self, pieces: list[Piece], urgent: bool = False) -> None:
        with self._lock:
            tagged = [(next(self._tags), p) for p in pieces]
            # Registered before submitting: a completion may arrive before submit returns.
            self._inflight.update(tagged)
            rc = self.ctx.submit([(t, p.fd, p.op, p.address, p.offset, p.length) for t, p in tagged], urgent)
            if rc < 0:
                for t, _ in tagged:
                    del self._inflight[t]
        if rc < 0:
            for _, p in tagged:
                p.fail(-rc, "refused by the AIO context")

    def _collect(self) -> None:
        while True:
            with self._lock:
                if self._closing and not self._inflight:
                    return
            got = self.ctx.reap(1, native.AioContext.REAP_BATCH, REAP_TIMEOUT_NS)
            if isinstance(got, int):
                if got == -errno.EINTR:
                    continue
                self._abort(-got)
                return
            if not got:
                continue
            with self._lock:
                done = [(self._inflight.pop(tag), result, moved) for tag, result, moved in got]
            for piece, result, moved in done:
                piece.finish(result, moved)

    def _abort(self, err: int) -> None:
        # Reaping itself failed (a bug, not an I/O error): destroying the context waits for the
        # requests it holds; then every piece still registered is failed, none left hanging.
        with self._lock:
            self._closing = True
        self.ctx.destroy()
        with self._lock:
            pieces, self._inflight = list(self._inflight.values()), {}
        for piece in pieces:
            piece.fail(err, "collecting AIO completions failed")

    def close(self) -> None:
        with self._lock:
            self._closing = True
        self.ctx.wake()
        self._thread.join()
        self.ctx.destroy()


class LibaioBackend:
    name = "libaio"
    direct = True

    def __init__(self, queue_depth: int, threads: int, submit_batch: int = 1, background_depth: int = 0):
        self._rings: list[_Ring] = []
        try:
            for i in range(threads):
                self._rings.append(_Ring(queue_depth, submit_batch, f"offload-aio-{i}", background_depth))
        except BaseException:
            self.close()
            raise
        self._next = 0

    def submit(self, pieces: list[Piece], urgent: bool = False) -> None:
        """Queue ``pieces``; ``urgent`` ones (data compute waits for) pass every background one
        not yet in the kernel."""
        n = len(self._rings)
        if n == 1:
            self._rings[0].enqueue(pieces, urgent)
            return
        start, self._next = self._next, (self._next + len(pieces)) % n
        for i, ring in enumerate(self._rings):
            share = pieces[(i - start) % n::n]
            if share:
                ring.enqueue(share, urgent)

    def close(self) -> None:
        """Wait for every request queued so far, then free the contexts."""
        for ring in self._rings:
            ring.close()
        self._rings = []
