"""The report of ``offload bench step --nproc N`` (see ``offload.bench.distributed``): one
system's figures summed over its ranks, the engine's own count checked against the counter,
the ratios between the systems, and the human lines."""

from __future__ import annotations

import statistics

SYMMETRIC_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def engine_agrees(engine: list, sent_by_op: list, received_by_op: list) -> bool:
    """Whether the engine's own count of a sample (``offload_stats()["collectives"]`` per rank,
    summed over the sample's steps) is the counter's, op by op.

    All-gather, reduce-scatter and all-reduce move the same bytes on every rank and each way:
    they must agree rank by rank. A broadcast or reduce does not (along the chain the root only
    sends, the last rank only receives); the engine may split it evenly across the ranks
    ((N-1)/N of the tensor each) where the counter follows the chain: those agree when the
    group's totals do, (N-1) times the tensor each way."""
    if not engine or any(e is None for e in engine):
        return False
    theirs = [e.get("by_op") or {} for e in engine]
    ops = set().union(*theirs, *sent_by_op, *received_by_op)
    for op in ops:
        ours_sent = [s.get(op, 0) for s in sent_by_op]
        ours_recv = [r.get(op, 0) for r in received_by_op]
        engine_op = [t.get(op, 0) for t in theirs]
        if op in SYMMETRIC_OPS:
            if engine_op != ours_sent or engine_op != ours_recv:
                return False
        elif not sum(engine_op) == sum(ours_sent) == sum(ours_recv):
            return False
    return True


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(results: list[dict], name: str) -> dict | None:
    """One system's figures over all ranks: per-rank bytes per step (median over samples), the
    group's step time per sample (its slowest rank), the mean loss over ranks per step."""
    parts = [r.get(name) for r in results]
    if any(p is None for p in parts):
        return None
    errors = [p["error"] for p in parts if p.get("error")]
    if errors:
        return {"error": errors[0]}
    samples = [max(ts) for ts in zip(*(p["step_times_s"] for p in parts))]
    sent = [int(_median([c["sent_bytes"] for c in p["collectives"]])) for p in parts]
    received = [int(_median([c["received_bytes"] for c in p["collectives"]])) for p in parts]
    def per_op(key, order=()):
        seen = {k for p in parts for c in p["collectives"] for k in c.get(key, {})}
        ops = [k for k in order if k in seen] + sorted(seen - set(order))
        return [{k: int(_median([c.get(key, {}).get(k, 0) for c in p["collectives"]])) for k in ops}
                for p in parts]

    by_op, by_op_received = per_op("by_op"), per_op("by_op_received")
    steady = all(len({c["sent_bytes"] for c in p["collectives"]}) == 1 for p in parts)
    losses = [statistics.fmean(x) for x in zip(*(p["losses"] for p in parts))]
    out = {"step_s": _median(samples), "step_times_s": [round(t, 4) for t in samples],
           "sent_bytes_per_rank": sent, "received_bytes_per_rank": received, "by_op_per_rank": by_op,
           "by_op_received_per_rank": by_op_received,
           "sent_by_phase_per_rank": per_op("by_phase", ("forward", "backward", "step")),
           "volume_bytes": max(sent + received),
           "ops_per_step": int(_median([c["ops"] for c in parts[0]["collectives"]])) if parts[0]["collectives"] else 0,
           "bytes_steady": steady, "losses": [round(x, 5) for x in losses]}
    if name == "ours":
        # sample by sample: the engine's steps against the counter's window over the same steps
        engine = [p.get("engine_collectives") or [] for p in parts]
        out["engine_collectives_per_rank"] = [e[-1] if e else None for e in engine]
        samples_n = min(len(es) for es in engine)
        checks = [engine_agrees([es[i] for es in engine], [p["collectives"][i]["by_op"] for p in parts],
                                [p["collectives"][i].get("by_op_received", {}) for p in parts])
                  for i in range(samples_n)]
        out["engine_matches_counter"] = all(checks) if any(any(es) for es in engine) else None
        adam = [[e.get("adam_s") for e in es if e and e.get("adam_s") is not None] for es in engine]
        out["adam_s_per_rank"] = [_median(a) if a else None for a in adam]
        out["layout"] = parts[0].get("layout")
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def compare(ours: dict | None, theirs: dict | None, one: dict | None, zero3: int) -> dict:
    """The report's ratios between ``summarize``'s figures of ours at N ranks, FSDP2 at N and ours
    alone (``one``), and the ZeRO-3 volume ``zero3`` (bytes per rank per step); None where a side
    did not run or failed."""
    ok = ours and not ours.get("error")
    # a system's volume: the most any rank sends or receives in a step
    ours_sent = ours["volume_bytes"] if ok else None
    fsdp_sent = theirs["volume_bytes"] if theirs and not theirs.get("error") else None
    return {
        "ours_over_zero3": _ratio(ours_sent, zero3),
        "fsdp2_over_zero3": _ratio(fsdp_sent, zero3),
        "ours_over_fsdp2_bytes": _ratio(ours_sent, fsdp_sent),
        "ours_exceeds_fsdp2": None if ours_sent is None or fsdp_sent is None else ours_sent > fsdp_sent,
        "step_n_over_1": _ratio(ours["step_s"] if ok else None, one and one.get("step_s")),
        "ours_over_fsdp2_time": _ratio(ours["step_s"] if ok else None, theirs and theirs["step_s"]),
    }


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def print_report(r: dict) -> None:
    n = r["nproc"]
    ours, theirs, one = r["ours"], r["fsdp2"], r["single"]
    print(f"offload bench step --nproc {n}: {r['run']['preset']} ({r['params'] / 1e6:.2f}M params, "
          f"{r['compute_dtype']}) on {r['device']} over {r['backend']}, {r['global_batch_tokens']} tokens/step "
          f"global ({r['global_batch_tokens'] // n} per rank), {r['threads_per_rank']} thread(s) per rank")
    print(f"ZeRO-3      {_mb(r['zero3_bytes_per_rank'])} per rank per step each way "
          f"(3 x params x 2 B x {n - 1}/{n}); ours packs {r['run']['chunks']} chunks of "
          f"{r['run']['chunk_size']} elements, {100 * r['run']['chunk_padding']:.1f}% beyond the parameters")
    for label, s in (("ours", ours), ("FSDP2", theirs)):
        if s is None:
            continue
        if s.get("error"):
            print(f"{label:<11} not run: {s['error']}")
            continue
        ops = ", ".join(f"{k} {_mb(v)}" for k, v in s["by_op_per_rank"][0].items())
        sent = " / ".join(_mb(x) for x in s["sent_bytes_per_rank"])
        recv = " / ".join(_mb(x) for x in s["received_bytes_per_rank"])
        phases = ", ".join(f"{k} {_mb(v)}" for k, v in (s.get("sent_by_phase_per_rank") or [{}])[0].items())
        if phases:
            ops += f"; rank 0 sends {phases}"
        print(f"{label:<11} sent {sent}, received {recv} per rank per step ({ops}; "
              f"{s['ops_per_step']} ops on rank 0){'' if s['bytes_steady'] else '; varies between steps'}")
    if r["ours_over_zero3"] is not None:
        versus = r["ours_over_fsdp2_bytes"]
        verdict = "" if versus is None else (" (at most FSDP2's: as issue 17 asks)" if versus <= 1 else
                                             " — MORE than FSDP2 (issue 17 asks <= 1)")
        parts = [f"ours/ZeRO-3 {r['ours_over_zero3']:.3f}"]
        if r["fsdp2_over_zero3"] is not None:
            parts.append(f"FSDP2/ZeRO-3 {r['fsdp2_over_zero3']:.3f}")
        if versus is not None:
            parts.append(f"ours/FSDP2 {versus:.3f}")
        print(f"volume      {', '.join(parts)}{verdict}")
        e = ours.get("engine_collectives_per_rank") or []
        if any(e):
            agree = "agrees" if ours.get("engine_matches_counter") else "DIFFERS from the counter"
            print(f"engine      says sent {' / '.join(_mb(x and x.get('sent_bytes')) for x in e)} per rank: {agree}")
        else:
            print("engine      reports no collectives in offload_stats()")
        adam = ours.get("adam_s_per_rank") or []
        if adam and all(adam):
            print(f"adam        {' / '.join(_ms(a) for a in adam)} per rank per step (each its piece of every "
                  f"chunk): max/min {max(adam) / min(adam):.2f}")
    elif theirs:
        print(f"volume      FSDP2/ZeRO-3 {r['fsdp2_over_zero3']:.3f}")
    if ours and not ours.get("error"):
        line = f"step        ours {_ms(ours['step_s'])} at N={n}"
        if one:
            line += (f" vs {_ms(one['step_s'])} at N=1 on the same global batch: N/1 "
                     f"{r['step_n_over_1']:.2f} (cores shared: contended, no target)")
        print(line)
    elif one:
        print(f"step        ours {_ms(one['step_s'])} at N=1")
    if theirs and not theirs.get("error"):
        tail = f": ours/FSDP2 {r['ours_over_fsdp2_time']:.2f}" if r["ours_over_fsdp2_time"] else ""
        print(f"FSDP2       {_ms(theirs['step_s'])} per step (fully_shard per layer + root, bf16 compute, "
              f"fp32 AdamW, in memory){tail}")
    for label, s in (("ours", ours), ("FSDP2", theirs), ("ours N=1", one)):
        if s and s.get("losses"):
            print(f"loss        {label}: first {s['losses'][0]:.4f}, last {s['losses'][-1]:.4f}")
