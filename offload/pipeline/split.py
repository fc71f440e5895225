"""Cut a causal LM into pipeline stages by layer: each stage a module of its own.

A model is seen as a chain of *units*: the token embedding, each decoder layer, then the final
norm with the LM head. ``split_llama`` / ``split_hf`` cut the chain into ``stages`` contiguous
runs balanced by parameter count or by measured forward + backward time (``balance.cut`` over
``timing.unit_costs``: ``balance="params" | "time"`` or the costs themselves) and return one ``nn.Module`` per stage,
built from the model's own submodules (the same parameter objects, so a model initialised or
loaded once is cut without copying). Stage ``s`` maps what stage ``s - 1`` returned (token ids
for the first) to hidden states, or to logits for the last; the rotary tables are recomputed per
stage (cheap, and only hidden states cross between stages, as in Megatron and torchtitan).

Each stage module records ``units`` (its ``[lo, hi)`` of the chain) and ``full_names`` (its
parameters' names in the stage -> in the whole model): what a pipeline checkpoint's manifest says
each stage holds, so that another cut finds every parameter by name (``reshard``).

Tied input and output embeddings are refused: the embedding would live on the first and the last
stage, and its two gradients would have to be summed across them every step (Megatron's
embedding group), which the stages' engines do not do yet.
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, UnsupportedError
from .balance import cut
from .timing import unit_costs


@dataclass(frozen=True)
class StageSpec:
    """Stage ``index`` of ``count``: units ``[lo, hi)`` of the model's chain."""

    index: int
    count: int
    lo: int
    hi: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def _params(*modules) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def _full_names(model: nn.Module, stage: nn.Module) -> dict[str, str]:
    """``{name in the stage: name in the whole model}`` of the stage's parameters (the same
    objects): what a checkpoint records, so that another cut finds each parameter by name."""
    whole = {id(p): n for n, p in model.named_parameters()}
    return {n: whole[id(p)] for n, p in stage.named_parameters()}


def _refuse_tied(embed: nn.Module, head: nn.Module) -> None:
    if head.weight is embed.weight:
        raise UnsupportedError(
            "the model ties its LM head to its input embedding (tie_embeddings / tie_word_embeddings): "
            "pipeline stages hold them on the first and the last stage, whose gradients are not summed "
            "yet; build the model untied (LlamaConfig.replace(tie_embeddings=False), or "
            "tie_word_embeddings=False for an HF config) to cut it into stages")


def plan(costs: list[float], stages: int) -> list[StageSpec]:
    """The stages of a chain of units with ``costs`` (parameters or seconds), balanced."""
    return [StageSpec(i, stages, lo, hi) for i, (lo, hi) in enumerate(cut(costs, stages))]


class LlamaStage(nn.Module):
    """Units ``[lo, hi)`` of an ``offload.models.LlamaForCausalLM``. ``gradient_checkpointing``
    (the model's setting when cut): recompute each decoder layer in backward, so a stage with
    several micro-batches in flight keeps only each layer's input of each."""

    def __init__(self, model, spec: StageSpec):
        super().__init__()
        from ..models.llama import rope_tables, run_layers

        self._rope, self._run_layers = rope_tables, run_layers
        self.cfg = model.config
        self.gradient_checkpointing = model.gradient_checkpointing
        self.hidden_size, self.vocab_size = self.cfg.hidden_size, self.cfg.vocab_size
        self.is_first, self.is_last = spec.first, spec.last
        n = self.cfg.num_layers
        self.embed_tokens = model.model.embed_tokens if spec.lo == 0 else None
        self.layers = nn.ModuleList(model.model.layers[max(spec.lo - 1, 0):min(spec.hi - 1, n)])
        last = spec.hi == n + 2
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.units = (spec.lo, spec.hi)
        self.full_names = _full_names(model, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        cos, sin = self._rope(self.cfg, x.shape[1], x.device, x.dtype)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        x = self._run_layers(self.layers, x, cos, sin, recompute=recompute)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def _probe_ids(embed: nn.Module, vocab_size: int, probe: tuple[int, int]):
    def make() -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, probe, generator=gen).to(embed.weight.device)
    return make


def split_llama(model, stages: int, *, balance="params", probe: tuple[int, int] = (1, 128)) -> list[LlamaStage]:
    """``offload.models.LlamaForCausalLM`` cut into ``stages`` balanced stage modules. ``balance``:
    "params", "time" (each unit timed on a ``probe`` = (batch, seq) batch of token ids, before
    the model is wrapped), or one cost per unit (``timing.unit_costs``)."""
    m = model.model
    _refuse_tied(m.embed_tokens, model.lm_head)
    costs = [_params(m.embed_tokens), *(_params(layer) for layer in m.layers), _params(m.norm, model.lm_head)]
    n = len(costs)
    costs = unit_costs(balance, costs, lambda i: LlamaStage(model, StageSpec(i, n, i, i + 1)),
                       _probe_ids(m.embed_tokens, model.config.vocab_size, probe))
    return [LlamaStage(model, spec) for spec in plan(costs, stages)]


class HFStage(nn.Module):
    """Units ``[lo, hi)`` of an HF causal LM of the LLaMA family (``model.model.embed_tokens``,
    ``.layers``, ``.norm``, ``.rotary_emb``, ``model.lm_head``: Llama, Mistral, Qwen2, ...).
    Attention is causal over the whole micro-batch (no padding mask: pipeline micro-batches are
    packed sequences): SDPA and flash attention are causal without a mask, the eager one is
    given an additive causal mask."""

    def __init__(self, model, spec: StageSpec):
        super().__init__()
        inner = model.model
        self.hidden_size, self.vocab_size = model.config.hidden_size, model.config.vocab_size
        self.is_first, self.is_last = spec.first, spec.last
        n = len(inner.layers)
        self.embed_tokens = inner.embed_tokens if spec.lo == 0 else None
        self.rotary_emb = inner.rotary_emb
        self.layers = nn.ModuleList(inner.layers[max(spec.lo - 1, 0):min(spec.hi - 1, n)])
        last = spec.hi == n + 2
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.units = (spec.lo, spec.hi)
        self.full_names = _full_names(model, self)
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        self.mask_free = impl == "sdpa" or impl.startswith("flash")
        # Mistral (and Gemma 2's sliding layers) mask keys older than the window; the stages
        # build no such mask, so they equal the model only on sequences within it.
        self.window = getattr(model.config, "sliding_window", None)

    def _mask(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.mask_free:
            return None
        t = x.shape[1]
        above = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        return torch.zeros(t, t, dtype=x.dtype, device=x.device).masked_fill(above, torch.finfo(x.dtype).min)[None, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.window is not None and x.shape[1] > self.window:
            raise ConfigError("sliding_window", self.window,
                              f"is shorter than the micro-batch's {x.shape[1]} tokens: pipeline stages attend "
                              "causally over the whole sequence (no sliding-window mask yet); use sequences "
                              f"of at most {self.window} tokens")
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rope = self.rotary_emb(x, positions)
        mask = self._mask(x)
        for layer in self.layers:
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
            x = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


# Config fields by which a family's top-level forward scales the embedding's output or the logits
# (Granite, Gemma 2/3, Cohere): the stages run only the submodules, so a value other than the
# neutral one would make them another model.
_UNREPRODUCED = {"embedding_multiplier": 1.0, "logits_scaling": 1.0, "final_logit_softcapping": None,
                 "logit_scale": 1.0}


def _refuse_unreproduced(config) -> None:
    for field, neutral in _UNREPRODUCED.items():
        value = getattr(config, field, neutral)
        if value != neutral:
            raise ConfigError(field, value, "is not reproduced by pipeline stages (the model's own forward "
                                            f"applies it outside its layers); only {neutral} can be cut")


def _refuse_layered_rotary(rotary) -> None:
    # The stages compute one rotary table, rotary_emb(x, position_ids), for every layer; a family
    # whose table depends on more (Gemma 3: each layer type's own) would fail inside torch later.
    extra = [name for name, p in list(inspect.signature(rotary.forward).parameters.items())[2:]
             if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if extra:
        raise ConfigError("rotary_emb", type(rotary).__name__,
                          f"takes {', '.join(extra)} beside (x, position_ids): rotary embeddings per layer type "
                          "are not reproduced by pipeline stages")


def split_hf(model, stages: int, *, balance="params", probe: tuple[int, int] = (1, 128)) -> list[HFStage]:
    """An HF causal LM of the LLaMA family cut into ``stages`` balanced stage modules (``balance``
    and ``probe``: as ``split_llama``'s)."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        raise ConfigError("model", type(model).__name__,
                          "is not an HF causal LM of the LLaMA family (model.model.embed_tokens, .layers, "
                          ".norm, .rotary_emb and model.lm_head)")
    _refuse_tied(inner.embed_tokens, model.lm_head)
    _refuse_unreproduced(model.config)
    _refuse_layered_rotary(inner.rotary_emb)
    costs = [_params(inner.embed_tokens), *(_params(layer) for layer in inner.layers),
             _params(inner.norm, model.lm_head)]
    n = len(costs)
    costs = unit_costs(balance, costs, lambda i: HFStage(model, StageSpec(i, n, i, i + 1)),
                       _probe_ids(inner.embed_tokens, model.config.vocab_size, probe))
    return [HFStage(model, spec) for spec in plan(costs, stages)]
