"""HF causal LMs of the LLaMA family cut into pipeline stages: the stages chain to the model."""

from __future__ import annotations

import pytest
import torch

from offload.errors import ConfigError, UnsupportedError
from offload.pipeline import split_hf

transformers = pytest.importorskip("transformers")

from tests.helpers.hf_models import tiny_config  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_hf_stages_chain_to_the_whole_model(arch, stages, attention):
    """Causal under either attention (eager's is causal only by its mask)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(arch, num_hidden_layers=3, tie_word_embeddings=False), attn_implementation=attention).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    want = model(ids).logits
    x = ids
    modules = split_hf(model, stages)
    for m in modules:
        x = m(x)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    assert sorted(id(p) for m in modules for p in m.parameters()) == sorted(id(p) for p in model.parameters())


def test_tied_hf_models_and_other_families_are_refused():
    tied = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=True))
    with pytest.raises(UnsupportedError, match="tie_word_embeddings=False"):
        split_hf(tied, 2)
    gpt2 = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    with pytest.raises(ConfigError, match="LLaMA family"):
        split_hf(gpt2, 2)


def _chain(modules, ids):
    for m in modules:
        ids = m(ids)
    return ids


def test_a_sliding_window_shorter_than_the_sequence_is_refused_not_ignored():
    """Stages attend causally over the whole micro-batch: within the window that is the model's
    own attention, past it the model would have masked what the stages let through."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        **{**tiny_config("llama").to_diff_dict(), "sliding_window": 8, "tie_word_embeddings": False})).eval()
    modules = split_hf(model, 2)
    short = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(_chain(modules, short), model(short).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="sliding_window=8: is shorter than the micro-batch's 12 tokens"):
        _chain(modules, torch.randint(0, 256, (2, 12)))


@pytest.mark.parametrize("field, value", [("logits_scaling", 2.0), ("embedding_multiplier", 3.0)])
def test_a_scaled_granite_is_refused_not_cut_without_its_scales(field, value):
    """Granite scales the embedding's output and divides the logits in the model's forward, which
    the stages do not run: cut anyway, the stages would compute another model."""
    cfg = transformers.GraniteConfig(**{**tiny_config("llama").to_diff_dict(), field: value,
                                        "tie_word_embeddings": False})
    model = transformers.GraniteForCausalLM(cfg)
    with pytest.raises(ConfigError, match=f"{field}={value}: is not reproduced by pipeline stages"):
        split_hf(model, 2)


def test_a_model_with_rotary_embeddings_per_layer_type_is_refused_by_name():
    """Gemma 3 computes a rotary table per layer type (sliding / full attention); the stages make
    one for all layers, so the model is refused when cut, not failed inside torch at the first batch."""
    config = getattr(transformers, "Gemma3TextConfig", None)
    if config is None:
        pytest.skip("this transformers has no Gemma 3")
    base = tiny_config("llama").to_diff_dict()
    cfg = config(vocab_size=256, hidden_size=base["hidden_size"], intermediate_size=base["intermediate_size"],
                 num_hidden_layers=2, num_attention_heads=base["num_attention_heads"],
                 num_key_value_heads=base["num_key_value_heads"], head_dim=16, tie_word_embeddings=False)
    model = transformers.Gemma3ForCausalLM(cfg)
    with pytest.raises(ConfigError, match="rotary_emb.*layer_type"):
        split_hf(model, 2)
