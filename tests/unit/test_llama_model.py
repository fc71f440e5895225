"""The LLaMA reference model: shapes, parameter counts, init, checkpointing, config checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import ConfigError
from offload.models import (PRESETS, LlamaConfig, LlamaForCausalLM, flops_per_token, get_preset,
                            layer_param_count, param_count)

TINY = PRESETS["tiny"]
MICRO = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, max_seq_len=32)


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_param_count_matches_built_module(name):
    assert param_count(PRESETS[name]) == _numel(LlamaForCausalLM(PRESETS[name]))


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_matches_module_built_on_meta(name):
    with torch.device("meta"):
        model = LlamaForCausalLM(PRESETS[name])
    assert param_count(PRESETS[name]) == _numel(model)
    layer = model.model.layers[0]
    assert layer_param_count(PRESETS[name]) == _numel(layer)


def test_large_presets_have_the_published_counts():
    # Meta's LLaMA-2 checkpoints: 6,738,415,616 / 13,015,864,320 / 68,976,648,192 parameters
    assert param_count(PRESETS["7b"]) == 6_738_415_616
    assert param_count(PRESETS["13b"]) == 13_015_864_320
    assert param_count(PRESETS["70b"]) == 68_976_648_192
    assert 95e9 < param_count(PRESETS["100b"]) < 105e9
    assert 1.0e9 < param_count(PRESETS["1b"]) < 1.3e9
    assert 1e6 < param_count(PRESETS["tiny"]) < 10e6
    assert 20e6 <= param_count(PRESETS["small"]) <= 50e6


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([2, 4, 8]),
       kv_div=st.sampled_from([1, 2, 4]), layers=st.integers(1, 3), vocab=st.integers(2, 64),
       inter=st.integers(1, 40), tie=st.booleans())
def test_param_count_random_configs(heads, head_dim, kv_div, layers, vocab, inter, tie):
    kv = max(1, heads // kv_div)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=inter,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv, tie_embeddings=tie)
    model = LlamaForCausalLM(cfg)
    assert param_count(cfg) == _numel(model)
    ids = torch.randint(0, vocab, (1, 5))
    assert model(ids).logits.shape == (1, 5, vocab)


def test_forward_backward_tiny():
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 48))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 48, TINY.vocab_size)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert abs(out.loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5   # ~uniform at init
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model(ids).loss is None


def test_causal_and_ignore_index():
    torch.manual_seed(0)
    model = LlamaForCausalLM(MICRO).eval()
    ids = torch.randint(0, MICRO.vocab_size, (1, 10))
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % MICRO.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[:, :6], model(changed).logits[:, :6])
        labels = ids.clone()
        labels[0, 5:] = -100
        full = model(ids[:, :5], labels=ids[:, :5]).loss
        torch.testing.assert_close(model(ids, labels=labels).loss, full)


def test_a_few_steps_lower_the_loss():
    torch.manual_seed(0)
    model = LlamaForCausalLM(MICRO)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, MICRO.vocab_size, (4, 16))
    losses = []
    for _ in range(10):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def _loss_and_grads(checkpointing: bool):
    torch.manual_seed(1)
    model = LlamaForCausalLM(TINY)
    model.gradient_checkpointing = checkpointing
    ids = torch.randint(0, TINY.vocab_size, (2, 32))
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_checkpointing_gives_the_same_loss_and_grads():
    loss, grads = _loss_and_grads(False)
    loss_ck, grads_ck = _loss_and_grads(True)
    torch.testing.assert_close(loss_ck, loss)
    assert grads.keys() == grads_ck.keys()
    for name in grads:
        torch.testing.assert_close(grads_ck[name], grads[name], msg=name)


def test_checkpointing_recomputes_each_layer():
    model = LlamaForCausalLM(MICRO)
    model.gradient_checkpointing = True
    calls = []
    for layer in model.model.layers:   # the engine fetches in pre-hooks and releases in hooks
        layer.register_forward_pre_hook(lambda *_: calls.append("pre"))
        layer.register_forward_hook(lambda *_: calls.append("post"))
        layer.mlp.register_forward_hook(lambda *_: calls.append("mlp"))
    ids = torch.randint(0, MICRO.vocab_size, (1, 8))
    loss = model(ids, labels=ids).loss
    assert calls == ["pre", "mlp", "post"] * MICRO.num_layers
    calls.clear()
    loss.backward()                    # recomputed last layer first, each to its end
    assert calls == ["pre", "mlp", "post"] * MICRO.num_layers
    calls.clear()
    model.eval()
    model(ids)
    assert calls == ["pre", "mlp", "post"] * MICRO.num_layers


def test_tied_embeddings_share_one_parameter():
    model = LlamaForCausalLM(TINY)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    untied = LlamaForCausalLM(MICRO)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert len(list(untied.parameters())) == len(list(model.parameters())) - 4 * 9 + 2 * 9 + 1


def test_hf_names_and_no_buffers():
    model = LlamaForCausalLM(MICRO)
    names = dict(model.named_parameters())
    for n in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
              "model.norm.weight", "lm_head.weight"):
        assert n in names
    assert list(model.buffers()) == []


def test_same_seed_same_model():
    torch.manual_seed(123)
    a = LlamaForCausalLM(TINY).state_dict()
    torch.manual_seed(123)
    b = LlamaForCausalLM(TINY).state_dict()
    torch.manual_seed(124)
    c = LlamaForCausalLM(TINY).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    w = a["model.layers.0.mlp.up_proj.weight"]
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(a["model.norm.weight"], torch.ones(TINY.hidden_size))


@pytest.mark.parametrize("tie", [False, True])
def test_reset_parameters_replays_eager_init(tie):
    """A lazy builder rebuilds the weights by calling reset_parameters in modules() order
    (skipping a tied lm_head, which owns no parameter of its own)."""
    cfg = MICRO.replace(tie_embeddings=tie)
    torch.manual_seed(7)
    eager = LlamaForCausalLM(cfg).state_dict()
    with torch.device("meta"):
        lazy = LlamaForCausalLM(cfg)
    lazy.to_empty(device="cpu")
    if tie:
        lazy.lm_head.weight = lazy.model.embed_tokens.weight    # to_empty unties
    torch.manual_seed(7)
    for m in lazy.modules():
        if hasattr(m, "reset_parameters") and not (tie and m is lazy.lm_head):
            m.reset_parameters()
    for k, v in lazy.state_dict().items():
        assert torch.equal(v, eager[k]), k


@pytest.mark.parametrize("field,value", [
    ("vocab_size", 0), ("hidden_size", -1), ("num_layers", 1.5), ("intermediate_size", True),
    ("num_kv_heads", 3), ("hidden_size", 30), ("num_heads", 32), ("rope_theta", 0.0),
    ("norm_eps", 2.0), ("tie_embeddings", "yes"), ("max_seq_len", 0),
])
def test_bad_config_fields_name_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        MICRO.replace(**{field: value})
    assert info.value.field == field
    assert field in str(info.value)


def test_get_preset_names():
    assert get_preset("llama-7b") is PRESETS["7b"]
    assert get_preset("LLaMA-100B") is PRESETS["100b"]
    assert get_preset("tiny") is PRESETS["tiny"]
    with pytest.raises(ConfigError) as info:
        get_preset("llama-3b")
    assert info.value.field == "model" and "100b" in str(info.value)


def test_flops_per_token():
    cfg = PRESETS["7b"]
    matmul_params = param_count(cfg) - cfg.vocab_size * cfg.hidden_size - \
        (2 * cfg.num_layers + 1) * cfg.hidden_size
    assert flops_per_token(cfg, 0) == 6 * matmul_params
    assert flops_per_token(cfg, 4096) - flops_per_token(cfg, 0) == 12 * 32 * 4096 * 4096
