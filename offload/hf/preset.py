"""A from-scratch model (``offload.models.llama``, a ``--preset`` run) as Hugging Face sees it.

Its module and parameter names already are ``transformers``' ``LlamaForCausalLM``'s, its RoPE
is HF's rotate-half layout and its norms are HF's RMSNorm, so only a ``LlamaConfig`` is missing
for ``export_pretrained`` to write a directory ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

from torch import nn

from ..models.llama import LlamaConfig, LlamaForCausalLM


def is_preset(model: nn.Module) -> bool:
    """Whether ``model`` is an ``offload.models.llama.LlamaForCausalLM`` (wrapped or not)."""
    return isinstance(model, LlamaForCausalLM)


def hf_llama_config(cfg: LlamaConfig, dtype=None):
    """``transformers.LlamaConfig`` of the same shape as ``cfg``; ``dtype``: the weights' dtype."""
    from transformers import LlamaConfig as HFLlamaConfig

    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    config = HFLlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
        # transformers 5 reads rope_parameters, 4.x rope_theta (each keeps the other as an unused attribute)
        rope_parameters=rope, rope_theta=float(cfg.rope_theta),
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if dtype is not None:
        config.dtype = dtype
    return config
