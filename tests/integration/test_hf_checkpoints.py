"""Hugging Face checkpoints in and out (offload.hf): load, export, LoRA adapters and merges, errors.

Every comparison is with transformers / peft themselves: ``from_pretrained`` of the same files,
``PeftModel.from_pretrained`` of the written adapter, peft's ``merge_and_unload``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import offload
from offload import OffloadError
from tests.helpers.hf_models import hf_load, save_tiny, token_batch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


from offload.hf import export_pretrained, load_pretrained  # noqa: E402
from offload.hf.output import write_output  # noqa: E402

pytestmark = pytest.mark.slow


def config(nvme, dtype="fp32", chunk=8192) -> offload.OffloadConfig:
    # Budgets below the state (~35 K parameters, 16-18 B each) and chunks of 8 Ki elements (the
    # embedding's size): every tier is used, NVMe included.
    return offload.OffloadConfig(device="cpu", dtype=dtype, device_budget=28 * chunk, cpu_budget=28 * chunk,
                                 nvme_paths=[str(nvme)], chunk_size=chunk)


def train(model, steps=3, lr=1e-2):
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for i in range(steps):
        ids = token_batch(i)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


def logits(model, seed=99):
    with torch.no_grad():
        return model(input_ids=token_batch(seed)).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_load_train_export_round_trip(disk_tmp, arch):
    src = save_tiny(disk_tmp / "src", arch)
    assert len(list(src.glob("model-*.safetensors"))) > 2            # the index path runs
    (src / "tokenizer_config.json").write_text("{}")                   # carried over as it is
    model = load_pretrained(src, config(disk_tmp / "nvme"))
    ref = hf_load(src)
    assert torch.equal(logits(model), logits(ref))                     # loaded exactly
    train(model)
    assert model.offload_engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"], "NVMe unused"
    out = export_pretrained(model, disk_tmp / "out", max_shard_size="20KB")
    assert (out / "tokenizer_config.json").read_text() == "{}"
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    back = hf_load(out)
    mine = model.state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, mine[name]), name                    # bit-equal weights
    assert torch.equal(logits(back), logits(model))
    assert not torch.equal(logits(back), logits(ref))                 # it did train
    model.offload_engine.close()


@pytest.mark.parametrize("arch", ["mixtral", "gpt_neox", "opt"])
def test_checkpoints_transformers_converts_on_load(disk_tmp, arch):
    """Per-expert tensors fused into one parameter (Mixtral), renamed keys (GPT-NeoX's embed_out):
    converted as from_pretrained converts them."""
    src = save_tiny(disk_tmp / "src", arch)
    names = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    chunk = 8192
    if arch == "mixtral":
        assert any(".experts.3.w1.weight" in n for n in names)
        chunk = 16384                  # a fused expert tensor must fit in one chunk (for now)
    model = load_pretrained(src, config(disk_tmp / "nvme", chunk=chunk))
    ref = hf_load(src)
    assert torch.equal(logits(model), logits(ref))
    export_pretrained(model, disk_tmp / "out", max_shard_size="20KB")
    assert torch.equal(logits(hf_load(disk_tmp / "out")), logits(ref))
    # written in the layout transformers' save_pretrained writes (per-expert, embed_out), same values
    written = json.loads((disk_tmp / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert written.keys() == names.keys()
    from safetensors import safe_open

    for name in names:
        with safe_open(str(src / names[name]), "pt") as a, safe_open(str(disk_tmp / "out" / written[name]), "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    model.offload_engine.close()


def test_bf16_weights_are_transformers_bf16_weights(disk_tmp):
    src = save_tiny(disk_tmp / "src", "llama", tie_word_embeddings=True)
    model = load_pretrained(src, config(disk_tmp / "nvme", "bf16"))
    ref = hf_load(src, torch.bfloat16)
    export_pretrained(model, disk_tmp / "out")
    back = hf_load(disk_tmp / "out", torch.bfloat16)
    assert not (disk_tmp / "out" / "model.safetensors.index.json").exists()     # one shard: one file, no index
    from safetensors import safe_open

    with safe_open(str(disk_tmp / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names                               # tied: written once, as transformers does
    assert json.loads((disk_tmp / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    for name, value in ref.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, back.state_dict()[name]), name
    model.offload_engine.close()


def test_export_replaces_an_earlier_export_whole(disk_tmp):
    src = save_tiny(disk_tmp / "src", "llama")
    model = load_pretrained(src, config(disk_tmp / "nvme"))
    export_pretrained(model, disk_tmp / "out", max_shard_size="20KB")
    export_pretrained(model, disk_tmp / "out", max_shard_size="1MB")    # fewer shards now
    assert sorted(p.name for p in (disk_tmp / "out").glob("*.safetensors")) == ["model.safetensors"]
    assert not (disk_tmp / "out" / "model.safetensors.index.json").exists()
    assert not [p for p in disk_tmp.iterdir() if p.name.startswith(".out")]    # no temp dirs left
    (disk_tmp / "mine").mkdir()
    (disk_tmp / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(offload.ConfigError, match="not an earlier export"):
        export_pretrained(model, disk_tmp / "mine")
    assert (disk_tmp / "mine" / "notes.txt").read_text() == "keep"
    model.offload_engine.close()


def lora_model(src, nvme, rank=4):
    from offload.hf.lora import LoraSettings, apply_lora

    settings = LoraSettings(rank=rank, targets=("q_proj", "v_proj"))
    return load_pretrained(src, config(nvme), adapt=lambda m: apply_lora(m, settings))


def test_lora_adapter_and_merge_equal_peft(disk_tmp):
    peft = pytest.importorskip("peft")
    src = save_tiny(disk_tmp / "src", "llama")
    model = lora_model(src, disk_tmp / "nvme")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    frozen_before = {n: v for n, v in model.state_dict().items() if ".lora_" not in n}
    train(model, steps=4)
    after = model.state_dict()
    for name, value in frozen_before.items():
        assert torch.equal(value, after[name]), f"frozen {name} changed"

    write_output(model, disk_tmp / "adapter")
    loaded = peft.PeftModel.from_pretrained(hf_load(src), str(disk_tmp / "adapter")).eval()
    adapter = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert adapter.keys() == trainable
    for name, p in adapter.items():
        assert torch.equal(p.detach(), after[name]), name             # the trained adapter, exactly
    assert torch.equal(logits(loaded), logits(model))

    write_output(model, disk_tmp / "merged", merge=True)
    merged = hf_load(disk_tmp / "merged")
    expected = loaded.merge_and_unload().state_dict()
    assert merged.state_dict().keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(merged.state_dict()[name], value), name    # base + adapter, as peft merges
    model.offload_engine.close()


# ---- bad input: one line naming the file and the tensor -------------------------------------
def rewrite_shard(path: Path, drop: str | None = None) -> None:
    """Rewrite a safetensors file without tensor ``drop`` (the index still lists it)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors.pop(drop)
    save_file(tensors, str(path), metadata={"format": "pt"})


def shard_of(src: Path, name: str) -> Path:
    return src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]


def load_error(src, nvme) -> str:
    with pytest.raises(OffloadError) as err:
        load_pretrained(src, config(nvme))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_tensor(disk_tmp):
    src = save_tiny(disk_tmp / "src")
    name = "model.layers.1.mlp.up_proj.weight"
    file = shard_of(src, name)
    rewrite_shard(file, drop=name)
    message = load_error(src, disk_tmp / "nvme")
    assert file.name in message and name in message
    # and with the index not listing it either
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    message = load_error(src, disk_tmp / "nvme")
    assert "model.safetensors.index.json" in message and name in message and "missing" in message


def test_mismatched_shape_and_extra_tensor(disk_tmp):
    src = save_tiny(disk_tmp / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(cfg))
    message = load_error(src, disk_tmp / "nvme")
    assert "mlp." in message and "[64, 32]" in message and "[48, 32]" in message and ".safetensors" in message

    src = save_tiny(disk_tmp / "src2")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    message = load_error(src, disk_tmp / "nvme")
    assert "model.layers.1." in message and "not a parameter" in message


def test_converted_group_with_a_tensor_missing(disk_tmp):
    src = save_tiny(disk_tmp / "src", "mixtral")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite_shard(shard_of(src, name), drop=name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(OffloadError) as err:
        load_pretrained(src, config(disk_tmp / "nvme", chunk=16384))
    message = str(err.value)
    assert "\n" not in message
    assert "model.layers.1.mlp.experts.gate_up_proj" in message and ".safetensors" in message


def test_shard_that_is_not_safetensors(disk_tmp):
    src = save_tiny(disk_tmp / "src")
    file = shard_of(src, "model.norm.weight")
    file.write_bytes(struct.pack("<Q", 10**12) + b"this is not a safetensors file")
    message = load_error(src, disk_tmp / "nvme")
    assert file.name in message and "not a readable safetensors" in message


def test_config_transformers_cannot_build(disk_tmp):
    src = save_tiny(disk_tmp / "src")
    (src / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    message = load_error(src, disk_tmp / "nvme")
    assert "config.json" in message and "transformers cannot" in message
    (src / "config.json").write_text("{not json")
    assert "config.json" in load_error(src, disk_tmp / "nvme")
    (src / "config.json").unlink()
    with pytest.raises(offload.ConfigError, match="has no config.json"):
        load_pretrained(src, config(disk_tmp / "nvme"))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return [int(line.split()[1]) * 1024 for line in f if line.startswith(key)][0]


def test_loading_streams_within_budgets(disk_tmp):
    """Peak RSS while loading <= budgets + the largest tensor + a fixed overhead (the staging chunk,
    read blocks, allocator slack), for a checkpoint ~3x the budgets. Measured in this process:
    /proc/self/clear_refs restarts the peak (VmHWM) at the current RSS."""
    from offload.hf.load import build_meta_model, read_checkpoint

    src = save_tiny(disk_tmp / "src", "llama", shard="8MB", hidden_size=256, intermediate_size=704,
                    num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    largest = 256 * 704 * 4                                  # an MLP projection, fp32
    build_meta_model(read_checkpoint(src))                   # transformers' modeling imports, not the load
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("no /proc/self/clear_refs to reset the peak RSS")
    base = _status("VmRSS")
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="6MiB", cpu_budget="6MiB",
                                nvme_paths=[str(disk_tmp / "nvme")])
    model = load_pretrained(src, cfg)
    growth = _status("VmHWM") - base
    budgets = 12 << 20
    assert size >= 2.5 * budgets
    assert growth <= budgets + largest + (12 << 20), (growth, size)
    assert torch.equal(logits(model), logits(hf_load(src)))
    model.offload_engine.close()
