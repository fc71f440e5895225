"""What a rank reads of a weight file to fill its piece of a chunk (``tensor_files.copy_rows``,
``chunk_fill.overlap``): exactly the tensor's flat elements that fall in the piece, from only the
rows that hold them, for any shape and range; and the pieces of N ranks together give the chunk."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.chunks.layout import ParamSlot
from offload.errors import OffloadError
from offload.hf.chunk_fill import overlap
from offload.hf.tensor_files import BLOCK_BYTES, copy_rows, copy_tensor


def reader(value: torch.Tensor, asked: list):
    def rows(r0, r1):
        asked.append((r0, r1))
        return value if value.dim() == 0 else value[r0:r1].clone()
    return rows


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 7), min_size=0, max_size=3), data=st.data())
def test_copy_rows_copies_the_range_from_the_rows_that_hold_it(shape, data):
    value = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    n = value.numel()
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    dst = torch.full((hi - lo,), -1.0)
    asked: list = []
    read = copy_rows(dst, tuple(shape), reader(value, asked), lo, hi)
    assert torch.equal(dst, value.reshape(-1)[lo:hi])
    if hi == lo:
        assert asked == [] and read == 0
    elif shape:
        row = math.prod(shape[1:])
        rows = sorted({r for r0, r1 in asked for r in range(r0, r1)})
        assert rows == list(range(lo // row, -(-hi // row)))          # each needed row once, no other
        assert read == len(rows) * row < (hi - lo) + 2 * row


def test_copy_rows_reads_large_tensors_in_blocks():
    row = 1024                                          # 4 KiB of fp32 a row
    value = torch.randn(3 * BLOCK_BYTES // (4 * row), row)
    asked: list = []
    lo, hi = row // 2, value.numel() - row // 2
    dst = torch.empty(hi - lo)
    copy_rows(dst, tuple(value.shape), reader(value, asked), lo, hi)
    assert torch.equal(dst, value.reshape(-1)[lo:hi]) and len(asked) == 3
    assert all((r1 - r0) * row * 4 <= BLOCK_BYTES for r0, r1 in asked)


def test_a_range_outside_the_tensor_is_refused():
    with pytest.raises(OffloadError, match=r"elements 3:7 are outside a tensor of shape \[2, 3\]"):
        copy_rows(torch.empty(4), (2, 3), lambda r0, r1: torch.zeros(2, 3), 3, 7)


def test_copy_tensor_reads_a_range_of_a_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    value = torch.randn(10, 6).to(torch.bfloat16)
    save_file({"w": value}, str(tmp_path / "w.safetensors"))
    dst = torch.empty(31)
    copy_tensor(dst, tmp_path / "w.safetensors", "w", (10, 6), 17, 48)
    assert torch.equal(dst, value.float().reshape(-1)[17:48])


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6), world=st.integers(1, 5), pad=st.integers(0, 7))
def test_the_pieces_of_every_rank_assemble_the_chunk(sizes, world, pad):
    # A chunk of parameters laid end to end (and padding), cut in ``world`` pieces of ceil(numel / world).
    slots, offset = [], 0
    for i, n in enumerate(sizes):
        slots.append(ParamSlot(name=f"p{i}", chunk=0, offset=offset, numel=n, shape=(n,)))
        offset += n
    numel = offset + pad
    p = -(-numel // world) if numel else 0
    values = [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(sizes)]
    whole = torch.zeros(world * p)
    for r in range(world):
        span = (r * p, r * p + p)
        piece = torch.zeros(p)
        for slot, v in zip(slots, values):
            part = overlap(slot, span)
            if part is None:
                assert slot.numel == 0 or slot.end <= span[0] or slot.offset >= span[1]
                continue
            lo, hi, at = part
            assert 0 <= lo < hi <= slot.numel and 0 <= at and at + hi - lo <= p
            piece[at:at + hi - lo] = v[lo:hi]
        whole[span[0]:span[1]] = piece
    expected = torch.cat([*values, torch.zeros(world * p - offset)])
    assert torch.equal(whole, expected)
