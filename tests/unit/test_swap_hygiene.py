"""Swap files cannot outlive their process: no name on disk, 0600, private directory, space
freed by kill -9; leftovers of older versions and crashed runs are reported and reclaimed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offload
from offload import AioConfig
from offload.aio import AsyncIO, StripedFile, aligned_empty
from offload.cli import main
from offload.tiers.nvme import NvmeTier
from offload.tiers.swapfiles import find_leftovers, private_dir, reclaim_stale
from tests.helpers.processes import ROOT, python_env
from tests.helpers.tiny_gpt import TinyGPT, batches

KiB, MiB = 1 << 10, 1 << 20


def test_tier_swap_files_have_no_name_and_hold_their_space(disk_tmp):
    tier = NvmeTier([disk_tmp / "a", disk_tmp / "b"], AioConfig(backend="threads"))
    try:
        slots = tier.reserve_group("master", 3, 300 * KiB)
        file = slots[0].file
        assert file.unlinked and len(file.fds) == 2
        # Nothing by name in either directory, not even the private directory.
        assert os.listdir(disk_tmp / "a") == [] and os.listdir(disk_tmp / "b") == []
        for fd, want in zip(file.fds, file.member_sizes):
            st_ = os.fstat(fd)
            assert st_.st_nlink == 0 and stat.S_IMODE(st_.st_mode) == 0o600
            assert st_.st_size == want and st_.st_blocks * 512 >= want      # fallocated up front
            assert "offload-" in os.readlink(f"/proc/self/fd/{fd}")          # made in a private dir
        src = [aligned_empty(300 * KiB) for _ in slots]
        for i, (s, buf) in enumerate(zip(slots, src)):
            buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
            tier.write(s, buf).wait()
        for s, buf in zip(slots, src):
            back = aligned_empty(300 * KiB)
            tier.read(s, back).wait()
            assert torch.equal(back, buf)
    finally:
        tier.close()
    assert file.fds == ()


@settings(max_examples=12, deadline=None)
@given(dirs=st.integers(1, 3), pages=st.integers(1, 96), unit_pages=st.sampled_from([1, 4, 16]),
       at=st.integers(0, 95), n=st.integers(1, 96))
def test_unlinked_striped_round_trip(dirs, pages, unit_pages, at, n):
    base = ROOT / ".pytest-tmp"
    base.mkdir(exist_ok=True)
    root = Path(private_dir(base))
    try:
        ds = [root / str(i) for i in range(dirs)]
        for d in ds:
            d.mkdir()
        size = pages * 4096
        f = StripedFile(ds, "swap", size, stripe_unit=unit_pages * 4096, unlinked=True)
        try:
            assert all(os.listdir(d) == [] for d in ds)
            at, n = at % pages, min(n, pages - at % pages)
            with AsyncIO(AioConfig(backend="threads")) as io:
                src = torch.randint(0, 256, (n * 4096,), dtype=torch.uint8)
                io.write(src, f, at * 4096)
                back = torch.zeros_like(src)
                io.read(back, f, at * 4096)
                assert torch.equal(back, src)
        finally:
            f.close()
        with AsyncIO(AioConfig(backend="threads")) as io, pytest.raises(offload.NvmeIOError, match="closed"):
            io.read(torch.zeros(4096, dtype=torch.uint8), f, 0)   # a closed file is an error, not fd -1
    finally:
        shutil.rmtree(root)


def test_private_dir_is_0700_and_named_after_the_pid(disk_tmp):
    d = private_dir(disk_tmp)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert Path(d).name.startswith(f"offload-{os.getpid()}-")


HOLDER = textwrap.dedent("""
    import sys, time
    import torch, offload
    from tests.helpers.tiny_gpt import TinyGPT, batches
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="192KiB",
                         cpu_budget="256KiB", nvme_paths=[sys.argv[1]], chunk_size=8192))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    data = batches(4)
    for _ in range(2):
        x, y = next(data); model(x, y).backward(); opt.step(); opt.zero_grad()
    print("READY", flush=True)
    time.sleep(3600)                    # until the kill
""")


def _dead_pid() -> int:
    """A pid no process has: above the kernel's ``pid_max``, which no pid reaches."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


@pytest.mark.slow
def test_kill_9_leaves_no_file_in_the_nvme_directory(disk_tmp):
    nvme = disk_tmp / "nvme"
    nvme.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(nvme)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())
    try:
        line = proc.stdout.readline().strip()
        assert line == "READY", proc.stderr.read() if proc.poll() is not None else line
        # The run really holds swap files on that disk (unlinked, open by descriptor).
        held = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
        swaps = [h for h in held if h.startswith(f"{nvme}/offload-{proc.pid}-") and h.endswith(" (deleted)")]
        assert len(swaps) >= 4, held
        assert os.listdir(nvme) == []
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert os.listdir(nvme) == []


def test_leftovers_are_reported_with_sizes_and_reclaimed(disk_tmp, capsys):
    old = disk_tmp / "offload-7f00aa-param.swp"          # a named swap file of an older version
    with open(old, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 3 * MiB)
    dead = disk_tmp / f"offload-{_dead_pid()}-abc123"      # a crashed run's private directory
    dead.mkdir()
    with open(dead / "offload-1-master.swp", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, MiB)
    live = Path(private_dir(disk_tmp))                      # ours: alive, never touched
    (disk_tmp / "unrelated.swp").write_bytes(b"x")

    found = {Path(f.path).name: f for f in find_leftovers(disk_tmp)}
    assert set(found) == {old.name, dead.name, live.name}
    assert found[old.name].kind == "swap file" and found[old.name].nbytes >= 3 * MiB
    assert found[dead.name].nbytes >= MiB and not found[dead.name].in_use
    assert found[live.name].in_use

    # Leftovers are warnings, not errors: the verdict stays ready (a small pinned probe keeps
    # a GPU box's host memory out of it).
    assert main(["doctor", "--path", str(disk_tmp), "--json", "--pinned-bytes", "1M"]) == 0
    full = json.loads(capsys.readouterr().out)
    report = full["path"]
    assert report["leftover_bytes"] >= 4 * MiB
    assert {Path(x["path"]).name for x in report["leftovers"]} == set(found)
    warned = [f["message"] for f in full["findings"] if f["topic"] == "leftovers" and f["level"] == "warn"]
    assert len(warned) == 1 and old.name in warned[0] and dead.name in warned[0] and live.name not in warned[0]

    # A tier start reclaims dead private directories only; old named files wait for --clean.
    NvmeTier([disk_tmp], AioConfig(backend="threads")).close()
    assert not dead.exists() and old.exists() and live.exists()
    assert main(["doctor", "--path", str(disk_tmp), "--clean", "--json", "--pinned-bytes", "1M"]) == 0
    report = json.loads(capsys.readouterr().out)["path"]
    assert [x["removed"] for x in report["leftovers"] if x["kind"] == "swap file"] == [True]
    assert not old.exists() and live.exists() and (disk_tmp / "unrelated.swp").exists()
    assert reclaim_stale(disk_tmp) == []


def test_nvme_directory_removed_mid_run_changes_nothing(disk_tmp):
    def run(remove_at):
        nvme = disk_tmp / f"nvme-{remove_at}"
        torch.manual_seed(0)
        model = offload.wrap(TinyGPT(), offload.OffloadConfig(
            device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
            nvme_paths=[str(nvme)], chunk_size=8192))
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        data, losses = batches(4), []
        try:
            for step in range(4):
                if step == remove_at:
                    shutil.rmtree(nvme)
                x, y = next(data)
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses, {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            model.offload_engine.close()

    ref_losses, ref_state = run(-1)
    losses, state = run(2)
    assert losses == ref_losses
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def test_close_keeping_files_names_the_swap_files_in_each_nvme_directory(disk_tmp, capsys):
    """``close(keep_files=True)`` (``finetune_100b.py --keep-nvme``) leaves the swap files on disk as
    they were written, named ``<prefix>-<group>.swp`` in each NVMe directory, one stripe member
    per directory, where ``offload doctor`` lists them; a plain close leaves nothing."""
    def train(dirs):
        torch.manual_seed(0)
        model = offload.wrap(TinyGPT(), offload.OffloadConfig(
            device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
            nvme_paths=[str(d) for d in dirs], chunk_size=8192, aio=AioConfig(backend="threads")))
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches(2):
            model(x, y).backward()
            opt.step()
        model.offload_engine.adam.drain()
        model.offload_engine.store.wait_idle()
        return model.offload_engine

    plain = [disk_tmp / "plain-a", disk_tmp / "plain-b"]
    train(plain).close()
    assert os.listdir(plain[0]) == [] and os.listdir(plain[1]) == []

    dirs = [disk_tmp / "a", disk_tmp / "b"]
    engine = train(dirs)
    nvme = engine.store.tiers["nvme"]
    files = {group: (f.name, f.size) for group, f in nvme.files.items()}
    on_disk = next(r for r in engine.store.records.values() if r.nvme_valid)   # its bytes, as written
    written = aligned_empty(on_disk.slot.nbytes)
    nvme.read(on_disk.slot, written).wait()
    engine.close(keep_files=True)

    for d in dirs:
        assert sorted(os.listdir(d)) == sorted(name for name, _ in files.values())
    for name, size in files.values():
        kept = StripedFile(dirs, name, size, create=False)
        assert kept.exists()
        assert all(os.stat(p).st_nlink == 1 and stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in kept.paths)
    kept = StripedFile(dirs, on_disk.slot.file.name, on_disk.slot.file.size, create=False)
    back = bytearray()
    for member, at, _, n in kept.locate(on_disk.slot.offset, on_disk.slot.nbytes):
        with open(kept.paths[member], "rb") as f:
            f.seek(at)
            back += f.read(n)
    assert bytes(back) == written.numpy().tobytes()

    found = find_leftovers(dirs[0])
    assert {Path(f.path).name for f in found} == {name for name, _ in files.values()}
    assert all(f.kind == "swap file" and not f.in_use for f in found)
    assert main(["doctor", "--path", str(dirs[0]), "--clean", "--json"]) in (0, 1)
    capsys.readouterr()
    assert os.listdir(dirs[0]) == []
