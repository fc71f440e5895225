"""A wrapped PeftModel's ``load_adapter`` (HF Trainer's resume of a LoRA run): values load into the
engine's own adapter parameters, never into new ones; a new adapter name is refused, naming it."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.errors import UnsupportedError
from tests.helpers.hf_models import tiny_llama

peft = pytest.importorskip("peft")


def wrapped_lora():
    torch.manual_seed(1)
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    return offload.wrap(model, offload.OffloadConfig(device="cpu", dtype="bf16", chunk_size=16384))


def adapter(model):
    return model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight


def test_load_adapter_keeps_the_wrapped_parameters_and_loads_their_values(tmp_path):
    source = wrapped_lora()
    with torch.no_grad():
        values = {k: torch.full_like(v, 0.25) if "lora_A" in k else v for k, v in source.state_dict().items()}
    source.load_state_dict(values)
    source.save_pretrained(str(tmp_path))
    model = wrapped_lora()
    before = [id(p) for p in model.parameters()]
    model.load_adapter(str(tmp_path), "default", is_trainable=True)     # peft would upcast to new fp32 params
    assert [id(p) for p in model.parameters()] == before
    assert adapter(model).dtype == torch.bfloat16
    got = model.state_dict()
    names = [k for k in got if "lora_A" in k]
    assert names and all(torch.equal(got[k], torch.full_like(got[k], 0.25)) for k in names)
    for m in (source, model):
        m.offload_engine.close()


def test_load_adapter_under_a_new_name_is_refused_naming_it(tmp_path):
    model = wrapped_lora()
    with pytest.raises(UnsupportedError, match=r"adapter_name='other'.*\['default'\].*before offload.wrap"):
        model.load_adapter(str(tmp_path), "other")
    model.offload_engine.close()
