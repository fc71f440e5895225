"""How chunks move between tiers, and how a full tier makes room: the part of the store that moves bytes.

A move is one hop between adjacent tiers (device <-> CPU by a copy, CPU <-> NVMe by AIO). It is
asynchronous: the chunk is busy (``incoming``) until the move is finished, and only then does
its new copy count. Making room on a full tier evicts by the eviction policy: a copy that is not
the last current one is dropped, the last one is written one tier down first (off a GPU, without
waiting: the copy is queued and the buffer's next user waits for it on the GPU). Nothing pinned,
protected or mid-move is evicted; when nothing can go, the caller waits for moves and pins, and
then ``TierFullError`` names who holds the tier (room-making lives in ``room.py``, a mixin).

``ChunkTraffic`` also owns where each copy lives (``resident``, ``add_copy``, ``drop_copy``) and
how work on a GPU tier is ordered against compute (``written``, ``compute_adopts``,
``compute_owns``). The store (``store.py``) builds one, hands it the records and its lock, and
calls it with that lock held: nothing here takes the lock itself.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from ..errors import OffloadError, StateError
from ..tiers.memory import MemoryTier
from ..tiers.moves import Move, copy_between
from ..tiers.nvme import NvmeTier
from ..tiers.streams import CopyStreams
from .policy import Policy
from .records import ChunkKey, ChunkRecord
from .room import RoomMaking

class ChunkTraffic(RoomMaking):
    """Moves, room-making and copy bookkeeping over ``tiers`` (ordered top down) for ``records``.

    ``released``: the store's condition (over its lock), notified whenever a pin goes.
    ``streams``: the CUDA copy streams when the top tier is a GPU (None: synchronous copies).
    ``tracer``: every move becomes a span on its own track. ``on_free(key, tier)`` is called
    just before a copy's buffer goes back to its tier (the engine detaches parameters viewing
    it). ``urgent_kinds``: kinds whose NVMe reads compute waits for; they pass the background
    traffic (write-backs, optimizer state) queued before them.
    """

    def __init__(self, tiers: dict[str, MemoryTier | NvmeTier], order: Sequence[str], records: dict,
                 policy: Policy, released: threading.Condition, *, streams: CopyStreams | None = None, tracer=None,
                 on_free: Callable[[ChunkKey, str], None] | None = None,
                 urgent_kinds: frozenset[str] = frozenset()):
        self.tiers = tiers
        self.order = list(order)
        self.records: dict[ChunkKey, ChunkRecord] = records
        self.policy = policy
        self.released = released
        self.streams = streams
        self.tracer = tracer
        self.on_free = on_free
        self.urgent_kinds = frozenset(urgent_kinds)
        self.memory_tiers = [n for n in self.order if isinstance(self.tiers[n], MemoryTier)]
        self.lowest_memory = self.memory_tiers[-1] if self.memory_tiers else None
        self.moved: Counter = Counter()       # (src, dst) -> bytes since the store's reset_counters()
        # tier -> keys holding a copy there (a dict for its insertion order: ties evict deterministically)
        self.resident: dict[str, dict] = {name: {} for name in self.order}
        # Chunks that an operation in progress is moving: making room for one move (which may
        # cascade into write-backs further down) must not evict the source of another.
        self.protected: Counter = Counter()
        # Asynchronous moves not yet finished: a chunk stays busy (not evictable) until its move
        # is finished, so room-making finishes the ones whose I/O is already done (``reap``).
        self.in_flight: set[Move] = set()
        # Host buffers given back while copies still read them: (tier, buffer, fences) (``_retire``).
        self._retiring: list[tuple[str, torch.Tensor, list]] = []

    @contextmanager
    def protect(self, key: ChunkKey) -> Iterator[None]:
        """While inside, room-making never evicts ``key`` (the caller is moving or pinning it).
        Takes the store's (reentrant) lock only to count: the caller may wait outside it."""
        with self.released:
            self.protected[key] += 1
        try:
            yield
        finally:
            with self.released:
                self.protected[key] -= 1
                if not self.protected[key]:
                    del self.protected[key]

    def allocate(self, tier: str, rec: ChunkRecord) -> torch.Tensor:
        """A buffer for ``rec`` on ``tier``, making room first. A reused GPU buffer keeps its
        fences in the tier: a copy into it waits for them on its stream, compute through
        ``_compute_adopts``."""
        with self.protect(rec.key):
            self.make_room(tier, rec.nbytes, rec.key)
            return self.tiers[tier].allocate(rec.nbytes, lambda: self.holders(tier))

    def hop(self, rec: ChunkRecord, target: str) -> tuple[Move | None, str, str]:
        """The next hop (src, dst) that brings ``rec`` towards ``target``, from its closest
        current copy, and the move already under way to ``target`` or ``dst`` (else None)."""
        if target in rec.incoming:
            return rec.incoming[target][1], target, target
        if not rec.valid:
            # Evicted from the GPU with its download still under way (``_evict``): the move
            # holds the only copy, and the next hop starts from where it lands.
            if not rec.incoming:
                raise StateError(f"chunk {rec.key} has no current copy left: the copy writing it "
                                 "down from the device failed")
            move = next(iter(rec.incoming.values()))[1]
            return move, move.src, move.dst
        ti = self.order.index(target)
        src = min(rec.valid, key=lambda t: (abs(self.order.index(t) - ti), self.order.index(t)))
        si = self.order.index(src)
        dst = self.order[si - 1 if si > ti else si + 1]
        return (rec.incoming[dst][1] if dst in rec.incoming else None), src, dst

    def start_move(self, rec: ChunkRecord, src: str, dst: str) -> Move:
        fence = None        # a CUDA copy's end, while it may still be running
        if dst == "nvme":
            buf = None
            version = rec.version
            move = self.tiers["nvme"].write(rec.slot, rec.buffers[src], src)
        else:
            buf = self.allocate(dst, rec)
            # Making room may have waited (lock released): another thread may have moved or
            # written this chunk meanwhile. Then this move is moot; the caller fetches again.
            if dst in rec.incoming or rec.has(dst) or not rec.has(src):
                self.tiers[dst].free(buf)
                return rec.incoming[dst][1] if dst in rec.incoming else Move(src, dst, 0, None)
            version = rec.version
            if src == "nvme":
                move = self.tiers["nvme"].read(rec.slot, buf, dst, urgent=rec.key[0] in self.urgent_kinds)
            else:
                move, fence = self._copy(rec, buf, src, dst)

        started = time.perf_counter()

        def done() -> None:
            self.in_flight.discard(move)
            rec.incoming.pop(dst, None)
            self.moved[(src, dst)] += rec.nbytes
            if self.tracer is not None:
                cat = "nvme" if "nvme" in (src, dst) else "copy"
                self.tracer.complete(f"{rec.key[0]}{rec.key[1]} {src}->{dst}", cat, started,
                                     time.perf_counter(), f"{src}->{dst}", bytes=rec.nbytes)
            if rec.version != version:       # written meanwhile: this copy is stale
                if buf is not None:
                    self.free_buffer(dst, buf, [fence] if fence is not None else [])
                return
            if dst == "nvme":
                rec.nvme_valid = True
            else:
                self.add_copy(rec, dst, buf)

        def failed() -> None:
            self.in_flight.discard(move)
            rec.incoming.pop(dst, None)
            if buf is not None:
                self.tiers[dst].free(buf)

        move.on_done, move.on_fail = done, failed
        rec.incoming[dst] = (buf, move)
        if move.synchronous:   # a CPU copy already done: settle it now
            move.finish()
        else:
            self.in_flight.add(move)
        return move

    def _copy(self, rec: ChunkRecord, buf: torch.Tensor, src: str, dst: str):
        """Start copying ``rec``'s copy on ``src`` into ``buf`` on ``dst``: ``(move, fence)``, the
        fence being None for a synchronous host copy."""
        n = rec.nbytes
        if not (self.gpu_tier(src) or self.gpu_tier(dst)):
            return copy_between(buf[:n], rec.buffers[src][:n], src, dst), None
        upload = self.gpu_tier(dst)
        # The buffer's last users and the work that wrote the source come first; nothing else.
        after = self.tiers[dst].take_fences(buf) if upload else []
        if src in rec.ready:
            after.append(rec.ready[src])
        move, fence = copy_between(buf[:n], rec.buffers[src][:n], src, dst, streams=self.streams,
                                   upload=upload, after=after, name=f"{rec.key[0]}{rec.key[1]}")
        self._add_reader(rec, src, fence)
        if upload:
            rec.ready[dst] = fence
        return move, fence

    def gpu_tier(self, tier: str) -> bool:
        """Whether ``tier`` is the compute device of a CUDA run (its copies run on streams)."""
        return self.streams is not None and tier == self.order[0]

    @staticmethod
    def _add_reader(rec: ChunkRecord, tier: str, fence) -> None:
        live = [f for f in rec.readers.get(tier, ()) if not f.query()]
        live.append(fence)
        rec.readers[tier] = live

    def quiesce(self, rec: ChunkRecord, tier: str) -> None:
        """Order whoever may write ``rec``'s copy on ``tier`` next after the copies in flight reading
        it: the host waits (rarely: uploads go well ahead of the writes after them); on a GPU tier
        (a download started ahead), compute waits on the GPU and the readers stay (``free_buffer``)."""
        if self.gpu_tier(tier):
            for fence in rec.readers.get(tier, ()):
                self.streams.compute_wait(fence)
            return
        for fence in rec.readers.pop(tier, ()):
            fence.synchronize()

    def free_buffer(self, tier: str, buf: torch.Tensor, readers) -> None:
        """Give ``buf`` back to ``tier`` once nothing in flight uses it, without the host waiting
        for the GPU. On the GPU its next user's stream waits for the fences (and for the compute
        queued so far). A host buffer's next user may be the host itself (the CPU Adam, an NVMe
        read), which no fence can order: one that copies still read is held back, still counted
        in its tier's use, until they are done (``_retire``)."""
        if self.gpu_tier(tier):
            self.tiers[tier].free(buf, [*readers, self.streams.compute_fence()])
            return
        pending = [f for f in readers if not f.query()]
        if pending:
            self._retiring.append((tier, buf, pending))
        else:
            self.tiers[tier].free(buf)

    def _retire(self, wait_on: str | None = None) -> bool:
        """Give back the held-back host buffers whose copies are done; True if any went.
        ``wait_on``: that tier is full and nothing else can go, so the host waits for its oldest
        held-back buffer first (the last resort: an upload still reading it, seldom long)."""
        if wait_on is not None:
            for fence in next((f for t, _, f in self._retiring if t == wait_on), ()):
                fence.synchronize()
        keep = []
        for tier, buf, fences in self._retiring:
            if all(f.query() for f in fences):
                self.tiers[tier].free(buf)
            else:
                keep.append((tier, buf, fences))
        freed = len(keep) < len(self._retiring)
        self._retiring = keep
        return freed

    def reap(self) -> None:
        """Finish the moves whose I/O is done (their chunks become evictable); retire host buffers."""
        for move in [m for m in self.in_flight if m.io_ready()]:
            move.finish()
        self._retire()

    def wait_idle(self, *, raise_failures: bool = True) -> None:
        """Wait for and finish every move under way, and the copies still reading freed host buffers.
        ``raise_failures=False`` (closing): a failed move is finished all the same, its error left
        to whoever waits for it (or to the NVMe tier's record of it)."""
        while self.in_flight:
            try:
                next(iter(self.in_flight)).wait()
            except OffloadError:
                if raise_failures:
                    raise
        while self._retiring:
            self._retire(wait_on=self._retiring[0][0])

    def settle(self, rec: ChunkRecord) -> None:
        """Wait for every move into or out of ``rec`` to finish."""
        while rec.incoming:
            _, move = next(iter(rec.incoming.values()))
            move.wait()

    def start_writeback(self, rec: ChunkRecord) -> Move | None:
        """Start writing ``rec``'s current copy from the lowest memory tier to NVMe, asynchronously,
        so that evicting it later costs nothing. None when there is nothing to do."""
        low = self.lowest_memory
        if "nvme" not in self.tiers or rec.slot is None or rec.nvme_valid or rec.busy or low not in rec.buffers:
            return None
        return self.start_move(rec, low, "nvme")

    # ---- copies and their order against compute -------------------------------------------------
    def add_copy(self, rec: ChunkRecord, tier: str, buf: torch.Tensor, view: torch.Tensor | None = None) -> None:
        rec.buffers[tier] = buf
        rec.views[tier] = rec.typed(buf) if view is None else view
        self.resident[tier][rec.key] = None

    def drop_copy(self, rec: ChunkRecord, tier: str) -> None:
        """Give a copy's buffer back to its tier; tell ``on_free`` first (views into it must go)."""
        if self.on_free is not None:
            self.on_free(rec.key, tier)
        rec.ready.pop(tier, None)
        self.free_buffer(tier, rec.buffers.pop(tier), rec.readers.pop(tier, ()))
        del rec.views[tier]
        self.resident[tier].pop(rec.key, None)

    def written(self, rec: ChunkRecord, tier: str) -> None:
        """``rec``'s copy on ``tier`` was just written: on a GPU, copies out of it wait for compute."""
        if self.gpu_tier(tier):
            rec.ready[tier] = self.streams.compute_fence()

    def compute_adopts(self, tier: str, buf: torch.Tensor) -> None:
        """Compute, about to write a fresh GPU buffer, first waits for the fences it was freed with."""
        if self.gpu_tier(tier):
            for fence in self.tiers[tier].take_fences(buf):
                self.streams.compute_wait(fence)

    @contextmanager
    def compute_owns(self, tier: str) -> Iterator[None]:
        """Device work on ``tier`` issued inside runs on the compute stream, whichever thread
        issues it (the Adam worker, a checkpoint writer, autograd's thread)."""
        if not self.gpu_tier(tier):
            yield
            return
        with self.streams.on_compute():
            yield
