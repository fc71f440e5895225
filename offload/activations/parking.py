"""Where parked activations' bytes are: the CPU area, NVMe, and back on the device for backward.

Order and overlap. Entries are numbered in the order forward saved them, and tagged with the
micro-batch (forward) that saved them; ``order.need_key`` says when backward needs each (within a
micro-batch, in the reverse of the saving order; across micro-batches, by the ``order`` given). At
the end of forward, and at every unpack, the next ``prefetch`` entries backward needs are brought
back ahead of need: NVMe reads started into the area, and with CUDA streams the uploads started on
the host-to-device copy stream. When the area is full (``"nvme"``), the entries backward needs
last (one forward at a time: the earliest saved; pipelined micro-batches: the newest's) are written out to NVMe,
asynchronously, and their area buffers are reused once the writes land. Under ``"cpu"`` a tensor
that finds no room stays on the device (counted as ``kept``): the area never exceeds its budget.

Copies are ordered the way the chunk store orders its own (``offload.tiers.streams``): a download
starts on the device-to-host stream after a compute fence (the tensor's producer), the source is
held until it has landed (a CUDA one by the caching allocator, not by us); an upload into a fresh device tensor starts on the host-to-device
stream after a compute fence (the block's earlier users) and the download of its bytes, and
compute waits for the upload's event before it reads the tensor. No host buffer is reused and no
spill range rewritten before the copy or I/O reading it has finished. Without streams (the CPU is
the compute device) the copies are synchronous memcpys.

``Parking`` holds no lock of its own: the ``ActivationStore`` that owns it calls it under its lock.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..errors import OffloadError
from .area import ActivationArea
from .entry import Entry
from .order import check_order, need_key
from .spill import ALIGN, SpillSpace

# Start writing the earliest entries out once the area is fuller than this (nvme): the writes
# are then done by the time their room is needed, and forward seldom waits for the disk.
SPILL_WATERMARK = 0.5
DIRECTIONS = ("device->cpu", "cpu->nvme", "nvme->cpu", "cpu->device")


class Parking:
    """The parked entries of one store, by forward order (``seq``), and their copies and I/O."""

    def __init__(self, device: torch.device, area: ActivationArea, tier: str, streams: Callable[[], object],
                 spill: SpillSpace | None, prefetch: int, tracer, order: str = "reverse"):
        self.device = device
        self.area = area
        self.tier = tier
        self.streams = streams
        self.spill = spill
        self.prefetch_depth = prefetch
        self.tracer = tracer
        self.order = check_order(order)
        self.entries: dict[int, Entry] = {}          # parked and live, by seq
        self.moved = dict.fromkeys(DIRECTIONS, 0)
        self.wait_s = 0.0

    def park(self, e: Entry, t: torch.Tensor) -> bool:
        """Copy ``t`` (``e``'s tensor) into the area; False when there is no room for it."""
        self._reap()
        host = self._room(-(-e.nbytes // ALIGN) * ALIGN, after=None)
        if host is None:
            return False
        e.host, e.device, e.parked = host, None, True
        flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
        started = time.perf_counter()
        streams = self.streams()
        dst = host[:e.nbytes].view(t.dtype)
        if streams is None:
            dst.copy_(flat)
        else:
            e.host_ready = streams.copy(dst, flat, [streams.compute_fence()], upload=False,
                                        name=f"act {e.seq} d2h")
            # A CUDA source goes now: the allocator keeps its memory until the download has read
            # it (DeviceStreams.copy). Holding it until a later reap saw the download land kept
            # every parked input alive while the host ran ahead of the GPU (a whole forward).
            e.source = None if t.is_cuda else t
        self._span(f"park {e.seq}", "device->cpu", started, e.nbytes)
        self.moved["device->cpu"] += e.nbytes
        self.entries[e.seq] = e
        if self.tier == "nvme":
            self._spill_over_watermark()
        return True

    def renumber(self, e: Entry, seq: int) -> None:
        """``e`` is saved again: backward first needs it at ``seq``."""
        if e.parked:
            del self.entries[e.seq]
            self.entries[seq] = e
        e.seq = seq

    def fetch(self, e: Entry) -> tuple[torch.Tensor, object]:
        """``e``'s tensor on the device and the fence of its upload (None: nothing to wait for);
        the entries backward needs next start on their way back."""
        if e.device is None:
            self._bring_back(e, urgent=True)
        upload, out = e.upload, e.device
        self._prefetch_after(self.key(e))
        return out, upload

    def end_forward(self) -> None:
        """A forward ended: the entries backward needs first start on their way back."""
        self._reap()
        self._prefetch_after(None)

    def key(self, e: Entry) -> tuple[int, int]:
        """When backward needs ``e``: a smaller key, sooner (``order.need_key``)."""
        return need_key(self.order, e.micro_batch, e.seq)

    def forget(self, e: Entry) -> None:
        """Let go of a parked entry's area bytes, NVMe range and device copy, each once the copy or
        I/O still using it has finished."""
        del self.entries[e.seq]
        self._wait_fence(e, "upload")   # before the device tensor it writes may be reused
        e.device = e.upload = None
        self._release_host(e)
        if e.slot is not None:
            self.spill.free(e.slot)
            e.slot = None

    def close(self) -> None:
        """Delete the spill files (the store has released every entry first)."""
        if self.spill is not None:
            self.spill.close()

    def take_moved(self) -> tuple[dict, float]:
        """Bytes moved per direction and seconds waited since the last call."""
        out = dict(self.moved), self.wait_s
        self.moved = dict.fromkeys(DIRECTIONS, 0)
        self.wait_s = 0.0
        return out

    def _room(self, nbytes_: int, after: tuple | None, for_entry: Entry | None = None) -> torch.Tensor | None:
        """An area buffer of ``nbytes_``, spilling the earliest entries to NVMe ("nvme") to make
        room; None when it cannot be had. ``after``: only entries backward needs after this key
        may be spilled (the ones needed after the one being brought back). ``for_entry``:
        the entry backward needs now: any other may make room for it (backward does not always
        take saved tensors in exactly the reverse order they were saved)."""
        area = self.area
        if nbytes_ > area.budget:
            return None
        while not area.can_allocate(nbytes_):
            self._reap()
            if area.can_allocate(nbytes_):
                break
            writing = [e for e in self.entries.values() if e.write is not None]
            landing = sum(e.host.numel() for e in writing)
            if self.tier == "nvme" and landing < area.tier.shortfall(nbytes_):
                # A prefetch never drops another read-back copy (they would take turns being read).
                victim = self._spill_victim(after, reread=for_entry is not None)
                if victim is None and for_entry is not None:
                    victim = self._spill_victim(None, exclude=for_entry)
                if victim is not None:
                    self._make_room_from(victim)
                    continue
            if writing:
                self._finish_write(max(writing, key=self.key), wait=True)       # spilled first
                continue
            uploading = [e for e in self.entries.values() if e.host is not None and e.upload is not None]
            if uploading:
                self._finish_upload(uploading[0], wait=True)
                continue
            reading = [e for e in self.entries.values() if e.read is not None and e is not for_entry]
            if for_entry is not None and reading:
                self._finish_read(max(reading, key=self.key), wait=True)   # then it can go
                continue
            return None
        return area.allocate(nbytes_)

    def _spill_victim(self, after: tuple | None, exclude: Entry | None = None, reread: bool = True) -> Entry | None:
        """The entry backward needs last among those whose area bytes could go (needed after
        ``after``): in the area alone, or (``reread``) with its NVMe copy already there."""
        cands = [e for e in self.entries.values() if e.host is not None and e.write is None and e.read is None
                 and e.device is None and (after is None or self.key(e) > after) and e is not exclude
                 and (reread or e.slot is None)]
        return max(cands, key=self.key) if cands else None

    def _make_room_from(self, e: Entry) -> None:
        if e.slot is not None:
            # Read back ahead of need and still on NVMe: let the area bytes go, read again later.
            self._release_host(e)
        else:
            self._start_spill(e)

    def _spill_over_watermark(self) -> None:
        target = self.area.budget * SPILL_WATERMARK
        writing = sum(-(-e.nbytes // ALIGN) * ALIGN for e in self.entries.values() if e.write is not None)
        while self.area.in_use - writing > target:
            victim = self._spill_victim(None)
            if victim is None or victim.slot is not None:
                return
            self._start_spill(victim)
            writing += victim.host.numel()

    def _start_spill(self, e: Entry) -> None:
        self._wait_fence(e, "host_ready")
        e.source = None
        e.slot = self.spill.allocate(e.host.numel())
        e.write = self.spill.aio.write_from(e.host, e.slot.file, e.slot.offset)
        e.write_started = time.perf_counter()

    def _finish_write(self, e: Entry, wait: bool) -> bool:
        if not wait and not e.write.done():
            return False
        started = time.perf_counter()
        self.spill.aio.wait([e.write])
        if wait:
            self.wait_s += time.perf_counter() - started
        e.write = None
        self._span(f"spill {e.seq}", "cpu->nvme", e.write_started, e.nbytes)
        self.moved["cpu->nvme"] += e.nbytes
        if e.device is None:        # else brought back meanwhile: the upload frees the bytes
            self._release_host(e)
        return True

    def _start_read(self, e: Entry, urgent: bool) -> bool:
        host = self._room(e.slot.nbytes, after=self.key(e), for_entry=e if urgent else None)
        if host is None:
            return False
        e.host = host
        e.read = self.spill.aio.read_into(host, e.slot.file, e.slot.offset, urgent=urgent)
        e.read_started = time.perf_counter()
        return True

    def _finish_read(self, e: Entry, wait: bool) -> bool:
        if not wait and not e.read.done():
            return False
        started = time.perf_counter()
        self.spill.aio.wait([e.read])
        if wait:
            self.wait_s += time.perf_counter() - started
        e.read = None
        self._span(f"read back {e.seq}", "nvme->cpu", e.read_started, e.nbytes)
        self.moved["nvme->cpu"] += e.nbytes
        return True

    def _bring_back(self, e: Entry, urgent: bool) -> bool:
        """Start (``urgent``: finish) the way back to the device; False when there was no room."""
        # An entry still being written out has its area bytes intact: they are used as they are
        # (the write only reads them too; they are freed once both are done).
        if e.host is None:
            if not self._start_read(e, urgent):
                if not urgent:
                    return False
                raise OffloadError(f"no room in the {self.area.budget}-byte activation area to read back "
                                   f"{e.nbytes} bytes (raise activation_budget)")
        if e.read is not None:
            if not urgent and not e.read.done():
                return True      # the upload starts when it lands (_reap)
            self._finish_read(e, wait=True)
        streams = self.streams()
        if streams is None and not urgent:
            return True          # a synchronous copy gains nothing by running early
        started = time.perf_counter()
        numel = e.nbytes // torch.empty((), dtype=e.dtype).element_size()
        src = e.host[:e.nbytes].view(e.dtype)
        if streams is None:
            out = torch.empty_strided(e.size, e.stride, dtype=e.dtype, device=self.device)
            out.as_strided((numel,), (1,), 0).copy_(src)
            e.device = out
            self._release_host(e)
        else:
            with streams.on_compute():
                out = torch.empty_strided(e.size, e.stride, dtype=e.dtype, device=self.device)
            after = [streams.compute_fence()] + ([e.host_ready] if e.host_ready is not None else [])
            e.upload = streams.copy(out.as_strided((numel,), (1,), 0), src, after, upload=True,
                                    name=f"act {e.seq} h2d")
            e.device = out
        self._span(f"bring back {e.seq}", "cpu->device", started, e.nbytes)
        self.moved["cpu->device"] += e.nbytes
        return True

    def _finish_upload(self, e: Entry, wait: bool) -> bool:
        if not wait and not e.upload.query():
            return False
        self._wait_fence(e, "upload")
        self._release_host(e)
        return True

    def _release_host(self, e: Entry) -> None:
        """Give the area bytes back, once nothing reads or writes them any more."""
        if e.host is not None:
            if e.write is not None:
                self._finish_write(e, wait=True)
                if e.host is None:
                    return
            if e.read is not None:
                self._finish_read(e, wait=True)
            self._wait_fence(e, "upload")
            self._wait_fence(e, "host_ready")
            e.source = None
            self.area.free(e.host)
            e.host = None

    def _wait_fence(self, e: Entry, name: str) -> None:
        fence = getattr(e, name)
        if fence is not None:
            if not fence.query():
                started = time.perf_counter()
                fence.synchronize()
                self.wait_s += time.perf_counter() - started
            if name == "host_ready":
                e.host_ready = None

    def _prefetch_after(self, key: tuple | None) -> None:
        """Bring back the next ``prefetch`` entries backward needs after ``key`` (None: from the first)."""
        if self.prefetch_depth == 0:
            return
        started = 0
        for e in sorted((e for e in self.entries.values() if key is None or self.key(e) > key), key=self.key):
            if e.device is None and not self._bring_back(e, urgent=False):
                return
            started += 1
            if started >= self.prefetch_depth:
                return

    def _reap(self) -> None:
        """Finish what has landed: downloads (drop their sources), spill writes (free their area
        bytes), reads back (start their uploads), uploads (free their area bytes)."""
        for e in list(self.entries.values()):
            if e.source is not None and e.host_ready is not None and e.host_ready.query():
                e.host_ready = None
                e.source = None
            if e.write is not None:
                self._finish_write(e, wait=False)
            if e.read is not None and e.read.done():
                self._finish_read(e, wait=True)
                if self.streams() is not None:
                    self._bring_back(e, urgent=False)
            if e.upload is not None and e.host is not None:
                self._finish_upload(e, wait=False)

    def _span(self, name: str, direction: str, started: float, size: int) -> None:
        if self.tracer is not None:
            self.tracer.complete(name, "activations", started, time.perf_counter(), f"activations {direction}",
                                 bytes=size)
