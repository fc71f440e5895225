"""offload: train models far larger than the GPU by keeping their state in chunks over GPU, pinned CPU and NVMe."""

from .config import AioConfig, OffloadConfig, parse_bytes
from .errors import (
    ChecksumError,
    ConfigError,
    DeviceMemoryError,
    DistributedError,
    NativeError,
    NvmeIOError,
    OffloadError,
    PinnedMemoryError,
    StateError,
    TierFullError,
    UnsupportedError,
)
from .native import native_info


def __getattr__(name):
    # The engine pulls in torch; import it only when used, so `import offload` stays light.
    if name in ("wrap", "AdamW", "register_external_parameter"):
        from . import api

        return getattr(api, name)
    if name == "num_parameters":
        from .wrapped_guards import num_parameters

        return num_parameters
    if name == "lazy_init":
        from .lazy import lazy_init

        return lazy_init
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpoint

        return getattr(checkpoint, name)
    if name in ("on_preempt", "Preemption"):
        from . import preempt

        return getattr(preempt, name)
    if name == "deepspeed_optimizer_kwargs":
        # offload.compat stays unloaded until used (OffloadConfig.from_deepspeed imports it the same way).
        from .compat import deepspeed_optimizer_kwargs

        return deepspeed_optimizer_kwargs
    if name == "export_safetensors":
        from .hf.safetensors_export import export_safetensors

        return export_safetensors
    if name == "load_safetensors":
        from .hf.safetensors_load import load_safetensors

        return load_safetensors
    raise AttributeError(f"module 'offload' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "AioConfig",
    "ChecksumError",
    "ConfigError",
    "DeviceMemoryError",
    "DistributedError",
    "NativeError",
    "NvmeIOError",
    "OffloadConfig",
    "OffloadError",
    "PinnedMemoryError",
    "StateError",
    "TierFullError",
    "UnsupportedError",
    "lazy_init",
    "native_info",
    "num_parameters",
    "register_external_parameter",
    "wrap",
    "parse_bytes",
    "save_checkpoint",
    "load_checkpoint",
    "on_preempt",
    "export_safetensors",
    "load_safetensors",
    "deepspeed_optimizer_kwargs",
]
