"""What ``offload plan`` prints: the plan as a readable table (``format_plan``), then the ways to
the batch and their predicted steps (``format_choice``). Sizes are decimal (``units.format_size``).
"""

from __future__ import annotations

from ..units import format_size
from .choice import FAMILIES, Choice, family_of
from .planner import Plan
from .precision import describe as describe_precision


def seconds(s: float) -> str:
    """A duration as the report prints it: 12.3 ms, 4.56 s, 789 s."""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s" if s < 100 else f"{s:.0f} s"


def _way_text(po: dict, b: dict) -> str:
    out = ""
    if po.get("activation_offload", "none") != "none":
        out += f", activations parked in {'RAM' if po['activation_offload'] == 'cpu' else 'RAM + NVMe'}"
    if po.get("micro_batches", 1) > 1:
        out += f", {po['micro_batches']} micro-batches of {b['micro_batch_tokens']} tokens"
    return out


def _precision_text(po: dict) -> str:
    state, master = po.get("optimizer_state", "fp32"), po.get("master", "fp32")
    return "" if state == master == "fp32" else f"; {describe_precision(state, master)}"


def _ranks_text(p: Plan) -> list[str]:
    b = p.breakdown
    world = b.get("world", 1)
    if world == 1:
        return []
    local = b["local_world"]
    coll = b["collective_bytes"]
    return [f"data parallel: {world} ranks, {local} on this box; the plan below is one rank's: it holds a "
            f"1/{world} piece of each of the {b['num_chunks']} chunks ({b['rank_elements']:,} elements) and "
            f"computes {b['rank_tokens']} tokens of each step; "
            + (f"the box's RAM, NVMe and CPU Adam below are split {local} ways" if local > 1 else
               "the box below is this rank's alone") + "; collectives per step and rank (bus bytes, "
            f"(N-1)/N of the whole chunks): all-gather {format_size(coll['all_gather'])}, reduce-scatter "
            f"{format_size(coll['reduce_scatter'])}"]


def format_plan(p: Plan, sources: dict | None = None) -> str:
    """The plan as a readable table (what ``offload plan`` prints)."""
    sources = sources or {}
    hw, b, t, tiers = p.hardware, p.breakdown, p.step_terms_s, p.tiers
    gpu = hw["gpu_mem"] is not None
    po = p.policy
    lines = [f"offload plan: {p.model}, {p.params / 1e9:.2f} B parameters ({p.params:,}), "
             f"{po['dtype']}, {po['batch_tokens']} tokens/step, seq {b['seq_len']}, "
             f"{'activation checkpointing' if po['activation_checkpointing'] else 'no checkpointing'}"
             + (f"; {b['trainable_params']:,} trainable ({b['trainable_chunks']} of {b['num_chunks']} chunks "
                "carry gradient, master and moments)" if b.get("trainable_params", p.params) != p.params else "")
             + _way_text(po, b) + _precision_text(po),
             "(sizes in decimal units: 1 GB = 1e9 bytes; on the command line 8T = 8 TiB = 8.80 TB)",
             *_ranks_text(p),
             "", "hardware"]
    rows = [("GPU memory", format_size(hw["gpu_mem"]) if gpu else "none (CPU-only)", "gpu_mem"),
            ("compute", f"{hw['compute_tflops']:.4g} TFLOPS", "compute_tflops"),
            ("PCIe each way", f"{hw['pcie_gbps']:.3g} GB/s" if gpu else "-", "pcie_gbps"),
            ("RAM", format_size(hw["cpu_mem"]), "cpu_mem"),
            ("NVMe free", f"{format_size(hw['nvme_capacity'])} at {hw['nvme_where']}", "nvme_capacity"),
            ("NVMe read/write", f"{hw['nvme_read_gbps']:.3g} / {hw['nvme_write_gbps']:.3g} GB/s", "nvme_gbps"),
            ("CPU Adam", f"{hw['adam_params_per_s'] / 1e9:.3g} G params/s", "adam_params_per_s")]
    if b.get("world", 1) > 1:
        rows.append(("interconnect", f"{hw['net_gbps']:.3g} GB/s a rank (bus)", "net_gbps"))
    for label, value, key in rows:
        lines.append(f"  {label:<16} {value:<36} {sources.get(key, '')}".rstrip())

    kinds = ["params", "grads", "master", "exp_avg", "exp_avg_sq", "scales", "activations", "working"]
    scales = tiers["cpu"].get("scales", 0)
    dev_name = "device (GPU)" if gpu else "device (RAM)"
    lines += ["", "bytes per tier and kind",
              f"  {'':<12} {dev_name:>14} {'cpu':>14} {'nvme':>14}"]
    for kind in kinds + ["bytes"]:
        cells = [tiers[tier].get(kind) for tier in ("device", "cpu", "nvme")]
        if not any(cells) and kind != "bytes":
            continue
        label = "total" if kind == "bytes" else kind
        lines.append(f"  {label:<12} " + " ".join(f"{format_size(c) if c else '-':>14}" for c in cells))
    budgets = (format_size(b["device_budget"]), format_size(b["cpu_budget"]),
               format_size(hw["nvme_capacity"]))
    lines.append(f"  {'budget':<12} " + " ".join(f"{x:>14}" for x in budgets))
    lines += [f"  (budgets are chunk storage: activations are outside the device budget; 'working' is CPU "
              f"room for the chunk Adam updates and the next one; chunks of {b['chunk_size']:,} elements x "
              f"{b['num_chunks']}, device minimum {format_size(b['device_min_bytes'])}, CPU minimum "
              f"{format_size(b['cpu_min_bytes'])})",
              "", f"NVMe space needed: {format_size(p.nvme_bytes_needed)} "
              f"(a slot for every chunk of every kind: {format_size(b['state_bytes'])}, "
              f"{b['state_bytes_per_param']:.4g} B/param incl. fp32 gradients and padding"
              + (f"; less the 8-bit block scales, {format_size(scales)}, held in RAM" if scales else "") + ")"]

    bps, size = p.bytes_per_step, format_size
    lines += ["", "bytes moved per step",
              f"  NVMe read    {size(bps['nvme_read']):>10}   NVMe write {size(bps['nvme_write']):>10}",
              f"  PCIe H2D     {size(bps['pcie_h2d']):>10}   PCIe D2H   {size(bps['pcie_d2h']):>10}"]
    if not gpu:
        cp = b["device_cpu_copy_bytes"]
        lines.append(f"  (no GPU: device<->CPU chunk copies are memcpy in RAM, {size(cp['h2d'])} + "
                     f"{size(cp['d2h'])}, not timed)")

    why = {
        "compute": f"{b['train_flops_per_token']:.3g} FLOP/token x {b.get('rank_tokens', po['batch_tokens'])} tokens "
                   f"at {hw['compute_tflops']:.4g} TFLOPS"
                   f"{' (incl. the checkpoint recompute, x4/3)' if po['activation_checkpointing'] else ''}",
        "pcie": "max(H2D, D2H): the link is full duplex" if gpu else "no GPU",
        "nvme": "read/GBps + write/GBps: the drives share reads and writes",
        "interconnect": (f"all-gather + reduce-scatter bus bytes at {hw['net_gbps']:.3g} GB/s a rank, "
                         "beside compute"),
        "adam": (f"{p.params / 1e9:.2f} G params at {hw['adam_params_per_s'] / 1e9:.3g} G params/s"
                 if b.get("world", 1) == 1 else
                 f"{b['adam_params'] / 1e9:.2f} G params (this rank's) at "
                 f"{b['rank_hardware']['adam_params_per_s'] / 1e9:.3g} G params/s (its share)"),
    }
    beside = "compute, PCIe, NVMe" + (", interconnect" if b.get("world", 1) > 1 else "")
    if not gpu:
        how = ("compute + Adam + NVMe" if b.get("world", 1) == 1 else "max(compute + Adam + NVMe, interconnect)") \
            + ": without a GPU the same cores run all three and I/O waits stall compute"
    elif po["defer_step"]:
        how = f"max({beside}) + max(Adam, its NVMe): the step is deferred to after backward"
    elif po.get("micro_batches", 1) > 1:
        how = (f"{po['micro_batches'] - 1} micro-batches at max({beside}) each, then the last "
               "beside the optimizer's NVMe traffic and Adam, which overlap only its backward")
    else:
        how = "max of the terms: Adam overlaps backward"
    lines += ["", f"predicted step time: {seconds(p.predicted_step_s)} ({how}); "
              f"{po['batch_tokens'] / p.predicted_step_s:,.0f} tokens/s"]
    for term in ("compute", "pcie", "nvme", "adam") + (("interconnect",) if b.get("world", 1) > 1 else ()):
        mark = "  <- bottleneck" if term == p.bottleneck else ""
        lines.append(f"  {term:<12} {seconds(t[term]):>10}   {why[term]}{mark}")
    lines.append("")
    if p.gpu_bound_batch_tokens is None:
        lines.append(f"bottleneck: {p.bottleneck} — the {'GPU' if gpu else 'CPU'} is already the limit")
    else:
        fit = "" if p.max_batch_tokens is None or p.gpu_bound_batch_tokens <= p.max_batch_tokens else (
            f"; but {'the GPU' if gpu else 'RAM'} holds activations for at most "
            f"{p.max_batch_tokens} tokens/step this way (see the other ways below)")
        lines.append(f"bottleneck: {p.bottleneck}; compute becomes the bottleneck from "
                     f"{p.gpu_bound_batch_tokens} tokens/step{fit}")
    lines.append(("verdict: " if p.fits else "verdict: REFUSED: ") + p.reason)
    return "\n".join(lines)


def describe_way(p: Plan) -> str:
    """One way to the batch in words: "4 x 2048 tokens, activations parked in RAM"."""
    po, b = p.policy, p.breakdown
    where = {"none": "activations on the GPU", "cpu": "activations parked in RAM",
             "nvme": "activations parked in RAM + NVMe"}[po["activation_offload"]]
    return f"{po['micro_batches']} x {b['micro_batch_tokens']} tokens, {where}"


def format_choice(c: Choice) -> str:
    """The ways to the batch and their predicted steps (what ``offload plan`` prints after the plan)."""
    tokens = c.given.policy["batch_tokens"]
    lines = ["", f"ways to {tokens} tokens/step ({c.candidates} plan{'s' if c.candidates != 1 else ''}; "
                         "the fastest that fits is chosen)"]
    for fam, label in FAMILIES:
        p = c.families.get(fam)
        if p is None:
            continue
        mark = "  <- chosen" if c.best is not None and p is c.best else ""
        budget = format_size(p.breakdown["device_budget"])
        if p.fits:
            outcome = f"{seconds(p.predicted_step_s):>8}  bound by {p.bottleneck}"
        else:
            outcome = f"{'-':>8}  refused: {p.reason.split(';')[0]}"
        lines.append(f"  {label:<38} {describe_way(p):<52} device budget {budget:>9}  {outcome}{mark}")
    if c.best is None:
        lines.append("  none fits")
    elif family_of(c.best) not in c.families or c.families[family_of(c.best)] is not c.best:
        lines.append(f"  chosen: {describe_way(c.best)}, {seconds(c.best.predicted_step_s)}")
    return "\n".join(lines)


def _nvme_bytes(p: Plan) -> int:
    return p.bytes_per_step["nvme_read"] + p.bytes_per_step["nvme_write"]


def savings_json(p: Plan, base: Plan) -> dict:
    """What ``p``'s optimizer-state precision buys against ``base``, the same ways with fp32 state
    (``offload plan --json``'s "versus_fp32")."""
    return {"state_bytes_per_param": p.breakdown["state_bytes_per_param"],
            "fp32_state_bytes_per_param": base.breakdown["state_bytes_per_param"],
            "nvme_bytes_needed": p.nvme_bytes_needed, "fp32_nvme_bytes_needed": base.nvme_bytes_needed,
            "nvme_bytes_per_step": _nvme_bytes(p), "fp32_nvme_bytes_per_step": _nvme_bytes(base),
            "nvme_s": p.step_terms_s["nvme"], "fp32_nvme_s": base.step_terms_s["nvme"],
            "predicted_step_s": p.predicted_step_s, "fp32_predicted_step_s": base.predicted_step_s,
            "fits": p.fits, "fp32_fits": base.fits}


def format_savings(p: Plan, base: Plan) -> str:
    """One line: what ``p``'s optimizer-state precision buys against fp32 state (``base``): bytes
    stored, NVMe bytes and time per step, step time."""
    po, b, bb = p.policy, p.breakdown, base.breakdown
    what = describe_precision(po["optimizer_state"], po["master"])
    step = (f"step {seconds(p.predicted_step_s)} instead of {seconds(base.predicted_step_s)} "
            f"({base.predicted_step_s / p.predicted_step_s:.2f}x, bound by {p.bottleneck})"
            if p.fits and base.fits else
            f"the fp32 plan {'fits' if base.fits else 'does not fit'}, this one {'fits' if p.fits else 'does not'}")
    return (f"\nversus fp32 state: {what}: {b['state_bytes_per_param']:.4g} B/param stored instead of "
            f"{bb['state_bytes_per_param']:.4g} ({format_size(p.nvme_bytes_needed)} of NVMe instead of "
            f"{format_size(base.nvme_bytes_needed)}); NVMe {format_size(_nvme_bytes(p))}/step instead of "
            f"{format_size(_nvme_bytes(base))} ({seconds(p.step_terms_s['nvme'])} instead of "
            f"{seconds(base.step_terms_s['nvme'])}); {step}. (CPU Adam is taken at the params/s given for "
            "fp32 state: give --adam-params-per-s from `offload bench adam --state ...` for this precision)")
