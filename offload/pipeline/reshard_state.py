"""Resharding compressed optimizer state by name (``reshard.load_resharded``): 8-bit moments
dequantised, moved and quantised again; what stays exact.

A checkpoint is resharded only into engines of its own precision: ``optimizer_state``,
``master`` and ``block_size`` must match (``checkpoint.compat.check_precision`` refuses another,
naming the field, as a same-layout load does). Converting would change the run silently (codes
into fp32 moments and back re-round them; a bf16 master cannot give back the fp32 bits it
replaced); the way across precisions is ``optimizer.state_dict()`` (fp32 at every precision) and
``load_state_dict``. Within one precision:

* fp32 and bf16 kinds -- the parameters, an fp32 or bf16 ``master``, fp32 or bf16 moments -- are
  copied element for element by the caller: the same dtype on both sides, bit for bit.
* 8-bit moments (``exp_avg`` / ``exp_avg_sq``: uint8 codes; ``exp_avg_absmax`` /
  ``exp_avg_sq_absmax``: one fp32 scale per block of ``BLOCK_SIZE`` chunk elements) are filled
  here. A block's scale is shared by whatever the block holds, and a new cut puts other elements
  together: each old chunk's codes are dequantised with its scales to fp32 (map[code] * scale),
  each parameter's values copied into an fp32 staging of the target chunk (zeros elsewhere:
  padding, and moments never initialized), and the staging quantised block-wise
  (``optim.quantized.quantize``) into the target's codes and scales.

What is exact: a target block holding the same elements at the same places as an old block (its
parameters at the same offsets modulo ``BLOCK_SIZE`` in both layouts, sharing the block with no
other parameter in either; padding is zeros on both sides) takes that block's codes and scale
verbatim. It is copied, not requantised, because dequantise -> quantise is *not* idempotent for
every block: the signed map of ``exp_avg`` has +1.0 but no -1.0 (its lowest value is -0.99297),
so a block whose largest magnitude is negative dequantises to an absmax 0.7 % below its scale
and would re-round (nearly half of random blocks). Every other block -- it straddles parameters
that the new cut moves -- is quantised from the dequantised values, as ``load_state_dict`` of
torch.optim.AdamW's fp32 moments would: each element moves at most half a step of the map at
its new block's scale (plus the fp32 rounding of value / scale and map * scale); a block that
held a NaN scale (a non-finite moment) poisons the new blocks its elements land in. Padding
quantises to zero's code, what a fresh chunk holds.

Memory: the target chunk's fp32 staging, codes and scales (and a copy of the codes of its
verbatim blocks, set aside while the rest is quantised), and one old chunk's codes, scales and
dequantised values. Under data parallelism every rank computes the whole target chunk and keeps
its piece (``chunks.write_full``: whole blocks, so codes and scales agree).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..engine.precision import SCALE_KINDS, SIGNED
from ..optim.quantized import BLOCK_SIZE, dequantize, quantize

Reader = Callable[[int, str, int], "torch.Tensor | None"]   # (source, kind, chunk) -> the old chunk or None


def quantized_kind(kind: str, dtype: torch.dtype) -> bool:
    """Whether ``kind`` of a target chunk holds 8-bit codes (its scales are filled with it)."""
    return kind in SCALE_KINDS and dtype == torch.uint8


def scale_kind(kind: str) -> bool:
    return kind in SCALE_KINDS.values()


class OldMoments:
    """The last old chunk of 8-bit moments read: its codes, scales and dequantised values."""

    def __init__(self, read: Reader, where: dict):
        self.read = read
        self.key = None
        self.value: tuple | None = None
        # Old chunk (source, chunk) -> its parameters' [offset, end): which old blocks they share.
        self.spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for s in where.values():
            self.spans.setdefault((s.source, s.chunk), []).append((s.offset, s.offset + s.numel))

    def get(self, source: int, kind: str, c: int) -> tuple | None:
        """``(codes, scales, values)`` of old chunk ``kind[c]`` of ``source``; None: never initialized."""
        if self.key != (source, kind, c):
            codes = self.read(source, kind, c)
            value = None
            if codes is not None:
                scales = self.read(source, SCALE_KINDS[kind], c)
                value = (codes, scales, dequantize(codes, scales, SIGNED[kind]))
            self.key, self.value = (source, kind, c), value
        return self.value

    def holders(self, source: int, c: int, block: int) -> int:
        """How many parameters of old chunk ``c`` of ``source`` have elements in its block ``block``."""
        lo, hi = block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE
        return sum(1 for a, b in self.spans.get((source, c), ()) if a < hi and b > lo)


def _blocks(slot) -> range:
    """The blocks of its chunk that a slot's elements touch."""
    return range(slot.offset // BLOCK_SIZE, -(-(slot.offset + slot.numel) // BLOCK_SIZE))


def _same_blocks(placed, old: OldMoments) -> dict[int, tuple[int, int, int]]:
    """Target block -> (source, old chunk, old block) whose elements it holds at the same places
    and nothing else; ``placed``: (target slot, saved) of the target chunk's parameters."""
    by_block: dict[int, list] = {}
    for slot, saved in placed:
        for b in _blocks(slot):
            by_block.setdefault(b, []).append((saved.source, saved.chunk, saved.offset - slot.offset))
    out = {}
    for b, moved in by_block.items():
        source, chunk, delta = moved[0]
        if delta % BLOCK_SIZE or any(m != moved[0] for m in moved):
            continue
        ob = b + delta // BLOCK_SIZE
        # Each target parameter of block b sits in old block ob; no other old one may.
        if old.holders(source, chunk, ob) == len(moved):
            out[b] = (source, chunk, ob)
    return out


def requantised(kind: str, numel: int, placed, old: OldMoments) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The codes and scales of a target chunk's 8-bit moment ``kind`` (``numel`` elements) whose
    parameters ``placed`` ((target slot, saved) pairs) held the old chunks' values; None when none
    of them had any (the moments were never initialized: the chunk stays empty)."""
    staging = torch.zeros(numel, dtype=torch.float32)
    same = _same_blocks(placed, old)
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    held = False
    for slot, saved in placed:
        got = old.get(saved.source, kind, saved.chunk)
        if got is None:             # Adam moments never initialized there: torch's zeros
            continue
        codes, scales, values = got
        staging[slot.offset:slot.offset + slot.numel] = values[saved.offset:saved.offset + saved.numel]
        held = True
        for b in _blocks(slot):
            if b in same and b not in kept:
                ob = same[b][2]
                kept[b] = (codes[ob * BLOCK_SIZE:(ob + 1) * BLOCK_SIZE].clone(), scales[ob:ob + 1].clone())
    if not held:
        return None
    codes, scales = quantize(staging, SIGNED[kind])
    for b, (c, s) in kept.items():
        n = min(c.numel(), numel - b * BLOCK_SIZE)
        codes[b * BLOCK_SIZE:b * BLOCK_SIZE + n] = c[:n]
        scales[b] = s[0]
    return codes, scales
