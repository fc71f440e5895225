"""What ``--output`` writes (``offload.hf.output.write_output``): the source trained and nothing
else changed -- its dtype (fp32 stays fp32 under bf16 training), its ``config.json`` byte for
byte (no ``use_cache: false`` from training), ``model.safetensors`` when one shard holds it --
unless ``dtype`` asks otherwise; and a from-scratch preset model as an HF Llama directory that
transformers loads to the same logits."""

from __future__ import annotations

import json

import pytest
import torch

import offload
from tests.helpers.hf_models import VOCAB, hf_load, save_tiny, token_batch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from offload.hf import load_pretrained  # noqa: E402
from offload.hf.output import write_output  # noqa: E402

pytestmark = pytest.mark.slow


def config(dtype="bf16", chunk=8192) -> offload.OffloadConfig:
    return offload.OffloadConfig(device="cpu", dtype=dtype, chunk_size=chunk)


def train(model, steps=2):
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for i in range(steps):
        ids = token_batch(i)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def file_dtypes(directory) -> set[torch.dtype]:
    found = set()
    for path in directory.glob("*.safetensors"):
        with safetensors.safe_open(str(path), "pt") as f:
            found |= {f.get_tensor(k).dtype for k in f.keys()}
    return found


def loaded_like_the_trainer(src, dtype="bf16"):
    def adapt(model):
        model.config.use_cache = False           # what the trainer sets for training
        return model

    return load_pretrained(src, config(dtype), adapt=adapt)


def test_output_keeps_the_source_dtype_and_config_and_is_one_file(disk_tmp):
    src = save_tiny(disk_tmp / "src", "llama", shard="5GB", use_cache=True)     # fp32, one file
    assert (src / "model.safetensors").is_file()
    # as written by hand or another tool: kept byte for byte, not re-serialized
    (src / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()), indent=4))
    model = loaded_like_the_trainer(src)                                        # trains in bf16
    train(model)
    out = write_output(model, disk_tmp / "out")
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert file_dtypes(out) == {torch.float32}
    # fp32 from the fp32 masters: the same weights an explicit fp32 export writes
    explicit = write_output(model, disk_tmp / "explicit", dtype="fp32")
    back, ref = hf_load(out).state_dict(), hf_load(explicit).state_dict()
    for name, value in ref.items():
        assert torch.equal(back[name], value), name
    model.offload_engine.close()


def test_output_dtype_asked_for_is_written_and_the_config_says_so(disk_tmp):
    src = save_tiny(disk_tmp / "src", "llama", shard="5GB", use_cache=True)
    model = loaded_like_the_trainer(src, "fp32")
    out = write_output(model, disk_tmp / "out", dtype="bf16")
    assert file_dtypes(out) == {torch.bfloat16}
    written, source = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and written.get("dtype", "bfloat16") == "bfloat16"
    assert {k: v for k, v in written.items() if k not in ("torch_dtype", "dtype")} == \
        {k: v for k, v in source.items() if k not in ("torch_dtype", "dtype")}
    assert hf_load(out, torch.bfloat16).config.dtype == torch.bfloat16
    model.offload_engine.close()


def test_output_in_several_shards_has_an_index(disk_tmp):
    src = save_tiny(disk_tmp / "src", "llama")
    model = loaded_like_the_trainer(src, "fp32")
    out = write_output(model, disk_tmp / "out", max_shard_size="20KB")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()) == set(shards)
    out = write_output(model, disk_tmp / "out")                   # again, in one shard: no stale index
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert torch.equal(hf_load(out)(input_ids=token_batch(5)).logits, model(input_ids=token_batch(5)).logits)
    model.offload_engine.close()


@pytest.mark.parametrize("tied", [True, False])
def test_a_preset_model_is_written_as_an_hf_llama_with_the_same_logits(disk_tmp, tied):
    from offload.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_seq_len=64, rope_theta=50000.0, tie_embeddings=tied)
    torch.manual_seed(0)
    with offload.lazy_init(config("fp32", chunk=16384)):
        model = LlamaForCausalLM(cfg)
    model = offload.wrap(model)
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    ids = token_batch(1)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    out = write_output(model, disk_tmp / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings == tied
    assert file_dtypes(out) == {torch.float32}
    with torch.no_grad():
        ids = token_batch(7)
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    model.offload_engine.close()


def test_an_adapter_takes_no_dtype(disk_tmp):
    pytest.importorskip("peft")
    from offload.hf.lora import LoraSettings, apply_lora

    src = save_tiny(disk_tmp / "src", "llama")
    model = load_pretrained(src, config("fp32"), adapt=lambda m: apply_lora(m, LoraSettings(rank=2)))
    with pytest.raises(offload.ConfigError, match="dtype"):
        write_output(model, disk_tmp / "out", dtype="bf16")
    merged = write_output(model, disk_tmp / "merged", merge=True, dtype="bf16")
    assert file_dtypes(merged) == {torch.bfloat16}
    model.offload_engine.close()
