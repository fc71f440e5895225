"""Live bytes of the tensors a piece of code makes, and their peak: ``max_memory_allocated`` for a CPU.

``LiveBytes`` is a ``TorchDispatchMode``: every tensor an operator returns that is not a view of
an input (its schema returns no alias) is new storage; the storage is held by a weak reference
(``StorageWeakRef``: expired once the last tensor viewing it is gone, however it was made) and
counted until it expires. Expired storages are dropped after every operator, so ``peak`` is the
most bytes alive at once, sampled at operator boundaries. Dispatch modes are per thread (autograd
takes its caller's on the CPU): storages other threads make (the engine's Adam worker) are not
counted. Storages that existed before the mode was entered are not counted either.
``nbytes``: count only storages of exactly that size (the kind of tensor a test is about, apart
from the rest, whose lifetimes may follow other threads' timing).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    def __init__(self, device: str = "cpu", nbytes: int | None = None):
        super().__init__()
        self.device = torch.device(device).type
        self.nbytes = nbytes
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}     # data_ptr -> (weak storage, bytes)
        self.bytes = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, outs):
            if isinstance(t, torch.Tensor) and ret.alias_info is None and t.device.type == self.device:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.live and self.nbytes in (None, storage.nbytes()):
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
                    self.bytes += storage.nbytes()
        for ptr, (ref, size) in list(self.live.items()):
            if ref.expired():
                del self.live[ptr]
                self.bytes -= size
        self.peak = max(self.peak, self.bytes)
        return out
