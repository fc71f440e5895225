"""Real I/O faults from the kernel under the NVMe tier, not simulated ones.

A small ext4 is made on a loop device and the engine's ``nvme_paths`` put on it; then the
block device starts failing mid-run, and every request to it ends with EIO from the kernel:

* ``dm-error`` / ``dm-flakey``: a device-mapper ``linear`` target over the loop device is
  swapped for an ``error`` target, or a ``flakey`` one that is always down (needs dm in the
  kernel; skipped with the reason where ``dmsetup`` cannot reach it);
* ``loop-shrink``: the loop device is shrunk under the filesystem (``losetup -c`` after
  truncating its image), so the block layer fails every access beyond the new end -- the same
  EIO, available wherever loop devices are.

Expected: ``NvmeIOError`` naming the swap file, offset and length within seconds, no hang and
no abort, the engine closeable (after which nothing holds the filesystem), the last checkpoint
(on another disk) loadable. Also: the disk filling while swap files are created is refused
before training starts, leaving nothing behind. Everything is undone in ``finally`` blocks.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import offload
from offload import AioConfig
from offload.tiers.nvme import NvmeTier
from tests.helpers.processes import python_env
from tests.helpers.tiny_gpt import TinyGPT, batches

pytestmark = [pytest.mark.nvme, pytest.mark.slow]
MiB = 1 << 20
_names = itertools.count()


# dmsetup makes its device nodes itself instead of waiting for a udev that containers lack.
DM_ENV = {**os.environ, "DM_DISABLE_UDEV": "1"}


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60, env=DM_ENV)


def _dm_unavailable() -> str | None:
    if not shutil.which("dmsetup"):
        return "dmsetup is not installed"
    done = _run("dmsetup", "version", check=False)
    if done.returncode != 0 or "Driver version" not in done.stdout:
        why = (done.stderr.strip().splitlines() or ["no driver version"])[0]
        return f"device-mapper is not available in this kernel ({why})"
    return None


class FaultyDisk:
    """An ext4 filesystem on a loop device (optionally under device-mapper) that can be made to fail."""

    def __init__(self, base: Path, mechanism: str, size: int):
        self.base, self.mechanism, self.size = base, mechanism, size
        self.img = base / "disk.img"
        self.mnt = base / "mnt"
        self.loop: str | None = None
        self.dm: str | None = None
        self.mounted = False

    @property
    def sectors(self) -> int:
        return self.size // 512

    def _dm_table(self, target: str) -> str:
        if target == "linear":
            return f"0 {self.sectors} linear {self.loop} 0"
        if target == "error":
            return f"0 {self.sectors} error"
        return f"0 {self.sectors} flakey {self.loop} 0 0 1"      # up 0 s, down 1 s: always down

    def _dm_swap(self, target: str) -> None:
        _run("dmsetup", "suspend", "--noflush", self.dm)
        _run("dmsetup", "load", self.dm, "--table", self._dm_table(target))
        _run("dmsetup", "resume", self.dm)

    def fail_command(self) -> list[str]:
        """A command that makes every further request to the device fail with EIO."""
        if self.mechanism == "loop-shrink":
            return ["sh", "-c", f"truncate -s 1M {self.img} && losetup -c {self.loop}"]
        target = "error" if self.mechanism == "dm-error" else "flakey"
        return ["sh", "-c", f"dmsetup suspend --noflush {self.dm} && dmsetup load {self.dm} --table "
                            f"'{self._dm_table(target)}' && dmsetup resume {self.dm}"]

    def heal(self) -> None:
        if self.mechanism == "loop-shrink":
            if self.loop:
                os.truncate(self.img, self.size)
                _run("losetup", "-c", self.loop, check=False)
        elif self.dm:
            with contextlib.suppress(subprocess.CalledProcessError):
                self._dm_swap("linear")

    def __enter__(self) -> "FaultyDisk":
        if os.geteuid() != 0:
            pytest.skip("loop devices and mounts need root")
        for tool in ("losetup", "mkfs.ext4", "mount"):
            if not shutil.which(tool):
                pytest.skip(f"{tool} is not installed")
        if self.mechanism.startswith("dm-"):
            why = _dm_unavailable()
            if why:
                pytest.skip(why)
        with open(self.img, "wb") as f:
            f.truncate(self.size)
        try:
            self.loop = _run("losetup", "-f", "--show", str(self.img)).stdout.strip()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"no loop device: {exc.stderr.strip()}")
        try:
            dev = self.loop
            if self.mechanism.startswith("dm-"):
                self.dm = f"offload-test-{os.getpid()}-{next(_names)}"
                _run("dmsetup", "create", self.dm, "--table", self._dm_table("linear"))
                dev = f"/dev/mapper/{self.dm}"
            _run("mkfs.ext4", "-q", "-F", dev)
            self.mnt.mkdir()
            _run("mount", dev, str(self.mnt))
            self.mounted = True
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def unmount(self) -> bool:
        """Unmount; True when nothing held the filesystem (no lazy unmount needed)."""
        if not self.mounted:
            return True
        self.mounted = False
        if _run("umount", str(self.mnt), check=False).returncode == 0:
            return True
        _run("umount", "-l", str(self.mnt), check=False)
        return False

    def __exit__(self, *exc) -> None:
        try:
            self.heal()
            self.unmount()
        finally:
            if self.dm:
                _run("dmsetup", "remove", "--retry", self.dm, check=False)
            if self.loop:
                _run("losetup", "-d", self.loop, check=False)
            self.img.unlink(missing_ok=True)


MECHANISMS = ["loop-shrink", "dm-error", "dm-flakey"]

# Runs in a child process, so that a hang is a timeout of this test, not of the whole suite.
SCENARIO = textwrap.dedent("""
    import json, subprocess, sys, time
    import torch, offload
    from tests.helpers.tiny_gpt import TinyGPT, batches
    nvme, ckpt, fail, where = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="192KiB",
                         cpu_budget="256KiB", nvme_paths=[nvme], chunk_size=8192))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    data = batches(50)
    def step():
        x, y = next(data); model(x, y).backward(); opt.step(); opt.zero_grad()
    step(); step()
    offload.save_checkpoint(model, opt, ckpt, step=2)
    x, y = next(data)
    loss = model(x, y)
    if where == "backward":          # fail between forward and backward: the step is mid-flight
        subprocess.run(fail, check=True)
    else:
        loss.backward(); opt.step(); opt.zero_grad()
        subprocess.run(fail, check=True)
    t0 = time.monotonic()
    out = {}
    try:
        if where == "backward":
            loss.backward(); opt.step(); opt.zero_grad()
        for _ in range(3):
            step()
        out["error"] = None
    except offload.NvmeIOError as exc:
        out["error"] = {"type": type(exc).__name__, "errno": exc.errno, "path": exc.path, "offset": exc.offset,
                        "length": exc.length, "message": str(exc)}
    except Exception as exc:
        out["error"] = {"type": type(exc).__name__, "message": str(exc)}
    out["seconds"] = time.monotonic() - t0
    try:
        model.offload_engine.close()
        out["close"] = "ok"
    except offload.NvmeIOError as exc:      # updates still queued hit the same dead disk: reported, not hung
        out["close"] = f"raised {exc.errno}"
    print(json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("where", ["backward", "forward"])
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_eio_mid_step_is_named_bounded_and_recoverable(disk_tmp, mechanism, where):
    ckpt = disk_tmp / "ckpt"                  # another disk: the checkpoint outlives the NVMe one
    with FaultyDisk(disk_tmp, mechanism, 48 * MiB) as disk:
        done = subprocess.run([sys.executable, "-c", SCENARIO, str(disk.mnt), str(ckpt),
                               json.dumps(disk.fail_command()), where],
                              capture_output=True, text=True, timeout=180,
                              env=python_env(DM_DISABLE_UDEV="1", OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stderr[-3000:]          # no abort
        out = json.loads(done.stdout.strip().splitlines()[-1])
        err = out["error"]
        assert err is not None and err["type"] == "NvmeIOError", out
        assert err["errno"] == errno.EIO
        assert err["path"].startswith(str(disk.mnt)) and err["path"].endswith(".swp")
        assert err["offset"] >= 0 and err["offset"] % 4096 == 0 and err["length"] > 0
        assert f"offset {err['offset']} length {err['length']}" in err["message"]
        assert out["seconds"] < 30                                  # bounded: no retry loop, no hang
        assert out["close"] in ("ok", f"raised {errno.EIO}")
        disk.heal()
        assert disk.unmount(), "a descriptor of the closed engine still holds the filesystem"
    model = offload.wrap(TinyGPT(), offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="192KiB",
                                                          cpu_budget="256KiB", nvme_paths=[str(disk_tmp / "nvme")],
                                                          chunk_size=8192))
    try:
        assert offload.load_checkpoint(model, offload.AdamW(model.parameters(), lr=1e-2), ckpt)["step"] == 2
    finally:
        model.offload_engine.close()


def test_disk_full_before_training_is_refused_and_leaves_nothing(disk_tmp):
    with FaultyDisk(disk_tmp, "loop-shrink", 16 * MiB) as disk:
        free = shutil.disk_usage(disk.mnt).free
        # The model's state is larger than the disk: refused at wrap time, before any step.
        with pytest.raises((offload.TierFullError, offload.NvmeIOError)) as info:
            offload.wrap(TinyGPT(d=256, layers=4), offload.OffloadConfig(
                device="cpu", dtype="fp32", device_budget="8MiB", cpu_budget="4MiB",
                nvme_paths=[str(disk.mnt)], chunk_size=1 << 18))
        assert "nvme" in str(info.value) or str(disk.mnt) in str(info.value)
        assert os.listdir(disk.mnt) == ["lost+found"]
        # The disk fills between measuring it and creating the files (another process's file):
        # fallocate fails with ENOSPC naming the swap file; nothing is left, the space comes back.
        tier = NvmeTier([disk.mnt], AioConfig(backend="threads"))
        try:
            hog = disk.mnt / "hog"
            with open(hog, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, free - 2 * MiB)
            with pytest.raises(offload.NvmeIOError) as info:
                tier.reserve_group("master", 2, 3 * MiB)
            assert info.value.errno == errno.ENOSPC and info.value.path.endswith("master.swp")
            assert "fallocate" in str(info.value) and info.value.length > 0
            assert sorted(os.listdir(disk.mnt)) == ["hog", "lost+found"]
            hog.unlink()
            assert shutil.disk_usage(disk.mnt).free >= free - MiB
            tier.reserve_group("master", 2, 3 * MiB)            # with room again, it works
        finally:
            tier.close()
        assert disk.unmount()


def test_checkpoint_on_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(disk_tmp):
    with FaultyDisk(disk_tmp, "loop-shrink", 16 * MiB) as disk:
        ckpt = disk.mnt / "ckpt"
        model = offload.wrap(TinyGPT(), offload.OffloadConfig(
            device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
            nvme_paths=[str(disk_tmp / "nvme")], chunk_size=8192))
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        try:
            x, y = next(batches(1))
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            first = offload.save_checkpoint(model, opt, ckpt, step=1)
            size = sum(p.stat().st_size for p in first.iterdir())
            st = os.statvfs(disk.mnt)
            free = st.f_bfree * st.f_frsize                          # root may use the reserved blocks too
            with open(disk.mnt / "hog", "wb") as f:                  # leave room for half a checkpoint
                os.posix_fallocate(f.fileno(), 0, free - size // 2)
            with pytest.raises(offload.NvmeIOError) as info:
                offload.save_checkpoint(model, opt, ckpt, step=2)
            assert info.value.errno == errno.ENOSPC and "\n" not in str(info.value)
            assert str(ckpt) in info.value.path
            assert sorted(p.name for p in ckpt.iterdir()) == ["latest", first.name]     # no step-2, no temp dir
            assert offload.load_checkpoint(model, opt, ckpt)["step"] == 1
        finally:
            model.offload_engine.close()
