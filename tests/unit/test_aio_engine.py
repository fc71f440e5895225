"""offload.aio.AsyncIO: one suite over both backends (round trips, striping, errors, checksums)."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload import AioConfig, ChecksumError, ConfigError, NvmeIOError, native
from offload.aio import AsyncIO, StripedFile, aligned_empty, choose_backend, free_bytes, supports_o_direct

HAVE_LIBAIO = native.libaio_linked()
BACKENDS = [pytest.param("libaio", marks=pytest.mark.skipif(not HAVE_LIBAIO, reason="built without libaio")),
            "threads"]
PAGE = 4096


def _random(nbytes: int, seed: int = 0) -> torch.Tensor:
    t = aligned_empty(nbytes)
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return t


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("aio")
    if free_bytes(path) < 256 << 20:
        pytest.skip("less than 256 MiB free for the I/O tests")
    ok, why = supports_o_direct(path)
    if not ok:
        pytest.skip(f"temp dir is not O_DIRECT-capable: {why}")
    return path


@pytest.fixture(scope="module", params=BACKENDS)
def io(request):
    # Small blocks and a short queue: every transfer is split and the pending list is used.
    engine = AsyncIO(AioConfig(backend=request.param, block_size=16384, queue_depth=4, threads=2))
    yield engine
    engine.close()


def test_backend_attribute(io):
    assert io.backend in ("libaio", "threads") and io.backend_reason


def test_round_trip_plain_file(io, disk_dir):
    path = str(disk_dir / f"plain-{io.backend}")
    src = _random(5 * 16384 + PAGE, seed=1)
    io.wait(io.write_from(src, path, 3 * PAGE))
    dst = aligned_empty(src.numel())
    io.read(dst, path, 3 * PAGE)
    assert torch.equal(src, dst)
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_other_dtypes_and_views(io, disk_dir):
    path = str(disk_dir / f"dtypes-{io.backend}")
    big = aligned_empty(4 * PAGE, torch.float32)
    big.copy_(torch.randn(big.numel()))
    view = big[PAGE:2 * PAGE]                       # 4096 float32 = 16 KiB at a 16 KiB offset
    io.write(view, path, 0)
    back = aligned_empty(PAGE, torch.float32)
    io.read(back, path, 0)
    assert torch.equal(back, view)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_concurrent_round_trips(io, disk_dir, data):
    """Random sizes, offsets and number of requests in flight: every byte comes back.

    libaio needs 4096-aligned sizes and offsets; the thread backend gets arbitrary ones.
    """
    aligned = io.backend == "libaio"
    size = st.integers(1, 40).map(lambda k: k * PAGE) if aligned else st.integers(1, 160_000)
    gap = st.integers(0, 6).map(lambda k: k * PAGE) if aligned else st.integers(0, 20_000)
    n = data.draw(st.integers(1, 8), label="requests in flight")
    pos = data.draw(gap, label="start")
    srcs, offsets = [], []
    for i in range(n):
        nbytes = data.draw(size, label=f"size {i}")
        srcs.append(_random(nbytes, seed=pos))
        offsets.append(pos)
        pos += nbytes + data.draw(gap, label=f"gap {i}")
    path = str(disk_dir / f"hyp-{io.backend}")
    io.wait([io.write_from(s, path, o) for s, o in zip(srcs, offsets)])
    dsts = [aligned_empty(s.numel()) for s in srcs]
    io.wait([io.read_into(d, path, o) for d, o in zip(dsts, offsets)])
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


@pytest.mark.parametrize("ndirs", [1, 2, 3, 4])
def test_striping_round_trip(io, disk_dir, ndirs):
    dirs = [disk_dir / f"stripe-{io.backend}-{ndirs}-{i}" for i in range(ndirs)]
    for d in dirs:
        d.mkdir(exist_ok=True)
    size = 10 * 16384 + 3 * PAGE
    sf = StripedFile(dirs, "swap", size, stripe_unit=16384)
    try:
        assert sum(os.stat(p).st_size for p in sf.paths) == size
        assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in sf.paths)
        src = _random(size, seed=ndirs)
        io.write(src, sf, 0)
        dst = aligned_empty(size)
        io.read(dst, sf, 0)
        assert torch.equal(src, dst)
        # A middle range crossing several stripes.
        part = aligned_empty(5 * 16384)
        io.read(part, sf, 16384 + PAGE)
        assert torch.equal(part, src[16384 + PAGE:16384 + PAGE + part.numel()])
        # The bytes really are spread: member 0 holds stripe 0, member 1 (if any) stripe 1.
        with open(sf.paths[-1], "rb") as f:
            first = f.read(16384)
        k = ndirs - 1
        assert first == bytes(src[k * 16384:(k + 1) * 16384].numpy())
        # Reopening reuses the files as they are.
        again = StripedFile(dirs, "swap", size, stripe_unit=16384)
        assert again.exists()
        io.read(dst, again, 0)
        assert torch.equal(src, dst)
        with pytest.raises(NvmeIOError) as exc:
            io.read_into(aligned_empty(2 * PAGE), sf, size - PAGE)
        assert exc.value.errno == errno.EINVAL
    finally:
        sf.remove()
    assert not any(os.path.exists(p) for p in sf.paths)


def test_missing_file_is_enoent(io, disk_dir):
    path = str(disk_dir / "does-not-exist")
    with pytest.raises(NvmeIOError) as exc:
        io.read_into(aligned_empty(PAGE), path, 0)
    assert exc.value.errno == errno.ENOENT and exc.value.path == path and exc.value.length == PAGE


def test_truncated_file_is_an_error_not_zeros(io, disk_dir):
    path = str(disk_dir / f"trunc-{io.backend}")
    src = _random(4 * 16384, seed=3)
    io.write(src, path, 0)
    os.truncate(path, 16384 + PAGE)
    dst = aligned_empty(src.numel())
    with pytest.raises(NvmeIOError) as exc:
        io.read(dst, path, 0)
    assert exc.value.errno == errno.EIO and exc.value.path == path
    assert exc.value.offset == 16384 and exc.value.length == 16384    # the first short piece


def test_unwritable_path(io, disk_dir):
    path = str(disk_dir / "no-such-dir" / "f")
    with pytest.raises(NvmeIOError) as exc:
        io.write_from(aligned_empty(PAGE), path, 0)
    assert exc.value.errno == errno.ENOENT and exc.value.path == path


def test_bad_requests(io, disk_dir):
    path = str(disk_dir / "bad")
    with pytest.raises(NvmeIOError) as exc:
        io.write_from(torch.zeros(8, 8).t(), path, 0)
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(NvmeIOError):
        io.write_from(aligned_empty(PAGE), path, -1)
    assert io.wait(io.write_from(torch.empty(0), path, 0)) == 0


def test_unaligned_requests(io, disk_dir):
    path = str(disk_dir / f"unaligned-{io.backend}")
    buf = aligned_empty(3 * PAGE)
    cases = [(buf[1:PAGE + 1], 0), (buf[:100], 0), (buf[:PAGE], 512)]
    for tensor, offset in cases:
        if io.backend == "libaio":
            with pytest.raises(NvmeIOError) as exc:
                io.write_from(tensor, path, offset)
            assert exc.value.errno == errno.EINVAL and "4096" in str(exc.value)
        else:
            io.write(tensor, path, offset)      # the thread backend takes any size and offset
            back = torch.empty_like(tensor)
            io.read(back, path, offset)
            assert torch.equal(back, tensor)


def test_wait_after_failure_leaves_nothing_in_flight(io, disk_dir):
    path = str(disk_dir / f"mixed-{io.backend}")
    io.write(_random(2 * PAGE), path, 0)
    good = aligned_empty(2 * PAGE)
    bad = aligned_empty(8 * PAGE)
    hs = [io.read_into(good, path, 0), io.read_into(bad, path, 0)]
    with pytest.raises(NvmeIOError):
        io.wait(hs)
    assert all(h.done() for h in hs) and hs[0].error is None and hs[1].error.errno == errno.EIO


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_engine_refuses(backend, disk_dir):
    path = str(disk_dir / f"closed-{backend}")
    with AsyncIO(AioConfig(backend=backend)) as io:
        h = io.write_from(_random(PAGE), path, 0)
    assert h.done() and io.closed            # close finished the request first
    with pytest.raises(NvmeIOError) as exc:
        io.read_into(aligned_empty(PAGE), path, 0)
    assert exc.value.errno == errno.EBADF and exc.value.path == path
    io.close()                                 # idempotent


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksum_detects_corruption(backend, disk_dir):
    path = str(disk_dir / f"crc-{backend}")
    with AsyncIO(AioConfig(backend=backend, block_size=16384, checksum=True)) as io:
        src = _random(4 * 16384, seed=9)
        io.write(src, path, 0)
        dst = aligned_empty(src.numel())
        io.read(dst, path, 0)
        assert torch.equal(src, dst)
        with open(path, "r+b") as f:                 # flip one byte of block 2 behind its back
            f.seek(2 * 16384 + 5)
            byte = f.read(1)
            f.seek(2 * 16384 + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ChecksumError) as exc:
            io.read(dst, path, 0)
        assert exc.value.offset == 2 * 16384 and exc.value.length == 16384 and exc.value.path == path
        io.write(src, path, 0)                       # rewriting heals it
        io.read(dst, path, 0)


def test_choose_backend_and_logging(disk_dir, caplog):
    assert choose_backend(AioConfig(backend="threads"))[0] == "threads"
    with caplog.at_level(logging.INFO, logger="offload.aio"):
        with AsyncIO(AioConfig(), paths=[disk_dir]) as io:
            pass
    lines = [r for r in caplog.records if r.name == "offload.aio"]
    assert len(lines) == 1 and io.backend in lines[0].getMessage()
    assert io.backend == ("libaio" if HAVE_LIBAIO else "threads")


def test_libaio_unavailable_is_a_config_error(monkeypatch):
    monkeypatch.setattr(native, "libaio_linked", lambda: False)
    with pytest.raises(ConfigError) as exc:
        AsyncIO(AioConfig(backend="libaio"))
    assert exc.value.field == "aio.backend"
    assert choose_backend(AioConfig())[0] == "threads"


def test_supports_o_direct(disk_dir, tmp_path):
    ok, why = supports_o_direct(disk_dir)
    assert ok and str(disk_dir) in why
    assert os.listdir(disk_dir) is not None and not any(n.startswith(".offload-odirect") for n in os.listdir(disk_dir))
    ok, why = supports_o_direct(tmp_path / "missing")
    assert not ok and "not a directory" in why


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_thread_backend_on_tmpfs():
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        with AsyncIO(AioConfig(backend="threads", block_size=8192, threads=3)) as io:
            src = _random(50_000 * 3, seed=4)[:50_001 * 2]   # odd size: no alignment needed
            path = os.path.join(d, "f")
            io.write(src, path, 77)
            dst = torch.empty_like(src)
            io.read(dst, path, 77)
            assert torch.equal(src, dst)
            sf = StripedFile([d], "s", 64 * PAGE, stripe_unit=8192)
            io.write(_random(64 * PAGE), sf, 0)
            sf.remove()
