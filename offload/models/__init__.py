"""Reference models for the fine-tuning script, the planner and the tests (pure PyTorch)."""

from .llama import (
    PRESETS,
    CausalLMOutput,
    LlamaConfig,
    LlamaForCausalLM,
    attention_flops_per_token,
    flops_per_token,
    get_preset,
    layer_param_count,
    param_count,
)

__all__ = [
    "PRESETS",
    "CausalLMOutput",
    "LlamaConfig",
    "LlamaForCausalLM",
    "attention_flops_per_token",
    "flops_per_token",
    "get_preset",
    "layer_param_count",
    "param_count",
]
