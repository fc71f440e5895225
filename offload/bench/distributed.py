"""``offload bench step --nproc N``: data parallelism over torch.distributed, measured in one run.

N processes (spawned; gloo on the CPU, NCCL with ``--device cuda``, one GPU per rank) each build
the same preset model (same seed) and take their 1/N of the same global batch (``--batch-tokens``,
split by sequences). Each rank trains it two ways, alternating samples (the machine drifts):

* **ours**: ``offload.wrap`` + ``offload.AdamW``, which shards the chunks across the ranks
  (ZeRO-3: parameters all-gathered per communication group for forward and again for backward,
  gradients reduce-scattered to their owners). In memory by default (budgets above the state, no
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
counter sample by sample (``engine_agrees``). The chunk size is ``dp_chunk_size``'s (each rank
owns several chunks), the same at N=1 and N; the figures do not fail the command.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import sys
import tempfile
import time

from ..config import OffloadConfig, parse_bytes
from ..errors import ConfigError, OffloadError
from .collectives import CollectiveCounter, zero3_bytes
from .distributed_report import _ratio, engine_agrees, print_report, summarize

STEPS_PER_SAMPLE = 2
GROUPS_PER_RANK = 4           # the bench's chunk size leaves each rank at least this many chunks
COMPUTE_ITEMSIZE = 2          # bf16
__all__ = ["measure", "print_report", "summarize", "engine_agrees", "dp_chunk_size"]
TIMEOUT_S = 600               # a rank that dies must not leave the others waiting for gloo's 30 min


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_rows(rows: int, world: int, rank: int) -> slice:
    """The rows of a global batch of ``rows`` sequences that rank ``rank`` of ``world`` takes."""
    per = rows // world
    return slice(rank * per, (rank + 1) * per)


def dp_chunk_size(numels: list[int], world: int) -> int:
    """Elements per chunk for the data-parallel run: the least wasteful size (the engine's own
    search) no larger than 1/(GROUPS_PER_RANK * N) of the model, unless one parameter is larger.

    "auto" sizes chunks by the budgets alone, and with budgets above a small model's state that
    is one chunk: one rank would own it all and the others only receive broadcasts. The same
    size serves the N=1 run, so both train the same layout."""
    from ..chunks import search_chunk_size

    cap = max(max(numels), sum(numels) // (GROUPS_PER_RANK * world))
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


# ---- one rank ---------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class _Phases:
    """Bytes sent per phase of a step (forward, backward, optimizer step): where a system's
    collectives happen, read off the counter between the phases (a lock and a dict copy each)."""

    def __init__(self, counter: CollectiveCounter):
        self.counter = counter
        self.sent = {"forward": 0, "backward": 0, "step": 0}
        self._last = counter.snapshot()["sent_bytes"]

    def mark(self, phase: str) -> None:
        now = self.counter.snapshot()["sent_bytes"]
        self.sent[phase] += now - self._last
        self._last = now


def _sample(kind: str, model, opt, ids, device: str, counter: CollectiveCounter,
            n: int = STEPS_PER_SAMPLE) -> tuple[float, list, dict, dict | None]:
    """``n`` steps back to back: (seconds per step, the losses, bytes sent per step by phase, the
    engine's own ``collectives`` summed over the steps and divided by ``n`` — ours only). Ours
    is timed until its queued updates and their writes have finished (``offload.bench.step``);
    reading the engine's statistics is taken off the clock."""
    _sync(device)
    phases = _Phases(counter)
    engine = {"sent_bytes": 0, "received_bytes": 0, "ops": 0, "by_op": {}} if kind == "ours" else None
    off_clock = 0.0
    t0 = time.perf_counter()
    losses = []
    for _ in range(n):
        phases.mark("step")               # the previous step's optimizer step and zero_grad
        loss = model(ids, labels=ids).loss
        phases.mark("forward")
        loss.backward()
        phases.mark("backward")
        opt.step()
        if kind == "ours":
            t = time.perf_counter()
            _add_stats(engine, model.offload_stats().get("collectives"))
            off_clock += time.perf_counter() - t
            opt.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if kind == "ours":
        model.offload_engine.adam.drain()
        model.offload_engine.store.wait_idle()
    _sync(device)
    seconds = (time.perf_counter() - t0 - off_clock) / n
    phases.mark("step")
    if engine is not None:
        engine = _per_step(engine, n) if engine["ops"] else None
    return seconds, [float(x) for x in losses], {k: v // n for k, v in phases.sent.items()}, engine


def _add_stats(total: dict, step: dict | None) -> None:
    if not step:
        return
    for key in ("sent_bytes", "received_bytes", "ops"):
        total[key] += int(step.get(key, 0))
    for op, nbytes in (step.get("by_op") or {}).items():
        total["by_op"][op] = total["by_op"].get(op, 0) + int(nbytes)


def _build_ours(spec: dict, rank: int):
    import offload

    from .step import _build

    model, _ = _build(spec["cfg"], spec["device"])
    model = model.cpu() if spec["device"] == "cuda" else model
    nvme = [os.path.join(spec["path"], "rank{rank}")] if spec["nvme"] else None
    config = OffloadConfig(device=spec["device"], dtype="bf16", device_budget=spec["device_budget"],
                           cpu_budget=spec["cpu_budget"], nvme_paths=nvme,
                           optimizer_threads=spec["threads"], chunk_size=spec["chunk_size"])
    model = offload.wrap(model, config)
    return model, offload.AdamW(model.parameters(), lr=spec["lr"])


def _build_fsdp(spec: dict, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .step import _build

    model, _ = _build(spec["cfg"], spec["device"])     # the same bf16 values ours starts from
    model = model.float()
    mesh = init_device_mesh(spec["device"], (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=spec["lr"])


def _worker(rank: int, world: int, port: int, spec: dict, outdir: str) -> None:
    """One rank of a phase: world == 1 runs ours alone, without a process group."""
    import torch
    import torch.distributed as dist

    from .step import _batch

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        ids = _batch(spec["cfg"], spec["batch_tokens"], device)[split_rows(spec["rows"], world, rank)]
        out = {"rank": rank, "world": world, "local_tokens": int(ids.numel()), "ours": {}, "fsdp2": None}
        with CollectiveCounter() as counter:
            systems = {}
            try:
                systems["ours"] = _build_ours(spec, rank)
            except OffloadError as exc:
                # the core refuses (or cannot shard) under this group: report it, keep FSDP2's figures
                out["ours"] = {"error": f"{type(exc).__name__}: {exc}"}
            if world > 1 and spec["fsdp"]:
                systems["fsdp2"] = _build_fsdp(spec, world)
            for name in systems:
                out[name] = {"step_times_s": [], "collectives": [], "losses": [], "engine_collectives": []}
            names = list(systems)
            for _ in range(spec["warmup"]):
                for name in names:
                    model, opt = systems[name]
                    out[name]["losses"] += _sample(name, model, opt, ids, device, counter, 1)[1]
            for i in range(spec["steps"]):
                for name in (names if i % 2 == 0 else names[::-1]):   # alternate who goes first
                    model, opt = systems[name]
                    before = counter.snapshot()
                    seconds, losses, phases, engine = _sample(name, model, opt, ids, device, counter)
                    per_step = _per_step(CollectiveCounter.since(counter.snapshot(), before))
                    per_step["by_phase"] = phases
                    r = out[name]
                    r["step_times_s"].append(seconds)
                    r["collectives"].append(per_step)
                    r["losses"] += losses
                    if name == "ours":
                        r["engine_collectives"].append(engine)
            if "ours" in systems:
                out["ours"]["layout"] = {k: v for k, v in systems["ours"][0].offload_stats().get("layout", {}).items()
                                         if k in ("chunks", "chunk_size")}
                systems["ours"][0].offload_engine.close()
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
            json.dump(out, fh)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _per_step(delta: dict, n: int = STEPS_PER_SAMPLE) -> dict:
    out = {"sent_bytes": delta["sent_bytes"] // n, "received_bytes": delta["received_bytes"] // n,
           "ops": delta["ops"] // n, "by_op": {k: v // n for k, v in delta["by_op"].items()}}
    if "by_op_received" in delta:
        out["by_op_received"] = {k: v // n for k, v in delta["by_op_received"].items()}
    return out


def _spawn(world: int, spec: dict) -> list[dict]:
    """Run ``world`` ranks to completion; their results, by rank. A rank's failure is a BenchStepError."""
    import torch.multiprocessing as mp

    from .step import BenchStepError

    outdir = tempfile.mkdtemp(prefix=".offload-bench-dp-")
    try:
        try:
            mp.start_processes(_worker, args=(world, _free_port(), spec, outdir), nprocs=world,
                               join=True, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise BenchStepError(f"rank {exc.error_index} of {world} failed: {last}") from None
        except mp.ProcessExitedException as exc:
            raise BenchStepError(f"rank {exc.error_index} of {world} exited with code {exc.exit_code}") from None
        results = []
        for r in range(world):
            with open(os.path.join(outdir, f"rank{r}.json")) as fh:
                results.append(json.load(fh))
        return results
    finally:
        shutil.rmtree(outdir, ignore_errors=True)



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
    from .step import BYTES_PER_PARAM, _build

    model, _ = _build(cfg, "cpu")
    numels = [p.numel() for p in model.parameters()]
    params = sum(numels)
    chunk = chunk_size if chunk_size != "auto" else dp_chunk_size(numels, nproc)
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
    ok = ours and not ours.get("error")
    # a system's volume: the most any rank sends or receives in a step
    ours_sent = ours["volume_bytes"] if ok else None
    fsdp_sent = theirs["volume_bytes"] if theirs and not theirs.get("error") else None
    return {
        "device": device, "nproc": nproc, "backend": "nccl" if device == "cuda" else "gloo",
        "params": params, "compute_dtype": "bf16", "global_batch_tokens": rows * seq,
        "threads_per_rank": threads, "threads_single": cores,
        "zero3_bytes_per_rank": zero3,
        "ours": ours, "fsdp2": theirs, "single": one,
        "ours_over_zero3": _ratio(ours_sent, zero3),
        "fsdp2_over_zero3": _ratio(fsdp_sent, zero3),
        "ours_over_fsdp2_bytes": _ratio(ours_sent, fsdp_sent),
        "ours_exceeds_fsdp2": None if ours_sent is None or fsdp_sent is None else ours_sent > fsdp_sent,
        "step_n_over_1": _ratio(ours["step_s"] if ok else None, one and one.get("step_s")),
        "ours_over_fsdp2_time": _ratio(ours["step_s"] if ok else None, theirs and theirs["step_s"]),
        "run": {"preset": name, "steps": steps, "warmup": warmup, "steps_per_sample": STEPS_PER_SAMPLE,
                "cpu_budget": cpu_b, "device_budget": dev_b, "nvme": nvme, "chunk_size": chunk,
                "chunks": layout.num_chunks, "chunk_padding": round(padding, 4)},
    }


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[bench step --nproc] {msg}", file=sys.stderr, flush=True)

