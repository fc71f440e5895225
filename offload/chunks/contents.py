"""Whole-chunk copies into and out of the chunk store (checkpoints, ``state_dict``, loading):
``ChunkStore``'s ``read``/``read_into``/``write``, apart from its moves and pins. A mixin: it runs
on the store's records, lock and traffic, under the same one-lock rule (``store.py``)."""

from __future__ import annotations

import torch

from ..errors import StateError
from .records import ChunkKey, ChunkRecord
from .states import ChunkState


class ChunkContents:
    """Copies of whole chunks' contents for ``ChunkStore`` (which holds ``lock``, ``records``,
    ``tiers``, ``order``, ``traffic`` and the life-cycle methods these call)."""

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
            self.traffic.settle(rec)
            if rec.state is ChunkState.FREE:
                raise StateError(f"chunk {key} holds no data")
            typed = rec.typed(out)
            for tier in self.order:
                if tier in rec.buffers:
                    with self.traffic.compute_owns(tier):
                        typed.copy_(rec.views[tier])
                    return typed
            self.tiers["nvme"].read(rec.slot, out[: rec.slot.nbytes]).wait()
            self.traffic.moved[("nvme", "host")] += rec.nbytes
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
                with self.traffic.compute_owns(tier):
                    view.copy_(data.reshape(-1))
            finally:
                self.release(key, tier, dirty=True)

    def _write_tier(self, rec: ChunkRecord) -> str:
        return next((tier for tier in self.order if tier in rec.buffers), self.traffic.lowest_memory)
