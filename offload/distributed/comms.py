"""The collectives the engine issues, through torch.distributed, with their bytes counted.

Every collective is started asynchronously (``async_op=True``: NCCL runs it on its own stream,
gloo on its own thread) and waited for where its data is needed, through ``wait``. Bytes are
counted per rank the way bandwidth is usually reported (nccl-tests' bus bytes): an all-gather
or reduce-scatter of N pieces of b bytes moves (N-1)·b in and out of each rank; a broadcast or
reduce of b bytes (N-1)/N·b (a pipelined ring: every rank but one receives b, every rank but
one sends it; N of them, one rooted at each rank, move what one all-gather does); an
all-reduce 2(N-1)/N of its size.

A failed collective (a dead peer, a timeout) becomes a ``DistributedError`` naming this rank,
the collective, and the failed rank when that rank left its name in the process group's store
(see ``failure``).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import DistributedError
from . import failure
from .sharding import Sharding


def collective_device(group=None) -> torch.device:
    """Where ``group``'s collectives take their tensors: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Collectives:
    def __init__(self, sharding: Sharding):
        self.sharding = sharding
        self.world = sharding.world
        self.group = sharding.group
        self.bytes_by_op: Counter = Counter()
        self.ops = 0

    # ---- the collectives ---------------------------------------------------------------
    def all_gather(self, outputs: Sequence[torch.Tensor], own: torch.Tensor):
        """``outputs[r]`` gets rank r's ``own`` (equal sizes); ``own`` may be ``outputs[rank]``."""
        self._count("all_gather", (self.world - 1) * _nbytes(own))
        return self._call("all_gather", lambda: dist.all_gather(list(outputs), own, group=self.group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int):
        self._count("broadcast", (self.world - 1) * _nbytes(tensor) // self.world)
        return self._call(f"broadcast from rank {src}",
                          lambda: dist.broadcast(tensor, src, group=self.group, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor]):
        """Sum ``inputs[r]`` over ranks into rank r's ``output`` (may be ``inputs[rank]``)."""
        self._count("reduce_scatter", (self.world - 1) * _nbytes(output))
        return self._call("reduce_scatter",
                          lambda: dist.reduce_scatter(output, list(inputs), group=self.group, async_op=True))

    def reduce(self, tensor: torch.Tensor, dst: int):
        """Sum ``tensor`` over ranks into rank ``dst``'s (in place)."""
        self._count("reduce", (self.world - 1) * _nbytes(tensor) // self.world)
        return self._call(f"reduce to rank {dst}", lambda: dist.reduce(tensor, dst, group=self.group, async_op=True))

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place and waited for (small tensors: norms, flags)."""
        self._count("all_reduce", 2 * (self.world - 1) * _nbytes(tensor) // self.world)
        work = self._call("all_reduce", lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True))
        self.wait(work, "all_reduce")
        return tensor

    def wait(self, work, what: str) -> None:
        if work is None:
            return
        try:
            work.wait()
        except Exception as exc:      # DistBackendError, a gloo "Connection closed", a timeout
            raise self._error(what, exc) from exc

    # ---- accounting ----------------------------------------------------------------------
    def take_stats(self) -> dict:
        """Bytes this rank sent (= received, under the bus-bytes model) since the last call."""
        total = sum(self.bytes_by_op.values())
        out = {"sent_bytes": total, "received_bytes": total, "by_op": dict(self.bytes_by_op), "ops": self.ops}
        self.bytes_by_op.clear()
        self.ops = 0
        return out

    def _count(self, op: str, nbytes: int) -> None:
        self.bytes_by_op[op] += nbytes
        self.ops += 1

    def _call(self, what: str, start):
        try:
            return start()
        except Exception as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: Exception) -> DistributedError:
        failed, why = failure.failed_peer()
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if why:
            detail = f"{why} (here: {detail})"
        return DistributedError(self.sharding.rank, what, detail, failed)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
