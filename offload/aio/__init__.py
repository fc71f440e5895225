"""NVMe I/O: ``AsyncIO`` over libaio (O_DIRECT) or a thread pool, aligned pinned buffers, striping.

Public API (stable names): ``AsyncIO``, ``Handle``, ``StripedFile``, ``aligned_empty``,
``BufferPool``, ``check_host_budget``, ``supports_o_direct``, ``choose_backend``.
"""

from .buffers import BufferPool, HostBudget, aligned_empty, check_host_budget
from .checks import free_bytes, supports_o_direct
from .engine import AsyncIO, choose_backend
from .request import Handle
from .striping import StripedFile

__all__ = [
    "AsyncIO",
    "BufferPool",
    "Handle",
    "HostBudget",
    "StripedFile",
    "aligned_empty",
    "check_host_budget",
    "choose_backend",
    "free_bytes",
    "supports_o_direct",
]
