"""A corrupt newest checkpoint: resume warns naming it and why and loads the previous one, which
then trains on exactly like an uninterrupted run; `offload checkpoint verify` finds every flipped
byte; incompatible checkpoints are never skipped past."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import offload
from offload.checkpoint import CheckpointSkipped, verify_checkpoint
from offload.cli import main
from tests.helpers.tiny_gpt import TinyGPT, batches

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def build(nvme, seed=0, dtype="bf16", chunk_size=8192, **model_kw):
    torch.manual_seed(seed)
    model = offload.wrap(TinyGPT(**model_kw), offload.OffloadConfig(
        device="cpu", dtype=dtype, device_budget="192KiB", cpu_budget="256KiB", nvme_paths=[str(nvme)],
        chunk_size=chunk_size))
    return model, offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model, opt, data, steps):
    out = []
    for _ in range(steps):
        x, y = next(data)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved():
    """Checkpoints at steps 1, 2, 3 of one run, the state at each, and losses of steps 3-4."""
    base = ROOT / ".pytest-tmp"
    base.mkdir(exist_ok=True)
    import tempfile

    tmp = Path(tempfile.mkdtemp(dir=base))
    nvme, ckpt = tmp / "nvme", tmp / "ckpt"
    model, opt = build(nvme)
    data = batches(6)
    states = {}
    for s in (1, 2, 3):
        train(model, opt, data, 1)
        offload.save_checkpoint(model, opt, ckpt, step=s, extra={"pos": s, "blob": torch.arange(s)})
        states[s] = state(model)
    model.offload_engine.close()
    try:
        yield tmp, nvme, ckpt, states
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset % len(raw)] ^= 0x10
    path.write_bytes(bytes(raw))


def test_corrupt_latest_falls_back_and_resumes_identically(saved, tmp_path):
    tmp, nvme, src, states = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    manifest = json.loads((ckpt / "step-00000003" / "manifest.json").read_text())
    entry = manifest["kinds"]["master"]["chunks"][2]
    flip(ckpt / "step-00000003" / "master.bin", entry["offset"] + 77)

    model, opt = build(nvme, seed=42)
    with pytest.warns(CheckpointSkipped) as caught:
        loaded = offload.load_checkpoint(model, opt, ckpt)
    msg = str(caught[0].message)
    assert "step-00000003" in msg and "master[2]" in msg and "mismatch" in msg and "step-00000002" in msg
    assert loaded["step"] == 2 and loaded["extra"]["pos"] == 2
    assert loaded["skipped"][0]["path"] == str(ckpt / "step-00000003")
    got = state(model)
    assert all(torch.equal(got[k], states[2][k]) for k in got)

    # From step 2 it trains on exactly like the run that wrote the checkpoints.
    ref, ref_opt = build(nvme)
    data = batches(6)
    train(ref, ref_opt, data, 2)
    resumed = batches(6)
    for _ in range(2):
        next(resumed)
    assert train(model, opt, resumed, 2) == train(ref, ref_opt, data, 2)
    after, ref_after = state(model), state(ref)
    assert all(torch.equal(after[k], ref_after[k]) for k in after)

    # `offload checkpoint verify` agrees: one corrupt, named with its chunk; exit status 1.
    assert main(["checkpoint", "verify", str(ckpt)]) == 1


def test_every_checkpoint_corrupt_raises_the_newest_error(saved, tmp_path):
    _, nvme, src, _ = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    for s in (1, 2, 3):
        flip(ckpt / f"step-0000000{s}" / "param.bin", 5)
    model, opt = build(nvme, seed=1)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(offload.ChecksumError) as info:
        warnings.simplefilter("always")
        offload.load_checkpoint(model, opt, ckpt)
    assert "step-00000003" in str(info.value) and "param[0]" in str(info.value)
    assert len([w for w in caught if w.category is CheckpointSkipped]) == 2
    # An explicit step is never replaced by another one.
    with pytest.raises(offload.ChecksumError, match="step-00000002"):
        offload.load_checkpoint(model, opt, ckpt, step=2)


def test_incompatible_checkpoint_is_an_error_not_a_fallback(saved):
    _, nvme, ckpt, _ = saved
    other, other_opt = build(nvme, vocab=80)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no CheckpointSkipped: it stops at the first
        with pytest.raises(offload.ConfigError, match="wte.weight"):
            offload.load_checkpoint(other, other_opt, ckpt)
        fp32, fp32_opt = build(nvme, dtype="fp32")
        with pytest.raises(offload.ConfigError, match="dtype"):
            offload.load_checkpoint(fp32, fp32_opt, ckpt)
        small, small_opt = build(nvme, chunk_size=4096)
        with pytest.raises(offload.ConfigError, match="different chunk layout"):
            offload.load_checkpoint(small, small_opt, ckpt)


def test_verify_command_summary(saved, capsys):
    _, _, ckpt, _ = saved
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert out.count("ok ") == 3 and "3 of 3 checkpoint(s) verify" in out and "--resume loads step-00000003" in out
    assert main(["checkpoint", "verify", str(ckpt / "step-00000001")]) == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["param.bin", "master.bin", "exp_avg.bin", "exp_avg_sq.bin", "extra.pt",
                              "manifest.json"]),
       at=st.integers(0, 1 << 20))
def test_any_flipped_byte_is_found_and_skipped(saved, which, at):
    tmp, nvme, src, states = saved
    ckpt = tmp / "flip"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.copytree(src, ckpt)
    target = ckpt / "step-00000003" / which
    if which == "manifest.json":
        raw = target.read_bytes()
        digits = [i for i, b in enumerate(raw) if chr(b).isdigit()]
        i = digits[at % len(digits)]                 # a digit becomes another digit: still valid JSON
        target.write_bytes(raw[:i] + str((int(chr(raw[i])) + 1) % 10).encode() + raw[i + 1:])
    else:
        flip(target, at)
    verdict = verify_checkpoint(ckpt / "step-00000003")
    assert not verdict.ok and verdict.problems
    model, opt = build(nvme, seed=3)
    with pytest.warns(CheckpointSkipped, match="step-00000003"):
        assert offload.load_checkpoint(model, opt, ckpt)["step"] == 2
    got = state(model)
    assert all(torch.equal(got[k], states[2][k]) for k in got)
    model.offload_engine.close()
