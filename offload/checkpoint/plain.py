"""Tensors and plain data only: what a checkpoint's small files (``buffers.pt``,
``optimizer_state.pt``, ``extra.pt``) may hold.

They are read with ``torch.load(weights_only=True)``, whose unpickler builds tensors, dicts,
lists, tuples, sets, strings, numbers, ``None``, dtypes, sizes and devices and nothing else: a
file carrying any other pickled object (a class instance, a ``__reduce__`` that calls a
function) is refused, naming the file, before any of it runs -- loading a checkpoint someone
else wrote (a shared cluster path, a downloaded run) cannot execute code. Saving checks the
same thing on the bytes it wrote, so a checkpoint that could not be loaded is never written:
the error names the value (``extra['rng']['numpy']``) and its type.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from ..errors import ConfigError, OffloadError

_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.Size,
           torch.device)


def load_plain(path: Path, data: bytes):
    """The object in ``data`` (the verified bytes of checkpoint file ``path``), unpickled with
    ``weights_only=True``; ``ConfigError`` naming ``path`` when it holds anything else."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise ConfigError("checkpoint file", str(path), f"holds a pickled object that is not a tensor or "
                                                        f"plain data ({_cause(exc)}); refused unread") from exc
    except Exception as exc:          # a file torch cannot parse at all (its checksum matched: not damage)
        raise OffloadError(f"checkpoint file {path} is not a torch.save file ({type(exc).__name__}: "
                           f"{_cause(exc)})") from exc


def check_plain(data: bytes, obj, what: str) -> None:
    """Raise ``ConfigError`` naming the first value of ``obj`` (saved as ``data``; ``what``: its
    name, e.g. ``extra``) that ``load_plain`` would refuse."""
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        where = _foreign(obj, what)
        found = f"{where[0]} is a {where[1]}" if where else _cause(exc)
        raise ConfigError(what, type(obj).__name__, f"{found}: a checkpoint keeps tensors and plain data only "
                                                    "(dict, list, tuple, str, int, float, bool, None), so that "
                                                    "loading one runs no code; convert it first (e.g. a numpy "
                                                    "array with torch.from_numpy or .tolist())") from exc


def _foreign(obj, path: str) -> tuple[str, str] | None:
    """``(path, type name)`` of the first value in ``obj`` that is not a tensor or plain data."""
    if type(obj) in (dict, list, tuple, set, frozenset) or isinstance(obj, dict):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(obj, dict) and not isinstance(key, _LEAVES):
                return f"{path} key {key!r}", type(key).__name__
            found = _foreign(value, f"{path}[{key!r}]")
            if found:
                return found
        return None
    return None if isinstance(obj, _LEAVES) and type(obj).__module__ in ("builtins", "torch") else \
        (path, f"{type(obj).__module__}.{type(obj).__qualname__}")


def _cause(exc: BaseException) -> str:
    """The line of torch's weights-only message that says what was refused (it is a page long)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines[1:]:
        if not line.startswith("Check the documentation"):
            return line
    return lines[0] if lines else type(exc).__name__
