"""Releasing device buffers on a real GPU without the host waiting (``pytest -m gpu``; skips
without CUDA). The CPU suite (``tests/unit/test_fenced_release.py``) checks the host never waits;
what only a GPU shows is that the memory stays safe meanwhile: torch's caching allocator does not
hand a released buffer to anyone before its fences have passed (``MemoryTier._release``), and a
dirty chunk evicted from the device lands intact on the host although ``evict`` returned while
the GPU was still busy with the work before its download.
"""

from __future__ import annotations

import pytest
import torch

from offload.chunks import ChunkStore
from offload.scheduler import LRUPolicy
from offload.tiers import MemoryTier
from offload.tiers.streams import DeviceStreams

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def queue_busy_work(stream: torch.cuda.Stream, seconds: float = 1.0) -> None:
    """Queue about ``seconds`` of matmuls on ``stream``, timed first on this card (an H200 runs a
    fixed count of them in a fraction of what an older card takes, TF32 or not)."""
    with torch.cuda.stream(stream):
        a = torch.ones(8192, 8192, device="cuda")
        torch.mm(a, a)                      # cuBLAS loaded, its workspace allocated
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(5):
            torch.mm(a, a)
        end.record(stream)
        end.synchronize()
        per_mm_s = start.elapsed_time(end) / 5 / 1000
        for _ in range(max(10, int(seconds / per_mm_s))):
            torch.mm(a, a)


def test_a_released_device_buffer_is_not_reused_before_its_fences_and_the_host_goes_on():
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    warm = [torch.empty(n * MIB, dtype=torch.uint8, device=dev) for n in (48, 32)]
    del warm        # cached now, one block of each size: the tier's buffers need no cudaMalloc
    tier = MemoryTier("device", 64 * MIB, dev)
    buf = tier.allocate(32 * MIB)
    address = buf.data_ptr()
    buf.view(torch.float32).fill_(1.0)
    # Loaded now, not behind the busy work: CUDA loads a kernel's module at its first launch
    # (lazy loading), and that load may wait for the whole device.
    buf.view(torch.float32).sum().item()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    queue_busy_work(side)
    with torch.cuda.stream(side):
        total = buf.view(torch.float32).sum()       # reads buf behind the busy work
        fence = torch.cuda.Event()
        fence.record(side)
    tier.free(buf, [fence])
    del buf
    other = tier.allocate(48 * MIB)     # no pooled size serves it: the 32 MiB buffer is released
    assert not fence.query(), "the host waited for the released buffer's fence"
    assert tier.reserved <= tier.budget
    # The released block is the only cached one of its size: were it free already, this exact
    # fit would get it, and the zeros would reach the sum still queued behind the busy work.
    probe = torch.zeros(32 * MIB, dtype=torch.uint8, device=dev)
    assert probe.data_ptr() != address, "the allocator handed out memory a queued kernel still reads"
    fence.synchronize()
    assert total.item() == 8 * MIB                  # 8 Mi fp32 ones: the sum saw the old bytes
    del other, probe
    torch.cuda.synchronize()


def test_evicting_a_dirty_chunk_from_the_gpu_returns_before_its_download():
    dev = torch.device("cuda")
    numel = MIB                                   # 4 MiB of fp32
    store = ChunkStore([MemoryTier("device", 8 * MIB, dev),
                        MemoryTier("cpu", 8 * MIB, "cpu", aligned=True, pin=True)], LRUPolicy(),
                       streams=DeviceStreams(dev))
    key = store.register("grad", 1, numel, torch.float32)[0]
    expected = torch.arange(numel, dtype=torch.float32, device=dev)
    view = store.access(key, "device", overwrite=True)
    with store.streams.on_compute():
        queue_busy_work(store.streams.compute)
        view.copy_(expected)                      # written behind the busy work
    store.release(key, "device", dirty=True)      # its download must wait for that write
    behind_write = store.streams.compute_fence()
    store.evict(key, "device")
    assert not behind_write.query(), "evict waited for the download"
    assert store.tiers["device"].in_use == 0
    got = store.read(key)                         # the reader waits for the download
    assert torch.equal(got, expected.cpu())
    torch.cuda.synchronize()
