"""One rank of ``offload bench pipeline`` (``offload.bench.pipeline`` spawns them): each schedule's
stages timed step by step with their busy compute time, the same global batch under pure data
parallelism, and each stage's activation memory with pipeline-aware offload; the figures written
as JSON for the launcher to read.

Busy time is the time this rank spends inside its stages' ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk``: torch's schedules wait for the
activations and gradients they receive before calling them, so what is left of the step is the
bubble (and the sends and receives themselves). A stage's own data-parallel collectives run
inside its backward and count as busy.
"""

from __future__ import annotations

import datetime
import json
import os
import time

from ..config import OffloadConfig
from .workload import build_model

TIMEOUT_S = 600               # a rank that dies must not leave the others waiting for gloo's 30 min
TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class BusyClock:
    """Seconds spent inside the timed calls of the stages it is given (``TIMED``)."""

    def __init__(self):
        self.busy_s = 0.0

    def wrap(self, stage) -> None:
        # torch's schedules call these three for every compute action and offer no hook around
        # them: the stage's own bound methods are wrapped, per instance, for the bench's stages.
        for name in TIMED:
            method = getattr(stage, name)
            setattr(stage, name, self._timed(method))

    def _timed(self, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - started
        return timed

    def take(self) -> float:
        out, self.busy_s = self.busy_s, 0.0
        return out


def _config(spec: dict, rank: int, **extra) -> OffloadConfig:
    nvme = [os.path.join(spec["path"], f"rank{rank}")] if spec["nvme"] else None
    return OffloadConfig(device="cpu", dtype="fp32", device_budget=spec["device_budget"],
                         cpu_budget=spec["cpu_budget"], nvme_paths=nvme, optimizer_threads=spec["threads"],
                         **extra)


def _model(spec: dict):
    model, _ = build_model(spec["cfg"].replace(tie_embeddings=False), "cpu")
    return model.float()            # fp32: the CPU's native compute


def _drain(modules) -> None:
    for m in modules:
        m.offload_engine.chunks.drain(moves=True)


def _staged(spec: dict, schedule: str, rank: int, mesh, *, checkpointing: bool = False, **extra):
    import offload
    from ..pipeline import StagedModel, split_llama, stage_count

    model = _model(spec)
    model.gradient_checkpointing = checkpointing
    modules = split_llama(model, stage_count(schedule, spec["pp"]))
    rows, seq = spec["rows"], spec["seq"]
    staged = StagedModel(modules, schedule=schedule, micro_batches=spec["micro_batches"],
                         config=_config(spec, rank, **extra),
                         micro_batch=(rows // spec["dp"] // spec["micro_batches"], seq), mesh=mesh)
    return staged, offload.AdamW(list(staged.parameters()), lr=spec["lr"])


def _time_schedule(spec: dict, schedule: str, rank: int, mesh, ids) -> dict:
    """Step times and busy times of ``schedule`` on this rank (warmup steps first, untimed)."""
    import torch.distributed as dist

    staged, opt = _staged(spec, schedule, rank, mesh)
    clock = BusyClock()
    for stage in staged.stages:
        clock.wrap(stage)
    out = {"stages": staged.indices, "schedule_s": [], "busy_s": [], "step_s": []}
    for i in range(spec["warmup"] + spec["steps"]):
        dist.barrier()                  # every rank starts the step together
        clock.take()
        started = time.perf_counter()
        staged.step(ids if staged.has_first else None, ids if staged.has_last else None)
        scheduled = time.perf_counter()
        opt.step()
        opt.zero_grad()
        _drain(staged.modules)
        ended = time.perf_counter()
        if i >= spec["warmup"]:
            out["schedule_s"].append(scheduled - started)
            out["busy_s"].append(clock.take())
            out["step_s"].append(ended - started)
    for m in staged.modules:
        m.offload_engine.close()
    return out


# What each memory run parks: nothing (an area smaller than any layer input: every one stays on
# the device, counted by the same store), or everything in the area in either backward order.
MEMORY_RUNS = {"without_offload": dict(activation_budget=4096),
               "reverse_order": dict(activation_backward_order="reverse"),
               "pipeline_aware": dict(activation_backward_order="micro-batches")}


def _activation_memory(spec: dict, schedule: str, rank: int, mesh, ids) -> list[dict]:
    """Each of this rank's stages, recomputing its layers: the most bytes of saved tensors it kept
    on the device at once (``resident_peak`` of its activation store) in each of ``MEMORY_RUNS``,
    measured in the second step (the first records the trace)."""
    import warnings

    import torch.distributed as dist

    out = {}
    for run, extra in MEMORY_RUNS.items():
        extra = {"activation_budget": spec["activation_budget"], **extra}
        staged, opt = _staged(spec, schedule, rank, mesh, checkpointing=True, activation_offload="cpu", **extra)
        with warnings.catch_warnings():
            # "parked nothing" is the point of the run without offload
            warnings.filterwarnings("ignore", message="activation_offload=.* parked nothing", category=RuntimeWarning)
            for _ in range(2):
                dist.barrier()
                for m in staged.modules:
                    m.offload_stats()           # statistics are per step: start the step's afresh
                staged.step(ids if staged.has_first else None, ids if staged.has_last else None)
                opt.step()
                opt.zero_grad()
                _drain(staged.modules)
            for s, m in zip(staged.indices, staged.modules):
                act = m.offload_stats()["activations"]
                row = out.setdefault(s, {"stage": s})
                row[f"{run}_bytes"] = act["resident_peak"]
                if run == "pipeline_aware":
                    row["parked_peak_bytes"] = act["area_peak"]
        for m in staged.modules:
            m.offload_engine.close()
    return list(out.values())


def _time_data_parallel(spec: dict, rank: int, world: int, ids) -> list[float]:
    """The whole model on every rank (offload.wrap over the default group), each rank its rows of
    the same global batch in one pass: step times (warmup steps first, untimed)."""
    import torch.distributed as dist

    import offload
    from ..pipeline import causal_lm_loss

    model = offload.wrap(_model(spec), _config(spec, rank))
    opt = offload.AdamW(model.parameters(), lr=spec["lr"])
    per = spec["rows"] // world
    mine = ids[rank * per:(rank + 1) * per]
    loss_fn = causal_lm_loss(1)
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        dist.barrier()
        started = time.perf_counter()
        loss_fn(model(mine).logits, mine).backward()
        opt.step()
        opt.zero_grad()
        _drain([model])
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - started)
    model.offload_engine.close()
    return times


def run_rank(rank: int, world: int, port: int, spec: dict, outdir: str) -> None:
    """One rank: every schedule of ``spec["schedules"]`` timed, the activation memory of
    ``spec["memory_schedules"]``, then pure data parallelism; writes ``outdir``/rank<r>.json."""
    import torch
    import torch.distributed as dist

    from ..pipeline import pipeline_mesh

    torch.set_num_threads(spec["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        mesh = pipeline_mesh(spec["pp"], spec["dp"])
        d = mesh["dp"].get_local_rank()
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, spec["cfg"].vocab_size, (spec["rows"], spec["seq"]), generator=gen)
        local = ids[d::spec["dp"]].contiguous()         # this data-parallel rank's rows
        out = {"rank": rank, "pp_rank": mesh["pp"].get_local_rank(), "dp_rank": d, "schedules": {},
               "activations": {}}
        for schedule in spec["schedules"]:
            out["schedules"][schedule] = _time_schedule(spec, schedule, rank, mesh, local)
        for schedule in spec["memory_schedules"]:
            out["activations"][schedule] = _activation_memory(spec, schedule, rank, mesh, local)
        out["data_parallel_s"] = _time_data_parallel(spec, rank, world, ids)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
            json.dump(out, fh)
    finally:
        dist.destroy_process_group()
