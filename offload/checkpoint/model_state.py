"""The model's side of a checkpoint: its kinds and parameter layout, buffers, optimizer
hyper-parameters and the state of parameters the engine does not hold; the two-buffer pipeline
that streams chunks. The chunks are seen through ``offload.chunks.access`` only."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..chunks.access import ChunkAccess
from ..errors import ConfigError


def persistent_buffers(model) -> dict[str, tuple[torch.nn.Module, str]]:
    """The buffers ``model.state_dict()`` holds, by full name: ``(module, attribute)``."""
    out = {}
    for mname, module in model.named_modules():
        # torch keeps persistence in a private set and has no public accessor for it.
        skip = module._non_persistent_buffers_set
        for bname, _ in module.named_buffers(recurse=False, remove_duplicate=False):
            if bname not in skip:
                out[f"{mname}.{bname}" if mname else bname] = (module, bname)
    return out


def _json_value(v):
    """A JSON-safe copy of a hyper-parameter value, or raise TypeError."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise TypeError("tensor with more than one element")
        return v.item()
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise TypeError("non-finite float")
        return v
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    raise TypeError(type(v).__name__)


def group_hypers(optimizer) -> list[dict]:
    groups = []
    for group in optimizer.param_groups:
        saved = {"num_params": len(group["params"])}
        for k, v in group.items():
            if k == "params":
                continue
            try:
                saved[k] = _json_value(v)
            except TypeError:
                pass            # not representable: the optimizer's constructor value stays
        groups.append(saved)
    return groups


def restore_hypers(optimizer, groups: list[dict], where: Path) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ConfigError("optimizer.param_groups", len(optimizer.param_groups),
                          f"the checkpoint {where} has {len(groups)} parameter groups")
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, groups)):
        if saved.get("num_params", len(group["params"])) != len(group["params"]):
            raise ConfigError(f"optimizer.param_groups[{gi}]", len(group["params"]),
                              f"the checkpoint {where} has {saved['num_params']} parameters in this group")
        for k, v in saved.items():
            if k == "num_params":
                continue
            cur = group.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple) and isinstance(v, list):
                group[k] = tuple(v)
            else:
                group[k] = v


def foreign_optimizer_state(optimizer, chunks: ChunkAccess) -> dict[int, dict]:
    """Optimizer state of parameters the engine does not hold (plain CPU parameters), by index."""
    out, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if chunks.param(p) is None and p in optimizer.state and optimizer.state[p]:
                out[i] = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                          for k, v in optimizer.state[p].items()}
            i += 1
    return out


def model_kinds(chunks: ChunkAccess) -> dict[str, torch.dtype]:
    """The saved kinds the model has, with their dtypes, whichever chunks this rank keeps: the
    parameters always; when some chunk is trainable, its Adam moments and (compute dtype not
    fp32) its fp32 master. The same at every world size."""
    return dict(chunks.kinds)


def layout_entries(chunks: ChunkAccess) -> list[list]:
    """``[name, chunk, offset, numel, shape]`` of every parameter, in layout order (the manifest's)."""
    return [[s.name, s.chunk, s.offset, s.numel, list(s.shape)] for s in chunks.layout.slots]


def pipelined(items: list, fetch, consume, device: torch.device | None = None) -> None:
    """``consume(i, fetch(i, buf))`` for each item, fetching item i+1 on a thread while item i is consumed.

    ``fetch`` fills one of two alternating buffers; item i's buffer is reused by item i+2 only
    after ``consume(i)`` returned. ``device``: the engine's, when ``fetch`` copies from it (the
    thread makes it current first).
    """
    from concurrent.futures import ThreadPoolExecutor

    from ..tiers.streams import use_device

    if not items:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="offload-ckpt", initializer=use_device,
                            initargs=(device if device is not None else torch.device("cpu"),)) as pool:
        future = pool.submit(fetch, 0)
        for i in range(len(items)):
            result = future.result()
            if i + 1 < len(items):
                future = pool.submit(fetch, i + 1)
            try:
                consume(i, result)
            except BaseException:
                if i + 1 < len(items):
                    future.cancel()
                    try:
                        future.result()
                    except BaseException:
                        pass
                raise
