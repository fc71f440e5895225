"""The thread backend: a pool of workers doing blocking pread/pwrite (GIL released).

For filesystems without O_DIRECT, builds without libaio, or by choice. Files are opened
without O_DIRECT, so there is no alignment rule. Pool size = ``AioConfig.threads``.
"""

from __future__ import annotations

import errno
import queue
import threading

from .. import native
from .request import Piece


class ThreadBackend:
    name = "threads"
    direct = False

    def __init__(self, threads: int):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"offload-io-{i}", daemon=True)
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    def submit(self, pieces: list[Piece]) -> None:
        for p in pieces:
            self._queue.put(p)

    def _work(self) -> None:
        while True:
            piece = self._queue.get()
            if piece is None:
                return
            try:
                rc = native.pio(piece.fd, piece.op, piece.address, piece.length, piece.offset)
            except BaseException as exc:   # never leave a handle waiting forever
                piece.fail(errno.EIO, f"worker failed: {exc!r}")
                continue
            if rc == piece.length:
                piece.finish(rc, rc)
            elif rc < 0:
                piece.finish(rc, -1)
            else:
                piece.finish(-errno.EIO, rc)   # end of file before the end of the request

    def close(self) -> None:
        """Finish every request queued so far, then stop the workers."""
        for _ in self._workers:
            self._queue.put(None)
        for w in self._workers:
            w.join()
        self._workers = []
