"""A cluster of boxes and how a pp x dp mesh lies on it, and the part of the model one pipeline
rank holds: its stages' parameters, cut as ``offload.pipeline`` cuts them.

* ``Cluster``: B boxes of G GPUs; the links between boxes (``inter_box_gbps``, a GPU's NIC) and
  within one (``intra_box_gbps``, NVLink).
* ``mesh_links``: ranks are numbered box by box (r = box x G + gpu, as torchrun does); a (pp, dp)
  mesh puts either the data-parallel ranks next to each other ("dp-inner": stage s holds ranks
  s x dp ... s x dp + dp - 1, as ``offload.pipeline.pipeline_mesh`` does) or the pipeline ranks
  ("pp-inner"). A collective or a point-to-point send is as fast as the slowest link it crosses.
* ``rank_layouts``: the model is the chain embedding, decoder layers, (norm + LM head), cut into
  pp x v stages balanced by parameters (``offload.pipeline.balance.cut``, the split the stages
  use); rank r holds stages r, r + pp, ... (the looped placement of the multi-stage schedules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..models.llama import LlamaConfig
from .model import param_numels

ORDERS = ("dp-inner", "pp-inner")
ASSUMED_INTER_BOX_GBPS = 25.0
"""A 200 Gb/s NIC per GPU (``figures.ASSUMED_NET_GBPS``, the link data parallelism assumes)."""
ASSUMED_INTRA_BOX_GBPS = 150.0
"""NVLink within a box, NCCL's bus bandwidth: a third of an H100's 450 GB/s each way (NVLink 4), as
all-gathers of a few hundred MB reach, and well above PCIe-only boxes (~20)."""
LAYER_PARAMS = 9
"""Parameters of a decoder layer in ``param_numels`` order (7 projections, 2 norms)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Boxes of GPUs joined by a network (bandwidths in GB/s each way, decimal)."""

    boxes: int
    """Boxes (B)."""
    gpus_per_box: int
    """GPUs in each box (G), one rank each; they share the box's RAM, NVMe and CPU cores."""
    inter_box_gbps: float = ASSUMED_INTER_BOX_GBPS
    """A GPU's bandwidth to other boxes (its NIC; 200 Gb/s ~ 25), for collectives (NCCL's bus
    bandwidth) and point-to-point sends alike."""
    intra_box_gbps: float = ASSUMED_INTRA_BOX_GBPS
    """A GPU's bandwidth to the others in its box (NVLink; PCIe-only boxes ~ 20)."""

    def __post_init__(self) -> None:
        for name in ("boxes", "gpus_per_box"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "expected a whole number >= 1")
        for name in ("inter_box_gbps", "intra_box_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(name, value, "expected a number > 0 (GB/s)")

    @property
    def ranks(self) -> int:
        """GPUs of the whole cluster (B x G)."""
        return self.boxes * self.gpus_per_box


@dataclass(frozen=True, slots=True)
class Links:
    """What a (pp, dp) mesh's traffic crosses."""

    dp_gbps: float
    """The data-parallel collectives' bandwidth (their slowest link)."""
    act_gbps: float
    """Activations' between neighbouring stages (the slowest pair's)."""
    dp_crosses_boxes: bool
    act_crosses_boxes: bool


def mesh_links(cluster: Cluster, pp: int, order: str) -> Links:
    """The links a (pp, dp = ranks / pp) mesh laid out in ``order`` crosses."""
    n, g = cluster.ranks, cluster.gpus_per_box
    if order not in ORDERS:
        raise ConfigError("order", order, f"must be one of {', '.join(ORDERS)}")
    if pp < 1 or n % pp:
        raise ConfigError("pp", pp, f"must divide the cluster's {n} GPUs")
    dp = n // pp

    def box(stage: int, d: int) -> int:
        rank = stage * dp + d if order == "dp-inner" else d * pp + stage
        return rank // g

    dp_cross = any(len({box(s, d) for d in range(dp)}) > 1 for s in range(pp))
    act_cross = any(box(s, d) != box(s + 1, d) for s in range(pp - 1) for d in range(dp))
    inter, intra = cluster.inter_box_gbps, cluster.intra_box_gbps
    return Links(inter if dp_cross else intra, inter if act_cross else intra, dp_cross, act_cross)


@dataclass(frozen=True, slots=True)
class RankLayout:
    """The part of the model pipeline rank ``rank`` holds."""

    rank: int
    numels: list
    """Elements of each of its parameters, in the order its stages' engines pack them."""
    layers: int
    """Decoder layers among its stages."""
    has_head: bool
    """Does it hold the final norm and the LM head (the last stage)?"""

    @property
    def params(self) -> int:
        return sum(self.numels)

    def shape(self, cfg: LlamaConfig) -> LlamaConfig:
        """A LLaMA shape with this rank's layers, for the activation and FLOP estimates: the LM head's
        vocabulary only on the rank that runs it (1, i.e. nothing to speak of, elsewhere; the
        embedding is a lookup, no matmul)."""
        return cfg.replace(num_layers=max(1, self.layers), vocab_size=cfg.vocab_size if self.has_head else 1,
                           tie_embeddings=False)


def chain_units(cfg: LlamaConfig) -> list[list[int]]:
    """The model as ``offload.pipeline.split`` sees it: [embedding], each decoder layer's
    parameters, [final norm, LM head] (untied: stages refuse tied embeddings)."""
    numels = param_numels(cfg.replace(tie_embeddings=False))
    layers = [numels[1 + LAYER_PARAMS * i:1 + LAYER_PARAMS * (i + 1)] for i in range(cfg.num_layers)]
    return [numels[:1], *layers, numels[-2:]]


def rank_layouts(cfg: LlamaConfig, pp: int, stages_per_rank: int) -> list[RankLayout]:
    """Every pipeline rank's part of ``cfg`` cut into ``pp x stages_per_rank`` stages."""
    # imported here: the package ``offload.pipeline`` loads the engine and torch's pipelining
    # (half a second), which a plan for one box does not need
    from ..pipeline.balance import cut

    units = chain_units(cfg)
    ranges = cut([sum(u) for u in units], pp * stages_per_rank)
    last = len(units) - 1
    out = []
    for r in range(pp):
        mine = ranges[r::pp]
        numels = [n for lo, hi in mine for u in units[lo:hi] for n in u]
        layers = sum(1 for lo, hi in mine for i in range(lo, hi) if 0 < i < last)
        out.append(RankLayout(r, numels, layers, any(lo <= last < hi for lo, hi in mine)))
    return out


def ranks_to_plan(layouts: list[RankLayout]) -> list[RankLayout]:
    """The ranks whose plans bound the pipeline: rank 0 (the most activations in flight) and the
    one with the most parameters (the most state, the longest compute), if another."""
    heaviest = max(layouts, key=lambda lay: (lay.params, lay.has_head))
    return [layouts[0]] if heaviest.rank == 0 else [layouts[0], heaviest]
