"""Pipeline stages on a cluster: choose pp x dp x micro-batches x schedule for B boxes of G GPUs, and
compare with sliced data parallelism over all B x G GPUs (issue 28).

A candidate is planned rank by rank with ``plan``: a pipeline rank is an engine over its stages'
parameters (``stage_layout``), sliced over its dp group (world = dp, its box shared by G ranks),
that runs the step's M micro-batches as gradient accumulation. On top of that plan:

* Activations in flight: pipeline rank 0 holds ``schedule_theory.in_flight`` micro-batches of its
  layers' saved inputs (the plan counted one): on the GPU, or parked in the RAM area (the
  pipeline-aware activation offload). If they do not fit beside the engine's "auto" device
  budget, the budget is cut to what they leave (not below the engine's minimum), as ``choose``
  does for one process.
* Time: the schedule stretches the rank's compute by its bubble (``schedule_theory``), each
  micro-batch slot lasting as long as its compute or its point-to-point sends, whichever is
  longer: a rank sends every micro-batch's hidden states forward and their gradients back, for
  each of its v stages (micro-batch tokens x hidden x dtype bytes each) at the bandwidth of the
  link between the stages. Transfers from CPU / NVMe, Adam and the dp collectives run on their
  own streams and threads and do not wait for the bubble (the ATC 2024 observation: bubbles are
  time to stream chunks). Step = max(the rank's plan, compute and sends stretched by the bubble).
* pp = 1 is today's data-parallel plan (``choose`` over world = B x G ranks, G a box), its
  collectives over the inter-box links when there are several boxes.

The fastest candidate that fits wins; within ``TIE`` the one with fewer stages, then the simpler
schedule and fewer micro-batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..units import format_size
from .choice import MAX_MICRO_BATCHES, TIE, Choice, choose
from .inputs import DTYPE_BYTES, Hardware, Policy, rank_share
from .memory import GPU_WORKSPACE, auto_budgets
from .model import chunk_sizes, resolve_model
from .planner import Plan, plan
from .schedule_theory import SCHEDULE_NAMES, bubble_fraction, in_flight, runnable, stages_per_rank
from .stage_layout import ORDERS, Cluster, RankLayout, mesh_links, rank_layouts, ranks_to_plan

GB = 1e9
def micro_options(pp: int, rows: int) -> list[int]:
    """Micro-batches tried per step: pp x 2^i (a pipeline wants M >= P; torch's interleaved schedules
    a multiple of P), up to one sequence per micro-batch (``rows``), and ``rows`` itself."""
    out = [pp << i for i in range(max(rows, 1).bit_length()) if pp << i <= rows]
    return sorted(set(out + [rows])) if rows >= 1 else []


@dataclass(frozen=True)
class Candidate:
    """One way to run the cluster: pp x dp, M micro-batches, a schedule, the mesh's order."""

    pp: int
    dp: int
    micro_batches: int
    schedule: str
    order: str
    activation_offload: str
    fits: bool
    reason: str
    step_s: float
    bottleneck: str
    bubble: float
    """Share of the step a rank's compute idles (schedule theory)."""
    terms: dict
    """Seconds: the rank plans' terms (the worst rank's each) and "pipeline" (compute and sends
    stretched by the bubble), "p2p" (the activations' sends alone)."""
    act_bytes: int
    """Bytes a rank sends per step between stages (hidden states forward, their gradients back)."""
    act_crosses_boxes: bool
    dp_crosses_boxes: bool
    in_flight: float
    """Micro-batches of activations pipeline rank 0 holds at once."""
    rank_plans: list = field(default_factory=list)
    """The ``Plan`` of rank 0 and of the heaviest rank (one for pp = 1)."""
    gpu_bytes: int = 0
    """The most GPU bytes a planned rank uses: its device tier and the activations it holds in flight."""

    @property
    def rank_memory(self) -> dict:
        """Bytes a rank holds: on its GPU (the most of any, activations in flight included), in its share
        of RAM and on NVMe (the heaviest rank's)."""
        worst = max(self.rank_plans, key=lambda p: p.tiers["cpu"]["bytes"] + p.tiers["nvme"]["bytes"])
        return {"device": self.gpu_bytes or worst.tiers["device"]["bytes"], "cpu": worst.tiers["cpu"]["bytes"],
                "nvme": worst.tiers["nvme"]["bytes"]}


@dataclass(frozen=True)
class ClusterChoice:
    """The fastest candidate that fits (None if none does), pure data parallelism, and per pp the
    best candidate (for the table)."""

    best: Candidate | None
    data_parallel: Candidate
    by_pp: dict
    candidates: int
    cluster: Cluster


def _dp_candidate(choice: Choice, links_dp: float, crosses: bool) -> Candidate:
    p = choice.best or choice.given
    po = p.policy
    return Candidate(pp=1, dp=po["world"], micro_batches=po["micro_batches"], schedule="-", order="-",
                     activation_offload=po["activation_offload"], fits=p.fits, reason=p.reason,
                     step_s=p.predicted_step_s, bottleneck=p.bottleneck, bubble=0.0,
                     terms={**p.step_terms_s, "pipeline": p.step_terms_s["compute"], "p2p": 0.0}, act_bytes=0,
                     act_crosses_boxes=False, dp_crosses_boxes=crosses, in_flight=1.0, rank_plans=[p])


def data_parallel(model, hardware: Hardware, policy: Policy, cluster: Cluster) -> Candidate:
    """Today's plan for sliced data parallelism over every GPU of the cluster (pp = 1): ``choose``
    over world = B x G ranks, G on a box, micro-batches in powers of two. The chunk size is the
    engine's "auto" one at the "auto" budgets, searched once (the search costs ~0.2 s at 100B
    and every way would repeat it): ways that cut the device budget for activations keep it, as a
    config that sets ``chunk_size`` would."""
    n, g = cluster.ranks, cluster.gpus_per_box
    link = mesh_links(cluster, 1, "dp-inner")
    po = dataclasses.replace(policy, world=n, local_world=g)
    if po.chunk_size is None:
        _, cfg = resolve_model(model)
        budgets = auto_budgets(rank_share(hardware, g), po.device_budget, po.cpu_budget)
        po = dataclasses.replace(po, chunk_size=chunk_sizes(cfg, *budgets)[0])
    rows = po.batch_tokens // n // po.seq_len
    micro = [1 << i for i in range(rows.bit_length()) if 1 << i <= min(rows, MAX_MICRO_BATCHES)]
    return _dp_candidate(choose(model, dataclasses.replace(hardware, net_gbps=link.dp_gbps), po,
                                micro_batches=micro), link.dp_gbps, link.dp_crosses_boxes)


class _RankPlanner:
    """Plans of pipeline ranks, each made once (candidates differ in schedule and order only after)."""

    def __init__(self, cfg, hardware: Hardware, policy: Policy, cluster: Cluster, seq: int):
        self.cfg, self.policy, self.seq = cfg, policy, seq
        self.hw = rank_share(hardware, cluster.gpus_per_box)          # every rank shares its box
        self.budgets = auto_budgets(self.hw, policy.device_budget, policy.cpu_budget)
        self.memo: dict = {}
        self.chunks: dict = {}
        self.layouts: dict = {}

    def ranks(self, pp: int, v: int) -> list[RankLayout]:
        """The ranks to plan of ``pp`` ranks holding ``v`` stages each."""
        if (pp, v) not in self.layouts:
            self.layouts[pp, v] = ranks_to_plan(rank_layouts(self.cfg, pp, v))
        return self.layouts[pp, v]

    def plan(self, lay: RankLayout, key: tuple, *, dp: int, micro: int, mode: str, net: float,
             device_budget: int | None) -> Plan:
        memo_key = (key, lay.rank, dp, micro, mode, net, device_budget)
        if memo_key not in self.memo:
            shape = lay.shape(self.cfg)
            if key not in self.chunks:
                # the engine's auto chunk size for the heaviest rank's layout (the search costs
                # ~0.1 s; the ranks' layouts differ by an embedding or a head at most)
                heavy = self.ranks(*key)[-1]
                self.chunks[key] = self.policy.chunk_size or chunk_sizes(
                    heavy.shape(self.cfg), *self.budgets, layout=(heavy.numels, [True] * len(heavy.numels)))[0]
            po = dataclasses.replace(self.policy, world=dp, local_world=1, micro_batches=micro, seq_len=self.seq,
                                     activation_offload=mode, chunk_size=self.chunks[key],
                                     device_budget=device_budget or self.policy.device_budget, lora_rank=None)
            self.memo[memo_key] = plan(shape, dataclasses.replace(self.hw, net_gbps=net), po,
                                       params=[(n, True) for n in lay.numels])
        return self.memo[memo_key]


def _extra_on_gpu(p: Plan, flight: float) -> int:
    """GPU bytes of the micro-batches in flight beyond the one ``p`` counted (0 when parked)."""
    if p.policy["activation_offload"] != "none":
        return 0
    act = p.breakdown["activations"]
    return int((flight - 1) * (act["layer_inputs"] if p.policy["activation_checkpointing"] else act["layer_working"]))


def _activation_room(p: Plan, hw: Hardware, flight: float) -> tuple[list[str], int | None]:
    """Why ``flight`` micro-batches of ``p``'s activations do not fit ([] if they do), and the device
    budget that would leave them room on the GPU (None if none would)."""
    b = p.breakdown
    if p.policy["activation_offload"] == "none":
        extra = _extra_on_gpu(p, flight)
        need = b["device_budget"] + p.tiers["device"]["activations"] + extra + GPU_WORKSPACE
        if need <= hw.gpu_mem:
            return [], None
        room = int(hw.gpu_mem - GPU_WORKSPACE - p.tiers["device"]["activations"] - extra)
        return ([f"GPU needs {format_size(need)} with {flight:g} micro-batches of activations in flight "
                 f"({format_size(extra)} beyond one), has {format_size(hw.gpu_mem)}"],
                room if b["device_min_bytes"] <= room < b["device_budget"] else None)
    placed = b["activation_placement"]
    if p.policy["activation_offload"] == "nvme":
        return [], None          # what the RAM area cannot hold spills to NVMe (counted once per micro-batch)
    held = int(flight * placed["area_bytes"])
    if held > placed["area_budget"]:
        return [f"the activation area ({format_size(placed['area_budget'])}) holds less than {flight:g} "
                f"micro-batches of parked layer inputs ({format_size(held)})"], None
    return [], None


def pipeline_candidate(rp: _RankPlanner, cluster: Cluster, *, pp: int, micro: int, schedule: str, order: str,
                       mode: str) -> Candidate:
    """Plan ``pp`` stages x dp = ranks / pp under ``schedule`` with ``micro`` micro-batches."""
    n, po, cfg = cluster.ranks, rp.policy, rp.cfg
    dp, v = n // pp, stages_per_rank(schedule)
    links = mesh_links(cluster, pp, order)
    key = (pp, v)
    flight = in_flight(schedule, pp, micro)
    plans, problems, gpu = [], [], 0
    for lay in rp.ranks(pp, v):
        held = in_flight(schedule, pp, micro, lay.rank)
        p = rp.plan(lay, key, dp=dp, micro=micro, mode=mode, net=links.dp_gbps, device_budget=None)
        why, smaller = _activation_room(p, rp.hw, held)
        if why and smaller is not None and po.device_budget is None:
            p = rp.plan(lay, key, dp=dp, micro=micro, mode=mode, net=links.dp_gbps, device_budget=smaller)
            why, _ = _activation_room(p, rp.hw, held)
        plans.append(p)
        gpu = max(gpu, p.tiers["device"]["bytes"] + _extra_on_gpu(p, held))
        problems += ([] if p.fits else [p.reason.split(";")[0]]) + why
    micro_tokens = plans[0].breakdown["micro_batch_tokens"]
    act_bytes = 2 * v * micro * micro_tokens * cfg.hidden_size * DTYPE_BYTES[po.dtype]
    p2p = act_bytes / (links.act_gbps * GB)
    bubble = bubble_fraction(schedule, pp, micro)
    terms = {t: max(p.step_terms_s[t] for p in plans) for t in plans[0].step_terms_s}
    terms["p2p"] = p2p
    terms["pipeline"] = max(terms["compute"], p2p) / (1 - bubble)
    step = max(max(p.predicted_step_s for p in plans), terms["pipeline"])
    if terms["pipeline"] >= max(p.predicted_step_s for p in plans):
        bottleneck = "bubble" if terms["compute"] >= p2p else "p2p"
    else:
        bottleneck = max(plans, key=lambda p: p.predicted_step_s).bottleneck
    reason = "; ".join(problems) if problems else (
        f"fits: {pp} stages x {dp} data-parallel ranks, {micro} micro-batches of {micro_tokens} tokens, "
        f"{flight:g} in flight on the first rank")
    return Candidate(pp=pp, dp=dp, micro_batches=micro, schedule=schedule, order=order, activation_offload=mode,
                     fits=not problems, reason=reason, step_s=step, bottleneck=bottleneck, bubble=bubble,
                     terms=terms, act_bytes=act_bytes, act_crosses_boxes=links.act_crosses_boxes,
                     dp_crosses_boxes=links.dp_crosses_boxes, in_flight=flight, rank_plans=plans, gpu_bytes=gpu)


def _complexity(c: Candidate) -> tuple:
    return (c.pp, SCHEDULE_NAMES.index(c.schedule) if c.schedule in SCHEDULE_NAMES else -1, c.micro_batches,
            c.activation_offload != "none", ORDERS.index(c.order) if c.order in ORDERS else -1)


def _fastest(cands: list[Candidate]) -> Candidate | None:
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return None
    quickest = min(c.step_s for c in fitting)
    return min((c for c in fitting if c.step_s <= quickest * (1 + TIE)), key=_complexity)


def pp_options(cfg, cluster: Cluster, policy: Policy, seq: int) -> list[int]:
    """Pipeline sizes worth planning: divisors of the GPUs (> 1) with at least one decoder layer per
    stage and at least one sequence per data-parallel rank."""
    n = cluster.ranks
    return [pp for pp in range(2, n + 1) if n % pp == 0 and pp <= cfg.num_layers
            and policy.batch_tokens % (n // pp) == 0 and policy.batch_tokens // (n // pp) >= seq]


def choose_cluster(model, hardware: Hardware, policy: Policy, cluster: Cluster, *,
                   pps: list[int] | None = None, schedules: list[str] | None = None,
                   micro_batches: list[int] | None = None) -> ClusterChoice:
    """Plan the cluster every way allowed (None: all) and pick the fastest that fits."""
    _, cfg = resolve_model(model)
    if policy.lora_rank is not None:
        raise ConfigError("lora_rank", policy.lora_rank, "the cluster planner plans full fine-tunes of presets only")
    seq = policy.seq_len or min(cfg.max_seq_len, policy.batch_tokens)
    dp_only = data_parallel(model, hardware, dataclasses.replace(policy, seq_len=seq), cluster) \
        if policy.batch_tokens % cluster.ranks == 0 and policy.batch_tokens // cluster.ranks >= seq else None
    rp = _RankPlanner(cfg, hardware, policy, cluster, seq)
    gpu = hardware.gpu_mem is not None
    modes = ["none"] + (["cpu"] if gpu and policy.activation_checkpointing else [])
    if policy.activation_offload != "none":
        modes = [policy.activation_offload]
    cands = [] if dp_only is None else [dp_only]
    allowed = pp_options(cfg, cluster, policy, seq) if pps is None else [p for p in pps if p > 1]
    for pp in allowed:
        rows = policy.batch_tokens // (cluster.ranks // pp) // seq        # sequences per dp rank and step
        ms = micro_batches or micro_options(pp, rows)
        for schedule in schedules or SCHEDULE_NAMES:
            if pp * stages_per_rank(schedule) > cfg.num_layers + 2:
                continue
            for m in ms:
                if m > rows or not runnable(schedule, pp, m):
                    continue
                seen = set()
                for order in ORDERS:
                    links = mesh_links(cluster, pp, order)
                    if (links.dp_gbps, links.act_gbps) in seen:
                        continue            # the same links: the same plan
                    seen.add((links.dp_gbps, links.act_gbps))
                    for mode in modes:
                        cands.append(pipeline_candidate(rp, cluster, pp=pp, micro=m, schedule=schedule,
                                                        order=order, mode=mode))
    groups: dict = {}
    for c in cands:
        groups.setdefault(c.pp, []).append(c)
    by_pp = {pp: _fastest(mine) or min(mine, key=_complexity) for pp, mine in groups.items()}
    if dp_only is None:
        dp_only = _refused_dp(cluster, policy, seq)
    return ClusterChoice(best=_fastest(cands), data_parallel=dp_only, by_pp=dict(sorted(by_pp.items())),
                         candidates=len(cands), cluster=cluster)


def _refused_dp(cluster: Cluster, policy: Policy, seq: int) -> Candidate:
    """Pure data parallelism when the batch does not give every GPU a sequence."""
    why = (f"{policy.batch_tokens} tokens/step give each of {cluster.ranks} GPUs less than one sequence of {seq}"
           if policy.batch_tokens // cluster.ranks < seq else
           f"{policy.batch_tokens} tokens/step do not split evenly over {cluster.ranks} GPUs")
    inf = float("inf")
    return Candidate(pp=1, dp=cluster.ranks, micro_batches=1, schedule="-", order="-", activation_offload="none",
                     fits=False, reason=why, step_s=inf, bottleneck="-", bubble=0.0, terms={}, act_bytes=0,
                     act_crosses_boxes=False, dp_crosses_boxes=cluster.boxes > 1, in_flight=1.0)
