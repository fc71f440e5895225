"""A local Hugging Face model directory in: built on the meta device, its shards streamed into chunks.

``load_pretrained(directory, config)`` never holds the model whole in memory. transformers builds
the architecture from ``config.json`` (``AutoModelForCausalLM.from_config``) under
``offload.lazy_init(initialize=False)``: every parameter is a meta tensor. Buffers are made real
and computed the way transformers' own loader does (``_init_weights`` fills rotary ``inv_freq``),
because they are not in the checkpoint. Every tensor of the checkpoint is matched against the
model (names, shapes) before anything is allocated; then the model is wrapped (its chunks stay
empty) and each tensor is read from its shard, one at a time, into its chunk — each chunk written
once when all of its tensors are in. Peak memory is therefore the tiers' budgets, one tensor (read
through a fresh ``safe_open`` that is closed straight after, so no shard stays mapped) and a
couple of staging chunks.

Every problem with the directory is an ``OffloadError`` with one line naming the file and tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import persistent_buffers
from ..config import OffloadConfig
from ..errors import ConfigError, OffloadError
from .chunk_fill import chunk_values, overlap, write_chunk_values
from .tensor_files import FLOAT_DTYPES, INDEX, SINGLE, one_line


def _require(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError as exc:
        raise OffloadError(f"--model needs the '{module}' package: pip install 'offload[{extra}]'") from exc


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str = ""                    # safetensors' name: "F32", "BF16", "F16", ...


@dataclass(frozen=True)
class Checkpoint:
    """What a model directory holds, read from its headers only (no tensor data)."""

    directory: Path
    hf_config: object                  # transformers.PretrainedConfig
    tensors: dict[str, TensorInfo]     # checkpoint tensor name -> where and what shape
    has_tokenizer: bool

    @property
    def largest_tensor_bytes(self) -> int:
        return max((4 * _numel(t.shape) for t in self.tensors.values()), default=0)

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The floating-point dtype that holds most of the weights (what the files store, whatever
        ``config.json`` says); None when the headers name no floating-point tensor."""
        count: dict[str, int] = {}
        for t in self.tensors.values():
            if t.dtype in FLOAT_DTYPES:
                count[t.dtype] = count.get(t.dtype, 0) + _numel(t.shape)
        return FLOAT_DTYPES[max(count, key=count.get)] if count else None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_checkpoint(directory: str | os.PathLike) -> Checkpoint:
    """Read ``config.json`` and every shard's header; one-line errors name the file (and tensor)."""
    _require("transformers", "hf")
    _require("safetensors", "hf")
    from safetensors import safe_open
    from transformers import AutoConfig

    root = Path(directory)
    if not root.is_dir():
        raise ConfigError("--model", str(directory), "is not a directory")
    if not (root / "config.json").is_file():
        raise ConfigError("--model", str(directory), "has no config.json (expected a Hugging Face model directory)")
    try:
        hf_config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:
        raise OffloadError(f"{root / 'config.json'}: transformers cannot read this config ({one_line(exc)})") from exc
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OffloadError(f"{root / INDEX}: not a safetensors index ({one_line(exc)})") from exc
        files = sorted(set(weight_map.values()))
        for name, fname in weight_map.items():
            if not (root / fname).is_file():
                raise OffloadError(f"{root / INDEX}: tensor {name!r} is in {fname}, which does not exist")
    elif (root / SINGLE).is_file():
        weight_map, files = None, [SINGLE]
    else:
        found = sorted(p.name for p in root.glob("*.safetensors"))
        if not found:
            others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            hint = f" (found {', '.join(others[:3])}: only safetensors weights are read)" if others else ""
            raise OffloadError(f"{root}: no {SINGLE}, {INDEX} or *.safetensors files{hint}")
        weight_map, files = None, found
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        path = root / fname
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    tensors[name] = TensorInfo(path, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as exc:
            raise OffloadError(f"{path}: not a readable safetensors file ({one_line(exc)})") from exc
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in tensors or tensors[name].file.name != fname:
                raise OffloadError(f"{root / fname}: tensor {name!r} is listed in {INDEX} but not in this file")
    tokenizer = any((root / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json",
                                                   "tokenizer_config.json"))
    return Checkpoint(root, hf_config, tensors, tokenizer)


def build_meta_model(ckpt: Checkpoint, config: OffloadConfig | None = None) -> nn.Module:
    """The architecture of ``ckpt`` with parameters on the meta device and real, computed buffers."""
    from transformers import AutoModelForCausalLM

    from ..lazy import lazy_init

    try:
        with lazy_init(config, initialize=False):
            model = AutoModelForCausalLM.from_config(ckpt.hf_config, dtype=torch.float32)
    except Exception as exc:
        raise OffloadError(f"{ckpt.directory / 'config.json'}: transformers cannot build a causal LM from it "
                           f"({one_line(exc)})") from exc
    _materialize_buffers(model, ckpt)
    return model


def _materialize_buffers(model: nn.Module, ckpt: Checkpoint) -> None:
    """Give meta buffers real storage, computed as transformers' loader computes them.

    Buffers that the checkpoint holds are loaded later; the others (rotary ``inv_freq`` and the
    like) are filled by the owning model's ``_init_weights``, exactly as ``from_pretrained`` does.
    They start as NaN so that one nobody computes is caught here, not as garbage in training.
    """
    owners = _pretrained_owners(model)
    names = {id(b): n for n, b in model.named_buffers()}
    for module in model.modules():
        meta = [(n, b) for n, b in module.named_buffers(recurse=False, remove_duplicate=False) if b.is_meta]
        if not meta:
            continue
        for n, b in meta:
            setattr(module, n, torch.full(b.shape, float("nan"), dtype=b.dtype) if b.is_floating_point()
                    else torch.zeros(b.shape, dtype=b.dtype))
        owner = owners.get(id(module), model)
        with torch.no_grad():
            owner._init_weights(module)
        for n, b in meta:
            full = names.get(id(b), n)
            filled = module.get_buffer(n)
            if filled.is_floating_point() and torch.isnan(filled).any() \
                    and full not in ckpt.tensors:
                raise OffloadError(f"{ckpt.directory / 'config.json'}: buffer {full!r} of "
                                   f"{type(model).__name__} is neither in the checkpoint nor computed by "
                                   "transformers' _init_weights; this architecture cannot be loaded lazily")


def _pretrained_owners(model: nn.Module) -> dict[int, nn.Module]:
    """``{id(module): the innermost PreTrainedModel containing it}`` (composite models init per part)."""
    from transformers import PreTrainedModel

    out: dict[int, nn.Module] = {}

    def walk(module, owner):
        if isinstance(module, PreTrainedModel):
            owner = module
        out[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, model)
    return out


def _ignored_unexpected(model: nn.Module, buffers: set[str], name: str) -> bool:
    import re

    if name in buffers:
        return True       # e.g. rotary inv_freq saved by old checkpoints: recomputed, not read
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    return any(re.search(p, name) for p in patterns)


def match_tensors(model: nn.Module, ckpt: Checkpoint) -> dict[tuple[int, str], object]:
    """``{(id(module), attribute): source}`` (``offload.hf.sources``: a checkpoint tensor, or several
    converted the way transformers converts them) for every parameter and persistent buffer,
    checked against the checkpoint; raises on a missing, extra or mis-shaped tensor.

    Keyed by module and attribute, not by parameter object: wrapping replaces meta parameters."""
    from .sources import resolve_sources

    sources, unexpected = resolve_sources(model, ckpt.tensors)
    where: dict[tuple[int, str], object] = {}
    tied: dict[int, list[tuple[tuple[int, str], str]]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for mname, module in modules.items():
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
            if p is not None:
                full = f"{mname}.{attr}" if mname else attr
                tied.setdefault(id(p), []).append(((id(module), attr), full))
    index = str(ckpt.directory / INDEX) if (ckpt.directory / INDEX).is_file() else str(ckpt.directory)
    for pid, names in tied.items():
        present = [full for _, full in names if full in sources]
        if not present:
            also = f" tied to {', '.join(n for _, n in names[1:])}" if len(names) > 1 else ""
            raise OffloadError(f"{index}: tensor {names[0][1]!r} is missing (the model built from "
                               f"config.json has it{also})")
        for key, _ in names:
            where[key] = sources[present[0]]
    for full, (module, attr) in persistent_buffers(model).items():
        if full in sources:
            where[(id(module), attr)] = sources[full]
    for mname, module in modules.items():
        for attr, p in [*module.named_parameters(recurse=False, remove_duplicate=False),
                        *module.named_buffers(recurse=False, remove_duplicate=False)]:
            source = where.get((id(module), attr))
            if p is not None and source is not None and tuple(source.shape) != tuple(p.shape):
                full = f"{mname}.{attr}" if mname else attr
                raise OffloadError(f"{source.where()} has shape {list(source.shape)}, the model built from "
                                   f"config.json expects {list(p.shape)} for {full!r}")
    buffers = {n for n, _ in model.named_buffers()}
    for name in unexpected:
        if not _ignored_unexpected(model, buffers, name):
            raise OffloadError(f"{ckpt.tensors[name].file}: tensor {name!r} is not a parameter of the "
                               f"{type(model).__name__} built from config.json")
    return where


def enable_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing of an HF model, non-reentrant (offload's hooks need autograd to see
    the recomputed forward; transformers 5 renamed the method, 4.x has only the old name)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_pretrained(directory: str | os.PathLike, config: OffloadConfig | None = None, *,
                    adapt=None) -> nn.Module:
    """Build, wrap and fill a model from a local HF directory; returns the wrapped model.

    ``adapt(model) -> model``: applied to the meta model before wrapping (``offload.hf.lora``
    adds LoRA adapters there, so the engine lays out their parameters with the others).
    """
    from ..api import wrap

    ckpt = read_checkpoint(directory)
    model = build_meta_model(ckpt, config)
    where = match_tensors(model, ckpt)
    modules = {id(m): m for m in model.modules()}
    if adapt is not None:
        model = adapt(model)
    wrapped = wrap(model, config)
    stream_into(wrapped, {(modules[mid], attr): source for (mid, attr), source in where.items()})
    wrapped.hf_checkpoint = ckpt
    wrapped.eval()                 # as from_pretrained returns it; train() before training
    return wrapped


def stream_into(model: nn.Module, where: dict[tuple[nn.Module, str], object]) -> None:
    """Write each source into its chunk (or buffer); a plain checkpoint tensor is read a block at a
    time (``tensor_files.copy_tensor``), a converted one (fused experts) as its converter's group.
    Under N ranks a rank writes its piece of every chunk and reads only what falls in it (a
    converted group whole, as its converter needs it)."""
    chunks = model.offload_engine.chunks
    chunks.drain()
    chunked: dict[int, list] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for (module, attr), source in where.items():
            if attr in dict(module.named_buffers(recurse=False)):
                source.copy_into(module.get_buffer(attr).view(-1))
                continue
            p = module.get_parameter(attr)
            if id(p) in seen:
                continue                     # tied: one tensor fills it
            seen.add(id(p))
            slot = chunks.param(p).slot
            chunked.setdefault(slot.chunk, []).append((slot, source))
        staging: dict[str, torch.Tensor] = {}
        for c in sorted(chunked):
            info = chunks.chunks()[c]
            # Under several ranks each fills its own piece of every chunk (``info.span``), reading
            # only the rows of the tensors that reach into it.
            parts = [(source, overlap(slot, info.span)) for slot, source in chunked[c]]
            # A chunk that also holds values from elsewhere (LoRA adapters copied in by ``wrap``)
            # is read first; padding stays zero (``chunk_fill.chunk_values``). A piece that none
            # of the tensors reaches (padding at a chunk's end) is written too: it must hold data.
            master = chunk_values(chunks, info, {slot.name for slot, _ in chunked[c]}, staging)
            for source, part in parts:
                if part is None:
                    source.skip()
                    continue
                lo, hi, at = part
                source.copy_into(master[at:at + hi - lo], lo, hi)
            write_chunk_values(chunks, info, master, staging)
