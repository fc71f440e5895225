"""``offload plan --boxes B --gpus-per-box G``: the cluster's flags, checked (each error names its
flag), and the cluster plan printed (``cluster_report``) or written as JSON; exit 1 when nothing fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..errors import ConfigError
from ..models.llama import param_count
from .cluster import choose_cluster
from .cluster_report import cluster_json, format_cluster
from .flags import positive_flag, positive_int_flag
from .inputs import Hardware, Policy
from .model import resolve_model
from .schedule_theory import runnable
from .stage_layout import ASSUMED_INTER_BOX_GBPS, ASSUMED_INTRA_BOX_GBPS, Cluster

__all__ = ["cluster_flags", "run_cluster"]

DEFAULT_GPUS_PER_BOX = 8
CLUSTER_ONLY = ("gpus_per_box", "inter_box_gbps", "intra_box_gbps", "pp", "schedule")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def cluster_flags(args: argparse.Namespace) -> Cluster | None:
    """The cluster ``--boxes`` describes (None without it), its flags checked against the others."""
    boxes = positive_int_flag(getattr(args, "boxes", None), "--boxes")
    if boxes is None:
        for name in CLUSTER_ONLY:
            if getattr(args, name, None) is not None:
                raise ConfigError(_flag(name), getattr(args, name), "plans a cluster: give --boxes as well")
        return None
    for name, default in (("world", 1), ("local_world", None), ("net_gbps", None), ("lora_rank", None)):
        value = getattr(args, name, default)
        if value != default:
            raise ConfigError(_flag(name), value, "does not go with --boxes: the cluster planner lays out the ranks "
                                                  "itself (pp x dp over --boxes x --gpus-per-box) and takes its links "
                                                  "from --inter-box-gbps and --intra-box-gbps; full fine-tunes only")
    if Path(args.model).is_dir():
        raise ConfigError("--model", args.model, "with --boxes: give a preset (stages are cut by its layers)")
    gpus = positive_int_flag(getattr(args, "gpus_per_box", None), "--gpus-per-box") or DEFAULT_GPUS_PER_BOX
    cluster = Cluster(boxes=boxes, gpus_per_box=gpus,
                      inter_box_gbps=positive_flag(args.inter_box_gbps, "--inter-box-gbps") or ASSUMED_INTER_BOX_GBPS,
                      intra_box_gbps=positive_flag(args.intra_box_gbps, "--intra-box-gbps") or ASSUMED_INTRA_BOX_GBPS)
    pp = positive_int_flag(getattr(args, "pp", None), "--pp")
    if pp is not None and cluster.ranks % pp:
        raise ConfigError("--pp", pp, f"must divide the cluster's {cluster.ranks} GPUs (--boxes {boxes} x "
                                      f"--gpus-per-box {gpus})")
    m, schedule = getattr(args, "micro_batches", None), getattr(args, "schedule", None)
    if pp is not None and schedule and m is not None and not runnable(schedule, pp, m):
        # Said here rather than as "no pipeline fits": nothing was planned, nothing was too big.
        raise ConfigError("--micro-batches", m, f"cannot run --schedule {schedule} over --pp {pp} (torch's "
                                                "schedule refuses it: 1F1B wants at least P micro-batches, the "
                                                "interleaved ones whole rounds of P)")
    return cluster


def run_cluster(args: argparse.Namespace, cluster: Cluster, hardware: Hardware, policy: Policy,
                notes: list[str]) -> int:
    """Choose pp x dp x micro-batches x schedule for ``cluster`` of boxes like ``hardware``; print it."""
    if hardware.gpu_mem is None:
        raise ConfigError("--gpu-mem", None, "a cluster plan is for boxes of GPUs: give --gpu-mem and --gpu-tflops")
    choice = choose_cluster(args.model, hardware, policy, cluster,
                            pps=None if args.pp is None else [args.pp],
                            schedules=None if args.schedule is None else [args.schedule],
                            micro_batches=None if args.micro_batches is None else [args.micro_batches])
    label, cfg = resolve_model(args.model)
    data = {"model": label, "params": param_count(cfg), "policy": dataclasses.asdict(policy),
            "hardware": dataclasses.asdict(hardware), **cluster_json(choice)}
    if args.json == "-":
        print(json.dumps(data, indent=2))
    else:
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(format_cluster(choice, label, data["params"], data["policy"], data["hardware"]))
        if args.json:
            try:
                Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
            except OSError as exc:
                raise ConfigError("--json", args.json, f"cannot be written: {exc.strerror}") from exc
    if choice.best is None:
        print(f"offload plan: refused: {data['verdict']}", file=sys.stderr)
        return 1
    return 0
