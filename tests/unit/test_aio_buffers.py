"""Aligned tensors, the budgeted buffer pool, and the host-memory checks before pinning."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from offload import ConfigError, PinnedMemoryError, StateError, TierFullError
from offload.aio import BufferPool, aligned_empty, buffers, check_host_budget


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 1000, 1 << 20])
def test_aligned_empty(numel, dtype):
    t = aligned_empty(numel, dtype)
    assert t.dtype == dtype and t.numel() == numel and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0 and bool((t == 0).all())
    big = t.numel() * t.element_size() >= buffers.HUGEPAGE_MIN_BYTES
    assert t.data_ptr() % (2 << 20) == 0 or not big
    t.fill_(1)                                    # writable, no copy elsewhere
    assert bool((t == 1).all())


def test_aligned_empty_zero_and_bad():
    assert aligned_empty(0).numel() == 0
    with pytest.raises(ConfigError):
        aligned_empty(-1)


def test_aligned_memory_outlives_the_first_tensor_while_a_view_lives():
    t = aligned_empty(1 << 20, torch.float32)
    t.fill_(3.0)
    view = t[10:20]
    del t
    gc.collect()
    assert bool((view == 3.0).all())


def test_pinned_without_cuda_uses_mlock():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning goes through cudaHostRegister (covered by the gpu tests)")
    t = aligned_empty(64 << 10, pin=True)       # 64 KiB fits any ulimit -l
    assert t.data_ptr() % 4096 == 0


@pytest.mark.gpu
def test_pinned_with_cuda_is_page_locked():
    t = aligned_empty(1 << 20, pin=True)
    assert t.is_pinned()


def test_check_host_budget_names_both_numbers():
    with pytest.raises(PinnedMemoryError) as exc:
        check_host_budget(1 << 50, pin=False)
    msg = str(exc.value)
    assert "available RAM" in msg and "ulimit -l" in msg and str(1 << 50) in msg
    assert check_host_budget(1 << 20, pin=False).requested == 1 << 20


def test_memlock_limit_refuses_before_locking(monkeypatch):
    monkeypatch.setattr(buffers, "memlock_usage", lambda: (64 << 10, 0))
    monkeypatch.setattr(buffers, "_has_cap_ipc_lock", lambda: False)
    monkeypatch.setattr(buffers, "_cuda_pinning", lambda: False)
    with pytest.raises(PinnedMemoryError) as exc:
        check_host_budget(1 << 20, pin=True)
    assert str(64 << 10) in str(exc.value) and "available RAM" in str(exc.value)
    with pytest.raises(PinnedMemoryError):
        BufferPool(4 << 20, 1 << 20, pin=True)
    check_host_budget(1 << 20, pin=False)          # not pinning: the limit does not apply


def test_pool_acquire_release():
    with BufferPool(4 << 20, 1 << 20, pin=False) as pool:
        assert pool.capacity == 4 and pool.free_count == 4
        bufs = [pool.acquire() for _ in range(4)]
        assert len({b.data_ptr() for b in bufs}) == 4
        assert all(b.data_ptr() % 4096 == 0 and b.numel() == 1 << 20 for b in bufs)
        with pytest.raises(TierFullError):
            pool.acquire(timeout=0.01)
        pool.release(bufs[0])
        with pytest.raises(StateError):
            pool.release(bufs[0])
        with pool.buffer() as b:
            assert b.data_ptr() == bufs[0].data_ptr()
        assert pool.free_count == 1


def test_pool_acquire_waits_for_release():
    pool = BufferPool(1 << 20, 1 << 20, pin=False)
    b = pool.acquire()
    threading.Timer(0.05, pool.release, args=(b,)).start()
    assert pool.acquire(timeout=5).data_ptr() == b.data_ptr()


def test_pool_bad_sizes():
    with pytest.raises(ConfigError):
        BufferPool(1 << 20, 1000)
    with pytest.raises(ConfigError):
        BufferPool(4096, 8192)
