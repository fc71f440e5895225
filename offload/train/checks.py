"""The checks a config value passes, shared by the command line and the TOML file.

Each check takes one value (a flag's string, or a TOML value) and returns it converted, or raises
``ValueError`` (``BadValue``) with the reason. argparse reports that as ``argument --steps: must be >= 1 (got
-3)`` and exits 2 at parse time; ``config.load_config`` turns it into a ``ConfigError`` naming the
key and the file. A check named ``int`` or ``float`` keeps argparse's own wording for a value
that is not a number at all (``invalid int value: 'x'``).
"""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..units import parse_bytes


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A value of the right type that the field refuses (argparse prints its message as is)."""


def _number(value, kind):
    if isinstance(value, bool) or (kind is int and isinstance(value, float)):
        raise BadValue(f"must be {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _named(fn, name: str):
    fn.__name__ = name                    # argparse says "invalid <name> value: 'x'"
    return fn


def at_least(low: int):
    """An integer >= ``low``."""
    def check(value) -> int:
        n = _number(value, int)
        if n < low:
            raise BadValue(f"must be >= {low} (got {n})")
        return n
    return _named(check, "int")


positive_int = at_least(1)
non_negative_int = at_least(0)


def _float_check(strict: bool):
    def check(value) -> float:
        x = _number(value, float)
        if not (x > 0 if strict else x >= 0) or x != x or x == float("inf"):
            raise BadValue(f"must be {'>' if strict else '>='} 0 and finite (got {value})")
        return x
    return _named(check, "float")


positive_float = _float_check(True)
non_negative_float = _float_check(False)


def choice(options: tuple[str, ...]):
    """One of ``options``."""
    def check(value) -> str:
        if value not in options:
            raise BadValue(f"must be one of {', '.join(options)} (got {value!r})")
        return value
    return _named(check, "choice")


def text(value) -> str:
    """Any string."""
    if not isinstance(value, str):
        raise BadValue(f"must be a string (got {value!r})")
    return value


def byte_size(value) -> str:
    """``auto`` or a size: bytes as a number, or with a unit (``60G``, ``224KiB``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    value = text(value)
    if value != "auto":
        try:
            parse_bytes(value)
        except ConfigError as exc:
            raise BadValue(exc.why) from None
    return value


def path_list(value) -> list[str]:
    """A list of directory names (TOML); one flag occurrence is one directory."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadValue("must be a list of directories")
    return list(value)
