"""What every rank must agree on before the first collective: budgets and the chunk layout.

The layout decides which chunk a collective moves, so two ranks with different layouts would
exchange the wrong bytes in silence. "auto" budgets are measured per rank (free memory differs
by a few pages between processes) and the "auto" chunk size follows them (and the world size,
which every rank knows alike): every rank takes the smallest budgets any rank measured, and
``check_same_layout`` compares a digest of the layout (names, shapes, chunk sizes, dtype)
across ranks and names what differs.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .comms import collective_device


def agreed_budgets(device_budget: int, cpu_budget: int, group=None) -> tuple[int, int]:
    """The smallest ``(device_budget, cpu_budget)`` over the ranks of ``group`` (None: all)."""
    t = torch.tensor([device_budget, cpu_budget], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0]), int(t[1])


def layout_digest(layout, dtype: torch.dtype) -> int:
    h = hashlib.sha256(f"{dtype}|{layout.chunk_size}|{layout.sizes}|{layout.trainable}".encode())
    for s in layout.slots:
        h.update(f"{s.name}:{s.shape}:{s.chunk}:{s.offset};".encode())
    return int.from_bytes(h.digest()[:7], "little")      # fits an int64


def check_same_layout(layout, dtype: torch.dtype, group=None) -> None:
    """Raise on every rank of ``group`` (None: all) when any of them built a different layout
    (another model, dtype, frozen set or chunk size)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([layout_digest(layout, dtype), layout.num_chunks, layout.total_params],
                        dtype=torch.int64, device=collective_device(group))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [tuple(int(v) for v in t.cpu()) for t in every]
    if len(set(rows)) > 1:
        detail = ", ".join(f"rank {r}: {n} chunks, {p} parameters" for r, (_, n, p) in enumerate(rows))
        raise ConfigError("model", f"rank {dist.get_rank()}",
                          "the ranks built different chunk layouts (a different model, dtype, frozen "
                          f"parameters or chunk_size on some rank): {detail}")
