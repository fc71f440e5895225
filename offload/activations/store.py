"""``ActivationStore``: saved tensors parked in the CPU area (and on NVMe), brought back for backward.

``pack`` (called by ``saved_tensors_hooks`` while the wrapped model's forward runs) hands
autograd a ``SavedActivation`` for each offloadable saved tensor. A chosen one — a checkpoint
boundary (``select.BoundaryFinder``), or any tensor of at least ``min_bytes`` — is copied into the
area, and autograd then holds no reference to the device tensor, so its memory goes back to the
allocator once the copy has read it. Whether a tensor is a boundary may be known only a little
later (after the next module has run): until then its entry is *pending* and holds the device
tensor, as autograd would; ``claim`` parks it then. ``unpack`` rebuilds a parked tensor on the
device with its own strides, bit for bit. Where parked bytes wait and how they come back in time
is ``parking.Parking``'s job.

A tensor autograd saved several times (a layer's input feeds q, k and v; the RoPE tables every
checkpointed layer is given) is parked once: later packs of the same live, unmodified tensor share
its entry, which takes the place of the last one in the order. An entry lives until the last
``SavedActivation`` of it is freed by autograd (after the backward that used it, or with the graph);
its device copy lives as long, exactly as the original would have.

Each forward is a micro-batch (numbered from 0 as forwards start); ``order`` says in which order
backward takes micro-batches (``order.py``: "reverse", one forward at a time; "micro-batches",
pipeline schedules with several in flight). ``resident_peak`` is the most bytes of saved tensors
this store held on the compute device at once (pending, kept, read back, or a parked one's source
until its download has read it), sampled where it peaks: as each forward ends and as backward
takes each parked tensor (a scan of the live entries: not on every pack).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Callable

import torch

from ..errors import OffloadError
from .area import ActivationArea
from .entry import Entry, SavedActivation
from .parking import Parking
from .select import BoundaryFinder, nbytes, offloadable
from .spill import SpillSpace


class ActivationStore:
    """Parks saved tensors of one wrapped model. ``tier``: "cpu" or "nvme" (spills allowed).

    ``streams``: returns the chunk store's copy streams (None: synchronous copies). ``spill`` is
    needed for "nvme". ``min_bytes``: also park saved tensors that are not checkpoint boundaries
    when at least this big (None: boundaries only). ``boundaries`` is fed by the engine's hooks.
    ``order``: "reverse" or "micro-batches" (``order.py``).
    """

    def __init__(self, device: torch.device, area: ActivationArea, *, tier: str = "cpu",
                 streams: Callable[[], object] = lambda: None, spill: SpillSpace | None = None,
                 min_bytes: int | None = None, prefetch: int = 4, tracer=None, order: str = "reverse"):
        if tier not in ("cpu", "nvme"):
            raise OffloadError(f"activation tier must be 'cpu' or 'nvme', not {tier!r}")
        if tier == "nvme" and spill is None:
            raise OffloadError("activation tier 'nvme' needs a SpillSpace")
        self.device = torch.device(device)
        self.area = area
        self.tier = tier
        self.streams = streams
        self.spill = spill
        self.min_bytes = min_bytes
        self.parking = Parking(self.device, area, tier, streams, spill, prefetch, tracer, order)
        self.lock = threading.RLock()
        self.by_key: dict[tuple, Entry] = {}          # every live entry (pending and kept too)
        self._seq = 0
        self.micro_batch = -1                          # the forward running (or last run)
        self.live: set[Entry] = set()                  # every entry not yet released
        self.resident_peak = 0
        self.boundaries = BoundaryFinder(self.claim)
        self.kept_bytes = 0
        self.packed = 0
        self.shared = 0
        self.found = 0
        self.forwards = 0
        self._warned = False

    @property
    def entries(self) -> dict[int, Entry]:
        """The parked entries still alive, by forward order."""
        return self.parking.entries

    # ---- pack / unpack (the saved_tensors_hooks pair) -----------------------------------------
    def wants(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (being packed now) is one this store may park."""
        return offloadable(t, self.device)

    def pack(self, t: torch.Tensor) -> SavedActivation:
        """A ``SavedActivation`` for ``t``: parked now, pending (``claim`` may park it), or kept."""
        with self.lock:
            # A view's base (alive: its memory cannot have been reused) identifies it; autograd
            # saves a fresh view of a layer's input for each projection that reads it.
            origin = t._base if t._base is not None else t
            size, stride = tuple(t.size()), tuple(t.stride())
            key = (t.data_ptr(), t.dtype, size, stride)
            e = self.by_key.get(key)
            if e is not None and not e.released and e.origin() is origin and e.version == t._version:
                # Backward first needs it where it was saved last: it moves to that place in the order.
                self.shared += e.parked
                self.parking.renumber(e, self._seq)
                e.micro_batch = max(self.micro_batch, 0)
            else:
                e = Entry(self._seq, size, stride, t.dtype, nbytes(t), key=key, micro_batch=max(self.micro_batch, 0),
                          version=t._version, origin=weakref.ref(origin), device=t)
                self.by_key[key] = e
                self.live.add(e)
            self._seq += 1
            if e.pending:
                if self.boundaries.after_no_grad:        # a reentrant checkpoint saving its inputs
                    self.found += 1
                    self._park(e)
                elif self.min_bytes is not None and e.nbytes >= self.min_bytes:
                    self._park(e)
                else:
                    self.boundaries.pending(e)
            return SavedActivation(self, e)

    def claim(self, entries: list) -> None:
        """``entries`` (pending) are checkpoint boundaries: park them."""
        with self.lock:
            for e in entries:
                if e.pending and not e.released:
                    self.found += 1
                    self._park(e)

    def _park(self, e: Entry) -> None:
        """Copy a pending entry's tensor into the area (it stays on the device when there is no room,
        or when it was changed in place since it was saved)."""
        t, e.pending = e.device, False
        if t._version != e.version:
            return
        if self.parking.park(e, t):
            self.packed += 1
        else:
            self.kept_bytes += e.nbytes

    def unpack(self, packed):
        if not isinstance(packed, SavedActivation):
            return packed
        e = packed.entry
        with self.lock:
            if e.released:
                raise OffloadError(f"saved activation {e.seq} was already released")
            if not e.parked:
                return e.device            # never left the device
            out, upload = self.parking.fetch(e)
            self._note_resident()
        streams = self.streams()
        if upload is not None and streams is not None:
            streams.compute_wait(upload)
        return out

    def begin_forward(self) -> None:
        with self.lock:
            self.boundaries.reset()
            self.micro_batch += 1

    def end_forward(self) -> None:
        """Forward is done: start bringing back what backward needs first (the last saved). What is
        still pending now stays on the device."""
        with self.lock:
            self.boundaries.reset()
            self.forwards += 1
            self.parking.end_forward()
            self._note_resident()

    # ---- lifetime ------------------------------------------------------------------------------
    def _drop_handle(self, e: Entry) -> None:
        with self.lock:
            e.handles -= 1
            if e.handles == 0:
                self._release(e)

    def _release(self, e: Entry) -> None:
        """Nobody needs the entry any more: let go of what it holds (a pending or kept entry, its
        device tensor; a parked one, its copies once the I/O still using them has finished)."""
        if e.released:
            return
        e.released = True
        self.live.discard(e)
        if self.by_key.get(e.key) is e:
            del self.by_key[e.key]
        if e.parked:
            self.parking.forget(e)
        e.device = None

    def close(self) -> None:
        with self.lock:
            for e in list(self.parking.entries.values()):
                self._release(e)
            self.parking.close()

    # ---- statistics ----------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of saved tensors this store holds on the compute device now."""
        with self.lock:
            return sum(e.nbytes for e in self.live if e.device is not None or e.source is not None)

    def _note_resident(self) -> None:
        self.resident_peak = max(self.resident_peak, self.resident_bytes())

    def take_stats(self) -> dict:
        """Bytes moved per direction, tensors parked, checkpoint boundaries found, and the area's
        peak since the last call. ``nothing_parked``: forwards ran and none parked anything (then a
        warning says, once, what to check)."""
        with self.lock:
            moved, wait_s = self.parking.take_moved()
            out = {"tier": self.tier, "bytes": moved, "parked": self.packed, "shared": self.shared,
                   "boundaries": self.found, "kept_on_device_bytes": self.kept_bytes,
                   "area_budget": self.area.budget, "area_peak": self.area.take_peak(),
                   "area_in_use": self.area.in_use, "nvme_bytes": self.spill.size if self.spill is not None else 0,
                   "wait_s": wait_s, "live": len(self.entries), "order": self.parking.order,
                   "resident_peak": self.resident_peak,
                   "nothing_parked": self.forwards > 0 and self.packed == 0 and self.shared == 0}
            self.kept_bytes = self.packed = self.shared = self.found = self.forwards = 0
            self.resident_peak = 0
            self._note_resident()
        if out["nothing_parked"] and not self._warned:
            self._warned = True
            warnings.warn(nothing_parked_message(out, self.min_bytes), RuntimeWarning, stacklevel=3)
        return out


def nothing_parked_message(stats: dict, min_bytes: int | None) -> str:
    """What a step that parked nothing under activation offload means, and what to check."""
    head = f"activation_offload={stats['tier']!r} parked nothing in this step"
    if stats["kept_on_device_bytes"]:
        # Under "nvme" the rest spills: what finds no room is a tensor larger than the whole area,
        # or one saved while all of the area is still being written out.
        fix = ("raise activation_budget (above the largest saved tensor, with room to spare)"
               if stats["tier"] == "nvme" else "raise activation_budget or use 'nvme'")
        return (f"{head}: the {stats['kept_on_device_bytes']} bytes chosen to park found no room in the "
                f"{stats['area_budget']}-byte activation area; {fix}")
    bigger = "" if min_bytes is None else f" and no saved tensor reached activation_min_bytes={min_bytes}"
    return (f"{head}: no tensor saved for backward was a checkpointed layer's input{bigger}. Is "
            "torch.utils.checkpoint used (Hugging Face: model.gradient_checkpointing_enable(); "
            "offload.models: model.gradient_checkpointing = True), with its layers inside the wrapped "
            "model and not under other saved_tensors_hooks (save_on_cpu, HF's offload=True)? Without "
            "checkpointing, activation_min_bytes parks every saved tensor of at least that size.")
