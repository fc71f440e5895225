"""``offload bench step --nproc N``: data parallelism over torch.distributed, measured in one run.

N processes (spawned; gloo on the CPU, NCCL with ``--device cuda``, one GPU per rank) each build
the same preset model (same seed) and take their 1/N of the same global batch (``--batch-tokens``,
split by sequences). Each rank trains it two ways, alternating samples (the machine drifts):

* **ours**: ``offload.wrap`` + ``offload.AdamW``, which slices every chunk across the ranks
  (ZeRO-3: each chunk all-gathered from the ranks' pieces for forward and again for backward,
  its gradients reduce-scattered back into the pieces). In memory by default (budgets above the state, no
  NVMe: FSDP2 is in memory too); ``--cpu-budget``/``--device-budget`` apply per rank and then put
  the rest on NVMe under ``--path``/rank<r>.
* **FSDP2**, the reference a PyTorch user would pick: ``torch.distributed.fsdp.fully_shard`` on
  each decoder layer and on the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``
  over fp32 parameters (the same bf16 values), ``torch.optim.AdamW`` on the fp32 shards, everything
  in memory.

A sample is two steps back to back (``offload.bench.step``'s rule: ours is timed until its queued
updates have finished); a sample's time is that of the slowest rank (a step of the group ends when
its last rank's does). Before that, ours runs alone in one process on the whole global batch (no
process group): ``step N/1`` = ours' step time at N ranks over that one, on the same global batch.
On a CPU the N ranks share the cores (each gets cores/N threads): that ratio is contended, reported
with no target.

Collective bytes are counted the same way for both systems, by ``offload.bench.collectives``
(ring accounting per rank, from the methods of ``ProcessGroup`` that every collective ends in),
and set against the ZeRO-3 figure ``3 x params x 2 B (bf16) x (N-1)/N`` per rank per step. FSDP2
keeps its root's parameters (embeddings, final norm) gathered from forward into backward, so it
sits slightly under that figure; ours must not move more than FSDP2. The bytes are also split by
phase (forward, backward, optimizer step: where a system re-gathers shows up there). The engine's
own ``offload_stats()["collectives"]``, summed over each sample's steps, is checked against the
counter sample by sample (``engine_agrees``). The chunk size is ``dp_chunk_size``'s (several
chunks, so that gathers and reductions overlap compute), the same at N=1 and N; the figures do
not fail the command.

This module checks the arguments, launches the ranks and collects their figures; one rank's work
is ``offload.bench.distributed_rank``'s, the figures summed over ranks, compared and printed are
``offload.bench.distributed_report``'s.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from ..config import parse_bytes
from ..errors import ConfigError
from .collectives import zero3_bytes
from .distributed_rank import run_rank
from .distributed_report import compare, engine_agrees, print_report, summarize
from .spawn import spawn_ranks
from .workload import BYTES_PER_PARAM, STEPS_PER_SAMPLE, build_model

CHUNKS_FOR_OVERLAP = 8        # the bench's chunk size cuts the model into at least this many chunks
COMPUTE_ITEMSIZE = 2          # bf16
__all__ = ["measure", "print_report", "summarize", "engine_agrees", "dp_chunk_size"]


def dp_chunk_size(numels: list[int]) -> int:
    """Elements per chunk for the data-parallel run: the least wasteful size (the engine's own
    search) no larger than 1/CHUNKS_FOR_OVERLAP of the model, unless one parameter is larger.

    "auto" sizes chunks by the budgets, which for the bench's small models in large budgets is
    one chunk: nothing to overlap. The size does not depend on the number of ranks (every rank
    keeps a piece of every chunk); the same size serves the N=1 run, so both train one layout."""
    from ..chunks import search_chunk_size

    cap = max(max(numels), sum(numels) // CHUNKS_FOR_OVERLAP)
    return search_chunk_size(numels, max_chunk=cap)


def parse_chunk_size(text) -> int | str:
    """``--chunk-size``: "auto" or a positive multiple of the engine's chunk quantum (elements)."""
    from ..config import CHUNK_QUANTUM

    if text is None or str(text).strip().lower() == "auto":
        return "auto"
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError("--chunk-size", text, "must be 'auto' or a number of elements") from None
    if value <= 0 or value % CHUNK_QUANTUM:
        raise ConfigError("--chunk-size", value, f"must be a positive multiple of {CHUNK_QUANTUM} elements")
    return value


def check_nproc(nproc) -> int:
    """``nproc`` when it is a usable number of ranks; ConfigError naming --nproc otherwise."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError("--nproc", nproc, "must be an integer >= 1 (processes, one rank each)")
    return nproc


def check_args(nproc, batch_tokens: int, max_seq_len: int, device: str) -> tuple[int, int]:
    """(rows, seq) of the global batch; ConfigError naming the field when it cannot be split."""
    check_nproc(nproc)
    seq = min(batch_tokens, max_seq_len)
    rows = max(1, batch_tokens // seq)
    if rows % nproc:
        raise ConfigError("--batch-tokens", batch_tokens,
                          f"makes {rows} sequence(s) of {seq} tokens, which {nproc} ranks cannot share "
                          f"equally: use a multiple of {seq * nproc}")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < nproc:
            raise ConfigError("--nproc", nproc, f"needs one GPU per rank; this machine has "
                                                f"{torch.cuda.device_count()}")
    return rows, seq


def _spawn(world: int, spec: dict) -> list[dict]:
    """Run ``world`` ranks to completion; their results, by rank. A rank's failure is a BenchStepError."""
    return spawn_ranks(run_rank, world, spec, prefix=".offload-bench-dp-")


def measure(path: str | os.PathLike = "./offload-nvme", nproc: int = 2, preset="tiny", steps: int = 10,
            warmup: int = 3, batch_tokens: int = 512, cpu_budget=None, device_budget=None,
            device: str = "auto", lr: float = 1e-4, fsdp: bool = True, single: bool = True,
            chunk_size="auto", quiet: bool = True) -> dict:
    """Run the data-parallel benchmark; returns the JSON dict described in the module doc.

    ``preset`` is a preset name or an ``offload.models.llama.LlamaConfig``. ``path`` must exist
    (used only when budgets put state on NVMe). ``single=False`` skips the one-process run.
    ``chunk_size`` (elements) "auto" is ``dp_chunk_size``'s, not the engine's "auto".
    """
    import torch

    from ..models.llama import LlamaConfig, get_preset
    from ..native import physical_cores

    for name, value in (("steps", steps), ("warmup", warmup), ("batch_tokens", batch_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "must be an integer >= 1")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError("device", device, "must be auto, cpu or cuda")
    cfg = preset if isinstance(preset, LlamaConfig) else get_preset(preset)
    rows, seq = check_args(nproc, batch_tokens, cfg.max_seq_len, device)
    path = os.path.abspath(os.fspath(path))

    from ..chunks import ChunkLayout

    model, _ = build_model(cfg, "cpu")
    numels = [p.numel() for p in model.parameters()]
    params = sum(numels)
    chunk = chunk_size if chunk_size != "auto" else dp_chunk_size(numels)
    # what whole-chunk collectives carry beyond the parameters (packing gaps, the last chunk's tail)
    layout = ChunkLayout.build([(n, p.shape) for n, p in model.named_parameters()], chunk)
    padding = sum(layout.sizes) / params - 1
    del model
    state = BYTES_PER_PARAM * params
    nvme = cpu_budget is not None or device_budget is not None
    big = 2 * state + (256 << 20)
    cpu_b = parse_bytes(cpu_budget, "--cpu-budget") if cpu_budget is not None else big
    dev_b = parse_bytes(device_budget, "--device-budget") if device_budget is not None else \
        (cpu_b // 2 if nvme else big)
    cores = physical_cores()
    spec = {"cfg": cfg, "device": device, "batch_tokens": batch_tokens, "rows": rows, "steps": steps,
            "warmup": warmup, "lr": lr, "cpu_budget": cpu_b, "device_budget": dev_b, "nvme": nvme,
            "fsdp": fsdp, "chunk_size": chunk}
    if nvme and not os.path.isdir(path):
        raise ConfigError("path", path, "is not a directory")
    work = tempfile.mkdtemp(prefix=".offload-bench-dp-", dir=path) if nvme else path
    name = preset if isinstance(preset, str) else "custom"
    try:
        single_r = None
        if single:
            _say(f"{name}: {params / 1e6:.1f}M params; ours alone, 1 process x {cores} threads, "
                 f"{rows * seq} tokens/step: {warmup} + {steps} samples", quiet)
            single_r = _spawn(1, {**spec, "path": work, "threads": cores, "fsdp": False})
        threads = max(1, cores // nproc)
        _say(f"{nproc} ranks x {threads} thread(s), {rows * seq // nproc} tokens each: ours"
             f"{' and FSDP2 alternating' if fsdp else ''}, {warmup} + {steps} samples", quiet)
        dp = _spawn(nproc, {**spec, "path": work, "threads": threads})
    finally:
        if nvme:
            shutil.rmtree(work, ignore_errors=True)

    ours, theirs = summarize(dp, "ours"), summarize(dp, "fsdp2")
    one = summarize(single_r, "ours") if single_r else None
    zero3 = zero3_bytes(params, COMPUTE_ITEMSIZE, nproc)
    return {
        "device": device, "nproc": nproc, "backend": "nccl" if device == "cuda" else "gloo",
        "params": params, "compute_dtype": "bf16", "global_batch_tokens": rows * seq,
        "threads_per_rank": threads, "threads_single": cores,
        "zero3_bytes_per_rank": zero3,
        "ours": ours, "fsdp2": theirs, "single": one,
        **compare(ours, theirs, one, zero3),
        "run": {"preset": name, "steps": steps, "warmup": warmup, "steps_per_sample": STEPS_PER_SAMPLE,
                "cpu_budget": cpu_b, "device_budget": dev_b, "nvme": nvme, "chunk_size": chunk,
                "chunks": layout.num_chunks, "chunk_padding": round(padding, 4)},
    }


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[bench step --nproc] {msg}", file=sys.stderr, flush=True)
