"""The chunk store: every chunk of every kind, where its bytes live, and access to them.

Tiers are ordered from the compute device down to NVMe. A chunk may have a current copy on
several tiers at once (a parameter chunk fetched to the device keeps its clean copy below, so
evicting it costs nothing); a write on one tier invalidates the others. A chunk's last current
copy is never dropped: evicting it writes it one tier down first. Budgets are enforced by the
tiers; when one is full the store evicts by the policy, never a chunk that is pinned (COMPUTE)
or mid-move, and raises ``TierFullError`` naming the holders when nothing can go.

Every public method takes the store's lock for its whole run, waits on I/O included: one lock,
no lock-order puzzles. Prefetches are asynchronous (they return ``Move`` handles). How moves
run, how a full tier makes room and where each copy lives is the store's ``ChunkTraffic``
(``traffic.py``), which it builds with the records and the lock and calls under that lock.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from ..errors import ConfigError, StateError
from ..tiers.memory import MemoryTier
from ..tiers.moves import Move
from ..tiers.nvme import SLOT_ALIGN, NvmeSlot, NvmeTier
from ..tiers.streams import CopyStreams
from .contents import ChunkContents
from .policy import Policy
from .records import ChunkKey, ChunkRecord
from .report import by_direction, memory_report
from .states import CHUNK_TRANSITIONS, ChunkState, check_transition
from .traffic import ChunkTraffic


class ChunkStore(ChunkContents):
    """Chunks of several kinds over an ordered list of tiers (top = compute device), evicting by
    ``policy`` (``offload.scheduler``'s LRU or next-use policies). ``aliases``:
    other names for a tier (with no GPU, the engine's "device" and "cpu" are one tier of host
    memory); ``streams``, ``tracer``, ``on_free``, ``urgent_kinds``: see ``ChunkTraffic``."""

    def __init__(self, tiers: Sequence[MemoryTier | NvmeTier], policy: Policy, *,
                 aliases: dict[str, str] | None = None, streams: CopyStreams | None = None, tracer=None,
                 on_free: Callable[[ChunkKey, str], None] | None = None, urgent_kinds: frozenset[str] = frozenset()):
        if not tiers:
            raise ConfigError("tiers", tiers, "at least one tier is needed")
        self.tiers = {t.name: t for t in tiers}
        self.order = [t.name for t in tiers]
        if "nvme" in self.tiers and self.order[-1] != "nvme":
            raise ConfigError("tiers", self.order, "the NVMe tier must be the last (lowest) one")
        self.policy = policy
        self.aliases = dict(aliases or {})
        for alias, name in self.aliases.items():
            if name not in self.tiers or alias in self.tiers:
                raise ConfigError("aliases", f"{alias}->{name}", f"must name one of the tiers {self.order}")
        self.lock = threading.RLock()
        self.released = threading.Condition(self.lock)   # notified whenever a pin goes
        self.streams = streams      # read by whoever orders its own copies the store's way
        self.records: dict[ChunkKey, ChunkRecord] = {}
        self.traffic = ChunkTraffic(self.tiers, self.order, self.records, self.policy, self.released,
                                    streams=streams, tracer=tracer, on_free=on_free, urgent_kinds=urgent_kinds)

    # ---- registration ---------------------------------------------------
    def register(self, kind: str, count: int, numel: int, dtype: torch.dtype) -> list[ChunkKey]:
        """Add ``count`` chunks of ``numel`` elements of ``dtype`` under ``kind``; reserves NVMe slots."""
        return self.register_chunks(kind, {i: numel for i in range(count)}, dtype)

    def register_chunks(self, kind: str, numels: dict[int, int], dtype: torch.dtype, *,
                        nvme: bool = True) -> list[ChunkKey]:
        """Add chunks ``(kind, i)`` of ``numels[i]`` elements of ``dtype``; reserves NVMe slots.

        Indices may skip (frozen chunks have no gradient or optimizer state) and sizes may differ
        (an oversized parameter's own chunk). ``nvme=False``: no slots, never written down (chunks
        another rank owns, released once used; the 8-bit moments' scales, held in memory throughout)."""
        with self.lock:
            keys = [(kind, i) for i in numels]
            if any(k in self.records for k in keys):
                raise ConfigError("kind", kind, "is already registered")
            # Whole blocks for O_DIRECT: a chunk's 1/N piece need not end on one (tail unread).
            block = SLOT_ALIGN if "nvme" in self.tiers and nvme else 1
            sizes = [-(-n * dtype.itemsize // block) * block for n in numels.values()]
            slots: list[NvmeSlot | None] = [None] * len(keys)
            if "nvme" in self.tiers and keys and nvme:
                slots = self.tiers["nvme"].reserve_slots(kind, sizes)
            for key, numel, nbytes, slot in zip(keys, numels.values(), sizes, slots):
                self.records[key] = ChunkRecord(key, numel, dtype, nbytes, slot=slot)
            return keys

    def largest_bytes(self, kind: str) -> int:
        """Bytes of the largest chunk of ``kind`` (0 when none): a ``read_into`` buffer for any of them."""
        with self.lock:
            return max((r.nbytes for k, r in self.records.items() if k[0] == kind), default=0)

    def tier_name(self, tier: str) -> str:
        """The tier ``tier`` names (itself, or the tier it is an alias of)."""
        return self.aliases.get(tier, tier)

    def _rec(self, key: ChunkKey) -> ChunkRecord:
        try:
            return self.records[key]
        except KeyError:
            raise ConfigError("chunk", key, "is not registered") from None

    def _set_state(self, rec: ChunkRecord, new: ChunkState) -> None:
        rec.state = check_transition(CHUNK_TRANSITIONS, rec.state, new, f"chunk {rec.key}")

    # ---- life cycle -------------------------------------------------------
    def initialize(self, key: ChunkKey, tier: str, fill: Callable[[torch.Tensor], None] | None = None) -> None:
        """Give a FREE chunk storage on a memory ``tier``: zeros, or whatever ``fill(view)`` writes."""
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            if rec.state is not ChunkState.FREE:
                raise StateError(f"chunk {key} is already initialized ({rec.state.name})")
            self._memory_tier(tier)
            buf = self.traffic.allocate(tier, rec)
            view = rec.typed(buf)
            try:
                self.traffic.compute_adopts(tier, buf)
                with self.traffic.compute_owns(tier):
                    if fill is None:
                        view.zero_()
                    else:
                        fill(view)
            except BaseException:
                self.traffic.free_buffer(tier, buf, ())    # stays FREE; after what fill queued
                raise
            self.traffic.add_copy(rec, tier, buf, view)
            self.traffic.written(rec, tier)
            rec.version += 1
            self._set_state(rec, ChunkState.HOLD)

    def release_storage(self, key: ChunkKey) -> None:
        """Drop every copy (HOLD -> FREE); the NVMe slot stays reserved."""
        with self.lock:
            rec = self._rec(key)
            self.traffic.settle(rec)
            self._set_state(rec, ChunkState.FREE)
            for tier in list(rec.buffers):
                self.traffic.drop_copy(rec, tier)
            rec.nvme_valid = False

    def close(self) -> None:
        """Give every copy's buffer back and let the memory tiers go of their memory: the engine is
        closing and its values are gone (``OffloadEngine.close``). Moves under way finish first (a
        failed one too: its error is its waiter's); parameters viewing a buffer are detached as it
        goes (``on_free``)."""
        with self.lock:
            self.traffic.wait_idle(raise_failures=False)
            for rec in self.records.values():
                for tier in list(rec.buffers):
                    self.traffic.drop_copy(rec, tier)
                rec.pins.clear()
                rec.pin_threads.clear()
                rec.nvme_valid = False
                rec.state = ChunkState.FREE      # for good: whatever it was (a close mid-forward)
            # Host buffers that uploads still read were set aside by the drops: retired first, so
            # no tier unpins its arena under a copy still running.
            self.traffic.wait_idle(raise_failures=False)
            for tier in self.tiers.values():
                if isinstance(tier, MemoryTier):
                    tier.close()

    # ---- access -----------------------------------------------------------
    def fetch(self, key: ChunkKey, tier: str) -> Move | None:
        """Start the next hop that brings ``key`` towards ``tier``; None when it is already there.
        Asynchronous: call again after the returned move finishes to take the next hop."""
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            if rec.state is ChunkState.FREE:
                raise StateError(f"chunk {key} holds no data yet; initialize it first")
            if rec.has(tier):
                return None
            under_way, src, dst = self.traffic.hop(rec, tier)
            return under_way or self.traffic.start_move(rec, src, dst)

    def prefetch(self, key: ChunkKey, tier: str, *, soon: bool = False) -> Move | None:
        """Like ``fetch``, but only into free room or by evicting chunks needed later than ``key``.

        ``soon=True`` says the chunk is needed imminently although the policy's trace does not
        show it (the optimizer's next chunk): it then outranks everything not needed right now.
        Never waits and never raises for lack of room: a prefetch that cannot go now is skipped.
        """
        tier = self.tier_name(tier)
        with self.lock:
            rec = self.records.get(key)
            if rec is None or rec.state is ChunkState.FREE:
                return None
            if soon:        # also when already here: it must stay until used
                self.policy.hint_soon(key)
            if rec.has(tier):
                return None
            under_way, src, dst = self.traffic.hop(rec, tier)
            if under_way is not None or (self.traffic.gpu_tier(src) and rec.pins[src]):
                # Pinned on the GPU, compute may be writing it (a gradient chunk backward fills):
                # a copy read now would race those writes, to be thrown away as stale once released.
                return under_way
            if dst != "nvme" and not self.tiers[dst].can_allocate(rec.nbytes):
                # A "soon" chunk (the optimizer's next) may only push out what the policy's
                # soon_limit allows (with a trace: chunks the trace never uses).
                limit = self.policy.soon_limit() if soon else \
                    self.policy.rank(key) if self.policy.name == "next_use" else float("inf")
                if not self.traffic.make_room(dst, rec.nbytes, key, later_than=limit):
                    return None
            return self.traffic.start_move(rec, src, dst)

    def hint_soon(self, key: ChunkKey) -> None:
        """What ``prefetch(soon=True)`` says of ``key``, without a download: it is needed soon, so
        it is not written down to make room meanwhile (the optimizer's next gradient chunk, which
        backward is still filling: a copy read now would be stale)."""
        with self.lock:
            rec = self.records.get(key)
            if rec is not None and rec.state is not ChunkState.FREE:
                self.policy.hint_soon(key)

    def landed(self, key: ChunkKey, tier: str) -> bool:
        """Whether a current copy of ``key`` is on ``tier``, counting a move there whose bytes
        have landed (it is finished now: nobody has asked for it since it was started)."""
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            if rec.has(tier):
                return True
            pending = rec.incoming.get(tier)
            if pending is not None and pending[1].io_ready():
                pending[1].finish()
                return rec.has(tier)
            return False

    def ensure(self, key: ChunkKey, tier: str) -> None:
        """Bring a current copy of ``key`` onto ``tier`` and wait for it. The I/O is waited for
        outside the store's lock (when the caller does not hold it): other threads go on meanwhile."""
        tier = self.tier_name(tier)
        while True:
            with self.lock:
                move = self.fetch(key, tier)
                if move is None:
                    return
            try:
                move.wait_io()
            finally:
                with self.lock:
                    # Also when the I/O failed: the move is finished (its chunk forgets it), so the
                    # next access starts a new read rather than meet this one's error again.
                    move.finish()

    def access(self, key: ChunkKey, tier: str, *, overwrite: bool = False) -> torch.Tensor:
        """Pin ``key`` on a memory ``tier`` (COMPUTE) and return its typed view; pair with ``release``.

        ``overwrite=True`` promises the caller rewrites every byte it will ever read back: no
        copy is fetched, the old contents are dropped, and the chunk counts as written.
        """
        tier = self.tier_name(tier)
        self._memory_tier(tier)
        with self.lock:     # resident (each access while the model fits): one lock, no hops
            rec = self._rec(key)
            if not overwrite and tier in rec.buffers:
                return self._pin(rec, tier)
        # While this thread brings the chunk up hop by hop (waiting outside the lock), no other
        # thread's eviction may take it back down: that is how two threads thrash a small tier.
        with self.traffic.protect(key):
            while True:
                if not overwrite:
                    self.ensure(key, tier)
                with self.lock:
                    rec = self._rec(key)
                    if overwrite and not rec.has(tier):
                        self.traffic.settle(rec)
                        buf = self.traffic.allocate(tier, rec)
                        if tier in rec.buffers:          # someone brought it here while we made room
                            self.tiers[tier].free(buf)
                        else:
                            if rec.state is ChunkState.FREE:
                                self._set_state(rec, ChunkState.HOLD)
                            self.traffic.compute_adopts(tier, buf)
                            self.traffic.add_copy(rec, tier, buf)
                        self._modified(rec, tier)
                    if tier not in rec.buffers:
                        continue        # it left between the fetch and here: again
                    return self._pin(rec, tier)

    def _pin(self, rec: ChunkRecord, tier: str) -> torch.Tensor:     # access's pin, under the lock
        if tier in rec.readers:     # the caller may write it: after the copies still reading it
            self.traffic.quiesce(rec, tier)
        rec.pins[tier] += 1
        rec.pin_threads[threading.get_ident()] += 1
        if rec.state is ChunkState.HOLD:
            self._set_state(rec, ChunkState.COMPUTE)
        self.policy.on_access(rec.key)
        return rec.views[tier]

    def release(self, key: ChunkKey, tier: str, *, dirty: bool = False) -> None:
        """Unpin ``key`` from ``tier``; ``dirty=True`` says its bytes there were modified."""
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            if rec.pins[tier] <= 0:
                raise StateError(f"chunk {key} is not pinned on {tier!r}")
            if dirty:
                self._modified(rec, tier)
                self.traffic.written(rec, tier)
            rec.pins[tier] -= 1
            me = threading.get_ident()
            if (left := rec.pin_threads.pop(me, 0) - 1) > 0:
                rec.pin_threads[me] = left
            if not any(rec.pins.values()):      # a pin taken on one thread may be let go on another
                rec.pins.clear()
                rec.pin_threads.clear()
                self._set_state(rec, ChunkState.HOLD)
            self.released.notify_all()

    def start_writeback(self, key: ChunkKey) -> Move | None:
        """Start writing ``key``'s current copy down to NVMe now, so that evicting it later costs nothing."""
        with self.lock:
            return self.traffic.start_writeback(self._rec(key))

    def wait_idle(self) -> None:
        """``ChunkTraffic.wait_idle``: every move under way, and copies reading freed host buffers."""
        with self.lock:
            self.traffic.wait_idle()

    def view(self, key: ChunkKey, tier: str) -> torch.Tensor | None:
        """The typed view of a current copy on ``tier``, or None (no pin taken: use only under a pin)."""
        tier = self.tier_name(tier)
        with self.lock:
            return self._rec(key).views.get(tier)

    def evict(self, key: ChunkKey, tier: str) -> None:
        """Drop ``key``'s copy on ``tier``, writing it one tier down first if it is the last current
        copy (off a GPU the copy is only queued: the chunk is busy until it lands)."""
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            if tier == "nvme":
                raise StateError("the NVMe tier is the bottom: chunks are evicted *to* it, not from it")
            self.traffic.settle(rec)
            if tier not in rec.buffers:
                return
            if rec.pins[tier]:
                raise StateError(f"chunk {key} is in COMPUTE on {tier!r} and cannot be evicted")
            if rec.only_on(tier) and tier == self.order[-1]:
                raise StateError(f"chunk {key}: {tier!r} holds its only copy and there is no tier below "
                                 "to write it to (set nvme_paths)")
            self.traffic.evict(rec, tier)

    # ---- accounting -------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes per tier and kind, chunk counts, budget use, and bytes moved per direction."""
        with self.lock:
            return memory_report(self.tiers, self.records.values(), self.traffic.moved)

    def moved_by_direction(self) -> dict:
        """Bytes moved per direction ("cpu->nvme": n) since ``reset_counters``."""
        with self.lock:
            return by_direction(self.traffic.moved)

    def reset_counters(self) -> None:
        with self.lock:
            self.traffic.moved.clear()

    def moved_bytes(self) -> int:
        with self.lock:
            return sum(self.traffic.moved.values())

    # ---- internals --------------------------------------------------------
    def _memory_tier(self, tier: str) -> MemoryTier:
        t = self.tiers.get(tier)
        if not isinstance(t, MemoryTier):
            raise ConfigError("tier", tier, f"must be one of the memory tiers {self.traffic.memory_tiers}")
        return t

    def _modified(self, rec: ChunkRecord, tier: str) -> None:
        rec.version += 1
        for other, buf in list(rec.buffers.items()):
            if other != tier:
                if rec.pins[other]:
                    raise StateError(f"chunk {rec.key} was written on {tier!r} while pinned on {other!r}")
                self.traffic.drop_copy(rec, other)
        rec.nvme_valid = False
