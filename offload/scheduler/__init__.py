"""The scheduler: access traces, eviction policies, and the prefetch plan. Plain Python, no CUDA."""

from .eviction import EvictionPolicy, LRUPolicy, NextUsePolicy, make_policy
from .prefetch import TracePrefetcher
from .trace import AccessTrace

__all__ = ["AccessTrace", "EvictionPolicy", "LRUPolicy", "NextUsePolicy", "make_policy", "TracePrefetcher"]
