"""An HF model directory out: config, tokenizer files, sharded safetensors with an index.

``export_pretrained(model, directory)`` writes what ``AutoModelForCausalLM.from_pretrained`` reads:
``config.json`` (its ``dtype`` set to the weights' dtype, or one given whole), the source
directory's tokenizer and generation files, and the weights as ``save_pretrained`` writes them --
``model.safetensors`` when they fit one shard, else ``model-0000i-of-0000N.safetensors`` +
``model.safetensors.index.json`` -- streamed one chunk at a time (``offload.export_safetensors``).
Everything goes to a temporary directory beside the target, which is renamed into place at the
end: a crash leaves the previous export (or nothing), never half of one.

Tied weights are written once, as transformers writes them: under the source name, not under
the tied copy's (``lm_head.weight`` is left out when it is ``embed_tokens.weight``). Tensors that
transformers converts on load are written in the checkpoint layout its ``save_pretrained`` writes
(``hub_layout``: a fused Mixtral expert tensor becomes one tensor per expert, GPT-NeoX's
``lm_head`` is ``embed_out``), which is what other tools (vLLM, llama.cpp's converter) read.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch

from ..checkpoint.ranks import Ranks
from ..distributed.arrival import arrive
from ..engine.access import engine_of
from ..errors import ConfigError
from ..units import parse_bytes

DEFAULT_MAX_SHARD = "5GB"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".msgpack", ".h5")
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
               "adapter_config.json"}


def max_shard_bytes(value) -> int:
    """``--max-shard-size`` in bytes: an int or a size like '5GB', '500MB', '20KB' (decimal, as
    transformers reads them) or '2GiB'."""
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip()
        upper = text.upper()
        decimal = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
        try:
            if upper[-2:] in decimal and not upper.endswith("IB"):
                n = int(float(text[:-2]) * decimal[upper[-2:]])
            else:
                n = parse_bytes(text)
        except (ValueError, ConfigError) as exc:
            raise ConfigError("--max-shard-size", value, "expected a size like 5GB, 500MB or 2GiB") from exc
    if n < 1:
        raise ConfigError("--max-shard-size", value, "must be positive")
    return n


# A tokenizer's files: an output takes them from the run's --tokenizer directory when it has one.
TOKENIZER_FILES = {"tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json"}


def support_files(source: Path | None, tokenizer: str | os.PathLike | None = None) -> list[Path]:
    """Files of a model directory to carry over unchanged: tokenizer, generation config, chat template.
    ``tokenizer``: the directory of the tokenizer the run used instead of the source's (its
    tokenizer files replace the source's)."""
    def carried(directory) -> list[Path]:
        directory = Path(directory) if directory is not None else None
        if directory is None or not directory.is_dir():
            return []
        return sorted(p for p in directory.iterdir() if p.is_file() and p.name not in _NOT_COPIED
                      and not p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.startswith("."))
    if tokenizer is None:
        return carried(source)
    return sorted([p for p in carried(source) if p.name not in TOKENIZER_FILES] +
                  [p for p in carried(tokenizer) if p.name in TOKENIZER_FILES], key=lambda p: p.name)


class StagedDirectory:
    """``with StagedDirectory(target) as tmp:`` — write into ``tmp``; on success it replaces
    ``target`` (an existing target is moved aside first and removed after); on error it is removed."""

    def __init__(self, target: str | os.PathLike, *, marker: str):
        self.target = Path(target)
        self.marker = marker          # a file whose presence says "this is one of ours"

    @staticmethod
    def check(target: str | os.PathLike, marker: str) -> None:
        """``target`` may be replaced: absent, an empty directory, or one holding ``marker`` (an
        earlier export); else a ConfigError for --output (a trainer calls this before training)."""
        t = Path(target)
        if t.exists() and (not t.is_dir() or (any(t.iterdir()) and not (t / marker).is_file())):
            raise ConfigError("--output", str(t), f"exists and is not an earlier export (no {marker}); "
                                                  "name a new or empty directory")

    def __enter__(self) -> Path:
        t = self.target
        self.check(t, self.marker)
        t.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = t.parent / f".{t.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if self.target.exists():
            old = self.target.parent / f".{self.target.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.target, old)
        os.replace(self.tmp, self.target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def tied_rename(model):
    """``rename`` for ``export_safetensors``: a tied copy's name becomes its source's, as in
    transformers' ``save_pretrained`` (the engine names a tied parameter by whichever name
    ``named_parameters`` met first)."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})      # {copy: source}
    return (lambda name: tied.get(name, name)) if tied else None


def hub_layout(model, names: dict[str, tuple[int, ...]]):
    """``expand`` for ``export_safetensors``: each tensor as transformers' ``save_pretrained`` would
    write it (``revert_weight_conversion``), worked out per tensor on meta tensors, the values
    converted as each tensor streams out. None when nothing is converted, or when a conversion
    needs several model tensors at once (then the model's own names are written; transformers
    loads those too). ``model``: the transformers model; ``names``: what the export writes, by shape."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    single = {}
    for name, shape in names.items():
        out = revert_weight_conversion(model, {name: torch.empty(shape, device="meta")})
        if list(out) != [name]:
            single[name] = {k: tuple(v.shape) for k, v in out.items()}
    if not single:
        return None
    whole = revert_weight_conversion(model, {n: torch.empty(s, device="meta") for n, s in names.items()})
    per_tensor = {n: s for outs in single.values() for n, s in outs.items()}
    if any(tuple(whole[n].shape) != s for n, s in per_tensor.items() if n in whole) or \
            not set(per_tensor) <= set(whole):
        return None
    cache: dict = {}

    def expand(name, shape):
        if name not in single:
            return None

        def pick(value, target, source=name):
            if cache.get("source") != source:
                cache.clear()
                cache.update(source=source, out=revert_weight_conversion(model, {source: value}))
            return cache["out"][target]

        return [(t, s, lambda v, t=t: pick(v, t)) for t, s in single[name].items()]

    return expand


def _shapes(model) -> dict[str, torch.Size]:
    """Names and shapes of what an export writes (tied copies and non-persistent buffers excluded)."""
    from ..checkpoint import persistent_buffers

    engine = engine_of(model)
    out = {}
    if engine is not None:
        for s in engine.chunks.layout.slots:
            out[s.name] = torch.Size(s.shape)
    else:
        out.update({n: p.shape for n, p in model.named_parameters()})
    for name, (module, b) in persistent_buffers(model).items():
        out[name] = getattr(module, b).shape
    return out


def export_pretrained(model, directory: str | os.PathLike, *, source: str | os.PathLike | None = None,
                      max_shard_size="5GB", dtype=None, rename=None, transform=None,
                      hf_config=None, expand=None, config: dict | bytes | None = None,
                      tokenizer: str | os.PathLike | None = None) -> Path:
    """Write ``model`` (wrapped, an HF ``PreTrainedModel``) as an HF directory; returns its path.

    ``source``: the directory it was loaded from (tokenizer and generation files are copied from
    there; default: the one ``offload.hf.load_pretrained`` recorded). ``dtype``: the weights' dtype
    (default: the engine's compute dtype — the values the model computes with, bit for bit).
    ``rename`` / ``transform``: see ``offload.export_safetensors`` (merged LoRA uses them).
    ``config``: the ``config.json`` to write, as parsed JSON or as the file's bytes (``offload.hf.output``
    passes the source's); default: ``hf_config`` (the model's) with its dtype set to the weights'.
    ``tokenizer``: the directory of the tokenizer trained with, when not the source's (its files go along).
    Under data parallelism every rank calls it; rank 0 writes the directory (see
    ``export_safetensors``), on a filesystem of its own or shared; an error on any rank raises on all.
    """
    from .safetensors_export import export_safetensors, parse_dtype

    hf_config = hf_config if hf_config is not None else getattr(model, "config", None)
    if config is None and (hf_config is None or not hasattr(hf_config, "to_json_file")):
        raise ConfigError("model", type(model).__name__, "has no Hugging Face config to export with")
    engine = engine_of(model)
    arrive("export_pretrained", None if engine is None else engine.chunks.sharding)
    out_dtype = parse_dtype(dtype) or (engine.chunks.kinds["param"] if engine is not None else torch.float32)
    if source is None and getattr(model, "hf_checkpoint", None) is not None:
        source = model.hf_checkpoint.directory
    limit = max_shard_bytes(max_shard_size)
    if rename is None:
        rename = tied_rename(model)
    if expand is None:
        names = {n: tuple(shape) for n, shape in _shapes(model).items()}
        if rename is not None:
            names = {rename(n): shape for n, shape in names.items() if rename(n) is not None}
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # Only a transformers model has conversions to revert (a preset's names are HF's already).
        expand = hub_layout(base, names) if hasattr(getattr(base, "config", None), "to_json_file") else None
    ranks = Ranks.of(engine) if engine is not None else Ranks()
    stage, tmp, error = StagedDirectory(directory, marker="config.json"), None, None
    if ranks.lead:
        try:
            tmp = stage.__enter__()
            for f in support_files(Path(source) if source is not None else None, tokenizer):
                shutil.copy2(f, tmp / f.name)
            if isinstance(config, bytes):
                (tmp / "config.json").write_bytes(config)
            elif config is not None:
                (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            else:
                written = copy.deepcopy(hf_config)
                written.dtype = out_dtype
                written.to_json_file(str(tmp / "config.json"))
        except BaseException as exc:
            if tmp is not None:
                stage.__exit__(type(exc), exc, None)
            if not ranks.sharded or not isinstance(exc, Exception):
                raise
            error = exc
    ranks.settle(error, f"preparing the export to {directory}")     # every rank: go on or raise
    try:
        export_safetensors(model, tmp if ranks.lead else directory, max_shard_bytes=limit, dtype=out_dtype,
                           rename=rename, transform=transform, expand=expand)
    except BaseException as exc:
        if ranks.lead:
            stage.__exit__(type(exc), exc, None)
        raise
    error = None
    if ranks.lead:
        try:
            stage.__exit__(None, None, None)
        except Exception as exc:
            if not ranks.sharded:
                raise
            error = exc
    ranks.settle(error, f"moving the export into {directory}")
    return Path(directory)
