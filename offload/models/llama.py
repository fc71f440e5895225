"""A compact LLaMA-architecture decoder in plain PyTorch, with presets from ``tiny`` to ``100b``.

RMSNorm, rotary embeddings (HF's rotate-half layout), grouped-query attention through
``scaled_dot_product_attention(is_causal=True)``, SwiGLU MLP, no biases. Module and parameter
names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.3.self_attn.q_proj.weight``), so
HF safetensors shards map onto it by name. Each decoder layer is its own submodule: the engine
hooks per submodule. The model has no buffers (the RoPE tables are rebuilt in each forward, a
few KiB), so building it on the meta device and materializing only parameters is enough.

Every weight is initialized in its own module's ``reset_parameters`` (normal, std 0.02, like HF;
norms to ones) at construction, so the random stream is consumed in module order, once:
the same seed gives the same model, and a lazy builder can replay ``reset_parameters`` in
``model.modules()`` order to reproduce eager construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ..errors import ConfigError

INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    """Shape of a LLaMA-architecture decoder."""

    vocab_size: int
    """Tokens in the vocabulary (256 for the byte-level tokenizer)."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads; head_dim = hidden_size / num_heads (must be even for RoPE)."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); divides num_heads."""
    max_seq_len: int = 2048
    """Longest sequence the model is meant for (tokens)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """lm_head shares the input embedding's Parameter."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "expected a positive integer")
        if self.hidden_size % self.num_heads:
            raise ConfigError("hidden_size", self.hidden_size,
                              f"must be divisible by num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError("num_heads", self.num_heads,
                              f"gives an odd head_dim={self.head_dim}; RoPE needs an even one")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", self.num_kv_heads,
                              f"must divide num_heads={self.num_heads}")
        for name, hi in (("rope_theta", float("inf")), ("norm_eps", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < hi:
                raise ConfigError(name, value, f"expected a number in (0, {hi})")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError("tie_embeddings", self.tie_embeddings, "expected true or false")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection."""
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, LlamaConfig] = {
    # byte-level vocab; the default of `make finetune`, trains in seconds on a CPU
    "tiny": LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_layers=4,
                        num_heads=4, num_kv_heads=2, max_seq_len=256, tie_embeddings=True),
    "small": LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1408, num_layers=8,
                         num_heads=8, num_kv_heads=4, max_seq_len=512, tie_embeddings=True),
    # TinyLlama-1.1B's shape
    "1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22,
                      num_heads=32, num_kv_heads=4),
    # LLaMA-2 7B / 13B / 70B
    "7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_heads=32, num_kv_heads=32, max_seq_len=4096),
    "13b": LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
                       num_heads=40, num_kv_heads=40, max_seq_len=4096),
    "70b": LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8, max_seq_len=4096),
    # a 70B-style shape widened to ~100B parameters (head_dim 128, GQA 10:1)
    "100b": LlamaConfig(vocab_size=32000, hidden_size=10240, intermediate_size=28672, num_layers=90,
                        num_heads=80, num_kv_heads=8, max_seq_len=4096),
}


def get_preset(name: str) -> LlamaConfig:
    """The preset called ``name``; ``"llama-7b"``, ``"LLaMA-7B"`` and ``"7b"`` are the same."""
    key = str(name).strip().lower()
    key = key.removeprefix("llama-").removeprefix("llama")
    if key not in PRESETS:
        raise ConfigError("model", name, f"unknown preset; known: {', '.join(PRESETS)}")
    return PRESETS[key]


def layer_matmul_params(cfg: LlamaConfig) -> int:
    """Weights of one decoder layer's seven projections (elements): what its matmuls multiply by."""
    h = cfg.hidden_size
    return 2 * h * h + 2 * h * cfg.kv_dim + 3 * h * cfg.intermediate_size


def layer_param_count(cfg: LlamaConfig) -> int:
    """Parameters of one decoder layer (elements)."""
    return layer_matmul_params(cfg) + 2 * cfg.hidden_size


def param_count(cfg: LlamaConfig) -> int:
    """Parameters of ``LlamaForCausalLM(cfg)`` (elements; a tied lm_head counts once)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    return v * h * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * layer_param_count(cfg) + h


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, no recompute): 6 N + 12 L d T.

    N counts the weights used in matmuls (all layers' projections and the lm_head; the input
    embedding is a lookup); 12 L d T is attention's QK^T and AV over a ``seq_len`` context,
    counting the full score matrix as PaLM's MFU convention does. Activation checkpointing adds
    one more forward (multiply the 6 N part by 8/6).
    """
    n = cfg.num_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size
    return 6.0 * n + attention_flops_per_token(cfg, seq_len)


def attention_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """The 12 L d T part of ``flops_per_token`` (forward 4 L d T, backward twice that)."""
    return 12.0 * cfg.num_layers * cfg.hidden_size * seq_len


class _Linear(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 (as HF does): bf16 squares lose too much
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(cfg: LlamaConfig, seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary embedding for positions ``0 .. seq_len - 1``, each
    ``(seq_len, head_dim)`` in ``dtype`` (computed in fp32)."""
    half = torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32),
                        1.0 / (cfg.rope_theta ** half))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def run_layers(layers, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, recompute: bool) -> torch.Tensor:
    """``x`` through decoder ``layers`` in turn; ``recompute``: each under activation checkpointing
    (its input kept, the rest recomputed in backward). ``LlamaModel`` and pipeline stages run theirs
    with it."""
    for layer in layers:
        if recompute:
            # no early stop: the recompute runs each layer to its end, so every forward
            # pre-hook the engine sees in backward is matched by a forward hook
            with set_checkpoint_early_stop(False):
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
        else:
            x = layer(x, cos, sin)
    return x


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.q_proj = _Linear(h, h, bias=False)
        self.k_proj = _Linear(h, cfg.kv_dim, bias=False)
        self.v_proj = _Linear(h, cfg.kv_dim, bias=False)
        self.o_proj = _Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cfg.num_kv_heads != cfg.num_heads:
            rep = cfg.num_heads // cfg.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, cfg.hidden_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = _Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.gradient_checkpointing = False
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = rope_tables(self.cfg, input_ids.shape[1], x.device, x.dtype)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        return self.norm(run_layers(self.layers, x, cos, sin, recompute=recompute))


class CausalLMOutput(NamedTuple):
    loss: torch.Tensor | None
    """Mean next-token cross-entropy (fp32) when labels were given (label -100 is ignored)."""
    logits: torch.Tensor
    """(batch, seq, vocab), in the model's dtype."""


class LlamaForCausalLM(nn.Module):
    """``model(input_ids, labels=None) -> CausalLMOutput(loss, logits)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if not isinstance(cfg, LlamaConfig):
            raise ConfigError("config", cfg, "expected an offload.models.LlamaConfig")
        self.config = cfg
        self.model = LlamaModel(cfg)
        if cfg.tie_embeddings:
            # built on meta (no memory, no random numbers drawn), then pointed at the embedding
            self.lm_head = _Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = _Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def gradient_checkpointing(self) -> bool:
        """Recompute each decoder layer in backward (saves all but the layer inputs)."""
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        self.model.gradient_checkpointing = bool(value)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss, logits)
