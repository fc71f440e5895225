"""Buffers keep the dtype the model made them in: a bf16 run of an HF Llama keeps its fp32
``rotary_emb.inv_freq``, so logits at long positions match an fp32-buffer reference (as HF loads
keep such buffers), where casting the buffer to bf16 visibly moves them."""

from __future__ import annotations

import copy

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
SEQ = 512


def long_context_llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                                   rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model.eval()


def bf16_params_fp32_buffers(model):
    """``model.to(bfloat16)`` casts buffers too; put the fp32 buffers back, as an HF load has them."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model = model.to(torch.bfloat16)
    for name, b in buffers.items():
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, b)
    return model


def test_bf16_run_keeps_fp32_rope_buffers(disk_tmp):
    base = long_context_llama()
    reference = bf16_params_fp32_buffers(copy.deepcopy(base))
    all_bf16 = copy.deepcopy(base).to(torch.bfloat16)
    cfg = offload.OffloadConfig(device="cpu", dtype="bf16", nvme_paths=[str(disk_tmp)],
                                device_budget="1MiB", cpu_budget="1MiB")
    model = offload.wrap(copy.deepcopy(base), cfg)
    inv_freq = dict(model.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv_freq.dtype == torch.float32
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(input_ids=ids).logits[0, -128:].float()
        want = reference(input_ids=ids).logits[0, -128:].float()
        worse = all_bf16(input_ids=ids).logits[0, -128:].float()
    assert torch.equal(got, want)
    # What the test guards against: with a bf16 inv_freq the long positions' logits move.
    assert (worse - want).abs().max() > 10 * (got - want).abs().max() + 1e-3
    model.offload_engine.close()
