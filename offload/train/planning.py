"""The planner's view of a run, before anything is allocated: does it fit, how fast, which way.

Rank 0 measures the box (``hardware``) and plans one rank's share of it (``make_plan``); every rank
follows that plan, because the chunk layout depends on the budgets and all ranks must lay out the
same chunks (``shared_budgets`` makes "auto" budgets bytes once, for the same reason).
"""

from __future__ import annotations

import dataclasses

from .config import TrainConfig
from .inputs import rank_paths
from .ranks import Ranks


def hardware(config: TrainConfig, shape, ranks: Ranks):
    """(Hardware, sources, notes): the box's figures for this rank's NVMe paths, measured here
    once and then read from the planner's cache (a second launch measures nothing)."""
    from ..plan.figures import hardware_for

    return hardware_for(rank_paths(config, ranks), model=shape, dtype=config.model.dtype,
                        seq_len=config.data.seq_len, batch_tokens=config.data.batch_tokens)


def make_plan(config: TrainConfig, cfg, engine_config, described=None, ranks: Ranks = Ranks()):
    """Run the planner on this box for one rank's share of it; returns (plan, sources, notes).
    ``cfg``: the model's shape; ``engine_config``: the OffloadConfig the run will build with."""
    from ..plan import Policy, choose

    hw, sources, notes = hardware(config, cfg, ranks)
    if ranks.many and hw.gpu_mem is None and sources.get("compute_tflops", "").startswith("measured"):
        # The planner takes the box's figures and gives each rank 1/local_world. A CPU-only rank
        # computes with its own threads (torchrun: OMP_NUM_THREADS=1), as measured here: the box
        # runs local_world of them at once.
        import torch

        hw = dataclasses.replace(hw, compute_tflops=hw.compute_tflops * ranks.local_world)
        sources["compute_tflops"] += f", {torch.get_num_threads()} thread(s) a rank x {ranks.local_world} ranks"
    d = config.data
    policy = Policy(batch_tokens=d.batch_tokens, seq_len=d.seq_len, dtype=config.model.dtype,
                    activation_checkpointing=not config.model.no_checkpointing,
                    device_budget=None if engine_config.device_budget == "auto" else int(engine_config.device_budget),
                    cpu_budget=None if engine_config.cpu_budget == "auto" else int(engine_config.cpu_budget),
                    # --chunk-size, or a resumed checkpoint's: the layout the engine will build.
                    chunk_size=None if engine_config.chunk_size == "auto" else int(engine_config.chunk_size),
                    defer_step=config.optimizer.max_grad_norm is not None,
                    optimizer_state=config.optimizer.state, master=config.optimizer.master,
                    world=ranks.world, local_world=ranks.local_world)
    # The planner chooses where activations wait, the device budget, and how many passes a step
    # takes (among those that split each rank's sequences evenly).
    rows = d.batch_tokens // min(d.seq_len, cfg.max_seq_len) // ranks.world
    given = config.parallel.micro_batches
    micro = [given] if given else [k for k in range(1, rows + 1) if rows % k == 0]
    if described is not None:
        choice = choose(described.shape, hw, policy, micro_batches=micro, name=described.name,
                        params=described.params)
    else:
        choice = choose(cfg, hw, policy, micro_batches=micro, name=config.run_name)
    return choice.best or choice.given, sources, notes


def decide(config: TrainConfig, cfg, engine_config, described, ranks: Ranks) -> dict:
    """Rank 0's plan as plain data every rank can receive: its text, whether it fits (and why
    not), the predicted step time, the chosen policy and the budgets it assumed."""
    from ..plan import format_plan

    result, sources, _ = make_plan(config, cfg, engine_config, described, ranks)
    return {"text": format_plan(result, sources), "fits": result.fits, "reason": result.reason,
            "predicted": result.predicted_step_s, "policy": result.policy,
            "budgets": (result.breakdown["device_budget"], result.breakdown["cpu_budget"])}


def shared_budgets(engine_config, ranks: Ranks):
    """``engine_config`` with "auto" budgets turned into bytes once, by rank 0, for one rank's share
    of the host (the ranks on it split its RAM; each has a GPU of its own): every rank then lays
    out the same chunks, and N ranks do not each take the engine's share of the whole host."""
    if not ranks.many or (engine_config.device_budget != "auto" and engine_config.cpu_budget != "auto"):
        return engine_config
    budgets = None
    if ranks.lead:
        from ..tiers.budgets import compute_device, resolve_budgets

        device = compute_device(engine_config)
        device_budget, cpu_budget, _ = resolve_budgets(engine_config, device)
        if engine_config.device_budget == "auto" and device.type == "cpu":
            device_budget //= ranks.local_world
        if engine_config.cpu_budget == "auto":
            cpu_budget //= ranks.local_world
        budgets = (device_budget, cpu_budget)
    device_budget, cpu_budget = ranks.broadcast(budgets)
    return engine_config.replace(device_budget=device_budget, cpu_budget=cpu_budget)
