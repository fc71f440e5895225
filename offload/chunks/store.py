"""The chunk store: every chunk of every kind, where its bytes live, and access to them.

Tiers are ordered from the compute device down to NVMe. A chunk may have a current copy on
several tiers at once (a parameter chunk fetched to the device keeps its clean copy below, so
evicting it costs nothing); a write on one tier invalidates the others. A chunk's last current
copy is never dropped: evicting it writes it one tier down first. Budgets are enforced by the
tiers; when one is full the store evicts by the policy, never a chunk that is pinned (COMPUTE)
or mid-move, and raises ``TierFullError`` naming the holders when nothing can go.

Every public method takes the store's lock for its whole run, waits on I/O included: one lock,
no lock-order puzzles. Prefetches are asynchronous (they return ``Move`` handles). How moves
run and how a full tier makes room is the other half, in ``traffic.py``.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from ..errors import ConfigError, StateError
from ..scheduler.eviction import EvictionPolicy, LRUPolicy
from ..tiers.memory import MemoryTier
from ..tiers.moves import Move
from ..tiers.nvme import NvmeSlot, NvmeTier
from .records import ChunkKey, ChunkRecord
from .states import CHUNK_TRANSITIONS, ChunkState, check_transition
from .traffic import ChunkTraffic


class ChunkStore(ChunkTraffic):
    """Chunks of several kinds over an ordered list of tiers (top = compute device)."""

    def __init__(self, tiers: Sequence[MemoryTier | NvmeTier], policy: EvictionPolicy | None = None, *,
                 aliases: dict[str, str] | None = None):
        if not tiers:
            raise ConfigError("tiers", tiers, "at least one tier is needed")
        self.tiers = {t.name: t for t in tiers}
        self.order = [t.name for t in tiers]
        if "nvme" in self.tiers and self.order[-1] != "nvme":
            raise ConfigError("tiers", self.order, "the NVMe tier must be the last (lowest) one")
        self.policy = policy or LRUPolicy()
        # Kinds whose NVMe reads compute waits for (the engine's parameters): they pass the
        # background traffic (write-backs, optimizer state) queued before them.
        self.urgent_kinds: frozenset[str] = frozenset()
        # Other names callers may use for a tier: with no GPU, the engine's "device" and "cpu"
        # are one tier of host memory (see OffloadEngine).
        self.aliases = dict(aliases or {})
        for alias, name in self.aliases.items():
            if name not in self.tiers or alias in self.tiers:
                raise ConfigError("aliases", f"{alias}->{name}", f"must name one of the tiers {self.order}")
        self.lock = threading.RLock()
        self.released = threading.Condition(self.lock)   # notified whenever a pin goes
        self.tracer = None      # an offload.tracer.Tracer: every move becomes a span on its own track
        # Called as on_free(key, tier) just before a copy's buffer goes back to its tier (under the
        # lock): the engine keeps parameters viewing idle chunks and detaches them here.
        self.on_free = None
        # The CUDA streams copies run on (offload.tiers.streams), when the top tier is a GPU.
        self.streams = None
        self.records: dict[ChunkKey, ChunkRecord] = {}
        self.moved: Counter = Counter()       # (src, dst) -> bytes since reset_counters()
        # tier -> keys holding a copy there (a dict for its insertion order: ties evict deterministically)
        self.resident: dict[str, dict] = {name: {} for name in self.order}
        # Chunks that an operation in progress is moving: making room for one move (which may
        # cascade into write-backs further down) must not evict the source of another.
        self._protected: Counter = Counter()
        # Asynchronous moves not yet finished: a chunk stays busy (not evictable) until its move
        # is finished, so room-making finishes the ones whose I/O is already done (``_reap``).
        self._in_flight: set[Move] = set()
        # Host buffers given back while copies still read them: (tier, buffer, fences) (``_retire``).
        self._retiring: list[tuple[str, torch.Tensor, list]] = []

    # ---- registration ---------------------------------------------------
    def register(self, kind: str, count: int, numel: int, dtype: torch.dtype) -> list[ChunkKey]:
        """Add ``count`` chunks of ``numel`` elements of ``dtype`` under ``kind``; reserves NVMe slots."""
        return self.register_chunks(kind, {i: numel for i in range(count)}, dtype)

    def register_chunks(self, kind: str, numels: dict[int, int], dtype: torch.dtype, *,
                        nvme: bool = True) -> list[ChunkKey]:
        """Add chunks ``(kind, i)`` of ``numels[i]`` elements of ``dtype``; reserves NVMe slots.

        Indices may skip (frozen chunks have no gradient or optimizer state) and sizes may differ
        (an oversized parameter's own chunk). ``nvme=False``: no slots (chunks another rank owns,
        held only while pinned, then released: they are never written down)."""
        with self.lock:
            keys = [(kind, i) for i in numels]
            if any(k in self.records for k in keys):
                raise ConfigError("kind", kind, "is already registered")
            sizes = [n * dtype.itemsize for n in numels.values()]
            slots: list[NvmeSlot | None] = [None] * len(keys)
            if "nvme" in self.tiers and keys and nvme:
                slots = self.tiers["nvme"].reserve_slots(kind, sizes)
            for key, numel, nbytes, slot in zip(keys, numels.values(), sizes, slots):
                self.records[key] = ChunkRecord(key, numel, dtype, nbytes, slot=slot)
            return keys

    def largest_bytes(self, kind: str) -> int:
        """Bytes of the largest chunk of ``kind`` (0 when none is registered): a ``read_into``
        buffer of this size serves every chunk of the kind."""
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
            buf = self._allocate(tier, rec)
            view = self._typed(buf, rec)
            try:
                self._compute_adopts(tier, buf)
                with self._compute_owns(tier):
                    if fill is None:
                        view.zero_()
                    else:
                        fill(view)
            except BaseException:
                self.tiers[tier].free(buf)        # the chunk stays FREE, its budget unspent
                raise
            self._add_copy(rec, tier, buf, view)
            self._written(rec, tier)
            rec.version += 1
            self._set_state(rec, ChunkState.HOLD)

    def release_storage(self, key: ChunkKey) -> None:
        """Drop every copy (HOLD -> FREE); the NVMe slot stays reserved."""
        with self.lock:
            rec = self._rec(key)
            self._settle(rec)
            self._set_state(rec, ChunkState.FREE)
            for tier in list(rec.buffers):
                self._drop_copy(rec, tier)
            rec.nvme_valid = False

    # ---- access -----------------------------------------------------------
    def fetch(self, key: ChunkKey, tier: str) -> Move | None:
        """Start the next hop that brings ``key`` towards ``tier``; None when it is already there.

        Asynchronous: call again after the returned move finishes to take the next hop.
        """
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            if rec.state is ChunkState.FREE:
                raise StateError(f"chunk {key} holds no data yet; initialize it first")
            if rec.has(tier):
                return None
            under_way, src, dst = self._hop(rec, tier)
            return under_way or self._start_move(rec, src, dst)

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
            under_way, src, dst = self._hop(rec, tier)
            if under_way is not None:
                return under_way
            if dst != "nvme" and not self.tiers[dst].can_allocate(rec.nbytes):
                # A "soon" chunk (the optimizer's next) may only push out what the policy's
                # soon_limit allows (with a trace: chunks the trace never uses).
                limit = self.policy.soon_limit() if soon else \
                    self.policy.rank(key) if self.policy.name == "next_use" else float("inf")
                if not self._make_room(dst, rec.nbytes, key, later_than=limit):
                    return None
            return self._start_move(rec, src, dst)

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
        """Bring a current copy of ``key`` onto ``tier`` and wait for it.

        The I/O is waited for outside the store's lock (when the caller does not hold it), so
        other threads keep fetching and evicting meanwhile.
        """
        tier = self.tier_name(tier)
        while True:
            with self.lock:
                move = self.fetch(key, tier)
                if move is None:
                    return
            move.wait_io()
            with self.lock:
                move.finish()

    def access(self, key: ChunkKey, tier: str, *, overwrite: bool = False) -> torch.Tensor:
        """Pin ``key`` on a memory ``tier`` (COMPUTE) and return its typed view; pair with ``release``.

        ``overwrite=True`` promises the caller rewrites every byte it will ever read back: no
        copy is fetched, the old contents are dropped, and the chunk counts as written.
        """
        tier = self.tier_name(tier)
        self._memory_tier(tier)
        # While this thread brings the chunk up hop by hop (waiting outside the lock), no other
        # thread's eviction may take it back down: that is how two threads thrash a small tier.
        with self.lock:
            self._protected[key] += 1
        try:
            while True:
                if not overwrite:
                    self.ensure(key, tier)
                with self.lock:
                    rec = self._rec(key)
                    if overwrite and not rec.has(tier):
                        self._settle(rec)
                        buf = self._allocate(tier, rec)
                        if tier in rec.buffers:          # someone brought it here while we made room
                            self.tiers[tier].free(buf)
                        else:
                            if rec.state is ChunkState.FREE:
                                self._set_state(rec, ChunkState.HOLD)
                            self._compute_adopts(tier, buf)
                            self._add_copy(rec, tier, buf)
                        self._modified(rec, tier)
                    if tier not in rec.buffers:
                        continue        # it left between the fetch and here: again
                    if not self._gpu_tier(tier) and tier in rec.readers:
                        self._quiesce(rec, tier)        # the caller may write it on the host
                    rec.pins[tier] += 1
                    rec.pin_threads[threading.get_ident()] += 1
                    if rec.state is ChunkState.HOLD:
                        self._set_state(rec, ChunkState.COMPUTE)
                    self.policy.on_access(key)
                    return rec.views[tier]
        finally:
            with self.lock:
                self._protected[key] -= 1
                if not self._protected[key]:
                    del self._protected[key]

    def release(self, key: ChunkKey, tier: str, *, dirty: bool = False) -> None:
        """Unpin ``key`` from ``tier``; ``dirty=True`` says its bytes there were modified."""
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            if rec.pins[tier] <= 0:
                raise StateError(f"chunk {key} is not pinned on {tier!r}")
            if dirty:
                self._modified(rec, tier)
                self._written(rec, tier)
            rec.pins[tier] -= 1
            me = threading.get_ident()
            rec.pin_threads[me] -= 1
            if rec.pin_threads[me] <= 0:
                del rec.pin_threads[me]
            if not any(rec.pins.values()):
                rec.pins.clear()
                self._set_state(rec, ChunkState.HOLD)
            self.released.notify_all()

    def view(self, key: ChunkKey, tier: str) -> torch.Tensor | None:
        """The typed view of a current copy on ``tier``, or None (no pin taken: use only under a pin)."""
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            return rec.views.get(tier)

    def evict(self, key: ChunkKey, tier: str) -> None:
        """Drop ``key``'s copy on ``tier``, writing it one tier down first if it is the last current
        copy (off a GPU the copy is only queued: the chunk is busy until it lands)."""
        tier = self.tier_name(tier)
        with self.lock:
            rec = self._rec(key)
            if tier == "nvme":
                raise StateError("the NVMe tier is the bottom: chunks are evicted *to* it, not from it")
            self._settle(rec)
            if tier not in rec.buffers:
                return
            if rec.pins[tier]:
                raise StateError(f"chunk {key} is in COMPUTE on {tier!r} and cannot be evicted")
            if rec.only_on(tier) and tier == self.order[-1]:
                raise StateError(f"chunk {key}: {tier!r} holds its only copy and there is no tier below "
                                 "to write it to (set nvme_paths)")
            self._evict(rec, tier)

    def read(self, key: ChunkKey) -> torch.Tensor:
        """A CPU copy of the chunk's current contents, from whichever tier holds them (no state change)."""
        return self.read_into(key, self.staging_buffers(self.staging_bytes(key), count=1)[0])

    def staging_buffers(self, nbytes: int, count: int = 2) -> list[torch.Tensor]:
        """Reusable chunk buffers for ``read_into`` (page-aligned when NVMe reads go straight into
        them), touched now so their first use does not pay for page faults."""
        if "nvme" in self.tiers:
            from ..aio import aligned_empty

            return [aligned_empty(nbytes, torch.uint8, populate=True) for _ in range(count)]
        return [torch.zeros(nbytes, dtype=torch.uint8, device="cpu") for _ in range(count)]

    def read_into(self, key: ChunkKey, out: torch.Tensor) -> torch.Tensor:
        """``read`` without allocating: copy the chunk's current contents into ``out`` and return its
        typed view. ``out``: a CPU uint8 tensor of at least ``staging_bytes(key)`` bytes, page-aligned
        (``offload.aio.aligned_empty``) when the chunk may be on NVMe only, as it is read straight in."""
        with self.lock:
            rec = self._rec(key)
            self._settle(rec)
            if rec.state is ChunkState.FREE:
                raise StateError(f"chunk {key} holds no data")
            typed = self._typed(out, rec)
            for tier in self.order:
                if tier in rec.buffers:
                    with self._compute_owns(tier):
                        typed.copy_(rec.views[tier])
                    return typed
            self.tiers["nvme"].read(rec.slot, out[: rec.slot.nbytes]).wait()
            self.moved[("nvme", "host")] += rec.nbytes
            return typed

    def staging_bytes(self, key: ChunkKey) -> int:
        """Bytes a ``read_into`` buffer for ``key`` needs (its chunk's size; NVMe slots hold exactly
        that; an oversized parameter's chunk is larger than the others: see ``largest_bytes``)."""
        return self._rec(key).nbytes

    def write(self, key: ChunkKey, data: torch.Tensor) -> None:
        """Overwrite a chunk's contents from a tensor (``numel`` elements) wherever it is best held."""
        with self.lock:
            rec = self._rec(key)
            tier = self._write_tier(rec)
            if rec.state is ChunkState.FREE:
                self.initialize(key, tier, lambda v: v.copy_(data.reshape(-1)))
                return
            view = self.access(key, tier, overwrite=True)
            try:
                with self._compute_owns(tier):
                    view.copy_(data.reshape(-1))
            finally:
                self.release(key, tier, dirty=True)

    def _write_tier(self, rec: ChunkRecord) -> str:
        for tier in self.order:
            if tier in rec.buffers:
                return tier
        return self._lowest_memory_tier()

    # ---- accounting -------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes per tier and kind, chunk counts, budget use, and bytes moved per direction."""
        with self.lock:
            tiers: dict[str, dict] = {}
            for name, tier in self.tiers.items():
                info = tier.describe()
                by_kind: Counter = Counter()
                counts: Counter = Counter()
                for rec in self.records.values():
                    if rec.has(name):
                        by_kind[rec.key[0]] += rec.nbytes
                        counts[rec.key[0]] += 1
                info["bytes_by_kind"] = dict(by_kind)
                info["chunks_by_kind"] = dict(counts)
                info["use"] = info["reserved"] / info["budget"] if info["budget"] else 0.0
                tiers[name] = info
            states = Counter(rec.state.name for rec in self.records.values())
            return {
                "tiers": tiers,
                "chunks": len(self.records),
                "chunk_states": dict(states),
                "moved_bytes": self.moved_by_direction(),
            }

    def moved_by_direction(self) -> dict:
        """Bytes moved per direction ("cpu->nvme": n) since ``reset_counters``."""
        with self.lock:
            return {f"{s}->{d}": n for (s, d), n in sorted(self.moved.items())}

    def reset_counters(self) -> None:
        with self.lock:
            self.moved.clear()

    def moved_bytes(self) -> int:
        with self.lock:
            return sum(self.moved.values())

    # ---- internals --------------------------------------------------------
    def _memory_tier(self, tier: str) -> MemoryTier:
        t = self.tiers.get(tier)
        if not isinstance(t, MemoryTier):
            raise ConfigError("tier", tier, f"must be one of the memory tiers {self._memory_names()}")
        return t

    def _memory_names(self) -> list[str]:
        return [n for n in self.order if isinstance(self.tiers[n], MemoryTier)]

    def _lowest_memory_tier(self) -> str:
        return self._memory_names()[-1]

    @staticmethod
    def _typed(buf: torch.Tensor, rec: ChunkRecord) -> torch.Tensor:
        return buf[: rec.nbytes].view(rec.dtype)[: rec.numel]

    def _modified(self, rec: ChunkRecord, tier: str) -> None:
        rec.version += 1
        for other, buf in list(rec.buffers.items()):
            if other != tier:
                if rec.pins[other]:
                    raise StateError(f"chunk {rec.key} was written on {tier!r} while pinned on {other!r}")
                self._drop_copy(rec, other)
        rec.nvme_valid = False

    def _drop_copy(self, rec: ChunkRecord, tier: str) -> None:
        """Give a copy's buffer back to its tier; tell ``on_free`` first (views into it must go)."""
        if self.on_free is not None:
            self.on_free(rec.key, tier)
        rec.ready.pop(tier, None)
        self._free_buffer(tier, rec.buffers.pop(tier), rec.readers.pop(tier, ()))
        del rec.views[tier]
        self.resident[tier].pop(rec.key, None)

    def _written(self, rec: ChunkRecord, tier: str) -> None:
        """The caller just wrote ``rec``'s copy on ``tier``: on a GPU, a copy out of it must wait
        for the compute queued so far."""
        if self._gpu_tier(tier):
            rec.ready[tier] = self.streams.compute_fence()

    def _compute_adopts(self, tier: str, buf: torch.Tensor) -> None:
        """A fresh buffer on a GPU tier is about to be written by compute: compute first waits for
        its last users (the fences it was freed with)."""
        if self._gpu_tier(tier):
            for fence in self.tiers[tier].take_fences(buf):
                self.streams.compute_wait(fence)

    @contextmanager
    def _compute_owns(self, tier: str) -> Iterator[None]:
        """Device work on ``tier`` issued inside runs on the compute stream, whichever thread
        issues it (the Adam worker, a checkpoint writer, autograd's thread)."""
        if not self._gpu_tier(tier):
            yield
            return
        with self.streams.on_compute():
            yield

    def _add_copy(self, rec: ChunkRecord, tier: str, buf: torch.Tensor, view: torch.Tensor | None = None) -> None:
        rec.buffers[tier] = buf
        rec.views[tier] = self._typed(buf, rec) if view is None else view
        self.resident[tier][rec.key] = None
