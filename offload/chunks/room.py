"""Making room on a full tier: which chunks may leave, which go (the eviction policy), waiting
for moves and pins when none may, and ``TierFullError`` naming the holders when nothing comes
free. A mixin of ``ChunkTraffic`` (``traffic.py``): it runs on the traffic's records, tiers,
policy and in-flight moves, under the store's lock like the rest of it."""

from __future__ import annotations

import threading
from typing import Hashable

from ..errors import TierFullError
from .records import ChunkRecord
from .report import tier_holders

# How long making room waits for another thread (the optimizer worker) to unpin chunks before
# declaring the tier full.
PIN_WAIT_S = 60.0


class RoomMaking:
    """Room-making for ``ChunkTraffic`` (which holds ``tiers``, ``order``, ``records``, ``resident``,
    ``protected``, ``policy``, ``in_flight``, ``released`` and the moves these call)."""

    def _evictable(self, tier: str, exclude: Hashable) -> list:
        """Keys of the chunks that may leave ``tier`` now: not ``exclude``, protected, pinned there
        or mid-move; the last current copy only if there is a tier below to write it to (and a
        slot there, when that tier is NVMe: chunks of other ranks have none). One pass with the
        checks inlined: it runs on every eviction and on every prefetch that meets a full tier,
        over every chunk the tier holds.

        Chunks with a current copy elsewhere come first: the policy's choice is a stable sort, so
        among chunks it ranks alike a clean one leaves, for free, before one that must be written
        down. Ties are common: every chunk the trace never uses ranks at infinity, a gradient
        waiting for the optimizer and state it has updated and written back alike (CI saw such a
        gradient written to NVMe because the tier happened to hold it first)."""
        records, protected = self.records, self.protected
        below = self.order.index(tier) + 1
        below_ok = below < len(self.order)
        below_nvme = below_ok and self.order[below] == "nvme"
        clean, last_copies = [], []
        for key in self.resident[tier]:
            rec = records[key]
            if rec.incoming or key == exclude or key in protected or rec.pins.get(tier):
                continue
            buffers = rec.buffers
            if tier not in buffers:
                continue
            if rec.nvme_valid or len(buffers) > 1:
                clean.append(key)
            elif below_ok and (not below_nvme or rec.slot is not None):
                last_copies.append(key)
        return clean + last_copies

    def make_room(self, tier: str, nbytes: int, exclude: Hashable, later_than: float | None = None) -> bool:
        """Evict from ``tier`` until ``nbytes`` fit. With ``later_than`` (a prefetch) only chunks the
        policy ranks beyond it may go, nothing is waited for, and False means "no room"."""
        t = self.tiers[tier]
        if not t.can_allocate(nbytes):
            self.reap()
        while not t.can_allocate(nbytes):
            candidates = self._evictable(tier, exclude)
            if later_than is not None:
                candidates = [k for k in candidates if self.policy.rank(k) > later_than]
                if sum(self.records[k].nbytes for k in candidates) < nbytes - t.free_bytes:
                    return False
            if not candidates and later_than is None:
                # Host buffers that uploads still read come back once those are done; chunks
                # mid-move become evictable once moved; chunks pinned elsewhere, once let go.
                if self._retire(wait_on=tier):
                    continue
                moving = [m for r in self.records.values() if tier in r.buffers or tier in r.incoming
                          for _, m in r.incoming.values()]
                if moving:
                    moving[0].wait()
                    continue
                if t.fits_outside_arena(nbytes):    # the bytes are free, only not contiguous
                    return True
                if self._pinned_elsewhere(tier) and self.released.wait(timeout=PIN_WAIT_S):
                    continue
                raise TierFullError(tier, t.budget, t.in_use, nbytes, self.holders(tier))
            if not candidates:
                return False
            victims = self.policy.choose(candidates, t.shortfall(nbytes), lambda k: self.records[k].nbytes)
            if later_than is None and self._wait_for_writeback(tier, victims):
                continue
            for key in victims:
                self.evict(self.records[key], tier)
                if t.can_allocate(nbytes):
                    break
        return True

    def _wait_for_writeback(self, tier: str, victims: list) -> bool:
        """If making room would write one of ``victims`` down, wait for a write already under way
        from this host tier instead (True: choose again). That write (``start_writeback``: state
        updated, needed next step) leaves a clean copy that goes for free; a new write costs a read
        later too and would queue behind it anyway. Else a slow disk spills the gradients waiting
        for the optimizer: theirs are the only chunks not busy. GPU tiers: copies down are fenced."""
        if self.gpu_tier(tier) or not any(self.records[k].only_on(tier) for k in victims):
            return False
        writing = next((m for m in self.in_flight if m.src == tier and m.dst == "nvme"), None)
        if writing is None:
            return False
        writing.wait()
        return True

    def _pinned_elsewhere(self, tier: str) -> bool:
        me = threading.get_ident()
        return any(r.pins[tier] and any(t != me for t in r.pin_threads) for r in self.records.values())

    def evict(self, rec: ChunkRecord, tier: str) -> None:
        """Drop ``rec``'s copy on ``tier`` (not busy: callers settle or skip chunks mid-move)."""
        if rec.only_on(tier):
            below = self.order[self.order.index(tier) + 1]
            version = rec.version
            move = self.start_move(rec, tier, below)
            # Off a GPU the copy down is queued and the device buffer goes back to its tier at
            # once, fenced by the copy (``drop_copy``): whatever reuses it is ordered after the
            # copy on the GPU, so the host need not wait for the bus while holding the lock. The
            # move holds the chunk's only copy until it is finished (the chunk is busy: never
            # evicted, written or released meanwhile); whoever reads the copy below waits for
            # it then (``ensure``, outside the lock). The move is this call's, or one another
            # thread started while room was made (the lock released): either way of the version
            # it still has, unless a write came in between. Host copies have no fences: a write
            # to NVMe is waited for before its buffer can be reused.
            if (self.gpu_tier(tier) and not move.synchronous and move.src == tier and tier in rec.buffers
                    and rec.version == version and not rec.pins[tier]
                    and rec.incoming.get(below, (None, None))[1] is move):
                self.drop_copy(rec, tier)
                return
            move.wait()
        # Making room below may have let another thread pin or rewrite the chunk: then it stays.
        if tier not in rec.buffers or rec.pins[tier] or rec.only_on(tier):
            return
        self.drop_copy(rec, tier)

    def holders(self, tier: str) -> str:
        return tier_holders(self.records.values(), tier, spills="nvme" in self.tiers or tier != self.lowest_memory)
