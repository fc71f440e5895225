"""Data parallelism across ranks: ZeRO-3-style sharding of every chunk over torch.distributed.

``sharding`` says which piece of every chunk a rank keeps; ``gather`` all-gathers a chunk's
parameters on every rank before use; ``reduce`` reduce-scatters its gradients back into pieces;
``failure`` turns a peer's death into an error on every rank.
"""

from .sharding import Sharding, expand_rank

__all__ = ["Sharding", "expand_rank"]
