"""Byte counts: parse the sizes users type ("4GiB", "512MB", "2G") and print them back, in binary
units (``format_bytes``: MiB, GiB) or decimal ones (``format_size``: GB, TB, as the planner quotes
disk and memory sizes)."""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

def parse_bytes(value: Any, field_name: str = "size") -> int:
    """Parse a byte count: an int, or a string like ``"4GiB"``, ``"512MB"``, ``"2G"`` (G = GiB)."""
    if isinstance(value, bool):
        raise ConfigError(field_name, value, "expected a byte count, not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field_name, value, "must be >= 0 bytes")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m and unit in _UNITS:
            return int(float(m.group(1)) * _UNITS[unit])
        raise ConfigError(field_name, value,
                          "expected a byte count such as 4294967296, '4GiB', '512MB' or '2G'")
    raise ConfigError(field_name, value, "expected a byte count (int) or a string such as '4GiB'")


def format_bytes(n: float) -> str:
    """Human-readable binary size: 512 B, 8.0 MiB, 1.40 TiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.{1 if abs(n) >= 10 else 2}f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_size(n: float) -> str:
    """Human-readable decimal size (1 GB = 1e9 bytes): 512 B, 72.00 GB, 512 GB, 1.40 TB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"
