"""8-bit optimizer state (and a bf16 master) as a user meets it: through ``offload finetune`` and
``scripts/finetune_100b.py``, through its checkpoint files, and through NVMe faults mid-step.

* A read of an 8-bit codes chunk that fails mid-step (the swap file truncated behind the engine's
  back through its descriptor, then restored: a transient fault, the data intact), or a write
  that fails (EFBIG under RLIMIT_FSIZE 0, in a child), raises ``NvmeIOError`` naming the swap file
  and offset; after it the model neither steps, runs forward nor saves (its chunks may hold part
  of the step), and the documented recovery -- close, resume from the last checkpoint -- repeats
  the uninterrupted run bit for bit.
* A truncated or flipped codes or scales file of an 8-bit checkpoint is named with its offset by
  the load and by ``verify_checkpoint``, and the resume falls back to the older checkpoint; a
  checkpoint without the precision fields (fp32 state: versions 1-3) loads as fp32 state and is
  refused by an 8-bit model, its files untouched.
* An 8-bit run of ``offload finetune`` resumed from its checkpoint repeats the uninterrupted run's
  losses; a checkpoint of the fp32 default is refused under ``--optimizer-state 8bit`` (the README:
  "A checkpoint of another precision is refused, naming it") in one line, left byte for byte. The
  headline script takes the same flags.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload.checkpoint import CheckpointSkipped, verify_checkpoint
from offload.errors import ConfigError, NvmeIOError, OffloadError
from tests.helpers.processes import python_env
from tests.helpers.tiny_gpt import TinyGPT, batches

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

QUANT = dict(optimizer_state="8bit", master="bf16")


# ---- NVMe faults in an 8-bit step --------------------------------------------------------------
def build(nvme, **budgets):
    """TinyGPT (53k parameters) under bf16 compute with 8-bit moments and a bf16 master, budgets
    far below its state: the moments' codes live on NVMe and come back for every update."""
    torch.manual_seed(0)
    nvme.mkdir(parents=True, exist_ok=True)
    config = offload.OffloadConfig(device="cpu", dtype="bf16", chunk_size=4096, nvme_paths=[str(nvme)],
                                   **{"device_budget": "96KiB", "cpu_budget": "64KiB", **budgets}, **QUANT)
    model = offload.wrap(TinyGPT(), config)
    return model, offload.AdamW(model.parameters(), lr=1e-2, state="8bit", master="bf16")


def train(model, opt, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def adam_steps(model) -> set[int]:
    return set(model.offload_engine.chunks.step_state().adam_steps)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Five steps without a fault: the losses and the final parameters."""
    root = tmp_path_factory.mktemp("uninterrupted")
    model, opt = build(root / "nvme")
    try:
        losses = train(model, opt, list(batches(5)))
        return losses, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        model.offload_engine.close()


@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_a_failed_read_of_8bit_codes_is_named_and_nothing_half_updated_is_saved(disk_tmp, uninterrupted, kind):
    data = list(batches(5))
    model, opt = build(disk_tmp / "nvme")
    engine = model.offload_engine
    ckpt = disk_tmp / "ckpt"
    try:
        train(model, opt, data[:2])
        offload.save_checkpoint(model, opt, ckpt, step=2)
        nvme = engine.store.tiers["nvme"]
        assert kind in nvme.files and f"{kind}_absmax" not in nvme.files     # the scales stay in RAM
        fd = nvme.files[kind].fds[0]
        size = os.fstat(fd).st_size
        saved = os.pread(fd, size, 0)
        os.ftruncate(fd, 0)                        # every read of a codes chunk now comes back short
        with pytest.raises(NvmeIOError) as info:
            train(model, opt, data[2:4])
        err = info.value
        assert err.path.endswith(f"-{kind}.swp") and err.offset % 4096 == 0 and err.length > 0, err
        assert f"offset {err.offset} length {err.length}" in str(err)
        assert adam_steps(model) == {2}            # the failed step did not count
        os.ftruncate(fd, size)                     # the fault goes away, the data as it was
        os.pwrite(fd, saved, 0)
        # Some chunks may have taken step 3 and others not: going on, or saving, would commit that.
        try:
            opt.zero_grad()
        except NvmeIOError as late:                  # an update that failed in the worker meanwhile
            assert late.path.endswith(f"-{kind}.swp"), late
        with pytest.raises(NvmeIOError, match="resume from the last checkpoint") as refused:
            offload.save_checkpoint(model, opt, ckpt, step=3)
        assert refused.value.path.endswith(f"-{kind}.swp")           # the request that failed
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000002"]
        with pytest.raises(NvmeIOError, match="resume from the last checkpoint"):
            train(model, opt, data[2:3])
        with pytest.raises(NvmeIOError, match="resume from the last checkpoint"):
            opt.state_dict()
    finally:
        engine.close()
    # The documented way on: a new model, the last checkpoint, the same batches.
    losses, final = uninterrupted
    model, opt = build(disk_tmp / "nvme2")
    try:
        assert offload.load_checkpoint(model, opt, ckpt)["step"] == 2
        assert train(model, opt, data[2:]) == losses[2:]
        got = model.state_dict()
        assert all(torch.equal(got[k], final[k]) for k in final)
    finally:
        model.offload_engine.close()


# Writes fail while RLIMIT_FSIZE is 0 (EFBIG from the kernel at any offset; reads go on): a
# process-wide limit, so in a child of its own. SIGXFSZ ignored: the write returns the error.
WRITE_FAULT = """
import json, resource, signal, sys
from pathlib import Path
import offload
from tests.integration.test_quantized_cli_faults import adam_steps, build, train
from tests.helpers.tiny_gpt import batches
tmp = Path(sys.argv[1])
data = list(batches(4))
model, opt = build(tmp / "nvme")
train(model, opt, data[:2])
offload.save_checkpoint(model, opt, tmp / "ckpt", step=2)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
out = {}
try:
    train(model, opt, data[2:4])
except offload.NvmeIOError as exc:
    out["error"] = {"errno": exc.errno, "path": exc.path, "offset": exc.offset, "length": exc.length}
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
out["steps"] = sorted(adam_steps(model))
try:
    offload.save_checkpoint(model, opt, tmp / "ckpt", step=3)
    out["save"] = "saved"
except offload.NvmeIOError as exc:
    out["save"] = str(exc)
model.offload_engine.close()
# The documented way on, against the uninterrupted run in this process (the same torch threads).
model, opt = build(tmp / "nvme2")
offload.load_checkpoint(model, opt, tmp / "ckpt")
out["resumed"] = train(model, opt, data[2:])
model.offload_engine.close()
model, opt = build(tmp / "nvme3")
out["uninterrupted"] = train(model, opt, data)[2:]
model.offload_engine.close()
print(json.dumps(out))
"""


def test_a_failed_write_in_an_8bit_step_is_named_and_the_step_is_not_saved(disk_tmp):
    import errno
    import json

    done = subprocess.run([sys.executable, "-c", WRITE_FAULT, str(disk_tmp)], capture_output=True, text=True,
                          timeout=120, env=python_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    err = out["error"]
    assert err["errno"] == errno.EFBIG and err["path"].endswith(".swp") and err["offset"] % 4096 == 0, out
    assert out["steps"] == [2]
    # The first request to fail, which need not be the one the training thread saw first.
    assert re.match(r"\[EFBIG\] File too large at \S+\.swp offset \d+ length \d+: ", out["save"]), out["save"]
    assert "resume from the last checkpoint" in out["save"]
    assert sorted(p.name for p in (disk_tmp / "ckpt").iterdir()) == ["latest", "step-00000002"]
    assert out["resumed"] == out["uninterrupted"]


# ---- damaged 8-bit checkpoint files, and checkpoints from before the precision fields -------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An 8-bit checkpoint root with steps 1 and 2 (TinyGPT, everything in memory), and the
    optimizer's state at step 1."""
    base = tmp_path_factory.mktemp("saved8")
    model, opt = build(base / "nvme", device_budget="1MiB", cpu_budget="1MiB")
    try:
        data = list(batches(2))
        train(model, opt, data[:1])
        offload.save_checkpoint(model, opt, base / "ckpt", step=1, keep=None)
        at1 = opt.state_dict()
        train(model, opt, data[1:])
        offload.save_checkpoint(model, opt, base / "ckpt", step=2, keep=None)
    finally:
        model.offload_engine.close()
    return base / "ckpt", at1


def damage(path, how: str) -> int:
    """Truncate ``path`` to half, or flip one bit in its middle; returns the byte touched."""
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2
    if how == "truncate":
        path.write_bytes(bytes(raw[:at]))
    else:
        raw[at] ^= 0x04
        path.write_bytes(bytes(raw))
    return at


@pytest.mark.parametrize("name, how", [("exp_avg.bin", "truncate"), ("exp_avg_sq.bin", "flip"),
                                       ("exp_avg_absmax.bin", "flip"), ("exp_avg_sq_absmax.bin", "truncate")])
def test_a_damaged_codes_or_scales_file_is_named_with_its_offset_and_the_resume_falls_back(
        disk_tmp, saved, name, how):
    src, at1 = saved
    root = disk_tmp / "ckpt"
    shutil.copytree(src, root)
    path = root / "step-00000002" / name
    at = damage(path, how)
    verdict = verify_checkpoint(root / "step-00000002")
    # Every problem is in that file (a truncation: each chunk past its end, and its size).
    assert not verdict.ok and all(p.startswith(f"{path}: ") for p in verdict.problems), verdict.problems
    model, opt = build(disk_tmp / "nvme", device_budget="1MiB", cpu_budget="1MiB")
    try:
        with pytest.raises(OffloadError) as info:
            offload.load_checkpoint(model, opt, root, step=2)            # that one: no fallback
        message = str(info.value)
        assert message.startswith(f"{path}: ") and "offset" in message, message
        offsets = [int(n) for n in re.findall(r"offset (\d+)", message)]
        chunk_bytes = json_kind(root / "step-00000002", name)["chunk_bytes"]
        # The chunk named is the one holding the byte touched (a truncation: where the file ends).
        assert any(o <= at < o + chunk_bytes or o == at for o in offsets), (at, message)
        with pytest.warns(CheckpointSkipped, match=re.escape(name)):
            loaded = offload.load_checkpoint(model, opt, root)
        assert loaded["step"] == 1
        got = opt.state_dict()["state"]
        for i, want in at1["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[i][key], want[key]), (i, key)
    finally:
        model.offload_engine.close()


def json_kind(ckpt, name: str) -> dict:
    import json

    manifest = json.loads((ckpt / "manifest.json").read_text())
    return next(info for info in manifest["kinds"].values() if info.get("file") == name)


def test_a_checkpoint_without_precision_fields_loads_as_fp32_state_and_an_8bit_model_refuses_it(disk_tmp):
    """fp32 state is still written as format version 1 (no ``precision``): what every checkpoint
    before issue 29 looks like."""
    import json

    torch.manual_seed(0)
    fp32 = offload.wrap(TinyGPT(), offload.OffloadConfig(device="cpu", dtype="bf16", chunk_size=4096))
    opt = offload.AdamW(fp32.parameters(), lr=1e-2)
    try:
        train(fp32, opt, list(batches(1)))
        path = offload.save_checkpoint(fp32, opt, disk_tmp / "ckpt", step=1)
        want = opt.state_dict()
    finally:
        fp32.offload_engine.close()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == 1 and "precision" not in manifest
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    model, opt = build(disk_tmp / "nvme")
    try:
        with pytest.raises(ConfigError, match=r"optimizer_state='8bit': the checkpoint .* holds fp32 optimizer state"):
            offload.load_checkpoint(model, opt, disk_tmp / "ckpt")
    finally:
        model.offload_engine.close()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    torch.manual_seed(0)
    again = offload.wrap(TinyGPT(), offload.OffloadConfig(device="cpu", dtype="bf16", chunk_size=4096))
    opt = offload.AdamW(again.parameters(), lr=1e-2)
    try:
        assert offload.load_checkpoint(again, opt, disk_tmp / "ckpt")["step"] == 1
        got = opt.state_dict()["state"]
        assert all(torch.equal(got[i][k], want["state"][i][k]) for i in want["state"] for k in ("exp_avg", "exp_avg_sq"))
        assert got[0]["exp_avg"].dtype == torch.float32
    finally:
        again.offload_engine.close()


# ---- offload finetune --optimizer-state 8bit --master bf16 ----------------------------------------
QUICK = ["--preset", "tiny", "--no-plan", "--warmup", "1", "--batch-tokens", "256", "--seq-len", "128",
         "--device-budget", "6M", "--cpu-budget", "8M"]
EIGHT = ["--optimizer-state", "8bit", "--master", "bf16"]


def finetune(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload", "finetune", *QUICK, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=python_env(OMP_NUM_THREADS="1"))


def test_finetune_8bit_resumes_like_the_uninterrupted_run_and_refuses_an_fp32_checkpoint(tmp_path):
    from offload.train.flags import parse
    from offload.train.trainer import Trainer

    (tmp_path / "nvme").mkdir()
    common = QUICK + EIGHT + ["--nvme-path", str(tmp_path / "nvme"), "--steps", "4"]
    whole = Trainer(parse(common + ["--checkpoint-dir", str(tmp_path / "whole"), "--checkpoint-every", "2"]))
    assert whole.train() == 0
    # The run as if stopped after step 2 (the same --steps: the LR schedule depends on it).
    (tmp_path / "ck").mkdir()
    shutil.copytree(tmp_path / "whole" / "step-00000002", tmp_path / "ck" / "step-00000002")
    (tmp_path / "ck" / "latest").write_text("step-00000002")
    manifest = (tmp_path / "ck" / "step-00000002" / "manifest.json").read_text()
    assert '"optimizer_state": "8bit"' in manifest and '"master": "bf16"' in manifest
    resumed = Trainer(parse(common + ["--checkpoint-dir", str(tmp_path / "ck"), "--resume"]))
    assert resumed.train() == 0
    assert resumed.losses == whole.losses[2:]                 # codes, scales and the master bit for bit

    # A checkpoint of the fp32 default: refused under 8-bit state, naming the flag, and left as it was.
    plain = Trainer(parse(QUICK + ["--steps", "1", "--checkpoint-dir", str(tmp_path / "fp32"), "--nvme-path",
                                   str(tmp_path / "nvme")]))
    assert plain.train() == 0
    ckpt = tmp_path / "fp32" / "step-00000001"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    refused = finetune("--steps", "2", "--checkpoint-dir", "fp32", "--nvme-path", "nvme", "--resume", *EIGHT,
                       cwd=tmp_path)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "offload: error: --optimizer-state='8bit': the checkpoint fp32/step-00000001 holds fp32 optimizer state "
        "with a fp32 master: resume it with --optimizer-state fp32 --master fp32")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "fp32").iterdir() if p.name.startswith("step-")) == ["step-00000001"]


def test_the_headline_script_offers_the_precision_flags_and_trains_with_them(tmp_path):
    """``scripts/finetune_100b.py`` (what ``make finetune`` runs) with ``make finetune``'s budgets
    and 8-bit moments + a bf16 master: the checkpoint it writes holds that precision."""
    import json

    script = str(ROOT / "scripts" / "finetune_100b.py")
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60,
                            env=python_env())
    assert "--optimizer-state STATE" in helped.stdout and "--master MASTER" in helped.stdout
    (tmp_path / "nvme").mkdir()
    done = subprocess.run([sys.executable, script, *QUICK, *EIGHT, "--steps", "2", "--nvme-path", "nvme",
                           "--checkpoint-dir", "ck"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=python_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"step 2/2 +loss \d+\.\d+", done.stderr), done.stderr[-2000:]
    manifest = json.loads((tmp_path / "ck" / "step-00000002" / "manifest.json").read_text())
    assert manifest["precision"] == {"optimizer_state": "8bit", "master": "bf16", "block_size": 256}
    assert manifest["kinds"]["exp_avg"]["dtype"] == "uint8" and "master" not in manifest["kinds"]
