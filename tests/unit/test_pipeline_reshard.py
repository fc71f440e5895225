"""Resharding by parameter name (offload.pipeline.reshard), in one process: a checkpoint loaded
into a model laid out with another chunk size -- every parameter at another chunk and offset --
holds the same parameters, fp32 masters, Adam moments and step counts, and trains on exactly as
the saving model does; what resharding does not do yet is refused naming it."""

from __future__ import annotations

import json

import pytest
import torch

import offload
from offload.checkpoint.format import manifest_bytes
from offload.errors import ConfigError
from offload.pipeline.checkpoint import Target, load_pipeline_checkpoint
from tests.helpers.reference import LR, WD, make_models, small_config
from tests.helpers.tiny_gpt import batches


def trained(tmp, chunk_size: int, steps: int, *, dtype="fp32"):
    """A wrapped TinyGPT (seed 0) and its AdamW after ``steps`` steps; the batches it will see next."""
    _, model = make_models(checkpointing=False)
    model = offload.wrap(model, small_config(tmp / f"nvme-{chunk_size}", chunk_size=chunk_size, dtype=dtype))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    data = iter(batches(steps + 2, batch=4, vocab=64))
    for _ in range(steps):
        step(model, opt, next(data))
    return model, opt, data


def step(model, opt, batch) -> float:
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_checkpoint_resharded_into_another_layout_trains_on_identically(tmp_path, dtype):
    saved, opt, data = trained(tmp_path, 8192, 2, dtype=dtype)
    offload.save_checkpoint(saved, opt, tmp_path / "ckpt", step=2)
    other, other_opt, _ = trained(tmp_path, 6144, 0, dtype=dtype)     # fresh, other chunks
    assert other.offload_engine.chunks.layout.slots != saved.offload_engine.chunks.layout.slots
    loaded = load_pipeline_checkpoint([Target(0, 1, other)], other_opt, tmp_path / "ckpt")
    assert loaded["resharded"] and loaded["step"] == 2
    assert other.offload_engine.chunks.step_state().adam_steps == saved.offload_engine.chunks.step_state().adam_steps
    a, b = state(saved), state(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for _ in range(2):      # masters and moments came too: the next updates are the same
        batch = next(data)
        assert step(saved, opt, batch) == step(other, other_opt, batch)
    a, b = state(saved), state(other)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_state_of_another_dtype_than_the_model_holds_is_refused_naming_the_kind(tmp_path):
    # (compressed state of the model's own precision is resharded: test_pipeline_reshard_state)
    saved, opt, _ = trained(tmp_path, 8192, 1)
    ckpt = offload.save_checkpoint(saved, opt, tmp_path / "ckpt", step=1)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.pop("manifest_crc32")
    manifest["kinds"]["exp_avg"]["dtype"] = "bfloat16"       # bf16 moments under an fp32 precision
    (ckpt / "manifest.json").write_bytes(manifest_bytes(manifest))
    other, other_opt, _ = trained(tmp_path, 6144, 0)
    with pytest.raises(ConfigError, match="kind='exp_avg': torch.bfloat16 in .*, torch.float32 in the model"):
        load_pipeline_checkpoint([Target(0, 1, other)], other_opt, tmp_path / "ckpt")


def test_a_parameter_missing_from_the_checkpoint_is_named(tmp_path):
    saved, opt, _ = trained(tmp_path, 8192, 1)
    offload.save_checkpoint(saved, opt, tmp_path / "ckpt", step=1)
    other, other_opt, _ = trained(tmp_path, 6144, 0)
    renamed = {n: ("renamed." + n if n.startswith("ln_f") else n) for n, _ in other.named_parameters()}
    with pytest.raises(ConfigError, match="parameter='renamed.ln_f.weight': is in the model but in none of the saved stages"):
        load_pipeline_checkpoint([Target(0, 2, other, renamed)], other_opt, tmp_path / "ckpt")
