"""Chunks: the layout of parameters in fixed-size chunks, their states, and the store that moves them."""

from .layout import ChunkLayout, ParamSlot, search_chunk_size
from .states import ChunkState
from .store import ChunkKey, ChunkStore

__all__ = ["ChunkKey", "ChunkLayout", "ChunkState", "ChunkStore", "ParamSlot", "search_chunk_size"]
