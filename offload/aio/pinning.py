"""Page-locking host memory: ``cudaHostRegister`` when CUDA is there (DMA to and from the GPU),
``mlock`` otherwise (kept out of swap). One small protocol, ``pin(address, nbytes)`` /
``unpin(address, nbytes)``, so a tier pins its memory once and tests can count the calls;
``memlock_usage()`` says how much more ``mlock`` may lock (``ulimit -l`` and what is locked).

CUDA registration is done with ``cudaHostRegisterPortable``: the range is pinned for every CUDA
context, not only the device that happens to be current on the registering thread (the engine
pins from whatever thread first needs a buffer). A failed ``cudaHostRegister`` also leaves its
error as the CUDA runtime's "last error", which torch reports after its next kernel launch as
that kernel's failure; it is read off (cleared) here before the failure is raised as a
``PinnedMemoryError``. A failed unregister cannot be raised from where it happens (a finalizer)
and would leak locked memory silently: it is reported as a ``ResourceWarning``.
"""

from __future__ import annotations

import ctypes
import resource
import warnings
from typing import Protocol

import torch

from .. import native
from ..errors import PinnedMemoryError

CUDA_HOST_REGISTER_PORTABLE = 1


class HostPinner(Protocol):
    """Page-locks and unlocks host address ranges; ``pin`` raises ``PinnedMemoryError``."""

    name: str

    def pin(self, address: int, nbytes: int) -> None: ...

    def unpin(self, address: int, nbytes: int) -> None: ...


def memlock_usage() -> tuple[int | None, int]:
    """(``ulimit -l``, i.e. the soft RLIMIT_MEMLOCK in bytes or None when unlimited, bytes this
    process has locked already): what ``mlock`` may still take."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else int(soft)
    used = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    used = int(line.split()[1]) * 1024
    except OSError:
        pass
    return limit, used


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch already loaded (the same instance, hence the same error
    state), or None when torch links it statically."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)     # already loaded: dlopen hands back the same handle
        except OSError:
            continue
    return None


def clear_cuda_error() -> None:
    """Read off (clear) the CUDA runtime's last error, so torch does not blame a later kernel."""
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


def _cuda_error_text(cudart, rc) -> str:
    try:
        return f"{cudart.cudaGetErrorString(rc)} (CUDA error {int(rc)})"
    except Exception:  # an old or stripped cudart binding: the number still says it
        return f"CUDA error {int(rc)}"


class CudaHostPinner:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime bindings."""

    name = "cudaHostRegister"

    def pin(self, address: int, nbytes: int) -> None:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE)
        if int(rc) != 0:
            text = _cuda_error_text(cudart, rc)
            clear_cuda_error()
            raise PinnedMemoryError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: {text}")

    def unpin(self, address: int, nbytes: int) -> None:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostUnregister(address)
        if int(rc) != 0:
            text = _cuda_error_text(cudart, rc)
            clear_cuda_error()
            warnings.warn(f"cudaHostUnregister of {nbytes} bytes at {address:#x} failed: {text}",
                          ResourceWarning, stacklevel=2)


class MlockPinner:
    """``mlock``; unmapping the memory unlocks it, so ``unpin`` is ``munlock`` for reuse only."""

    name = "mlock"

    def pin(self, address: int, nbytes: int) -> None:
        rc = native.buffer_lock(address, nbytes)
        if rc < 0:
            limit, used = memlock_usage()
            raise PinnedMemoryError(f"mlock of {nbytes} bytes refused (errno {-rc}): ulimit -l is "
                                    f"{'unlimited' if limit is None else limit} bytes, {used} locked already")

    def unpin(self, address: int, nbytes: int) -> None:
        native.buffer_unlock(address, nbytes)


def default_pinner() -> HostPinner:
    """What pins host memory in this process: CUDA registration when CUDA is usable, else mlock."""
    return CudaHostPinner() if torch.cuda.is_available() else MlockPinner()
