"""CPU optimizers on the native SIMD Adam: drop-in ``CPUAdamW`` / ``CPUAdam`` and the
low-level ``adam_step`` over raw chunk buffers."""

from .cpu_adam import CPUAdam, CPUAdamW
from .kernel import adam_step

__all__ = ["CPUAdam", "CPUAdamW", "adam_step"]
