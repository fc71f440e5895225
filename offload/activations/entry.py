"""One saved tensor the store holds (``Entry``) and what autograd holds instead (``SavedActivation``).

An entry is *pending* from its pack until the boundary finder (``select.BoundaryFinder``) has
seen whether it is a checkpoint boundary: it then holds the device tensor itself, exactly as
autograd would have. *Parked*, its bytes are in the area (``host``) or on NVMe (``slot``) and
come back to ``device`` for backward. Neither (*kept*): it stays on the device for good (not a
boundary, or no room in the area).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spill import SpillSlot


@dataclass(eq=False)
class Entry:
    """One saved tensor. ``host``: its bytes in the area; ``slot``: on NVMe; ``device``: on the device."""

    seq: int
    size: tuple
    stride: tuple
    dtype: torch.dtype
    nbytes: int
    micro_batch: int = 0                 # the forward that saved it (``order``: when backward needs it)
    pending: bool = True
    parked: bool = False
    host: torch.Tensor | None = None
    host_ready: object = None            # fence: the download into ``host`` has landed
    source: torch.Tensor | None = None   # held until the download has read it (a CUDA one: by the allocator)
    slot: SpillSlot | None = None
    write: object = None                 # AIO handle of the spill write in flight
    read: object = None                  # AIO handle of the read back in flight
    device: torch.Tensor | None = None
    upload: object = None                # fence: the upload into ``device`` has landed
    handles: int = 0
    key: tuple | None = None
    origin: object = None                # weakref of the packed tensor (sharing test)
    version: int = 0
    released: bool = False
    write_started: float = 0.0
    read_started: float = 0.0


class SavedActivation:
    """What autograd holds instead of a saved tensor; freeing it (autograd drops a node's saved
    tensors after its backward, or the whole graph) releases the entry once no other holds it."""

    __slots__ = ("store", "entry", "__weakref__")

    def __init__(self, store, entry: Entry):
        self.store = store
        self.entry = entry
        entry.handles += 1

    def __del__(self):
        try:
            self.store._drop_handle(self.entry)
        except Exception:       # interpreter shutdown: nothing left to give back
            pass
