"""Checkpoints someone else wrote load no code (``weights_only``; a pickled object is refused
naming its file, and nothing of it runs); what cannot load that way is refused when saved; a
checkpoint resumes under other budgets through ``saved_chunk_size``; a checksum mismatch says so."""

from __future__ import annotations

import fractions
import json

import pytest
import torch

import offload
from offload.checkpoint import save_checkpoint, saved_chunk_size
from offload.checkpoint.format import MANIFEST, checksum_bytes, manifest_bytes
from offload.errors import ChecksumError, ConfigError


def build(chunk_size: int, seed: int = 0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model = offload.wrap(net, offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=chunk_size))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def step(model, opt, seed: int = 1) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


class _CreatesAFile:
    """Unpickling it would create ``path``: what a malicious state file does."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _replace_small_file(ckpt, entry_key: str, obj) -> None:
    """Put ``obj`` into the checkpoint's ``entry_key`` file with valid checksums everywhere: the
    file is well-formed, only what it holds is hostile."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest.pop("manifest_crc32")
    entry = manifest[entry_key]
    path = ckpt / entry["file"]
    torch.save(obj, path)
    data = path.read_bytes()
    entry.update({"bytes": len(data), manifest["checksum"]: checksum_bytes(manifest["checksum"], data)})
    (ckpt / MANIFEST).write_bytes(manifest_bytes(manifest))


def test_a_state_file_holding_a_pickled_object_is_refused_and_nothing_of_it_runs(tmp_path):
    model, opt = build(4096)
    step(model, opt)
    # A tensor in ``extra`` makes it a torch file (extra.pt), as RNG states do.
    ckpt = save_checkpoint(model, opt, tmp_path / "ckpt", extra={"rng": torch.get_rng_state(), "step": 1})
    marker = tmp_path / "pwned"
    _replace_small_file(ckpt, "extra_file", {"rng": _CreatesAFile(marker)})
    with pytest.raises(ConfigError) as info:
        offload.load_checkpoint(model, opt, tmp_path / "ckpt")
    assert not marker.exists()
    message = str(info.value)
    assert str(ckpt / "extra.pt") in message and len(message.splitlines()) == 1
    assert "refused" in message


def test_rng_scheduler_and_data_state_round_trip_as_plain_data(tmp_path):
    model, opt = build(4096)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    step(model, opt)
    scheduler.step()
    extra = {"step": 1, "rng": {"cpu": torch.get_rng_state(), "cuda": []}, "scheduler": scheduler.state_dict(),
             "data": {"next_batch": 3, "rows": 4}}
    save_checkpoint(model, opt, tmp_path / "ckpt", extra=extra)
    got = offload.load_checkpoint(model, opt, tmp_path / "ckpt")["extra"]
    assert torch.equal(got["rng"]["cpu"], extra["rng"]["cpu"]) and got["data"] == extra["data"]
    assert got["scheduler"] == extra["scheduler"]


def test_saving_refuses_a_value_that_would_not_load_as_plain_data(tmp_path):
    model, opt = build(4096)
    step(model, opt)
    with pytest.raises(ConfigError, match=r"extra\['rng'\]\['numpy'\] is a fractions.Fraction"):
        save_checkpoint(model, opt, tmp_path / "ckpt", extra={"rng": {"numpy": fractions.Fraction(1, 3)}})
    assert saved_chunk_size(tmp_path / "ckpt") is None      # nothing was written


def test_saved_chunk_size_is_the_chunk_size_of_the_checkpoint_a_resume_loads(tmp_path):
    root = tmp_path / "ckpt"
    assert saved_chunk_size(root) is None and saved_chunk_size(tmp_path) is None
    model, opt = build(2048)
    step(model, opt)
    save_checkpoint(model, opt, root, step=1)
    assert saved_chunk_size(root) == 2048
    other, opt2 = build(8192)
    step(other, opt2)
    newest = save_checkpoint(other, opt2, root, step=2)
    assert saved_chunk_size(root) == 8192
    with open(newest / "param.bin", "r+b") as f:     # truncated: a resume falls back to step 1
        f.truncate(100)
    assert saved_chunk_size(root) == 2048
    assert saved_chunk_size(newest.parent / "step-00000001") == 2048    # one checkpoint directly


def test_a_checkpoint_resumes_under_another_chunk_size_through_saved_chunk_size(tmp_path):
    model, opt = build(2048)
    step(model, opt)
    save_checkpoint(model, opt, tmp_path / "ckpt")
    want = params(model)
    other, opt2 = build(8192, seed=5)     # other budgets chose another chunk size
    with pytest.raises(ConfigError) as info:
        offload.load_checkpoint(other, opt2, tmp_path / "ckpt")
    message = str(info.value)
    assert info.value.field == "chunk_size"
    assert "chunk_size=2048" in message and "chunk_size=8192" in message and "saved_chunk_size" in message
    same, opt3 = build(saved_chunk_size(tmp_path / "ckpt"), seed=5)
    offload.load_checkpoint(same, opt3, tmp_path / "ckpt")
    for k, v in params(same).items():
        assert torch.equal(v, want[k]), k


def test_a_checksum_mismatch_says_so_and_names_file_chunk_and_offset(tmp_path):
    model, opt = build(2048)
    step(model, opt)
    ckpt = save_checkpoint(model, opt, tmp_path / "ckpt")
    manifest = json.loads((ckpt / MANIFEST).read_text())
    entry = manifest["kinds"]["exp_avg"]["chunks"][1]
    with open(ckpt / "exp_avg.bin", "r+b") as f:
        f.seek(entry["offset"] + 10)
        byte = f.read(1)
        f.seek(entry["offset"] + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError) as info:
        offload.load_checkpoint(model, opt, ckpt)
    message = str(info.value)
    assert "EIO" not in message and "Input/output" not in message
    assert message.startswith(f"{ckpt / 'exp_avg.bin'}: checksum mismatch") and "exp_avg[1]" in message
    assert f"offset {entry['offset']}" in message


def test_a_run_resumes_under_other_budgets(tmp_path):
    """The issue's case: the budgets change between runs and with them the "auto" chunk size."""
    def run(cpu_budget, chunk_size="auto"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        model = offload.wrap(net, offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="1MiB",
                                                        cpu_budget=cpu_budget, chunk_size=chunk_size))
        return model, offload.AdamW(model.parameters(), lr=1e-2)

    model, opt = run("1MiB")
    step(model, opt)
    save_checkpoint(model, opt, tmp_path / "ckpt")
    want = params(model)
    step(model, opt, seed=2)
    after = params(model)
    resumed, opt2 = run("192KiB", chunk_size=saved_chunk_size(tmp_path / "ckpt") or "auto")
    fresh, _ = run("192KiB")
    assert fresh.offload_engine.chunks.layout.chunk_size != resumed.offload_engine.chunks.layout.chunk_size
    offload.load_checkpoint(resumed, opt2, tmp_path / "ckpt")
    assert all(torch.equal(v, want[k]) for k, v in params(resumed).items())
    step(resumed, opt2, seed=2)
    for k, v in params(resumed).items():
        assert torch.equal(v, after[k]), k
