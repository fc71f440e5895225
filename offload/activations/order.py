"""When backward needs each parked entry: the order spills and read-backs follow.

Each forward of the wrapped model is one micro-batch, numbered as it starts (``Entry.micro_batch``).
Backward needs a micro-batch's saved tensors in the reverse of the order they were saved (its last
layer first). Across micro-batches there are two orders:

* ``"reverse"``: each forward's backward runs before the next forward (a training loop, gradient
  accumulation): the last saved tensor is needed first, whatever its micro-batch. The key is
  ``-seq``.
* ``"micro-batches"``: several forwards are in flight and their backwards come in forward order
  (every ``torch.distributed.pipelining`` schedule, per stage: GPipe, 1F1B, interleaved, looped
  BFS, the zero-bubble passes). Stage ``s`` of ``P`` under 1F1B holds ``P - s`` micro-batches; the
  one whose backward comes first is the *oldest*, the one needed last the newest. The key is
  ``(micro_batch, -seq)``. With one micro-batch in flight at a time (the last stage) it orders
  exactly as ``"reverse"``.

A smaller key is needed sooner: the area spills the entry with the largest key first (needed
last), and read-backs go up from the key of the entry backward takes now. Under "reverse" in a
pipeline, the spills would take the oldest micro-batch (the next backward's), and the read-backs
at the end of each forward would bring that forward's own tensors back to the device, where they
wait out every older micro-batch's backward: an early stage ends up holding ``P - s`` micro-batches
of read-backs.
"""

from __future__ import annotations

from ..errors import ConfigError

ORDERS = ("reverse", "micro-batches")


def check_order(order: str) -> str:
    if order not in ORDERS:
        raise ConfigError("activation_backward_order", order, f"must be one of {', '.join(ORDERS)}")
    return order


def need_key(order: str, micro_batch: int, seq: int) -> tuple[int, int]:
    """The key of an entry saved ``seq``-th in forward micro-batch ``micro_batch``: smaller is
    needed sooner by backward."""
    if order == "micro-batches":
        return (micro_batch, -seq)
    return (0, -seq)
