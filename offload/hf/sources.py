"""Where each of a model's tensors comes from in a checkpoint, with transformers' own key conversions.

transformers 5 renames and fuses checkpoint tensors on load and reverses that on save: GPT-NeoX's
``embed_out`` is ``lm_head``, and a Mixtral or Qwen-MoE layer's experts are stored one tensor per
expert (``experts.3.w1.weight``) but are one fused parameter in the model (``experts.gate_up_proj``).
``resolve_sources`` applies the model's registered conversions
(``transformers.conversion_mapping.get_model_conversion_mapping``, in the order and with the rules
``from_pretrained`` uses) to the checkpoint's names. A model tensor is then either ``Direct`` (one
checkpoint tensor, copied in row blocks) or ``Converted`` (its converter runs over the group's
source tensors — all experts of one layer — when the tensor is loaded; the group's memory is freed
once all of its outputs are in). Shapes of converted tensors are found without reading any data, by
running the converter on meta tensors of the sources' shapes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import OffloadError
from .tensor_files import copy_tensor, one_line, read_rows


@dataclass
class Direct:
    """One checkpoint tensor, as it is."""

    name: str
    file: Path
    shape: tuple[int, ...]

    def where(self) -> str:
        return f"{self.file}: tensor {self.name!r}"

    def copy_into(self, dst: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Its flat elements ``lo:hi`` (default all) into ``dst``; only the rows holding them are read."""
        copy_tensor(dst, self.file, self.name, self.shape, lo, hi)

    def skip(self) -> None:
        """None of its elements are wanted (they lie in other ranks' pieces)."""


@dataclass(eq=False)
class Group:
    """The checkpoint tensors one transformers ``WeightConverter`` turns into model tensors."""

    key: str                       # the renamed key transformers groups them under
    template: object               # the WeightConverter (deep-copied per use: converters hold state)
    model: object
    sources: list = field(default_factory=list)      # (checkpoint name, source pattern, file, shape)
    outputs: dict | None = None                      # model name -> tensor, while being loaded
    pending: set = field(default_factory=set)
    finished: set = field(default_factory=set)       # outputs already done with (a rank that needs
                                                     # none of their elements never converts for them)

    def where(self) -> str:
        files = sorted({str(f) for _, _, f, _ in self.sources})
        return (f"{', '.join(files[:2])}{' ...' if len(files) > 2 else ''}: tensors "
                f"{self.sources[0][0]!r} ... ({len(self.sources)}) converted to {self.key!r}")

    def _convert(self, read) -> dict[str, torch.Tensor]:
        conv = copy.deepcopy(self.template)
        for name, pattern, file, shape in self.sources:
            conv.add_tensor(self.key, name, pattern, lambda n=name, f=file, s=shape: read(n, f, s))
        out = conv.convert(self.key, model=self.model, config=getattr(self.model, "config", None))
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    def meta_shapes(self) -> dict[str, tuple[int, ...]]:
        try:
            out = self._convert(lambda n, f, s: torch.empty(s, device="meta"))
        except Exception as exc:
            raise OffloadError(f"{self.where()}: transformers' conversion fails ({one_line(exc)})") from exc
        return {k: tuple(v.shape) for k, v in out.items()}

    def value(self, target: str) -> torch.Tensor:
        if self.outputs is None:
            self.outputs = self._convert(lambda n, f, s: read_rows(f, n, 0))
            self.pending = set(self.outputs) - self.finished
        return self.outputs[target]

    def done(self, target: str) -> None:
        self.finished.add(target)
        self.pending.discard(target)
        if self.outputs is not None and not self.pending:
            self.outputs = None          # the group's tensors leave memory


@dataclass
class Converted:
    """A model tensor made by a converter from several checkpoint tensors."""

    target: str
    group: Group
    shape: tuple[int, ...]

    def where(self) -> str:
        return self.group.where()

    def copy_into(self, dst: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Its flat elements ``lo:hi`` (default all) into ``dst``. The converter needs the group's
        source tensors whole, so they are read whole."""
        value = self.group.value(self.target)
        if tuple(value.shape) != self.shape:
            raise OffloadError(f"{self.where()}: conversion gave {list(value.shape)} for {self.target!r}, "
                               f"expected {list(self.shape)}")
        dst.copy_(value.reshape(-1)[lo:hi])
        self.group.done(self.target)

    def skip(self) -> None:
        """None of its elements are wanted (they lie in other ranks' pieces): the group is not
        converted for it, and forgets it once converted for the others."""
        self.group.done(self.target)


def _conversions(model):
    """transformers' (renamings, converters, natural sort key) for ``model``; none before transformers 5."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key
    except ImportError:
        return [], [], None
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)], dot_natural_key)


def resolve_sources(model, tensors: dict) -> tuple[dict, list[str]]:
    """``({model state-dict name: Direct | Converted}, [checkpoint names the model has no place for])``.

    ``tensors``: ``{checkpoint name: TensorInfo(file, shape)}``."""
    renamings, converters, natural = _conversions(model)
    meta_sd = {k: None for k in model.state_dict(keep_vars=True)}
    prefix = getattr(model, "base_model_prefix", None)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    sources: dict = {}
    groups: dict[str, Group] = {}
    unexpected: list[str] = []
    names = sorted(tensors, key=natural) if natural is not None else sorted(tensors)
    for original in names:
        info = tensors[original]
        renamed, pattern = original, None
        if renamings or converters:
            from transformers.core_model_loading import rename_source_key

            renamed, pattern = rename_source_key(original, renamings, converters, prefix, meta_sd)
            if renamed not in meta_sd and original in meta_sd:
                renamed, pattern = original, None
        if renamed not in meta_sd:
            unexpected.append(original)
        elif pattern is None:
            sources[renamed] = Direct(original, info.file, info.shape)
        else:
            group = groups.setdefault(renamed, Group(renamed, by_pattern[pattern], model))
            group.sources.append((original, pattern, info.file, info.shape))
    for group in groups.values():
        for target, shape in group.meta_shapes().items():
            sources[target] = Converted(target, group, shape)
    return sources, unexpected
