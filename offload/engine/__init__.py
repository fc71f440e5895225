"""The engine: hooks, gradient capture, trace-driven prefetch and the per-chunk optimizer."""

from .engine import OffloadEngine

__all__ = ["OffloadEngine"]
