"""What ``offload plan --boxes B --gpus-per-box G`` prints: per pipeline size the best way found, the
chosen one, and when pipelining beats sliced data parallelism over every GPU and why
(``format_cluster``); and the same as JSON (``cluster_json``)."""

from __future__ import annotations

from ..units import format_size
from .cluster import Candidate, ClusterChoice
from .report import seconds


def _way(c: Candidate) -> str:
    parked = {"none": "", "cpu": ", parked", "nvme": ", parked+NVMe"}[c.activation_offload]
    if c.pp == 1:
        return f"data parallel, {c.micro_batches} micro-batch{'es' if c.micro_batches > 1 else ''}{parked}"
    return f"{c.schedule}, {c.micro_batches} micro-batches{parked}"


def _memory(c: Candidate) -> str:
    if not c.rank_plans:
        return "-"
    m = c.rank_memory
    return " / ".join(format_size(m[t]) if m[t] else "-" for t in ("device", "cpu", "nvme"))


def _bound(c: Candidate) -> str:
    return {"bubble": "compute + bubble", "p2p": "stage sends"}.get(c.bottleneck, c.bottleneck)


def why(choice: ClusterChoice) -> str:
    """When pipelining beats data parallelism over all the GPUs, and why (or why not)."""
    best, dp, cl = choice.best, choice.data_parallel, choice.cluster
    n = cl.ranks
    if best is None:
        return "nothing fits: " + (dp.reason if not choice.by_pp else
                                   "; ".join(f"pp={pp}: {c.reason.split(';')[0]}" for pp, c in choice.by_pp.items()))
    coll = dp.rank_plans[0].breakdown.get("collective_bytes") if dp.rank_plans else None
    dp_moves = (f" (each rank all-gathers {format_size(coll['all_gather'])} and reduce-scatters "
                f"{format_size(coll['reduce_scatter'])} a step, the whole model's chunks, over "
                f"{'the links between boxes' if dp.dp_crosses_boxes else 'the links within the box'})") if coll else ""
    if best.pp == 1:
        piped = [c for pp, c in choice.by_pp.items() if pp > 1 and c.fits]
        lead = f"data parallelism over all {n} GPUs is fastest: {seconds(dp.step_s)} a step, bound by {dp.bottleneck}"
        if not piped:
            return lead + "; no pipeline fits"
        other = min(piped, key=lambda c: c.step_s)
        return (f"{lead}; the fastest pipeline, pp={other.pp} x dp={other.dp} ({_way(other)}), takes "
                f"{seconds(other.step_s)}, bound by {_bound(other)}: a pipeline adds its bubble ({other.bubble:.0%} "
                "there) and runs its micro-batches as gradient accumulation (the engine reduce-scatters every "
                "micro-batch's gradients and re-streams the stage's chunks that do not stay on the GPU)")
    gain = (f"{dp.step_s / best.step_s:.2f}x faster than data parallelism over all {n} GPUs "
            f"({seconds(dp.step_s)}, bound by {dp.bottleneck}{dp_moves})" if dp.fits else
            f"data parallelism over all {n} GPUs does not fit: {dp.reason}")
    link = "within a box" if not best.dp_crosses_boxes else "between boxes"
    mesh = "the dp ranks side by side" if best.order == "dp-inner" else "the stages side by side"
    return (f"pipelining wins: pp={best.pp} x dp={best.dp} ({mesh}), {_way(best)}, {seconds(best.step_s)} a step, "
            f"{gain}; each stage's dp collectives carry 1/{best.pp} of the model {link}, and only "
            f"{format_size(best.act_bytes)} of activations a rank cross between stages"
            f"{' (between boxes)' if best.act_crosses_boxes else ''}, at a bubble of {best.bubble:.1%}")


def format_cluster(choice: ClusterChoice, model: str, params: int, policy: dict, hardware: dict) -> str:
    """The cluster plan as a table (what ``offload plan --boxes`` prints)."""
    cl = choice.cluster
    hw = hardware
    lines = [f"offload plan: {model}, {params / 1e9:.2f} B parameters, {policy['dtype']}, "
             f"{policy['batch_tokens']:,} tokens/step, seq {policy['seq_len']}, on {cl.boxes} box"
             f"{'es' if cl.boxes > 1 else ''} x {cl.gpus_per_box} GPUs ({cl.ranks})",
             f"each box: {cl.gpus_per_box} GPUs of {format_size(hw['gpu_mem'])} at {hw['compute_tflops']:.4g} TFLOPS, "
             f"RAM {format_size(hw['cpu_mem'])}, NVMe {format_size(hw['nvme_capacity'])} at "
             f"{hw['nvme_read_gbps']:.3g}/{hw['nvme_write_gbps']:.3g} GB/s, CPU Adam "
             f"{hw['adam_params_per_s'] / 1e9:.3g} G params/s (shared by its GPUs); links a GPU: "
             f"{cl.inter_box_gbps:.3g} GB/s between boxes, {cl.intra_box_gbps:.3g} GB/s within one",
             "",
             f"  {'pp x dp':<11} {'way':<42} {'bubble':>7} {'in flight':>9} {'step':>9}  {'bound by':<17} "
             f"{'rank GPU / RAM / NVMe':<30} {'stage sends a rank'}"]
    rows = [choice.data_parallel] + [c for pp, c in choice.by_pp.items() if pp > 1]
    for c in rows:
        mark = "  <- chosen" if c is choice.best else ""
        step = seconds(c.step_s) if c.fits else "refused"
        sends = "-" if c.pp == 1 else format_size(c.act_bytes) + (" across boxes" if c.act_crosses_boxes else "")
        bubble, flight = (f"{c.bubble:.1%}", f"{c.in_flight:g}") if c.pp > 1 else ("-", "-")
        lines.append(f"  {f'{c.pp} x {c.dp}':<11} {_way(c):<42} {bubble:>7} {flight:>9} {step:>9}  "
                     f"{_bound(c) if c.fits else '-':<17} {_memory(c):<30} {sends}{mark}")
        if not c.fits:
            lines.append(f"  {'':<11} refused: {c.reason.split(';')[0]}")
    lines += ["", f"({choice.candidates} ways planned: every pp dividing {cl.ranks}, the schedules, micro-batches "
                  "P, 2P, 4P, ... up to one sequence each, activations on the GPU or parked in RAM, the mesh "
                  "with dp or pp ranks side by side; "
                  "the table keeps each pp's fastest. Bubble: schedule theory (offload.plan.schedule_theory); "
                  "'in flight': micro-batches of activations the first stage holds)",
              "", "verdict: " + why(choice)]
    return "\n".join(lines)


def candidate_json(c: Candidate) -> dict:
    return {"pp": c.pp, "dp": c.dp, "micro_batches": c.micro_batches, "schedule": c.schedule, "order": c.order,
            "activation_offload": c.activation_offload, "fits": c.fits, "reason": c.reason,
            "predicted_step_s": c.step_s, "bottleneck": c.bottleneck, "bubble_fraction": c.bubble,
            "step_terms_s": c.terms, "stage_send_bytes": c.act_bytes, "in_flight": c.in_flight,
            "activations_cross_boxes": c.act_crosses_boxes, "dp_crosses_boxes": c.dp_crosses_boxes,
            "rank_bytes": c.rank_memory if c.rank_plans else None}


def cluster_json(choice: ClusterChoice) -> dict:
    """The cluster choice as ``offload plan --boxes ... --json`` writes it."""
    cl = choice.cluster
    return {"cluster": {"boxes": cl.boxes, "gpus_per_box": cl.gpus_per_box, "inter_box_gbps": cl.inter_box_gbps,
                        "intra_box_gbps": cl.intra_box_gbps},
            "chosen": None if choice.best is None else candidate_json(choice.best),
            "data_parallel": candidate_json(choice.data_parallel),
            "by_pp": {str(pp): candidate_json(c) for pp, c in choice.by_pp.items()},
            "candidates": choice.candidates, "verdict": why(choice)}
