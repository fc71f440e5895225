"""Building an engine's parts from the model and the config: the set-up ``OffloadEngine`` runs once.

The parameters to offload (meta-built ones replaced by real ones), the chunk layout and the
budget checks every step relies on, the tiers, the gradient and optimizer-state chunks, the
model's buffers on the compute device, the copy streams, the collectives and the optimizer's
threads.
"""

from __future__ import annotations

import torch
from torch import nn

from ..chunks import ChunkLayout, ChunkStore
from ..chunks.layout import auto_max_chunk
from ..config import CHUNK_QUANTUM, OffloadConfig
from ..distributed import Sharding, expand_rank
from ..distributed.agree import check_same_layout
from ..errors import ConfigError
from ..tiers import MemoryTier, NvmeTier
from ..tiers.budgets import min_cpu_bytes, min_device_bytes_sharded
from ..tiers.streams import CopyStreams, DeviceStreams
from ..units import format_bytes
from .pins import empty_placeholder
from .precision import StatePrecision


def collectives(sharding, streams: CopyStreams | None, device: torch.device):
    """``(comms, comm_device)``: the collectives over ``sharding``'s group, and where they take
    their tensors; ``(None, cpu)`` in a single process. A failing rank then says so to its peers."""
    if sharding is None:
        return None, torch.device("cpu")
    from ..distributed import failure
    from ..distributed.comms import Collectives, collective_device

    import torch.distributed as dist

    failure.install(dist.get_rank())      # the store names ranks globally, whatever the group
    return Collectives(sharding, streams=streams, device=device), collective_device(sharding.group)


def copy_streams(device: torch.device) -> CopyStreams | None:
    """The copy streams of ``device``: a CUDA device's (its compute stream is the one current
    now, and again at each forward's start), None for the CPU (copies are synchronous). Tests
    put simulated streams here to run the GPU path's ordering on the CPU."""
    return DeviceStreams(device) if device.type == "cuda" else None


def offloaded_parameters(model: nn.Module, dtype: torch.dtype, device: torch.device, lazy) -> tuple[list, dict]:
    """``(named, shapes)``: the model's parameters by name, and the shapes of those built on the
    meta device under ``lazy_init`` (``lazy``: its record, or None), which are swapped here for
    real parameters with placeholder data (ties kept) before anyone (an optimizer) holds them."""
    shapes: dict[int, torch.Size] = {}
    if lazy is not None:
        new: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if not p.is_meta:
                    continue
                if id(p) not in new:
                    q = nn.Parameter(empty_placeholder(p.dim(), dtype, device), requires_grad=p.requires_grad)
                    new[id(p)] = q
                    shapes[id(q)] = p.shape
                setattr(module, name, new[id(p)])
        for module in model.modules():
            for name, b in module.named_buffers(recurse=False, remove_duplicate=False):
                if b.is_meta:
                    raise ConfigError("buffer", f"{type(module).__name__}.{name}",
                                      "was built on the meta device; lazy_init materializes parameters "
                                      "only: create buffers with an explicit device")
    named = list(model.named_parameters())
    if not named:
        raise ConfigError("model", type(model).__name__, "has no parameters to offload")
    for name, p in named:
        if not p.is_floating_point():
            raise ConfigError("model", name, f"parameter dtype {p.dtype} is not floating point")
    return named, shapes


def state_precision(config: OffloadConfig, dtype: torch.dtype) -> StatePrecision:
    """The optimizer state's precision (``config.optimizer_state`` / ``.master``), checked."""
    return StatePrecision.of(config, dtype)


def with_quantum(sharding, precision: StatePrecision):
    """``sharding`` whose pieces are whole blocks of the quantised state (None stays None)."""
    if sharding is None or precision.quantum == 1:
        return sharding
    import dataclasses

    return dataclasses.replace(sharding, quantum=precision.quantum)


def build_layout(named: list, shapes: dict, config: OffloadConfig, dtype: torch.dtype, device_budget: int,
                 cpu_budget: int, sharding, precision: StatePrecision | None = None,
                 staged: bool = False) -> ChunkLayout:
    """The chunk layout (the same on every rank, checked), refused when the budgets cannot hold
    the minimum working set of one step (``min_device_bytes`` and ``min_cpu_bytes``: the planner
    refuses by the same rules). The layout does not depend on the number of ranks (each keeps a
    piece of every chunk); every rank computes it from the same inputs (the model, the agreed
    budgets), and checks that the others did. ``staged``: the device tier is a tier of its own and
    NVMe lies below, so a chunk read for compute passes through the CPU tier."""
    layout = ChunkLayout.build([(n, shapes.get(id(p), p.shape)) for n, p in named], config.chunk_size,
                               max_chunk=auto_max_chunk(device_budget, cpu_budget),
                               frozen={n for n, p in named if not p.requires_grad})
    if sharding is not None:
        check_same_layout(layout, dtype, sharding.group)
    n, e = layout.chunk_size, dtype.itemsize
    need_device = min_device_bytes_sharded(n, e, layout.largest_chunk, sharding.world if sharding else 1)
    # The CPU Adam updates this rank's piece of a chunk at a time (the whole chunk in one process),
    # each kind's buffer in whole 4 KiB blocks (CHUNK_QUANTUM elements are whole blocks of any dtype).
    piece = (lambda n: -(-sharding.piece_numel(n) // CHUNK_QUANTUM) * CHUNK_QUANTUM) if sharding is not None \
        else (lambda n: n)
    trainable = [piece(layout.sizes[c]) for c in layout.trainable_chunks]
    largest = max(trainable, default=0)
    # Counted by the state's precision (8-bit moments, a bf16 master): the same as min_cpu_bytes at fp32.
    update = min_cpu_bytes(largest, e) if precision is None else precision.update_bytes(largest)
    resident = 0 if precision is None else precision.resident_bytes(trainable)
    # Updates overlap the next forward, whose chunks come up from NVMe through the CPU tier: with
    # the largest update pinned there, one chunk on its way to the device must fit beside it (or the
    # optimizer's worker found the tier full of its own update and a chunk in transit, and failed).
    transit = piece(layout.largest_chunk) * e if staged else 0
    need_cpu = max(update, piece(layout.largest_chunk) * e) + resident + transit
    groups = (f"; under {sharding.world} ranks, whole chunks gathered from the pieces and gradient "
              f"chunks being reduce-scattered" if sharding else "")
    why = (f"chunks are {n} elements (the largest has {layout.largest_chunk}); "
           "raise the budget or lower chunk_size")
    if device_budget < need_device:
        raise ConfigError("device_budget", device_budget,
                          f"holds less than the {format_bytes(need_device)} one backward step needs "
                          f"(the largest chunk and 2 bulk chunks, parameters and fp32 gradients"
                          f"{groups}): {why}")
    at = "" if precision is None or precision.default else \
        f" at {precision.moments} moments and a {precision.master} master"
    if cpu_budget < need_cpu:
        raise ConfigError("cpu_budget", cpu_budget,
                          f"holds less than the {format_bytes(need_cpu)} one chunk's optimizer update "
                          f"needs (gradient, master, exp_avg, exp_avg_sq, parameters{at})"
                          + (f" with a chunk on its way from NVMe to the device beside it "
                             f"({format_bytes(transit)})" if transit else "")
                          + (f" beside the block scales of every chunk, held in memory "
                             f"({format_bytes(resident)})" if resident else "") + f": {why}")
    return layout


def make_tiers(config: OffloadConfig, device: torch.device, device_budget: int, cpu_budget: int, sharding,
               prefix: str) -> tuple[list, dict | None]:
    """``(tiers, aliases)`` for the chunk store, top down; NVMe swap files are named by ``prefix``."""
    aligned = config.nvme_paths is not None      # O_DIRECT reads and writes land in these buffers
    if device.type == "cpu" and config.merge_host_tiers:
        # Computing on the CPU, the device and CPU tiers would both be host memory: copying a
        # chunk between them costs time and holds it twice. They are one tier of both budgets,
        # still addressed as "device" where the engine means "where compute reads it".
        tiers = [MemoryTier("cpu", device_budget + cpu_budget, "cpu", aligned=aligned)]
        aliases = {"device": "cpu"}
    else:
        tiers = [MemoryTier("device", device_budget, device),
                 MemoryTier("cpu", cpu_budget, "cpu", aligned=aligned,
                            pin=device.type == "cuda" and config.pin_memory)]
        aliases = None
    if config.nvme_paths is not None:
        # Swap files are named by the process's rank in the default group: under pipeline stages two
        # processes of different stages (each a group of its own) must not share them either.
        files = Sharding.from_process_group() if sharding is None or sharding.group is not None else sharding
        tiers.append(NvmeTier(expand_rank(config.nvme_paths, files), config.aio, prefix=prefix))
    return tiers, aliases


# Chunk buffers a pinned CPU tier holds beyond one per registered chunk (``fit_pinned_tier``).
SPARE_BUFFERS = 2
# The kinds accumulated on the device across micro-batches: uploaded, then rewritten there (under
# N ranks the pieces; the whole chunks, "grad_full", live pinned on the device until reduced).
GRADIENT_KINDS = frozenset({"grad"})


def fit_pinned_tier(store: ChunkStore) -> None:
    """Size the pinned CPU tier's arena to what it can ever hold, when that is less than its budget.

    Every registered chunk of every kind, each at most one buffer there (``ChunkRecord.buffers``
    holds one per tier; nothing but the store's chunks is allocated from it: staging and the
    activation area are buffers of their own); plus ``SPARE_BUFFERS`` of the largest chunk: one
    for a thread that made room for a chunk another thread brought there meanwhile (it frees the
    second copy under the same lock: one at a time), one for a dropped buffer an upload still
    reads (``ChunkTraffic.free_buffer`` holds it back, still counted, until the upload is done);
    and one more buffer per gradient chunk: under accumulation (any run of several backwards
    before a step, whatever the config says) a gradient evicted mid-backward comes back for the
    next micro-batch and is rewritten on the device, its host copy dropped while the upload may
    still read it, and the GPU may be a whole backward behind the host (on simulated streams 64
    copies behind: 10 such buffers of 36 chunks at once, where 2 spares made the tier evict, and
    wait under the store's lock). Beyond that, making room waits for those uploads or evicts, as
    in any full tier: never an error (every chunk's buffer still fits: ``fits_outside_arena``).
    Called once the chunks are registered and before the first allocation maps (and page-locks)
    the arena. The budget can only shrink. Unpinned arenas are left as they are: their pages are
    touched only as used, so the cap would change nothing."""
    tier = store.tiers.get("cpu")       # a MemoryTier whenever there is one (make_tiers)
    if tier is None or not tier.pin:
        return
    sizes = [r.nbytes for r in store.records.values()]
    sizes += [r.nbytes for r in store.records.values() if r.key[0] in GRADIENT_KINDS]
    tier.fit_to(sizes, spare=SPARE_BUFFERS * max(sizes, default=0))


# The kinds that live from step to step (gradients come and go; gathered chunks are copies).
PERSISTENT_KINDS = frozenset({"param", "master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"})


def register_optimizer_state(store: ChunkStore, params, config: OffloadConfig, dtype: torch.dtype,
                             memory_bytes: int) -> bool:
    """Register the gradient and Adam moment chunks; returns whether the persistent state
    outgrows ``memory_bytes`` (then each update writes its state down at once: ``spills``)."""
    # Without accumulation a gradient chunk only holds copies of what autograd produced: keep
    # autograd's dtype (lossless, and half of fp32's bytes for bf16/fp16). Adding micro-batches
    # together is done in fp32. Frozen chunks get neither gradients nor optimizer state.
    pieces = params.trainable_sizes()       # this rank's piece of each (the whole chunk in one process)
    grad_dtype = dtype if config.gradient_accumulation_steps == 1 else torch.float32
    if params.capture_kind != "grad":
        # Under several ranks autograd's gradients fill whole chunks, reduce-scattered into the
        # pieces Adam reads on every micro-batch: a whole chunk lives from its first gradient until
        # it is reduced, pinned all along, and never needs an NVMe slot. The pieces accumulate.
        store.register_chunks(params.capture_kind, params.trainable_whole_sizes(), grad_dtype, nvme=False)
    store.register_chunks("grad", pieces, grad_dtype)
    precision = params.precision
    for kind, kind_dtype in precision.state_kinds().items():
        # A scale kind holds one fp32 per block of the piece (pieces are whole blocks: the quantum).
        block = precision.kind_block(kind)
        store.register_chunks(kind, {c: -(-n // block) for c, n in pieces.items()}, kind_dtype,
                              nvme=kind not in precision.resident_kinds())
    persistent = sum(r.nbytes for r in store.records.values() if r.key[0] in PERSISTENT_KINDS)
    return config.nvme_paths is not None and persistent > memory_bytes


# The gathered chunks may hold at most this share of the device budget (the rest: pins, gradients,
# reductions in flight, prefetches).
GATHERED_SHARE = 4


def gathered_window(params, device_budget: int) -> int:
    """How many gathered chunks stay on the device under N ranks (``ChunkGather.keep``): 3, or
    as many as a quarter of the device budget holds. The chunks that end forward begin backward,
    so a window that holds them saves their all-gathers again (DeepSpeed's max_live_parameters
    does the same for ZeRO-3; FSDP2 keeps its root module only). It counts chunks, never ranks."""
    whole = max((params.whole_numel(c) for c in range(params.layout.num_chunks)), default=1)
    fits = device_budget // (GATHERED_SHARE * whole * params.dtype.itemsize)
    return int(max(3, min(params.layout.num_chunks, fits)))


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers go to the compute device in the dtype the model made them: an fp32 ``inv_freq``
    in a bf16 run keeps RoPE exact at long positions (as HF loads keep it). A user who wants
    them in another dtype casts them before wrapping."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(module, name, buf.to(device))      # a buffer stays a buffer, persistence kept


def optimizer_threads(config: OffloadConfig, sharding) -> int | None:
    """The CPU Adam's threads (None: all cores)."""
    if config.optimizer_threads != "auto":
        return config.optimizer_threads
    if sharding is not None and sharding.local_world > 1:
        # Ranks on one host share its cores: each runs its Adam on its share of them.
        from ..native import physical_cores

        return max(1, physical_cores() // sharding.local_world)
    return None
