"""The optimizer state's precision: which chunk kinds a trainable chunk has, their dtypes, and
the bytes each costs (``OffloadConfig.optimizer_state`` and ``.master``).

* fp32 moments (the default): ``exp_avg`` and ``exp_avg_sq`` fp32, 8 B per parameter, exact torch AdamW.
* 8-bit moments: ``exp_avg`` / ``exp_avg_sq`` hold uint8 codes of the block-wise dynamic map
  (``offload.optim.quantized``), and ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` one fp32 scale per
  256-element block: 2 x (1 + 4/256) B per parameter. A block never straddles two ranks' pieces
  (``quantum``: the sharding rounds pieces to whole blocks), so a rank quantises only its own.
  The scale kinds stay in host memory (``resident_kinds``): 1/256 of the codes' bytes each, but as
  NVMe requests of their own (4-16 KiB) they were half of an 8-bit step's requests, each a move
  through the store and an aio submission (measured: keeping them cut the bench's 8-bit step from
  212 to 183 ms, one A/B on the 2-core box).
* bf16 moments: ``exp_avg`` / ``exp_avg_sq`` bf16, stored by stochastic rounding (E's
  ``native/adam16*.c``: nearest rounding would freeze ``exp_avg_sq``), 4 B per parameter.
* fp32 master: a ``master`` chunk of fp32 beside the compute-precision ``param`` (compute fp32:
  the parameters are the master). bf16 master (stochastic rounding, native kernel): with bf16
  compute the ``param`` chunk itself is the master, updated in place -- no master kind at all;
  with fp16 compute a bf16 ``master`` kind.

Every bf16 the kernels store is rounded stochastically, bits hashed from (``SR_SEED``, step,
element index in the whole layout): one process and N ranks round alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..optim.quantized import BLOCK_SIZE

MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
SCALE_KINDS = {"exp_avg": "exp_avg_absmax", "exp_avg_sq": "exp_avg_sq_absmax"}
SIGNED = {"exp_avg": True, "exp_avg_sq": False}
# The master's stochastic rounding is seeded by this, the step and each element's index in the
# whole layout (chunk offset + position): the same bits at any world size and chunk split.
SR_SEED = 0


@dataclass(frozen=True, slots=True)
class StatePrecision:
    """``moments``: "fp32" | "8bit"; ``master``: "fp32" | "bf16"; ``compute``: the parameters' dtype."""

    moments: str
    master: str
    compute: torch.dtype

    @classmethod
    def of(cls, config, compute: torch.dtype) -> "StatePrecision":
        moments, master = config.optimizer_state, config.master
        if master == "bf16" and compute == torch.float32:
            raise ConfigError("master", "bf16", "with dtype 'fp32' the fp32 parameters are the master")
        return cls(moments, master, compute)

    @property
    def quantized(self) -> bool:
        return self.moments == "8bit"

    @property
    def default(self) -> bool:
        """Today's exact fp32 Adam (checkpoints keep their former format)."""
        return self.moments == "fp32" and self.master == "fp32"

    @property
    def quantum(self) -> int:
        """Elements every rank's piece is a multiple of: whole blocks of the 8-bit state."""
        return BLOCK_SIZE if self.quantized else 1

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.master == "bf16" else torch.float32

    @property
    def separate_master(self) -> bool:
        """Whether trainable chunks have a ``master`` kind (else ``param`` is updated in place)."""
        return self.compute != torch.float32 and self.compute != self.master_dtype

    def state_kinds(self) -> dict[str, torch.dtype]:
        """The Adam state kinds of a trainable chunk and their dtypes, moments first."""
        if not self.quantized:
            dtype = torch.bfloat16 if self.moments == "bf16" else torch.float32
            return {kind: dtype for kind in MOMENT_KINDS}
        out = {kind: torch.uint8 for kind in MOMENT_KINDS}
        out.update({SCALE_KINDS[kind]: torch.float32 for kind in MOMENT_KINDS})
        return out

    def resident_kinds(self) -> frozenset[str]:
        """Kinds registered without NVMe slots: never written down, held in host memory throughout."""
        return frozenset(SCALE_KINDS.values()) if self.quantized else frozenset()

    def resident_bytes(self, pieces) -> int:
        """Host bytes the resident kinds of trainable chunk pieces of ``pieces`` elements take."""
        kinds = self.state_kinds()
        return sum(-(-n // self.kind_block(k)) * kinds[k].itemsize for n in pieces for k in self.resident_kinds())

    def kind_block(self, kind: str) -> int:
        """Chunk elements per stored element of ``kind`` (256 for a scale kind, else 1)."""
        return BLOCK_SIZE if kind in SCALE_KINDS.values() else 1

    def state_bytes(self) -> float:
        """Bytes per parameter of the moments and a separate master (not the compute parameters)."""
        moments = 2 * (1 + 4 / BLOCK_SIZE) if self.quantized else 4.0 if self.moments == "bf16" else 8.0
        return moments + (self.master_dtype.itemsize if self.separate_master else 0)

    def update_bytes(self, elements: int) -> int:
        """Bytes of one trainable chunk's update pinned together: its fp32 gradient, master,
        moments (and scales) and compute parameters (``elements``: the chunk, or a rank's piece)."""
        moments = sum(-(-elements // self.kind_block(k)) * d.itemsize for k, d in self.state_kinds().items())
        master = elements * self.master_dtype.itemsize if self.separate_master else 0
        return elements * (4 + self.compute.itemsize) + master + moments

    def describe(self) -> dict:
        """What a checkpoint records of it."""
        return {"optimizer_state": self.moments, "master": self.master, "block_size": BLOCK_SIZE}
