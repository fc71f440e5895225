"""Data parallelism across ranks: ZeRO-3-style chunk sharding over torch.distributed.

``sharding`` says who owns which chunk; ``gather`` brings a communication group's parameter
chunks to every rank before use; ``reduce`` takes a group's gradients to their owners;
``failure`` turns a peer's death into an error on every rank.
"""

from .sharding import Sharding, expand_rank, owner_of

__all__ = ["Sharding", "expand_rank", "owner_of"]
