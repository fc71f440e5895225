"""The "auto" chunk size under N ranks: a small model is cut into at least N chunks, so that
round-robin ownership leaves no rank without a chunk to keep and update (issue 26, point 10)."""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from offload.chunks.layout import CHUNK_QUANTUM, DEFAULT_MAX_CHUNK, ChunkLayout, search_chunk_size
from offload.distributed import owner_of
from tests.helpers.tiny_gpt import TinyGPT


def tiny_gpt_shapes() -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in TinyGPT().named_parameters()]


def test_a_small_model_gets_a_chunk_per_rank_under_default_budgets():
    named = tiny_gpt_shapes()
    assert ChunkLayout.build(named, "auto", max_chunk=DEFAULT_MAX_CHUNK).num_chunks == 1   # one process: one chunk
    for world in (2, 3, 4):
        layout = ChunkLayout.build(named, "auto", max_chunk=DEFAULT_MAX_CHUNK, min_chunks=world)
        owners = {owner_of(c, world) for c in range(layout.num_chunks)}
        assert owners == set(range(world)), (world, layout)


def test_frozen_and_trainable_chunks_count_toward_the_ranks_share():
    named = tiny_gpt_shapes()
    frozen = {n for n, _ in named if n.startswith(("blocks.0.", "blocks.1."))}
    layout = ChunkLayout.build(named, "auto", frozen=frozen, min_chunks=4)
    assert layout.num_chunks >= 4 and 0 < len(layout.trainable_chunks) < layout.num_chunks


def test_one_rank_and_an_explicit_size_are_unchanged():
    named = tiny_gpt_shapes()
    numels = [math.prod(s) for _, s in named]
    assert search_chunk_size(numels, min_chunks=1) == search_chunk_size(numels)
    assert ChunkLayout.build(named, 64 * CHUNK_QUANTUM, min_chunks=8).num_chunks == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.sampled_from([4 * CHUNK_QUANTUM, DEFAULT_MAX_CHUNK]), st.data())
def test_at_least_n_chunks_whenever_no_parameter_exceeds_an_nth_of_the_model(world, cap, data):
    numels = data.draw(st.lists(st.integers(1, 6000), min_size=4 * world, max_size=80))
    total = sum(numels)
    assume(total >= world * CHUNK_QUANTUM and max(numels) <= total / world)
    size = search_chunk_size(numels, max_chunk=cap, min_chunks=world)
    layout = ChunkLayout.build([(f"p{i}", (n,)) for i, n in enumerate(numels)], size)
    assert layout.num_chunks >= world
    assert size <= max(cap, CHUNK_QUANTUM)          # never above the budgets' cap


def test_the_fewest_chunks_short_of_n_when_parameters_cannot_be_split():
    # Two parameters, three ranks: each parameter gets a chunk of its own, the best there is.
    size = search_chunk_size([60000, 40000], min_chunks=3)
    assert ChunkLayout.build([("a", (60000,)), ("b", (40000,))], size).num_chunks == 2


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.sampled_from([4 * CHUNK_QUANTUM, 16 * CHUNK_QUANTUM]),
       st.lists(st.integers(1, 6000), min_size=1, max_size=80))
def test_a_layout_with_a_chunk_per_rank_already_is_the_one_process_layout(world, cap, numels):
    # Checkpoints reshard by chunk index: N changes the layout only where one process would
    # leave some rank without a chunk.
    one = search_chunk_size(numels, max_chunk=cap)
    layout = ChunkLayout.build([(f"p{i}", (n,)) for i, n in enumerate(numels)], one)
    if layout.num_chunks >= world:
        assert search_chunk_size(numels, max_chunk=cap, min_chunks=world) == one


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
