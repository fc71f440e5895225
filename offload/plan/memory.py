"""Where one rank's state sits: the budgets, the bytes each tier holds by kind, the NVMe space, and
whether it all fits (bytes throughout).

* Kinds, bytes per element: compute parameters ``e`` (2 for bf16/fp16, 4 for fp32), fp32
  gradients 4, fp32 master 4 (none for fp32 compute: the parameter is the master), ``exp_avg`` 4,
  ``exp_avg_sq`` 4 — 18 B/param for bf16, 16 for fp32 — under the default exact fp32 Adam; a
  compressed master and moments (``Policy.optimizer_state``/``master``) cost ``precision``'s bytes
  instead, e.g. 8-bit moments and a bf16 master under bf16 compute 2 + 4 + 0 + 2 x (1 + 4/256).
  Frozen chunks hold parameters only.
* Budgets are chunk storage only. ``device_budget``: parameter chunks and the fp32 gradient chunks
  being filled on the compute device; activations, autograd temporaries and the CUDA context are
  outside it (torch's allocator), so a GPU needs device_budget + activations + workspace, and a
  CPU-only box (whose "device" is a region of RAM) device_budget + cpu_budget + activations of
  RAM. ``cpu_budget``: chunks of every kind in RAM; NVMe I/O goes straight into them (no staging).
  Not given: the engine's "auto" (``offload.tiers.budgets``): GPU 50% of its (free) memory, a
  CPU-only device 25% of available RAM; CPU 50% of the RAM the device did not take.
* Minimums: the engine's own (``tiers.budgets.min_device_bytes_sharded`` / ``min_cpu_bytes``): the
  device holds the largest chunk and 2 bulk chunks, parameters and fp32 gradients, at once (the tied
  embedding's and a module's that may straddle two) — under several ranks, whole gathered chunks and
  gradient chunks being reduce-scattered as well, a number that does not depend on the ranks; the
  CPU one chunk (one rank's piece of it) of each kind for the optimizer (18 B x the largest in bf16).
* Placement: the device keeps as many parameter chunks as fit beside a layer's gradient chunks
  (all of them: "resident"); the CPU keeps, beyond two chunk sets of working room (the chunk Adam
  updates and the next one's prefetch), parameters first (read every step), then master,
  ``exp_avg``, ``exp_avg_sq`` (and whole gradients when the step is deferred or micro-batches
  accumulate into them). With NVMe paths every chunk of every kind has a slot reserved up front:
  NVMe space needed = all chunks.
* Under data parallelism the figures are one rank's: its piece (1/world) of every chunk's state, on
  its share of the box (``inputs.rank_share``); the device still holds every parameter chunk it
  uses whole, all-gathered from the pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..tiers.budgets import (AUTO_CPU_SHARE, AUTO_DEVICE_SHARE_CPU, AUTO_DEVICE_SHARE_CUDA, GATHERED_CHUNKS,
                             REDUCING_CHUNKS, min_cpu_bytes, min_device_bytes_sharded)
from ..units import format_size
from .activations import ActivationPlacement, activation_problems
from .inputs import Hardware, Policy
from .model import RankChunks

STATE_KINDS = ("params", "master", "exp_avg", "exp_avg_sq", "grads")
"""The CPU tier's priority order (gradients only stay there whole when the step is deferred)."""

CPU_WORKING_SETS = 2
"""Chunk sets (one chunk of every kind) the CPU tier keeps free for Adam: the chunk being updated
and the next one being prefetched."""
GPU_WORKSPACE = 1 << 30
"""GPU memory outside the budget and the activations: CUDA context, cuBLAS workspace, allocator slack."""


def auto_budgets(hw: Hardware, device_budget: int | None, cpu_budget: int | None) -> tuple[int, int]:
    """``(device_budget, cpu_budget)`` as ``offload.tiers.budgets.resolve_budgets`` turns "auto" into
    bytes, with ``gpu_mem`` and ``cpu_mem`` standing for the free GPU memory and available RAM."""
    gpu = hw.gpu_mem is not None
    if device_budget is None:
        device_budget = int(hw.gpu_mem * AUTO_DEVICE_SHARE_CUDA) if gpu else int(hw.cpu_mem * AUTO_DEVICE_SHARE_CPU)
    if cpu_budget is None:
        taken = 0 if gpu else device_budget
        cpu_budget = max(int((hw.cpu_mem - taken) * AUTO_CPU_SHARE), 1 << 20)
    return device_budget, cpu_budget


def _fp32_kinds(e: int) -> dict:
    """Bytes per element of each kind under exact fp32 Adam (the engine's default)."""
    return {"params": e, "grads": 4, "master": 4 if e < 4 else 0, "exp_avg": 4, "exp_avg_sq": 4}


def _split(kinds: dict, order: tuple, room: int) -> tuple[dict, dict]:
    """Fill ``room`` bytes with ``kinds`` in ``order``: (what stays, what spills)."""
    here, rest = {}, {}
    room = max(room, 0)
    for kind in order:
        take = min(kinds.get(kind, 0), room)
        room -= take
        here[kind], rest[kind] = take, kinds.get(kind, 0) - take
    return here, rest


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    """Where one rank's state sits (bytes)."""

    per_elem: dict
    """Bytes per element of each kind: {"params", "grads", "master", "exp_avg", "exp_avg_sq"} (and
    "scales" under 8-bit moments: held in host memory, never spilled)."""
    total: dict
    """Bytes of each kind in the rank's chunks (gradients, master and moments of trainable ones only)."""
    all_params: int
    """Parameter bytes of every chunk of the model (padded to the ranks' pieces): what the device
    sees, gathered."""
    dev_params: int
    """Parameter bytes the device keeps beside a layer's gradient chunks."""
    device_min: int
    """The engine's smallest device budget for this layout."""
    cpu_min: int
    """The engine's smallest CPU budget: one chunk of every kind for Adam (and every chunk's
    8-bit block scales, which stay in host memory)."""
    working: int
    """CPU room kept for Adam's chunk sets."""
    spill: dict
    """Bytes of each kind below the CPU tier (on NVMe)."""
    tiers: dict
    """{"device"|"cpu"|"nvme": {"bytes": total, <kind>: bytes, ...}}"""
    nvme_needed: int
    """NVMe space reserved: a slot for every chunk of every kind, and the activations' spill."""
    cpu_transit: int = 0
    """Part of ``cpu_min``: one chunk on its way from NVMe to the GPU beside Adam's chunks."""

    @property
    def state_bytes(self) -> int:
        """Bytes of every kind of the rank's chunks."""
        return sum(self.total.values())

    @property
    def resident(self) -> bool:
        """Does the device keep every parameter chunk?"""
        return self.dev_params == self.all_params


def place_state(chunks: RankChunks, placed: ActivationPlacement, *, per_elem: dict, layer_params: int,
                world: int, device_budget: int, cpu_budget: int, hold_grads: bool, nvme_tier: bool,
                staged: bool = False) -> Memory:
    """Put the state of ``chunks`` (the rank's) on the device, the CPU and NVMe; ``per_elem``: bytes
    per element of each kind (``precision.state_per_elem``); ``layer_params``: elements of one
    decoder layer; ``hold_grads``: gradients are held whole until the update (a deferred step, or
    micro-batches accumulating into them); ``nvme_tier``: is there one? ``staged``: chunks come up
    from NVMe to a GPU through the CPU tier (without a GPU the engine's two host tiers are one)."""
    e = per_elem["params"]
    # 8-bit moments cost a fractional byte per element (their block scales): round up per kind
    total = {k: math.ceil((chunks.elems if k == "params" else chunks.trained) * b) for k, b in per_elem.items()}
    set_bytes = math.ceil(chunks.largest_trained * sum(per_elem.values()))    # one (largest) chunk of every kind
    state_bytes = sum(total.values())
    all_params = chunks.gathered_elems * e          # what the device sees: every chunk, gathered
    chunk, largest = chunks.chunk_size, chunks.largest

    # ---- the device tier: parameter chunks beside a layer's gradient chunks (+ activations, outside)
    # A layer's chunks: whole bulk chunks, or (its matrices in chunks of their own) its parameters,
    # plus one chunk it may straddle into.
    layer_elems = min(-(-layer_params // chunk) * chunk, layer_params + chunk) + chunk
    grads_window = min(chunks.all_trained * 4, layer_elems * 4)
    dev_params = min(all_params, max(0, device_budget - grads_window))
    device_min = min_device_bytes_sharded(chunk, e, largest, world)   # whole chunks: the same at any world
    tiers_device = {"params": dev_params, "grads": grads_window, "activations": placed.device_bytes}

    # ---- the CPU tier: working room for the optimizer, then state by priority; NVMe holds the rest
    # the rank's pieces pass through the CPU tier, never a whole chunk (the device gathers them)
    # the engine's minimum for fp32 state is the same sum; other precisions: their own bytes
    one_set = min_cpu_bytes(chunks.largest_trained, e) if per_elem == _fp32_kinds(e) else set_bytes
    lower = dict(total)            # what lives below the device
    resident = lower.pop("scales", 0)        # 8-bit block scales: in host memory throughout, no slot
    # one chunk on its way from NVMe to the device passes the CPU tier beside the largest update
    # (updates overlap the next forward): the engine's rule (engine/build.py, ``staged``)
    transit = chunks.largest_piece * e if staged else 0
    cpu_min = max(one_set, chunks.largest_piece * e) + resident + transit
    working = min(CPU_WORKING_SETS * set_bytes, cpu_budget, state_bytes)
    # consumed by Adam as they arrive, unless held whole
    lower["grads"] = total["grads"] if hold_grads else 0
    cpu, spill = _split(lower, STATE_KINDS, cpu_budget - working - resident)
    if resident:
        cpu["scales"] = resident
    if not nvme_tier:
        # the CPU tier is the bottom: everything must be held in RAM (the device's parameters are copies)
        spill = {k: 0 for k in spill}
    tiers = {"device": {"bytes": sum(tiers_device.values()), **tiers_device},
             "cpu": {"bytes": sum(cpu.values()) + working + placed.area_bytes, "working": working, **cpu,
                     "activations": placed.area_bytes},
             "nvme": {"bytes": sum(spill.values()) + placed.spill_bytes, **spill, "activations": placed.spill_bytes}}
    # a slot for every chunk of every kind but the resident scales, and the activations' spill space
    nvme_needed = state_bytes - resident + placed.spill_bytes if nvme_tier else 0
    return Memory(per_elem=per_elem, total=total, all_params=all_params, dev_params=dev_params,
                  device_min=device_min, cpu_min=cpu_min, working=working, spill=spill, tiers=tiers,
                  nvme_needed=nvme_needed, cpu_transit=transit)


def max_batch_tokens(hw: Hardware, placed: ActivationPlacement, device_budget: int, cpu_budget: int, *,
                     world: int, micro_batches: int, seq: int) -> int:
    """Largest batch (tokens/step, all ranks) whose activations fit beside the budgets: in GPU
    memory, or in RAM without a GPU."""
    if hw.gpu_mem is not None:
        act_room = hw.gpu_mem - device_budget - GPU_WORKSPACE
    else:
        act_room = hw.cpu_mem - device_budget - cpu_budget
    return world * micro_batches * (act_room // placed.device_per_token // seq * seq) if act_room > 0 else 0


def fit_problems(hw: Hardware, po: Policy, mem: Memory, chunks: RankChunks, placed: ActivationPlacement, *,
                 device_budget: int, cpu_budget: int, max_batch: int, micro_tokens: int,
                 rank_tokens: int) -> list[str]:
    """Why the plan cannot run, one message per reason ([] when it fits)."""
    gpu, nvme_tier, world = hw.gpu_mem is not None, hw.nvme_capacity > 0, po.world
    act_total, largest = placed.device_bytes, chunks.largest
    problems = []
    if device_budget < mem.device_min:
        problems.append(
            f"device budget {format_size(device_budget)} is below the largest chunk ({largest:,} elements) "
            f"and 2 chunks of {chunks.chunk_size:,}, parameters and fp32 gradients "
            f"({format_size(mem.device_min)}): the "
            f"device holds the tied embedding's chunks and a module's (which may straddle two) at once"
            + ("" if world == 1 else f", and under {world} ranks (as under any number) whole chunks "
               f"all-gathered and gradient chunks being reduce-scattered: {GATHERED_CHUNKS} gathered "
               f"parameter chunks, {REDUCING_CHUNKS} gradient chunks in reduction and this rank's pieces in flight"))
    if cpu_budget < mem.cpu_min:
        problems.append(
            f"CPU budget {format_size(cpu_budget)} is below one chunk of every kind "
            f"({format_size(mem.cpu_min)}: {chunks.largest_trained:,} elements x {sum(mem.per_elem.values()):.4g} B"
            + ("" if world == 1 else ", this rank's piece of the largest trainable chunk") +
            ") that Adam needs at once"
            + (f", and one chunk on its way from NVMe to the GPU ({format_size(mem.cpu_transit)})"
               if mem.cpu_transit else "")
            + (f", beside the 8-bit block scales of every chunk, held in RAM ({format_size(mem.total['scales'])})"
               if mem.total.get("scales") else ""))
    if gpu and device_budget + act_total + GPU_WORKSPACE > hw.gpu_mem:
        problems.append(
            f"GPU needs {format_size(device_budget + act_total + GPU_WORKSPACE)} (device budget "
            f"{format_size(device_budget)} + {format_size(act_total)} activations for {micro_tokens} "
            f"tokens + {format_size(GPU_WORKSPACE)} workspace), has {format_size(hw.gpu_mem)}; at most "
            f"{max_batch} tokens/step fit")
    problems += activation_problems(placed, po.activation_offload, gpu, nvme_tier)
    if not gpu and device_budget + cpu_budget + act_total > hw.cpu_mem:
        problems.append(
            f"RAM needs {format_size(device_budget + cpu_budget + act_total)} (device budget "
            f"{format_size(device_budget)} + CPU budget {format_size(cpu_budget)} + "
            f"{format_size(act_total)} activations for {rank_tokens} tokens), "
            f"{format_size(hw.cpu_mem)} available; at most {max_batch} tokens/step fit")
    if not nvme_tier:
        held = mem.state_bytes - (0 if po.defer_step else mem.total["grads"])
        if held > cpu_budget - mem.working:
            problems.append(f"state needs {format_size(held)} in RAM beyond the CPU budget's room of "
                            f"{format_size(max(cpu_budget - mem.working, 0))} and there is no NVMe tier "
                            f"(give --nvme-path)")
    elif mem.nvme_needed > hw.nvme_capacity:
        problems.append(f"NVMe needs {format_size(mem.nvme_needed)}, {format_size(hw.nvme_capacity)} free at "
                        f"{hw.nvme_where}")
    return problems


def verdict(hw: Hardware, po: Policy, mem: Memory, placed: ActivationPlacement, problems: list[str], *,
            device_budget: int, cpu_budget: int) -> str:
    """The plan's one-line reason: what does not fit, or the budgets it fits in."""
    world = po.world
    ranks_note = "" if world == 1 else (
        f" (one rank of {world}, {po.local_world} on this box sharing its RAM, NVMe and CPU)")
    act_total = placed.device_bytes
    if problems:
        return "; ".join(problems) + ranks_note
    if hw.gpu_mem is not None:
        return (f"fits: device budget {format_size(device_budget)} + {format_size(act_total)} activations "
                f"on the GPU of {format_size(hw.gpu_mem)}, CPU budget {format_size(cpu_budget)}, "
                f"{format_size(mem.nvme_needed)} on NVMe of {format_size(hw.nvme_capacity)}"
                + placed.describe(po.micro_batches) + ranks_note)
    return (f"fits: budgets {format_size(device_budget)} (device) + {format_size(cpu_budget)} (CPU) "
            f"+ {format_size(act_total)} activations in RAM of {format_size(hw.cpu_mem)}, "
            f"{format_size(mem.nvme_needed)} on NVMe of {format_size(hw.nvme_capacity)}" + ranks_note)
