"""Activation offload: tensors autograd saves for backward, parked off the compute device.

``saved_tensors_hooks`` hand each saved tensor to ``ActivationStore.pack``; the ones chosen
(``select``: checkpoint boundaries, found from the engine's own hooks, optionally any saved
tensor above a size) are copied into a budgeted area of CPU memory (``area``: pinned with CUDA,
carved from one reused mapping), spilled to NVMe through the AIO engine when that area is full
(``spill``), and brought back ahead of the backward that needs them (``parking``), in the order
backward takes them (``order``: the reverse of forward, or, with pipeline micro-batches in flight,
the oldest micro-batch first).
"""

from .area import ActivationArea
from .entry import SavedActivation
from .select import BoundaryFinder, module_saves, offloadable
from .spill import SpillSpace
from .store import ActivationStore

__all__ = ["ActivationArea", "ActivationStore", "BoundaryFinder", "SavedActivation", "SpillSpace", "module_saves",
           "offloadable"]
