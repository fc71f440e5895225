"""The native I/O primitives: CRC32C (hardware = table = reference), buffers, pread/pwrite, AIO contexts."""

from __future__ import annotations

import contextlib
import errno
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import native

libaio = pytest.mark.skipif(not native.libaio_linked(), reason="offload._native built without libaio")


def _crc_reference(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _crc(data: bytes, **kw) -> int:
    buf, address = native.buffer_alloc(max(len(data), 1), hugepage=False, populate=False)
    buf[: len(data)] = data
    return native.crc32c(address, len(data), **kw)


def test_crc32c_known_vector():
    assert _crc(b"123456789") == 0xE3069283
    assert _crc(b"123456789", portable=True) == 0xE3069283
    assert _crc(b"") == 0


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=300), st.integers(0, 7))
def test_crc32c_paths_agree_with_reference(data, skip):
    data = data[skip:]
    ref = _crc_reference(data)
    assert _crc(data) == ref and _crc(data, portable=True) == ref


def test_crc32c_is_chainable():
    data = os.urandom(10000)
    buf, address = native.buffer_alloc(len(data), hugepage=False, populate=False)
    buf[:] = data
    whole = native.crc32c(address, len(data))
    assert native.crc32c(address + 777, len(data) - 777, native.crc32c(address, 777)) == whole


@pytest.mark.parametrize("hugepage", [False, True])
def test_buffer_alignment_and_zero_fill(hugepage):
    buf, address = native.buffer_alloc(3 << 20, hugepage=hugepage, populate=True)
    assert address % ((2 << 20) if hugepage else 4096) == 0
    assert len(buf) == 3 << 20 and bytes(buf[:4096]) == bytes(4096)


def test_pio_round_trip_and_eof(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        buf, address = native.buffer_alloc(8192, hugepage=False, populate=True)
        buf[:] = os.urandom(8192)
        assert native.pio(fd, native.IO_WRITE, address, 8192, 100) == 8192
        out, oaddr = native.buffer_alloc(8192, hugepage=False, populate=True)
        assert native.pio(fd, native.IO_READ, oaddr, 8192, 100) == 8192
        assert bytes(out) == bytes(buf)
        assert native.pio(fd, native.IO_READ, oaddr, 8192, 4196) == 4096   # EOF: short count
        assert native.pio(-1, native.IO_READ, oaddr, 1, 0) == -errno.EINVAL
    finally:
        os.close(fd)


def _reap_all(ctx, count: int, timeout_s: float = 30.0) -> list:
    """Reap until ``count`` completions (tag, result, done) have come back; fail (not hang) when
    they have not after ``timeout_s``."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} completions after {timeout_s} s"
        got += ctx.reap(1, count, 1_000_000_000)
    return got


@contextlib.contextmanager
def _direct_context(path, flags, depth):
    """An O_DIRECT descriptor of ``path`` and an AIO context of ``depth``, both closed after."""
    fd = os.open(path, flags | os.O_DIRECT)
    ctx = native.AioContext(depth)
    try:
        yield fd, ctx
    finally:
        ctx.destroy()
        os.close(fd)


@libaio
def test_aio_context_reports_short_read_as_eio(disk_tmp):
    path = disk_tmp / "short"
    path.write_bytes(b"x" * 4096)
    with _direct_context(path, os.O_RDWR, 4) as (fd, ctx):
        buf, address = native.buffer_alloc(16384, hugepage=False, populate=True)
        assert ctx.submit([(7, fd, native.IO_READ, address, 0, 16384),
                           (8, fd, native.IO_READ, address, 0, 4096)]) == 2
        got = {tag: (result, done) for tag, result, done in _reap_all(ctx, 2)}
        assert got[7] == (-errno.EIO, 4096) and got[8] == (4096, 4096)   # short, then whole
        assert ctx.inflight() == 0
        assert ctx.reap(0, 4, 1_000_000) == []     # timeout: nothing
        assert ctx.submit([(1, fd, 9, address, 0, 4096)]) == -errno.EINVAL   # nothing accepted


@libaio
def test_aio_context_accepts_more_than_its_depth(disk_tmp):
    """The native completion thread feeds a pending list into the kernel as slots free up."""
    path = disk_tmp / "q"
    path.write_bytes(os.urandom(64 * 4096))
    with _direct_context(path, os.O_RDWR, 2) as (fd, ctx):
        buf, address = native.buffer_alloc(64 * 4096, hugepage=False, populate=True)
        reqs = [(i, fd, native.IO_READ, address + i * 4096, i * 4096, 4096) for i in range(64)]
        assert ctx.submit(reqs) == 64
        got = _reap_all(ctx, 64)
        assert sorted(t for t, _, _ in got) == list(range(64)) and all(r == 4096 for _, r, _ in got)
        assert bytes(buf) == path.read_bytes() and ctx.inflight() == 0


@libaio
def test_aio_context_refused_request_completes_with_its_error(disk_tmp):
    path = disk_tmp / "ro"
    path.write_bytes(bytes(8192))
    with _direct_context(path, os.O_RDONLY, 4) as (fd, ctx):
        buf, address = native.buffer_alloc(8192, hugepage=False, populate=True)
        assert ctx.submit([(1, fd, native.IO_WRITE, address, 0, 4096),
                           (2, fd, native.IO_READ, address, 4096, 4096)]) == 2
        got = {t: (r, d) for t, r, d in _reap_all(ctx, 2)}
        assert got[1] == (-errno.EBADF, -1) and got[2] == (4096, 4096)


@libaio
def test_urgent_requests_pass_queued_background_ones(disk_tmp):
    """With background requests limited to one kernel slot, an urgent read submitted behind 64
    of them passes all those not yet in the kernel: it completes well before the last of them
    (the bound leaves the test thread ~15 ms between its two submissions on a loaded box)."""
    block, count = 1 << 20, 64
    path = disk_tmp / "lanes"
    path.write_bytes(os.urandom((count + 1) * block))
    with _direct_context(path, os.O_RDONLY, 4) as (fd, ctx):
        assert ctx.set_background_limit(0) == -errno.EINVAL
        assert ctx.set_background_limit(1) == 0
        buf, address = native.buffer_alloc((count + 1) * block, hugepage=False, populate=True)
        background = [(i, fd, native.IO_READ, address + i * block, i * block, block) for i in range(count)]
        assert ctx.submit(background) == count
        assert ctx.submit([(count, fd, native.IO_READ, address + count * block, count * block, block)],
                          urgent=True) == 1
        got = _reap_all(ctx, count + 1)
        order = [t for t, _, _ in got]
        assert order.index(count) < count // 2, order    # without the lane it comes last
        assert sorted(order) == list(range(count + 1)) and all(r == block for _, r, _ in got)
        assert bytes(buf) == path.read_bytes() and ctx.inflight() == 0


@libaio
def test_urgent_request_refused_by_the_kernel_completes_with_its_error(disk_tmp):
    path = disk_tmp / "ro-lanes"
    path.write_bytes(bytes(16 * 4096))
    with _direct_context(path, os.O_RDONLY, 2) as (fd, ctx):
        ctx.set_background_limit(1)
        buf, address = native.buffer_alloc(16 * 4096, hugepage=False, populate=True)
        assert ctx.submit([(i, fd, native.IO_READ, address + i * 4096, i * 4096, 4096) for i in range(8)]) == 8
        assert ctx.submit([(99, fd, native.IO_WRITE, address, 0, 4096)], urgent=True) == 1
        got = {t: (r, d) for t, r, d in _reap_all(ctx, 9)}
        assert got[99] == (-errno.EBADF, -1)
        assert all(got[i] == (4096, 4096) for i in range(8)) and ctx.inflight() == 0


@libaio
def test_lanes_mixed_in_partly_accepted_batches_all_complete(disk_tmp):
    """Batches of 4 per io_submit mixing both lanes, with a request the kernel refuses among them
    (a write on a read-only descriptor): io_submit takes part of a batch, the rest goes back to
    its lane, the refused one completes with its error, every other one with its bytes."""
    path = disk_tmp / "mixed"
    path.write_bytes(os.urandom(64 * 4096))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    ctx = native.AioContext(8, 4)
    try:
        ctx.set_background_limit(3)
        buf, address = native.buffer_alloc(64 * 4096, hugepage=False, populate=True)
        reads = [(i, fd, native.IO_READ, address + i * 4096, i * 4096, 4096) for i in range(64)]
        bad = [(100 + i, fd, native.IO_WRITE, address, 0, 4096) for i in range(3)]
        assert ctx.submit(reads[:32]) == 32
        assert ctx.submit([reads[32], bad[0], reads[33], bad[1]], urgent=True) == 4
        assert ctx.submit(reads[34:48] + [bad[2]] + reads[48:]) == 31
        got = {t: (r, d) for t, r, d in _reap_all(ctx, 67)}
        assert all(got[100 + i] == (-errno.EBADF, -1) for i in range(3))
        assert all(got[i] == (4096, 4096) for i in range(64)) and ctx.inflight() == 0
        assert bytes(buf) == path.read_bytes()
    finally:
        ctx.destroy()
        os.close(fd)
