"""Checkpoints: bit-identical resume (fp32, bf16), kill -9 during a save, corruption and layout
errors; safetensors export/load round trip and shape errors.

Budgets are small and an NVMe directory is set, so chunks live on every tier when saved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import offload
from offload.checkpoint import list_checkpoints
from tests.helpers.processes import python_env
from tests.helpers.reference import LR, WD
from tests.helpers.tiny_gpt import TinyGPT, batches

pytestmark = pytest.mark.slow


def config(path, dtype="fp32", **kw) -> offload.OffloadConfig:
    base = dict(device="cpu", dtype=dtype, device_budget="192KiB", cpu_budget="256KiB",
                nvme_paths=[str(path)], chunk_size=8192)
    base.update(kw)
    return offload.OffloadConfig(**base)


def build(path, dtype="fp32", seed=0, **model_kw):
    torch.manual_seed(seed)
    model = offload.wrap(TinyGPT(**model_kw), config(path, dtype))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return model, opt


def train(model, opt, data, steps):
    losses = []
    for _ in range(steps):
        x, y = next(data)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def params_of(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def tiers_holding(model):
    report = model.offload_engine.store.memory_report()["tiers"]
    return {t for t, info in report.items() if info["bytes_by_kind"]}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_is_bit_identical(disk_tmp, dtype):
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    model, opt = build(nvme, dtype)
    data = batches(6)
    losses = train(model, opt, data, 3)
    with torch.no_grad():                    # an evaluation pass leaves parameter chunks on the device
        model(*next(batches(1, seed=9)))
    # Every tier holds some chunk: the checkpoint reads from all of them (on a CPU-only machine
    # the device and CPU tiers are one).
    assert tiers_holding(model) == set(model.offload_engine.store.order)
    path = offload.save_checkpoint(model, opt, ckpt, step=3, extra={"data_position": 3})
    assert path == ckpt / "step-00000003" and (ckpt / "latest").read_text().strip() == path.name
    losses += train(model, opt, data, 3)
    final = params_of(model)
    model.offload_engine.close()

    # A fresh model (different initial weights) resumes from step 3.
    model2, opt2 = build(nvme, dtype, seed=123)
    manifest = offload.load_checkpoint(model2, opt2, ckpt)
    assert manifest["extra"] == {"data_position": 3} and manifest["step"] == 3
    assert model2.offload_engine.step_count == 3
    data2 = batches(6)
    for _ in range(manifest["extra"]["data_position"]):
        next(data2)
    resumed = train(model2, opt2, data2, 3)
    assert resumed == losses[3:]
    after = params_of(model2)
    for k in final:
        assert torch.equal(final[k], after[k]), k
    sd1 = opt2.state_dict()
    assert all(float(s["step"]) == 6 for s in sd1["state"].values())


def test_optimizer_hypers_scaler_and_fp16(disk_tmp):
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    model, opt = build(nvme, "fp16")
    data = batches(4)
    train(model, opt, data, 2)
    opt.param_groups[0]["lr"] = 3e-3
    engine = model.offload_engine
    engine.scaler.scale, engine.scaler.good_steps = 1024.0, 7
    assert engine.scaler.skipped == 1 and engine.step_count == 1     # the first step overflowed
    path = offload.save_checkpoint(model, opt, ckpt)     # step defaults to the engine's count
    model2, opt2 = build(nvme, "fp16", seed=5)
    offload.load_checkpoint(model2, opt2, ckpt)
    assert opt2.param_groups[0]["lr"] == 3e-3
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    e2 = model2.offload_engine
    assert path.name == "step-00000001"
    assert (e2.scaler.scale, e2.scaler.good_steps, e2.scaler.skipped, e2.step_count) == (1024.0, 7, 1, 1)
    x, y = next(data)
    assert train(model2, opt2, iter([(x, y)]), 1) == train(model, opt, iter([(x, y)]), 1)
    for a, b in zip(params_of(model).values(), params_of(model2).values()):
        assert torch.equal(a, b)


def test_save_refused_mid_window_and_keep(disk_tmp):
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    model, opt = build(nvme)
    data = batches(5)
    x, y = next(data)
    model(x, y).backward()
    with pytest.raises(offload.OffloadError, match="after optimizer.step"):
        offload.save_checkpoint(model, opt, ckpt)
    opt.step()
    opt.zero_grad()
    for s in range(1, 5):
        offload.save_checkpoint(model, opt, ckpt, step=s, keep=2)
        if s < 4:
            train(model, opt, data, 1)
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-00000003", "step-00000004"]
    # Re-saving an existing step replaces it.
    offload.save_checkpoint(model, opt, ckpt, step=4, keep=2)
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-00000003", "step-00000004"]
    assert offload.load_checkpoint(model, opt, ckpt, step=3)["step"] == 3


def test_corrupt_chunk_and_truncated_file_raise(disk_tmp):
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    model, opt = build(nvme, "bf16")
    train(model, opt, batches(2), 2)
    path = offload.save_checkpoint(model, opt, ckpt, step=2)
    manifest = json.loads((path / "manifest.json").read_text())
    entry = manifest["kinds"]["exp_avg"]["chunks"][1]
    f = path / "exp_avg.bin"
    raw = bytearray(f.read_bytes())
    raw[entry["offset"] + 100] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(offload.ChecksumError, match=r"exp_avg\[1\].*exp_avg.bin|exp_avg.bin.*exp_avg\[1\]") as info:
        offload.load_checkpoint(model, opt, ckpt)
    assert str(f) in str(info.value)
    f.write_bytes(bytes(raw[:-4096]))
    with pytest.raises(offload.ChecksumError, match="truncated"):
        offload.load_checkpoint(model, opt, ckpt)


def test_layout_mismatch_names_the_parameter(disk_tmp):
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    model, opt = build(nvme)
    offload.save_checkpoint(model, opt, ckpt, step=0)
    other, other_opt = build(nvme, vocab=80)
    with pytest.raises(offload.ConfigError, match="wte.weight"):
        offload.load_checkpoint(other, other_opt, ckpt)
    bf, bf_opt = build(nvme, "bf16")
    with pytest.raises(offload.ConfigError, match="dtype"):
        offload.load_checkpoint(bf, bf_opt, ckpt)


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch, offload, offload.checkpoint as ck, offload.checkpoint.files as ckfiles
    from tests.helpers.tiny_gpt import TinyGPT, batches
    nvme, ckpt, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), offload.OffloadConfig(device="cpu", dtype=dtype, device_budget="192KiB",
                         cpu_budget="256KiB", nvme_paths=[nvme], chunk_size=8192))
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(4)
    def train(n):
        for _ in range(n):
            x, y = next(data); model(x, y).backward(); opt.step(); opt.zero_grad()
    train(2)
    ck.save_checkpoint(model, opt, ckpt, step=2, extra={"pos": 2})
    print("A", flush=True)
    train(1)
    slow = ckfiles.write_chunk
    def paused(writer, data):
        slow(writer, data)
        print("PAUSED", flush=True)
        time.sleep(3600)                    # until the kill
    ckfiles.write_chunk = paused
    ck.save_checkpoint(model, opt, ckpt, step=3, extra={"pos": 3})
    print("B", flush=True)
""")


def test_kill_during_save_keeps_previous_checkpoint(disk_tmp):
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(nvme), str(ckpt), "bf16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.strip() == "PAUSED":
                break
        assert lines == ["A", "PAUSED"], (lines, proc.stderr.read() if proc.poll() is not None else "")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stale = [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    assert stale == [f".tmp-step-00000003-{proc.pid}"]
    assert (ckpt / "latest").read_text().strip() == "step-00000002"

    model, opt = build(nvme, "bf16", seed=9)
    manifest = offload.load_checkpoint(model, opt, ckpt)
    assert manifest["step"] == 2 and manifest["extra"] == {"pos": 2}
    # Same as an uninterrupted run from the start: step 3's loss matches.
    ref, ref_opt = build(nvme, "bf16")
    data = batches(4)
    train(ref, ref_opt, data, 2)
    resumed_data = batches(4)
    for _ in range(manifest["extra"]["pos"]):
        next(resumed_data)
    assert train(model, opt, resumed_data, 1) == train(ref, ref_opt, data, 1)
    # The next save removes the dead process's temp directory.
    offload.save_checkpoint(model, opt, ckpt, step=3)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-00000002", "step-00000003"]


def test_latest_missing_falls_back_to_newest_complete(disk_tmp):
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    model, opt = build(nvme)
    offload.save_checkpoint(model, opt, ckpt, step=1)
    offload.save_checkpoint(model, opt, ckpt, step=2)
    (ckpt / "latest").unlink()
    (ckpt / "step-00000005").mkdir()             # incomplete: no manifest
    assert offload.load_checkpoint(model, opt, ckpt)["step"] == 2
    assert offload.load_checkpoint(model, opt, ckpt / "step-00000001")["step"] == 1
    with pytest.raises(offload.OffloadError, match="no checkpoint"):
        offload.load_checkpoint(model, opt, disk_tmp / "empty")


# ---- safetensors ------------------------------------------------------------------------------
def test_safetensors_round_trip(disk_tmp):
    safetensors = pytest.importorskip("safetensors")
    nvme, out = disk_tmp / "nvme", disk_tmp / "hf"
    nvme.mkdir()
    model, opt = build(nvme, "bf16")
    train(model, opt, batches(2), 2)
    want = params_of(model)                      # fp32 masters
    files = offload.export_safetensors(model, out, max_shard_bytes=20_000, dtype=torch.float32)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == {f.name for f in files}
    assert "head.weight" not in index["weight_map"]         # tied to wte.weight
    with safetensors.safe_open(str(out / index["weight_map"]["wte.weight"]), "pt") as f:
        assert torch.equal(f.get_tensor("wte.weight"), want["wte.weight"])

    fresh, _ = build(nvme, "bf16", seed=77)
    report = offload.load_safetensors(fresh, out)
    assert report["missing"] == [] and report["unexpected"] == []
    got = params_of(fresh)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert fresh.head.weight is fresh.wte.weight

    # A file with only some tensors (strict=False) keeps the other parameters of their chunks.
    from safetensors.torch import save_file

    save_file({"pos": torch.ones(16, 32), "blocks.1.fc.bias": torch.full((128,), 2.0)}, disk_tmp / "part.safetensors")
    report = offload.load_safetensors(fresh, disk_tmp / "part.safetensors", strict=False)
    assert sorted(report["loaded"]) == ["blocks.1.fc.bias", "pos"] and "wte.weight" in report["missing"]
    got = params_of(fresh)
    for k in want:
        expect = {"pos": torch.ones(16, 32), "blocks.1.fc.bias": torch.full((128,), 2.0)}.get(k, want[k])
        assert torch.equal(expect, got[k]), k

    # bf16 export is what the model computes with; a bf16 load gives those values back exactly.
    offload.export_safetensors(model, disk_tmp / "bf16")
    plain = TinyGPT()
    offload.load_safetensors(plain, disk_tmp / "bf16")
    for k, v in plain.state_dict().items():
        assert torch.equal(v, want[k].to(torch.bfloat16).float()), k


def test_safetensors_shape_mismatch_names_tensor(disk_tmp):
    pytest.importorskip("safetensors")
    nvme, out = disk_tmp / "nvme", disk_tmp / "hf"
    nvme.mkdir()
    model, _ = build(nvme)
    offload.export_safetensors(model, out)
    other, _ = build(nvme, vocab=80)
    with pytest.raises(offload.ConfigError, match=r"model\.safetensors.*wte\.weight"):
        offload.load_safetensors(other, out)
    small, _ = build(nvme, layers=2)
    with pytest.raises(offload.OffloadError, match="blocks.2"):
        offload.load_safetensors(small, out)
    report = offload.load_safetensors(small, out, strict=False)
    assert report["unexpected"] and report["missing"] == []
