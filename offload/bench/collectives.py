"""Bytes each rank sends and receives through torch.distributed collectives, counted one way for
every system the benchmarks compare (offload's engine and FSDP2 alike).

The counter wraps the methods of ``torch.distributed.ProcessGroup`` itself: every Python-level
collective (``all_gather_single``, the deprecated ``all_gather_into_tensor``, ``all_reduce``,
FSDP2's ``dist.all_gather_single``/``dist.reduce_scatter_single`` …) ends in exactly one of those
methods, whichever module attribute the caller went through, so one call is counted once. The
methods differ between torch versions (2.11 has ``_allgather_base`` where 2.13 has
``all_gather_single``): the table holds both, and a method a version lacks is not wrapped.
Functional collectives compiled by dynamo bypass it (neither system uses them in eager mode).

Accounting is the ring algorithm's, per rank (``ring_bytes``): in a group of N ranks

* all-gather of a b-byte input (output N*b): sends and receives (N-1)*b;
* reduce-scatter to a b-byte output (input N*b): sends and receives (N-1)*b;
* all-reduce of B bytes (a reduce-scatter then an all-gather of B/N): 2*(N-1)/N*B each way;
* broadcast of B bytes from a root along the chain root, root+1, …: the root sends B, the
  last rank receives B, every other rank receives and forwards B; reduce is its mirror;
* send/recv: the tensor's bytes; all-to-all: everything but the rank's own slice.

A barrier moves no data and is counted as an operation only.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all",
       "gather", "scatter", "send", "recv", "barrier")


def ring_bytes(op: str, nbytes: int, world: int, rank: int = 0, root: int = 0) -> tuple[int, int]:
    """(sent, received) bytes of one rank for one collective under ring accounting.

    ``nbytes`` is the per-rank piece for all-gather (its input) and reduce-scatter (its output),
    the whole tensor for all-reduce, broadcast and reduce, and the whole local buffer for
    all-to-all, send and recv. ``root`` is the source of broadcast/scatter and the destination
    of reduce/gather.
    """
    n = world
    if n <= 1 or op == "barrier":
        return 0, 0
    pos = (rank - root) % n                # place in the chain that starts at the root
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * nbytes, (n - 1) * nbytes
    if op == "all_reduce":
        each = 2 * (n - 1) * nbytes // n
        return each, each
    if op == "broadcast":
        return (0 if pos == n - 1 else nbytes), (0 if pos == 0 else nbytes)
    if op == "reduce":                     # the chain runs the other way, ending at the root
        return (0 if pos == 0 else nbytes), (0 if pos == n - 1 else nbytes)
    if op == "all_to_all":
        moved = (n - 1) * nbytes // n
        return moved, moved
    if op == "gather":                     # every rank sends its piece to the root
        return (0 if pos == 0 else nbytes), ((n - 1) * nbytes if pos == 0 else 0)
    if op == "scatter":
        return ((n - 1) * nbytes if pos == 0 else 0), (0 if pos == 0 else nbytes)
    if op == "send":
        return nbytes, 0
    if op == "recv":
        return 0, nbytes
    raise ValueError(f"unknown collective {op!r}")


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _flat(x):
    """Tensors in a tensor, a list of tensors or a list of lists of tensors."""
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _flat(item)
    else:
        yield x


def _sum(x) -> int:
    return sum(_nbytes(t) for t in _flat(x))


def _root(opts, name: str) -> int:
    return int(getattr(opts, name, 0)) if opts is not None else 0


# ProcessGroup method -> (op, function (args) -> (nbytes, root attribute of the options or None)).
# Argument orders are those of torch.distributed.distributed_c10d's calls into the group.
_METHODS = {
    "all_gather_single": ("all_gather", lambda a: _nbytes(a[1])),                  # (out, in, opts)
    "all_gather_single_coalesced": ("all_gather", lambda a: _sum(a[1])),           # (outs, ins, opts)
    "_allgather_base": ("all_gather", lambda a: _nbytes(a[1])),                    # torch 2.11's all_gather_single
    "allgather_into_tensor_coalesced": ("all_gather", lambda a: _sum(a[1])),
    "allgather": ("all_gather", lambda a: _sum(a[1])),                             # ([[out]], [in], opts)
    "allgather_coalesced": ("all_gather", lambda a: _sum(a[1])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a[0])),          # (out, in, opts)
    "reduce_scatter_single_coalesced": ("reduce_scatter", lambda a: _sum(a[0])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: _nbytes(a[0])),           # torch 2.11's reduce_scatter_single
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _sum(a[0])),
    "reduce_scatter": ("reduce_scatter", lambda a: _sum(a[0])),                    # ([out], [[in]], opts)
    "allreduce": ("all_reduce", lambda a: _sum(a[0])),                             # ([t], opts)
    "allreduce_coalesced": ("all_reduce", lambda a: _sum(a[0])),
    "broadcast": ("broadcast", lambda a: _sum(a[0])),                              # ([t], opts.rootRank)
    "reduce": ("reduce", lambda a: _sum(a[0])),                                    # ([t], opts.rootRank)
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a[1])),                  # (out, in, splits.., opts)
    "alltoall": ("all_to_all", lambda a: _sum(a[1])),                              # (outs, ins, opts)
    "alltoall_base": ("all_to_all", lambda a: _nbytes(a[1])),
    "gather": ("gather", lambda a: _sum(a[1])),                                    # ([[out]], [in], opts)
    "scatter": ("scatter", lambda a: _sum(a[0])),                                  # ([out], [[in]], opts)
    "send": ("send", lambda a: _sum(a[0])),                                        # ([t], dst, tag)
    "recv": ("recv", lambda a: _sum(a[0])),
    "recv_anysource": ("recv", lambda a: _sum(a[0])),
    "barrier": ("barrier", lambda a: 0),
}
_INHERITED = object()
_ROOTED = {"broadcast": "rootRank", "reduce": "rootRank", "gather": "rootRank", "scatter": "rootRank"}


class CollectiveCounter:
    """Counts (ring accounting) the collectives this process issues while installed.

    ``snapshot()`` is ``{"sent_bytes", "received_bytes", "ops", "by_op": {op: bytes sent},
    "by_op_received": {op: bytes received}}`` so far (the shape of the engine's
    ``offload_stats()["collectives"]``, plus the received side per op); ``since(before)`` is the
    difference from an earlier snapshot. Install with ``with CollectiveCounter() as c:``; one at
    a time per process.
    """

    _active: "CollectiveCounter | None" = None

    def __init__(self):
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.ops = 0
        self.by_op: dict[str, int] = {}
        self.by_op_received: dict[str, int] = {}
        self._saved: dict[str, object] = {}

    # -- counting --------------------------------------------------------------------------
    def record(self, op: str, nbytes: int, world: int, rank: int, root: int = 0) -> None:
        sent, received = ring_bytes(op, nbytes, world, rank, root)
        with self._lock:
            self.sent += sent
            self.received += received
            self.ops += 1
            self.by_op[op] = self.by_op.get(op, 0) + sent
            self.by_op_received[op] = self.by_op_received.get(op, 0) + received

    def snapshot(self) -> dict:
        with self._lock:
            return {"sent_bytes": self.sent, "received_bytes": self.received, "ops": self.ops,
                    "by_op": dict(self.by_op), "by_op_received": dict(self.by_op_received)}

    @staticmethod
    def since(now: dict, before: dict) -> dict:
        def minus(key):
            ops = sorted(set(now[key]) | set(before[key]))
            diff = {op: now[key].get(op, 0) - before[key].get(op, 0) for op in ops}
            return {op: n for op, n in diff.items() if n}

        return {"sent_bytes": now["sent_bytes"] - before["sent_bytes"],
                "received_bytes": now["received_bytes"] - before["received_bytes"],
                "ops": now["ops"] - before["ops"], "by_op": minus("by_op"),
                "by_op_received": minus("by_op_received")}

    # -- installing ------------------------------------------------------------------------
    def __enter__(self) -> "CollectiveCounter":
        from torch.distributed import ProcessGroup

        if CollectiveCounter._active is not None:
            raise RuntimeError("a CollectiveCounter is already installed in this process")
        CollectiveCounter._active = self
        for name, (op, size_of) in _METHODS.items():
            original = getattr(ProcessGroup, name, None)
            if original is None:
                continue
            # Restore what the class itself held: pybind keeps its methods in the class dict as
            # ``instancemethod`` wrappers, and the plain function getattr returns would not bind.
            self._saved[name] = ProcessGroup.__dict__.get(name, _INHERITED)
            setattr(ProcessGroup, name, self._wrap(original, op, size_of, _ROOTED.get(op)))
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed import ProcessGroup

        for name, saved in self._saved.items():
            if saved is _INHERITED:
                delattr(ProcessGroup, name)
            else:
                setattr(ProcessGroup, name, saved)
        self._saved.clear()
        CollectiveCounter._active = None

    def _wrap(self, original, op, size_of, root_attr):
        counter = self

        def counted(group, *args, **kwargs):
            try:
                nbytes = size_of(args)
                root = _root(args[-1] if args else None, root_attr) if root_attr else 0
                counter.record(op, nbytes, group.size(), group.rank(), root)
            except (IndexError, AttributeError, TypeError):
                counter.record(op, 0, group.size(), group.rank())   # an unknown calling form
            return original(group, *args, **kwargs)

        counted.__name__ = getattr(original, "__name__", op)
        counted.__wrapped__ = original
        return counted


@contextmanager
def counting():
    """``with counting() as c:`` — a ``CollectiveCounter`` installed for the block."""
    with CollectiveCounter() as c:
        yield c


def zero3_bytes(params: int, itemsize: int, world: int) -> int:
    """ZeRO-3's bytes per rank per step, each way: parameters all-gathered for forward and again
    for backward, gradients reduce-scattered, each moving (N-1)/N of the model's compute-dtype
    bytes (``params`` elements of ``itemsize`` bytes)."""
    return 3 * params * itemsize * (world - 1) // world
