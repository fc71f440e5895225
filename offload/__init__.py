"""offload: train models far larger than the GPU by keeping their state in chunks over GPU, pinned CPU and NVMe."""

from .config import AioConfig, OffloadConfig, parse_bytes
from .errors import (
    ChecksumError,
    ConfigError,
    NativeError,
    NvmeIOError,
    OffloadError,
    PinnedMemoryError,
    StateError,
    TierFullError,
    UnsupportedError,
)
from .native import native_info

__version__ = "0.1.0"

__all__ = [
    "AioConfig",
    "ChecksumError",
    "ConfigError",
    "NativeError",
    "NvmeIOError",
    "OffloadConfig",
    "OffloadError",
    "PinnedMemoryError",
    "StateError",
    "TierFullError",
    "UnsupportedError",
    "native_info",
    "parse_bytes",
]
