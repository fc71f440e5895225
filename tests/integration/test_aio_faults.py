"""Fault injection for offload.aio: full filesystems, files truncated or corrupted behind the
engine's back, a closed engine. Full-filesystem tests mount a small loop ext4 image or a
tmpfs with size= and need root; they skip cleanly otherwise."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess

import pytest
import torch

from offload import AioConfig, ChecksumError, NvmeIOError, native
from offload.aio import AsyncIO, StripedFile, aligned_empty

pytestmark = [pytest.mark.nvme, pytest.mark.slow]
HAVE_LIBAIO = native.libaio_linked()
needs_libaio = pytest.mark.skipif(not HAVE_LIBAIO, reason="offload._native built without libaio")
BACKENDS = [pytest.param("libaio", marks=needs_libaio), "threads"]
MiB = 1 << 20


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def _mounted(base, kind: str):
    """A small full-able filesystem under ``base``: 'ext4' (16 MiB loop image) or 'tmpfs' (8 MiB)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mnt = base / f"mnt-{kind}"
    mnt.mkdir()
    try:
        if kind == "ext4":
            if not shutil.which("mkfs.ext4"):
                pytest.skip("mkfs.ext4 not installed")
            img = base / "small.img"
            with open(img, "wb") as f:
                f.truncate(16 * MiB)
            _run("mkfs.ext4", "-q", "-F", str(img))
            _run("mount", "-o", "loop", str(img), str(mnt))
        else:
            _run("mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt))
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a {kind} test filesystem here: {exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)


def _fill(io: AsyncIO, path, total: int) -> NvmeIOError:
    buf = aligned_empty(4 * MiB)
    handles = [io.write_from(buf, path, off) for off in range(0, total, buf.numel())]
    with pytest.raises(NvmeIOError) as exc:
        io.wait(handles, timeout=60)             # a full disk is an error, never a hang
    assert all(h.done() for h in handles)
    return exc.value


@pytest.mark.parametrize("backend,kind", [pytest.param("libaio", "ext4", marks=needs_libaio),
                                          ("threads", "ext4"), ("threads", "tmpfs")])
def test_full_filesystem_is_enospc(disk_tmp, backend, kind):
    with _mounted(disk_tmp, kind) as mnt, AsyncIO(AioConfig(backend=backend)) as io:
        path = str(mnt / "big")
        err = _fill(io, path, 32 * MiB)
        assert err.errno == errno.ENOSPC and err.path == path and err.length > 0
        assert err.offset < 16 * MiB
        # Preallocating a striped file that cannot fit is refused up front, files removed.
        with pytest.raises(NvmeIOError) as exc:
            StripedFile([mnt], "swap", 64 * MiB)
        assert exc.value.errno == errno.ENOSPC and not os.path.exists(mnt / "swap")


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_striped_file_reads_fail_not_zeros(disk_tmp, backend):
    dirs = [disk_tmp / "a", disk_tmp / "b"]
    for d in dirs:
        d.mkdir()
    sf = StripedFile(dirs, "swap", 8 * MiB)
    try:
        with AsyncIO(AioConfig(backend=backend)) as io:
            src = aligned_empty(8 * MiB)
            src.copy_(torch.randint(1, 256, (8 * MiB,), dtype=torch.uint8))
            io.write(src, sf, 0)
            os.truncate(sf.paths[1], MiB)            # member b loses 3 of its 4 stripes
            dst = aligned_empty(8 * MiB)
            with pytest.raises(NvmeIOError) as exc:
                io.read(dst, sf, 0)
            assert exc.value.errno == errno.EIO and exc.value.path == sf.paths[1]
            assert exc.value.offset == MiB           # member offset of the first lost stripe
            assert "short read" in str(exc.value)
    finally:
        sf.remove()


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_through_closed_engine(disk_tmp, backend):
    io = AsyncIO(AioConfig(backend=backend))
    path = str(disk_tmp / "f")
    io.write(aligned_empty(MiB), path, 0)
    io.close()
    with pytest.raises(NvmeIOError) as exc:
        io.read_into(aligned_empty(MiB), path, 0)
    assert exc.value.errno == errno.EBADF


@pytest.mark.parametrize("backend", BACKENDS)
def test_crc_mismatch_in_a_striped_file(disk_tmp, backend):
    sf = StripedFile([disk_tmp], "swap", 4 * MiB)
    try:
        with AsyncIO(AioConfig(backend=backend, checksum=True)) as io:
            src = aligned_empty(4 * MiB)
            src.copy_(torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8))
            io.write(src, sf, 0)
            fd = os.open(sf.paths[0], os.O_RDWR)
            try:
                os.pwrite(fd, b"\0\1\2\3", 3 * MiB + 12345)
                os.fsync(fd)
            finally:
                os.close(fd)
            dst = aligned_empty(4 * MiB)
            with pytest.raises(ChecksumError) as exc:
                io.read(dst, sf, 0)
            assert exc.value.offset == 3 * MiB and exc.value.length == MiB
    finally:
        sf.remove()
