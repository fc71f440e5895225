"""CUDA's stream sanitizer (CSAN) on the CPU: copy streams that check every access to device
memory is ordered after the last conflicting access from another stream.

``CheckedStreams`` has ``DeviceStreams``' protocol. It models three streams (compute, h2d, d2h)
with the vector clocks ``torch.cuda._sanitizer`` keeps: a copy is one launch on its direction's
stream, after the fences it was given; ``compute_wait`` orders compute after a fence; a host
wait (``synchronize``) orders every stream after it. ``query`` never orders anything (as in
CSAN) and always says "done": copies run at once, as on a GPU that keeps up, which is exactly
when code that skips a wait for a finished fence goes unordered.

Compute's accesses are seen by ``watching()``, a dispatch mode like CSAN's on the thread that
enters it and on the engine's threads: each op's tensor arguments in memory of the watched tier (``watch(tier)``: the
"device" tier of a CPU run with ``merge_host_tiers=False``) are reads, or writes where the op's
schema says so. Accesses are keyed by storage (a view anywhere in a chunk buffer is the buffer:
stricter than CSAN, which keys by the first byte). Memory the tier lets go is forgotten (CSAN
forgets deallocated memory). Every unordered pair is kept in ``races`` (a test asserts none).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

STREAMS = ("compute", "h2d", "d2h")
ENGINE_THREADS = "offload-"


@dataclass
class Access:
    write: bool
    stream: str
    seq: int
    what: str


class CheckedFence:
    """A recorded point of one stream (its vector clock then)."""

    def __init__(self, checker: "CheckedStreams", state: dict[str, int]):
        self._checker = checker
        self.state = dict(state)

    def query(self) -> bool:
        return True         # done, but the host is not thereby ordered after it (as in CSAN)

    def synchronize(self) -> None:
        self._checker.host_wait(self)


class CheckedStreams:
    """``CopyStreams`` that record accesses to watched memory and flag unordered ones."""

    def __init__(self):
        self.races: list[str] = []
        self.trace = False          # name each copy's caller in ``races`` (for debugging a race)
        self.copies = {"h2d": 0, "d2h": 0}
        self._mutex = threading.RLock()
        self._local = threading.local()
        self._seq = 0
        self._state = {s: {t: -1 for t in STREAMS} for s in STREAMS}
        self._watched: dict[int, dict] = {}     # storage address -> {"write": Access, "reads": [Access]}

    # ---- the memory watched ------------------------------------------------------------------
    def watch(self, tier) -> None:
        """Watch every buffer ``tier`` (a ``MemoryTier``) hands out from now on."""
        allocate = tier.allocate

        def watched_allocate(nbytes, *args, **kwargs):
            buf = allocate(nbytes, *args, **kwargs)
            address = buf.untyped_storage().data_ptr()
            with self._mutex:
                if address not in self._watched:
                    self._watched[address] = {"write": None, "reads": []}
                    weakref.finalize(buf, self._forget, address)
            return buf

        tier.allocate = watched_allocate

    def _forget(self, address: int) -> None:
        with self._mutex:
            self._watched.pop(address, None)

    @contextlib.contextmanager
    def watching(self):
        """Check compute's accesses made on the calling thread while inside, and on every thread
        the engine starts meanwhile (named ``offload-...``: the Adam worker, a checkpoint's
        fetches) for as long as it runs, as ``tests/gpu/conftest.py`` makes CSAN do."""
        original = threading.Thread.run

        def run(thread):
            if not thread.name.startswith(ENGINE_THREADS):
                return original(thread)
            with _ComputeAccesses(self):
                return original(thread)

        with mock.patch.object(threading.Thread, "run", run), _ComputeAccesses(self):
            yield

    # ---- the clocks --------------------------------------------------------------------------
    def _stream(self) -> str:
        return getattr(self._local, "stream", "compute")

    @contextlib.contextmanager
    def _on(self, stream: str):
        before = self._stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def _wait(self, stream: str, state: dict[str, int]) -> None:
        mine = self._state[stream]
        for s, seq in state.items():
            mine[s] = max(mine[s], seq)

    def launch(self, stream: str, reads, writes, what: str) -> None:
        """One kernel or copy on ``stream`` reading and writing these tensors."""
        with self._mutex:
            self._seq += 1
            self._state[stream][stream] = self._seq
            for t, write in [(t, False) for t in reads] + [(t, True) for t in writes]:
                entry = self._watched.get(t.untyped_storage().data_ptr())
                if entry is None:
                    continue
                access = Access(write, stream, self._seq, what)
                previous = [entry["write"]] + (entry["reads"] if write else [])
                for p in previous:
                    if p is not None and p.stream != stream and p.seq > self._state[stream][p.stream]:
                        self.races.append(f"{'write' if write else 'read'} by {what} on {stream} is not "
                                          f"ordered after the {'write' if p.write else 'read'} by {p.what} "
                                          f"on {p.stream}")
                if write:
                    entry["write"], entry["reads"] = access, []
                else:
                    entry["reads"].append(access)

    def host_wait(self, fence: CheckedFence) -> None:
        with self._mutex:
            for s in STREAMS:
                self._wait(s, fence.state)

    # ---- the CopyStreams protocol ------------------------------------------------------------
    def copy(self, dst, src, after, *, upload: bool, name: str = ""):
        stream = "h2d" if upload else "d2h"
        with self._mutex:
            self.copies[stream] += 1
            for fence in after:
                self._wait(stream, fence.state)
            self.launch(stream, [src], [dst], f"copy {name}" + (_caller() if self.trace else ""))
            with self._on("unwatched"):
                dst.copy_(src)
            return CheckedFence(self, self._state[stream])

    def compute_fence(self):
        with self._mutex:
            return CheckedFence(self, self._state["compute"])

    def compute_wait(self, fence) -> None:
        with self._mutex:
            self._wait("compute", fence.state)

    def on_compute(self):
        return self._on("compute")

    def capture(self) -> None:
        pass

    def receive(self, t) -> None:
        pass

    def close(self) -> None:
        pass


def _caller() -> str:
    import traceback

    frames = [f for f in traceback.extract_stack()[:-2] if "/offload/" in f.filename]
    return " from " + " < ".join(f"{f.name}:{f.lineno}" for f in reversed(frames[-6:]))


class _ComputeAccesses(TorchDispatchMode):
    """Each op issued on this thread is a launch on its current stream (compute by default)."""

    def __init__(self, checker: CheckedStreams):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        stream = self.checker._stream()
        if stream == "unwatched" or func is torch.ops.aten.record_stream.default:
            return out
        reads, writes = [], []
        schema = func._schema
        for i, argument in enumerate(schema.arguments):
            value = args[i] if i < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
            alias = argument.alias_info
            for t in tree_flatten(value)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                if alias is not None and alias.is_write:
                    writes.append(t)
                elif alias is None:
                    reads.append(t)         # a view (alias, no write) only reads metadata
        if not schema.name.endswith(("empty", "empty_strided", "empty_like")):
            results = out if isinstance(out, (tuple, list)) else (out,)
            for ret, t in zip(schema.returns, results):
                if isinstance(t, torch.Tensor) and ret.alias_info is None:
                    writes.append(t)
        self.checker.launch(stream, reads, writes, str(schema.name))
        return out
