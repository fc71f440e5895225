"""Tiny Hugging Face causal LMs built from configs in the tests (no download), saved sharded."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256          # the byte tokenizer's vocabulary: the script's default data works unchanged


def tiny_config(arch: str, **kw):
    import transformers

    llama_like = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    if arch == "llama":
        return transformers.LlamaConfig(**{**llama_like, **kw})
    if arch == "qwen2":
        return transformers.Qwen2Config(**{**llama_like, **kw})
    if arch == "mixtral":           # transformers 5 stores experts per expert, fuses them in the model
        return transformers.MixtralConfig(**{**llama_like, "num_local_experts": 4, "num_experts_per_tok": 2, **kw})
    if arch == "gpt_neox":          # its checkpoints name lm_head "embed_out"
        return transformers.GPTNeoXConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4, use_cache=False), **kw})
    if arch == "opt":
        return transformers.OPTConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, word_embed_proj_dim=32,
                                                max_position_embeddings=128, use_cache=False), **kw})
    if arch == "gpt2":
        return transformers.GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                                 bos_token_id=0, eos_token_id=0, use_cache=False), **kw})
    raise ValueError(arch)


def tiny_llama(seed: int = 0):
    """A 2-layer, 128-token-vocabulary LlamaForCausalLM with tied embeddings, made with ``seed``
    (the engine-equivalence, Trainer and accelerate tests)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def save_tiny(directory: Path, arch: str = "llama", seed: int = 0, shard: str = "20KB", **kw) -> Path:
    """Build a tiny model with random weights and ``save_pretrained`` it in shards of ``shard``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **kw))
    model.save_pretrained(str(directory), max_shard_size=shard)
    return Path(directory)


def hf_load(directory, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).eval()


def token_batch(seed: int = 0, rows: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def checkpointing(model):
    # transformers 5.x renamed gradient_checkpointing_enable (kept, deprecated); 4.x has only the old name.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
