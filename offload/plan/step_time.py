"""What one optimizer step moves (bytes) and how long it takes (seconds).

* Traffic per step: parameter chunks go CPU->device for the forward (the update rewrote them on the
  CPU, so even resident ones are fetched once) and again for the backward, less what the device
  kept; those not in the CPU tier come from NVMe first (and are written back after the update);
  fp32 gradients device->CPU once; each chunk's optimizer state that lives on NVMe is read once and
  written once. Each micro-batch after the first streams the parameters again and moves the
  gradients out and back. Without a GPU the device<->CPU copies are memcpy within RAM: counted
  (``Traffic.device_cpu_copy``), not timed (PCIe terms are 0).
* Step time. GPU: ``max(compute, PCIe, NVMe, Adam)`` when the optimizer overlaps backward; with a
  deferred step (clipping, fp16) the optimizer's part — max(Adam, its NVMe traffic) — comes after
  the backward and adds. PCIe is full duplex: max(H2D, D2H) / GB/s. NVMe is not: reads and writes
  share the drives, read/read_GBps + write/write_GBps. Without a GPU, compute, Adam and the disk
  path add up: the same cores run the layers, Adam and the I/O copies, and the chunk store waits on
  I/O holding its lock, which stalls the compute thread's next fetch (measured: NVMe traffic adds
  its time to a CPU-only step rather than hiding under it). Compute is the training FLOPs at the
  measured rate, x 4/3 with activation checkpointing (each layer's forward runs again in backward).
* Data parallelism (sliced chunks): a rank uploads, stores and updates its 1/world piece of every
  chunk; every parameter chunk the device takes in is all-gathered whole from the pieces (in the
  forward, and again in the backward for what the device did not keep), and every gradient chunk
  is reduce-scattered (each micro-batch; in the compute dtype without accumulation, as the engine
  keeps autograd's gradients then, else fp32). A ring moves (world - 1)/world of the whole chunk's
  bytes through each rank's link (``Traffic.collective``, NCCL's "bus bytes"); at ``net_gbps`` that
  is the interconnect term, which overlaps compute like PCIe and NVMe do (the collectives run on
  their own thread and stream).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..models.llama import LlamaConfig, flops_per_token
from ..units import format_size
from .activations import ActivationPlacement
from .inputs import Hardware, Policy
from .memory import Memory
from .model import RankChunks

GB = 1e9
"""Bandwidths are decimal: 1 GB/s = 1e9 bytes/s."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    """Bytes one rank moves per optimizer step."""

    bytes_per_step: dict
    """{"nvme_read", "nvme_write", "pcie_h2d", "pcie_d2h"} (PCIe 0 without a GPU)."""
    device_cpu_copy: dict
    """{"h2d", "d2h"}: chunk bytes between the device and the CPU tier (memcpy without a GPU)."""
    optimizer_nvme: int
    """Optimizer state (and held gradients) on NVMe: read and written once by the update."""
    optimizer_nvme_read: int
    """What the update reads from NVMe (for fp32 compute also the parameters: they are the master)."""
    collective: dict
    """{"all_gather", "reduce_scatter"}: bus bytes through each rank's link per step (sent, and as
    many received): (world - 1)/world of the whole (padded) chunks gathered or reduced."""


def traffic(mem: Memory, chunks: RankChunks, placed: ActivationPlacement, *, micro_batches: int,
            world: int, gpu: bool) -> Traffic:
    """What the rank of ``chunks``, its state placed as ``mem``, moves in one step."""
    e, k, spill = mem.per_elem["params"], micro_batches, mem.spill
    all_params, dev_params = mem.all_params, mem.dev_params
    # Rewritten on the CPU by the update, so even resident ones are fetched again; frozen ones the
    # device kept are not.
    h2d_fwd = all_params - min(dev_params, (chunks.gathered_elems - chunks.gathered_trained) * e)
    h2d_bwd = all_params - dev_params                          # what the device could not keep
    d2h = mem.total["grads"]             # under data parallelism: the rank's pieces of the reduced gradients
    pn = spill["params"]
    refetch = pn * h2d_bwd / all_params if all_params else 0
    opt_nvme = spill["master"] + spill["exp_avg"] + spill["exp_avg_sq"] + spill["grads"]
    opt_read = opt_nvme + (0 if mem.per_elem["master"] else pn)   # fp32: Adam reads the parameter as master
    # Each micro-batch after the first streams again what the device does not keep (forward and
    # backward), moves the gradients out and (to add into them) back in, re-reads spilled parameters
    # and gradients; parked activations go out and back once per micro-batch.
    streamed = h2d_fwd + h2d_bwd + (k - 1) * 2 * h2d_bwd     # parameter bytes the device takes in
    # Each rank uploads its piece of every chunk streamed; the all-gather assembles the whole chunk.
    h2d_params = streamed // world
    grad_bytes = e if k == 1 else 4       # the engine's gradient chunks: autograd's dtype, or fp32 to add into
    collective = {"all_gather": int(streamed * (world - 1) / world),
                  "reduce_scatter": int(chunks.gathered_trained * grad_bytes * k * (world - 1) / world)}
    grad_spill = (k - 1) * spill["grads"]
    act_host, act_spill = placed.host_bytes * k, placed.spill_bytes * k
    moved = {
        "nvme_read": int(opt_read + (pn + refetch) * k + grad_spill + act_spill),
        # frozen parameters are never rewritten
        "nvme_write": int(opt_nvme + pn * chunks.trained / chunks.elems + grad_spill + act_spill),
        "pcie_h2d": h2d_params + d2h * (k - 1) + act_host if gpu else 0,
        "pcie_d2h": d2h * k + act_host if gpu else 0,
    }
    return Traffic(bytes_per_step=moved, device_cpu_copy={"h2d": h2d_fwd + h2d_bwd, "d2h": d2h},
                   optimizer_nvme=opt_nvme, optimizer_nvme_read=opt_read, collective=collective)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """The predicted step (seconds) and what bounds it."""

    terms: dict
    """{"compute", "pcie", "nvme", "adam", "interconnect"}: seconds each would take alone."""
    predicted: float
    bottleneck: str
    gpu_bound_tokens: int | None
    """Batch (tokens/step, all ranks) from which compute is the bottleneck; None if it already is."""
    flops_per_token: float
    """Training FLOPs per token (recompute included, frozen weights' gradients left out)."""
    compute_s_per_token: float
    adam_params: float
    """Parameters the rank's Adam updates."""


def step_time(cfg: LlamaConfig, hw: Hardware, po: Policy, moved: Traffic, chunks: RankChunks, *,
              params: int, trained_params: int, seq: int, rank_tokens: int) -> StepTime:
    """Time one step of ``po`` on ``hw`` (the rank's share) moving ``moved``; ``params`` and
    ``trained_params``: the model's parameters, all and trainable (elements)."""
    gpu, nvme_tier, world, k = hw.gpu_mem is not None, hw.nvme_capacity > 0, po.world, po.micro_batches
    bps = moved.bytes_per_step
    full_tok = flops_per_token(cfg, seq)
    # Frozen weights get no weight gradient: 2 of the 6 FLOPs per weight and token go.
    per_tok = full_tok - 2.0 * (params - trained_params)
    if po.activation_checkpointing:
        per_tok += full_tok / 3.0        # one more forward, and the forward is 1/3 of fwd + bwd
    rate = hw.compute_tflops * 1e12
    compute_per_tok = per_tok / rate
    nvme_s = opt_nvme_s = 0.0
    if (bps["nvme_read"] or bps["nvme_write"]) and nvme_tier:
        if hw.nvme_read_gbps <= 0 or hw.nvme_write_gbps <= 0:
            raise ConfigError("nvme_gbps", hw.nvme_read_gbps,
                              f"the plan moves {format_size(bps['nvme_read'] + bps['nvme_write'])} "
                              "through NVMe per step: an NVMe bandwidth > 0 is needed")
        nvme_s = bps["nvme_read"] / (hw.nvme_read_gbps * GB) + bps["nvme_write"] / (hw.nvme_write_gbps * GB)
        opt_nvme_s = moved.optimizer_nvme_read / (hw.nvme_read_gbps * GB) + \
            moved.optimizer_nvme / (hw.nvme_write_gbps * GB)
    # a rank updates its pieces (1/world of each trainable chunk, padding aside)
    adam_params = (trained_params * chunks.trained / chunks.all_trained if world > 1 and chunks.all_trained
                   else trained_params)
    coll = moved.collective
    net_s = (coll["all_gather"] + coll["reduce_scatter"]) / (hw.net_gbps * GB) if world > 1 else 0.0
    terms = {
        "compute": rank_tokens * compute_per_tok,
        "pcie": max(bps["pcie_h2d"], bps["pcie_d2h"]) / (hw.pcie_gbps * GB) if gpu else 0.0,
        "nvme": nvme_s,
        "adam": adam_params / hw.adam_params_per_s,
        "interconnect": net_s,
    }
    # One micro-batch's share of what runs beside compute (the optimizer's own NVMe traffic aside).
    per_micro = max(terms["compute"], terms["pcie"], nvme_s - opt_nvme_s, net_s) / k
    if gpu and not po.defer_step:
        # The update overlaps only the last micro-batch's backward (k = 1: max of the terms).
        predicted = (k - 1) * per_micro + max(terms["compute"] / k, terms["pcie"] / k, net_s / k,
                                              (nvme_s - opt_nvme_s) / k + opt_nvme_s, terms["adam"])
        bottleneck = max(terms, key=terms.get)
        others = max(terms["pcie"], terms["nvme"], terms["adam"], net_s)
        gpu_bound = None if bottleneck == "compute" else others / compute_per_tok
    elif gpu:
        # the optimizer (and its share of the disk) runs after the backward
        during = {"compute": terms["compute"], "pcie": terms["pcie"], "nvme": nvme_s - opt_nvme_s,
                  "interconnect": net_s}
        after = {"adam": terms["adam"], "nvme": opt_nvme_s}
        predicted = k * per_micro + max(after.values())
        parts = {"compute": terms["compute"], "pcie": terms["pcie"], "nvme": during["nvme"] + opt_nvme_s,
                 "adam": terms["adam"], "interconnect": net_s}
        bottleneck = max(parts, key=parts.get)
        others = max(during["pcie"], during["nvme"], net_s)
        gpu_bound = None if terms["compute"] >= others else others / compute_per_tok
    else:
        # one pair of cores runs the layers, Adam and the I/O path; store waits block the compute
        # thread. The collectives wait on the network from their own thread meanwhile.
        serial = terms["compute"] + terms["adam"] + terms["nvme"]
        predicted = max(serial, net_s)
        bottleneck = ("interconnect" if net_s > serial
                      else max(("compute", "adam", "nvme"), key=terms.get))
        # compute leads once it is the largest of the three
        lead = max(terms["adam"], terms["nvme"])
        gpu_bound = (None if bottleneck == "compute" else
                     max(lead, net_s - terms["adam"] - terms["nvme"]) / compute_per_tok)
    # (tokens of the whole step: each rank computes 1/world of them)
    gpu_bound_tokens = None if gpu_bound is None else world * max(seq, math.ceil(gpu_bound / seq) * seq)
    return StepTime(terms=terms, predicted=predicted, bottleneck=bottleneck, gpu_bound_tokens=gpu_bound_tokens,
                    flops_per_token=per_tok, compute_s_per_token=compute_per_tok, adam_params=adam_params)
