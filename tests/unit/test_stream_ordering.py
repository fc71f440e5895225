"""Every access to a device buffer is ordered after the last conflicting access from another
stream, as CUDA's stream sanitizer (CSAN) demands, checked on the CPU.

The copies run on ``CheckedStreams`` (``tests/helpers/stream_checker.py``): the vector clocks
CSAN keeps for the compute, upload and download streams, compute's accesses seen by a dispatch
mode, and every fence reporting "done" at once (a GPU that keeps up: code that skips a wait for
a finished fence goes unordered, as CSAN sees it). The first tests show the checker catches the
two kinds of race (a read not ordered after a write, a write not ordered after a read); the rest
drive the store and the engine through the paths a device buffer takes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

import offload
from offload.chunks import ChunkStore
from offload.engine import build
from offload.scheduler import LRUPolicy
from offload.tiers import MemoryTier
from tests.helpers.stream_checker import CheckedStreams
from tests.helpers.tiny_gpt import TinyGPT, batches

N = 512                 # elements of an fp32 chunk (2 KiB)


def checked_store(device_bytes: int = 16 * N * 4, cpu_bytes: int = 16 * N * 4):
    streams = CheckedStreams()
    store = ChunkStore([MemoryTier("device", device_bytes), MemoryTier("cpu", cpu_bytes)], LRUPolicy(),
                       streams=streams)
    streams.watch(store.tiers["device"])
    store.register("grad", 2, N, torch.float32)
    return store, streams


# ---- the checker ------------------------------------------------------------------------------
def test_the_checker_flags_a_download_not_ordered_after_compute_writing_its_source():
    store, streams = checked_store()
    with streams.watching():
        buf = store.tiers["device"].allocate(N * 4)
        buf.fill_(1)                                        # compute writes
        streams.copy(torch.empty(N * 4, dtype=torch.uint8), buf, [], upload=False, name="early")
    assert any("early on d2h is not ordered after the write by aten::fill_" in r for r in streams.races), streams.races


def test_the_checker_flags_compute_writing_a_buffer_a_download_may_still_read():
    store, streams = checked_store()
    with streams.watching():
        buf = store.tiers["device"].allocate(N * 4)
        buf.fill_(1)
        done = streams.copy(torch.empty(N * 4, dtype=torch.uint8), buf, [streams.compute_fence()], upload=False,
                            name="read")
        assert done.query() and not streams.races      # "done", yet nothing waited for it
        buf.fill_(2)
    assert any("write by aten::fill_ on compute is not ordered after the read by copy read" in r
               for r in streams.races), streams.races


def test_the_checker_accepts_what_fences_order():
    store, streams = checked_store()
    with streams.watching():
        buf = store.tiers["device"].allocate(N * 4)
        buf.fill_(1)
        done = streams.copy(torch.empty(N * 4, dtype=torch.uint8), buf, [streams.compute_fence()], upload=False)
        streams.compute_wait(done)
        buf.fill_(2)
        up = streams.copy(buf, torch.zeros(N * 4, dtype=torch.uint8), [streams.compute_fence()], upload=True)
        up.synchronize()        # a host wait orders every stream after it
        buf.fill_(3)
    assert not streams.races, streams.races


# ---- the store --------------------------------------------------------------------------------
def test_a_chunk_pinned_on_the_device_is_not_prefetched_down_while_compute_may_write_it():
    """A gradient chunk is filled by compute while pinned; the optimizer asks for the chunks it
    updates next ahead of time. A download started then reads bytes compute is still writing."""
    store, streams = checked_store()
    key = ("grad", 0)
    with streams.watching():
        store.initialize(key, "device")
        view = store.access(key, "device")
        view[:N // 2].fill_(1.0)                     # backward: the first gradients
        assert store.prefetch(key, "cpu", soon=True) is None
        with store.traffic.compute_owns("device"):
            view[N // 2:].fill_(2.0)                 # and the rest
        store.release(key, "device", dirty=True)
        move = store.prefetch(key, "cpu", soon=True)     # final now: down it goes
        assert move is not None
        got = store.access(key, "cpu")
        assert torch.equal(got, torch.cat([torch.ones(N // 2), torch.full((N // 2,), 2.0)]))
        store.release(key, "cpu")
    assert not streams.races, streams.races


def test_writing_a_device_copy_a_download_read_waits_for_that_download():
    """A chunk written on the device is downloaded with its device copy kept; rewriting that copy
    (a load, the next micro-batch's gradients) must come after the download on the GPU."""
    store, streams = checked_store()
    key = ("grad", 0)
    with streams.watching():
        store.initialize(key, "device", lambda v: v.fill_(1.0))
        assert store.prefetch(key, "cpu") is not None   # down, the device copy kept, not waited for
        store.write(key, torch.full((N,), 3.0))      # on the device: compute overwrites it
        view = store.access(key, "device")
        with store.traffic.compute_owns("device"):
            view.add_(1.0)
        store.release(key, "device", dirty=True)
        assert torch.equal(store.read(key), torch.full((N,), 4.0))
    assert not streams.races, streams.races


# ---- the engine: the device-resident round trip (tests/gpu's, on the CPU) ---------------------
def checked_model(seed: int, dtype: str, overlap: bool):
    torch.manual_seed(seed)
    streams = CheckedStreams()
    with mock.patch.object(build, "copy_streams", lambda device: streams):
        model = offload.wrap(TinyGPT(), offload.OffloadConfig(
            device="cpu", dtype=dtype, device_budget="8MiB", cpu_budget="8MiB", merge_host_tiers=False,
            chunk_size=8192, overlap_optimizer=overlap))
    streams.watch(model.offload_engine.store.tiers["device"])
    return model, streams


@pytest.mark.parametrize("dtype,overlap", [("bf16", True), ("fp32", False)])
def test_device_resident_round_trips_keep_every_device_access_ordered(dtype, overlap):
    model, streams = checked_model(0, dtype, overlap)
    other, other_streams = checked_model(1, dtype, overlap)
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        oopt = offload.AdamW(other.parameters(), lr=1e-3)
        with tempfile.TemporaryDirectory() as tmp, streams.watching():
            for x, y in batches(3):
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            offload.save_checkpoint(model, opt, Path(tmp) / "ckpt", step=3)
            with other_streams.watching():
                offload.load_checkpoint(other, oopt, Path(tmp) / "ckpt")
                got = other.state_dict()
                for x, y in batches(2, seed=1):
                    other(x, y).backward()
                    oopt.step()
                    oopt.zero_grad()
                other.load_state_dict(sd)       # over device copies the last forward left
        assert all(torch.equal(got[k], v) for k, v in sd.items())
        assert streams.copies["h2d"] and streams.copies["d2h"], streams.copies
        assert not streams.races, streams.races[:4]
        assert not other_streams.races, other_streams.races[:4]
    finally:
        model.offload_engine.close()
        other.offload_engine.close()


def test_a_buffer_whose_fill_failed_goes_back_after_what_the_fill_queued():
    """``initialize`` gives the buffer back when ``fill`` raises; compute may have written part of
    it already, so the upload that reuses it comes after that on the GPU."""
    store, streams = checked_store(device_bytes=N * 4)

    def fail(view):
        view[:8].fill_(1.0)
        raise ValueError("a loader found a bad tensor")

    with streams.watching():
        with pytest.raises(ValueError):
            store.initialize(("grad", 0), "device", fail)
        store.initialize(("grad", 1), "cpu", lambda v: v.fill_(2.0))
        store.ensure(("grad", 1), "device")     # the same buffer, by an upload
        assert torch.equal(store.read(("grad", 1)), torch.full((N,), 2.0))
    assert not streams.races, streams.races
