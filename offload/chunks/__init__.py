"""Chunks: the layout of parameters in fixed-size chunks, their states, and the store that moves them.

- ``layout``: which parameter sits where (fixed-size chunks, frozen apart from trainable,
  oversized parameters in chunks of their own) — pure arithmetic.
- ``states``: a chunk copy's states and the transitions allowed between them.
- ``records``: one chunk's copies, pins and moves in flight.
- ``store``: ``ChunkStore``, every chunk of every kind over the tiers; ``traffic`` its moves and
  room-making (evicting by a ``policy``, which ``offload.scheduler`` provides); ``report`` its
  memory report.
- ``access``: the chunk interface (``ChunkAccess``) that code outside the engine uses.
"""

from .layout import ChunkLayout, ParamSlot, search_chunk_size
from .states import ChunkState
from .store import ChunkKey, ChunkStore

__all__ = ["ChunkKey", "ChunkLayout", "ChunkState", "ChunkStore", "ParamSlot", "search_chunk_size"]
