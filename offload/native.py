"""The only Python module that touches the cffi ``lib``/``ffi`` of ``offload._native``.

It loads the extension once, applies ``OFFLOAD_SIMD`` (which may lower the instruction set
for tests and never raise it), and turns ``-errno`` returns into exceptions.
"""

from __future__ import annotations

import functools
import os

from .errors import ConfigError, NativeError

SIMD_LEVELS = ("scalar", "avx2", "avx512")


@functools.lru_cache(maxsize=None)
def load():
    """Return ``(ffi, lib)``, loading the extension and applying ``OFFLOAD_SIMD`` once."""
    try:
        from . import _native  # type: ignore[attr-defined]
    except ImportError as exc:  # the package was imported from a tree that was never built
        raise NativeError(
            "offload._native is not built: install the package with `pip install -e .` "
            f"(or run `make test`), which compiles native/ ({exc})") from exc
    ffi, lib = _native.ffi, _native.lib
    lib.off_set_default_threads(physical_cores())
    wanted = os.environ.get("OFFLOAD_SIMD", "").strip().lower()
    if wanted:
        _apply_simd(lib, wanted, "OFFLOAD_SIMD")
    return ffi, lib


def physical_cores() -> int:
    """Physical cores this process may run on (the default thread count of the kernels)."""
    import psutil

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or allowed
    return max(1, min(physical, allowed))


def _apply_simd(lib, name: str, field: str) -> None:
    if name not in SIMD_LEVELS:
        raise ConfigError(field, name, f"must be one of {', '.join(SIMD_LEVELS)}")
    rc = lib.off_simd_set_level(SIMD_LEVELS.index(name))
    if rc < 0:
        best = SIMD_LEVELS[lib.off_simd_supported()]
        raise ConfigError(field, name, f"this CPU supports at most {best!r}")


def check(rc: int, what: str) -> int:
    """Return ``rc`` when non-negative; raise ``NativeError`` naming ``what`` and the errno."""
    if rc < 0:
        raise NativeError(f"{what} failed: {os.strerror(-rc)} (errno {-rc})")
    return rc


def simd_level() -> str:
    """The instruction set the native kernels use now."""
    _, lib = load()
    return SIMD_LEVELS[lib.off_simd_level()]


def simd_supported() -> str:
    """The best instruction set this CPU runs."""
    _, lib = load()
    return SIMD_LEVELS[lib.off_simd_supported()]


def set_simd_level(name: str) -> None:
    """Lower (or restore) the instruction set; asking above what the CPU runs is an error."""
    _, lib = load()
    _apply_simd(lib, name, "simd_level")


def libaio_linked() -> bool:
    _, lib = load()
    return bool(lib.off_libaio_linked())


def version() -> str:
    _, lib = load()
    v = lib.off_version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def native_info() -> dict:
    """Native facts as a dict: ``simd_level``, ``simd_supported``, ``libaio``, ``version``, ``default_threads``."""
    _, lib = load()
    return {
        "version": version(),
        "simd_level": simd_level(),
        "simd_supported": simd_supported(),
        "libaio": libaio_linked(),
        "default_threads": int(lib.off_default_threads()),
    }
