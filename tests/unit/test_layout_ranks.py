"""The chunk layout never depends on the number of ranks: every chunk is sliced into N pieces
instead (issue 27), so a small model packed into one chunk still gives every rank a piece to keep
and update, and an oversized chunk is split like any other."""

from __future__ import annotations

import inspect

from hypothesis import given, settings
from hypothesis import strategies as st

from offload.chunks.layout import CHUNK_QUANTUM, DEFAULT_MAX_CHUNK, ChunkLayout, search_chunk_size
from offload.distributed import Sharding
from tests.helpers.tiny_gpt import TinyGPT


def tiny_gpt_shapes() -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in TinyGPT().named_parameters()]


def test_the_layout_has_no_world_size_to_depend_on():
    """Checkpoints reshard by slicing the same chunks: nothing in the layout search takes N."""
    for fn in (ChunkLayout.build, search_chunk_size):
        assert "min_chunks" not in inspect.signature(fn).parameters, fn


def test_a_small_model_in_one_chunk_gives_every_rank_a_piece_of_it():
    layout = ChunkLayout.build(tiny_gpt_shapes(), "auto", max_chunk=DEFAULT_MAX_CHUNK)
    assert layout.num_chunks == 1                       # one process's layout, at any N
    numel = layout.chunk_numel(0)
    for world in (2, 3, 4, 8):
        spans = [Sharding(r, world).span(numel) for r in range(world)]
        # Every rank holds real elements of the chunk (padding is only the last < N elements).
        assert all(min(hi, numel) - lo >= numel // world for lo, hi in spans), (world, spans)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 16), st.sampled_from([4 * CHUNK_QUANTUM, 16 * CHUNK_QUANTUM]),
       st.lists(st.integers(1, 400_000), min_size=1, max_size=60))
def test_oversized_and_frozen_chunks_are_split_evenly_over_the_ranks(world, cap, numels):
    """Round-robin gave an oversized chunk (a large embedding) to one rank alone; sliced, every
    rank keeps 1/N of every chunk, trainable ones (its Adam work) and frozen ones alike."""
    named = [(f"p{i}", (n,)) for i, n in enumerate(numels)]
    frozen = {name for i, (name, _) in enumerate(named) if i % 3 == 0}
    layout = ChunkLayout.build(named, search_chunk_size(numels, max_chunk=cap), frozen=frozen)
    for chunks in (range(layout.num_chunks), layout.trainable_chunks):
        held = []
        for r in range(world):
            s = Sharding(r, world)
            held.append(sum(s.span(layout.chunk_numel(c))[1] - s.span(layout.chunk_numel(c))[0] for c in chunks))
        whole = sum(layout.chunk_numel(c) for c in chunks)
        assert len(set(held)) == 1 and 0 <= held[0] * world - whole <= (world - 1) * len(chunks)


def test_the_planners_layout_does_not_depend_on_the_ranks_and_each_holds_a_piece_of_every_chunk():
    """The planner plans the sliced layout: the chunks one process would lay out, at any N, and a
    rank's piece of each (ceil(numel / N) elements) — a model packed into one chunk is still one
    chunk, and a rank plans for 1/N of it rather than for the whole model or for nothing."""
    from offload.models.llama import get_preset
    from offload.plan.model import param_layout, rank_chunks

    cfg = get_preset("tiny")
    layout = param_layout(cfg, None, ("q_proj", "v_proj"))
    budget = 1 << 40        # budgets far above the model: "auto" packs it into one chunk
    one = rank_chunks(cfg, layout, budget, budget, None, 1)
    assert len(one.sizes) == 1 and one.elems == one.all_elems
    for world in (2, 3, 4, 7):
        ranks = rank_chunks(cfg, layout, budget, budget, None, world)
        assert ranks.sizes == one.sizes and ranks.chunk_size == one.chunk_size
        assert ranks.elems == -(-one.all_elems // world)
        assert ranks.gathered_elems == world * ranks.elems < one.all_elems + world
