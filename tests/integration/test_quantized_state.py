"""8-bit Adam moments (and a bf16 master) inside the engine, one process: every chunk through
every tier (NVMe forced by small budgets), against the same scheme written out on plain PyTorch
(tests/helpers/flat8.py: the torch reference the native kernel is bit-identical to, applied to
the same flat chunks). Forward and backward are the plain model's, so the runs agree bit for bit."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.errors import ConfigError
from offload.optim.quantized import qmap
from tests.helpers.flat8 import Flat8Adam
from tests.helpers.ranks import launch
from tests.helpers.reference import LR, WD, make_models, small_config
from tests.helpers.tiny_gpt import batches

pytestmark = pytest.mark.slow

CASES = {"fp32 compute": dict(dtype="fp32", optimizer_state="8bit"),
         "bf16 moments, bf16 master": dict(dtype="bf16", optimizer_state="bf16", master="bf16"),
         "fp32 moments, bf16 master": dict(dtype="bf16", master="bf16"),
         "bf16 compute, bf16 master": dict(dtype="bf16", optimizer_state="8bit", master="bf16"),
         "bf16 compute, fp32 master": dict(dtype="bf16", optimizer_state="8bit")}


STEPS = 6


def train(model, opt, steps):
    losses = []
    for x, y in batches(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("case", list(CASES))
def test_8bit_engine_matches_the_scheme_on_flat_chunks(disk_tmp, case):
    kw = CASES[case]
    ref, mine = make_models()
    # Budgets below even the compressed state: it goes to NVMe and back every step.
    model = offload.wrap(mine, small_config(disk_tmp, device_budget="96KiB", cpu_budget="128KiB", chunk_size=4096, **kw))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, state=kw.get("optimizer_state", "fp32"),
                        master=kw.get("master"))
    engine = model.offload_engine
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16}[kw["dtype"]]
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref = ref.to(compute)
    master = torch.bfloat16 if kw.get("master") == "bf16" else torch.float32
    flat = Flat8Adam(ref, engine.chunks.layout, master, lr=LR, weight_decay=WD, initial=initial,
                     moments=kw.get("optimizer_state", "fp32"))
    got = train(model, opt, STEPS)
    want = train(ref, flat, STEPS)
    assert got == want
    sd = model.state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(sd[name].to(p.dtype), p.detach()), name     # an fp32 master rounds to them
    kinds = {k[0] for k in engine.store.records}
    assert ("master" in kinds) == (kw["dtype"] == "bf16" and master == torch.float32)
    report = engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"]
    assert report.get("exp_avg"), report       # the state spilled
    quantized = kw.get("optimizer_state") == "8bit"
    # The block scales are held in memory, never written down (no NVMe slot): the moments' codes spill.
    scales = [r for k, r in engine.store.records.items() if k[0] in ("exp_avg_absmax", "exp_avg_sq_absmax")]
    assert bool(scales) == quantized
    assert all(r.slot is None and r.buffers for r in scales)
    assert not report.get("exp_avg_absmax") and not report.get("exp_avg_sq_absmax"), report
    want = {"8bit": torch.uint8, "bf16": torch.bfloat16}.get(kw.get("optimizer_state"), torch.float32)
    assert engine.store.records[("exp_avg", 0)].dtype == want


def test_state_dict_dequantised_round_trip_with_torch_adamw(disk_tmp):
    """optimizer.state_dict() holds fp32 moments that load into torch.optim.AdamW, and loading
    them back quantises. exp_avg_sq (unsigned map, its top code is exactly 1) comes back bit for
    bit. exp_avg's signed map has -0.993, not -1, at the bottom: a block whose largest moment is
    negative is given back 0.993 x its scale, and its values move by at most that share of the
    scale plus half the map's widest gap (a value re-rounded to its neighbour code)."""
    _, mine = make_models()
    model = offload.wrap(mine, small_config(disk_tmp, optimizer_state="8bit"))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    train(model, opt, 3)
    sd = opt.state_dict()
    # What the next step would use: exp_avg held to Adam's bound (torch's next update on a
    # moment exported past it, beside an exp_avg_sq read back as 0, would be m / eps).
    from offload.optim.quantized import moment_bound
    k2 = moment_bound(0.9, 0.999)[1]
    for i, st in sd["state"].items():
        m, v = st["exp_avg"].double(), st["exp_avg_sq"].double()
        assert bool((m * m <= k2 * v * (1 + 2.0 ** -20)).all()), i
    engine = model.offload_engine
    before = {k: engine.store.read(k).clone() for k in engine.store.records if k[0].startswith("exp_avg")}
    plain = make_models()[0]
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD)
    torch_opt.load_state_dict(sd)
    back = torch_opt.state_dict()
    for i, st in sd["state"].items():
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == back["state"][i]["exp_avg"].shape
    for k in before:        # scramble the engine's state, then load torch's state dict back
        engine.chunks.write(k[0], k[1], torch.zeros_like(before[k]))
    opt.load_state_dict(back)
    for k, want in before.items():
        if k[0].startswith("exp_avg_sq"):
            assert torch.equal(engine.store.read(k), want), k
    signed = qmap(True)
    share = float(1 + signed[0]) + float((signed[1:] - signed[:-1]).max()) / 2
    again = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    # No block's scale exceeds the largest exp_avg anywhere (blocks may span parameters).
    scale = max(st["exp_avg"].abs().max() for st in sd["state"].values())
    for i, st in sd["state"].items():
        torch.testing.assert_close(again["state"][i]["exp_avg"], st["exp_avg"], rtol=0,
                                   atol=float(scale) * share, msg=str(i))
        assert torch.equal(again["state"][i]["exp_avg_sq"], st["exp_avg_sq"])
    assert len(params) == len(sd["state"])


def test_precision_is_checked_by_name(disk_tmp):
    with pytest.raises(ConfigError, match="optimizer_state"):
        offload.OffloadConfig(optimizer_state="int4")
    with pytest.raises(ConfigError, match="master"):
        offload.OffloadConfig(dtype="fp32", master="bf16")
    model = offload.wrap(make_models()[1], small_config(disk_tmp))
    with pytest.raises(ConfigError, match="optimizer_state='8bit'"):
        offload.AdamW(model.parameters(), state="8bit")


@pytest.mark.parametrize("case", ["bf16 compute, bf16 master"])
def test_two_ranks_with_8bit_state_train_bit_for_bit_like_one_process(tmp_path, case):
    """2 gloo ranks, NVMe forced, each keeping and updating its piece of every chunk (whole
    256-element blocks: the pieces' quantum) against one process. Every rank takes the same
    slice of each batch, so the averaged gradient is exactly one process's (a mean of equal
    values) and any difference would be the sliced 8-bit state's own."""
    cfg = dict(device="cpu", device_budget="208KiB", cpu_budget="64KiB", nvme_paths=[str(tmp_path / "nvme-{rank}")],
               chunk_size=6144, **CASES[case])
    out = {}
    for world in (1, 2):
        spec = {"steps": 5, "out": str(tmp_path / f"w{world}"), "config": cfg, "batch": 4, "replicate": 2}
        (tmp_path / f"run{world}").mkdir()
        results = launch("tests.helpers.dp_worker:main", spec, world, tmp_path / f"run{world}", timeout_s=240)
        for r in results:
            if r.returncode != 0:
                pytest.fail(f"rank {r.rank} of {world} exited with {r.returncode}:\n{r.output[-3000:]}")
        out[world] = [torch.load(tmp_path / f"w{world}.rank{r}.pt") for r in range(world)]
    one = out[1][0]
    for r, o in enumerate(out[2]):
        assert o["losses"] == one["losses"], r
        for name, value in one["state"].items():
            assert torch.equal(o["state"][name], value), (r, name)
        # 6144 elements in 2 pieces of 3072 = 12 whole blocks each; the rank spilled its pieces
        assert all((hi - lo) % 256 == 0 for lo, hi in o["spans"]), o["spans"]
        on_nvme = o["stats"][-1]["memory"]["tiers"]["nvme"]["bytes_by_kind"]
        assert on_nvme and not on_nvme.get("exp_avg_absmax"), (r, on_nvme)   # the scales stay in memory


def test_nvme_bytes_per_step_fall_in_proportion_to_the_state(disk_tmp):
    """A model whose persistent state is 8x the memory tiers (1.5 M parameters, bf16 compute):
    each step streams its state through NVMe. Per parameter that is 2 B of parameters + 12 B of
    fp32 master and moments, against 2 B of bf16 parameters-as-master + 2 x (1 + 4/256) B of
    8-bit moments: 4.03 / 14 = 0.29 of the bytes if everything streamed. The smaller state
    also leaves a larger share of itself in the same memory, so the measured share is at most
    that (plus a margin for the order chunks happen to be evicted in) and is not far below it."""
    moved = {}
    for name, kw in (("fp32", {}), ("8bit", {"optimizer_state": "8bit", "master": "bf16"})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(24)])
        model = offload.wrap(model, offload.OffloadConfig(
            device="cpu", dtype="bf16", device_budget="1280KiB", cpu_budget="1536KiB", chunk_size=65536,
            nvme_paths=[str(disk_tmp / name)], **kw))
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        per_step = []
        for step in range(4):
            x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step)).bfloat16()
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            per_step.append(sum(v for k, v in model.offload_stats()["moved_bytes"].items() if "nvme" in k))
        moved[name] = sum(per_step[1:])     # the first step also writes the initial state down
        model.offload_engine.close()
    share = moved["8bit"] / moved["fp32"]
    assert 0.18 <= share <= 1.1 * (2 + 2 * (1 + 4 / 256)) / 14, (share, moved)


@pytest.mark.parametrize("case", ["fp32 compute", "bf16 compute, bf16 master"])
def test_no_parameter_moves_further_than_an_adam_step_can(disk_tmp, case):
    """The tiny LLaMA at lr 1e-2 for 5 steps: an embedding row whose token left the batches kept an
    exp_avg code while its exp_avg_sq (1e-8 of its block's largest) read back 0, and the update
    became m / eps: the row moved by 26.9 (fp32 Adam's largest move: 0.05). Held to Adam's bound,
    no parameter moves further than Adam's steps can: lr * K * sqrt(1 - b2^t) / (1 - b1^t) each,
    plus the decay and, under bf16 compute, a bf16 rounding of the largest value."""
    import math

    from offload.optim.quantized import moment_bound

    kw = CASES[case]
    _, mine = make_models()
    initial = {n: p.detach().clone().float() for n, p in mine.named_parameters()}
    model = offload.wrap(mine, small_config(disk_tmp, device_budget="96KiB", cpu_budget="128KiB", chunk_size=4096, **kw))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, state="8bit", master=kw.get("master"))
    train(model, opt, 5)
    state = model.state_dict()
    k = moment_bound(0.9, 0.999)[0]
    steps = sum(LR * k * math.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t) for t in range(1, 6))
    largest = max(float(p.abs().max()) for p in initial.values())
    bound = steps + 5 * LR * WD * largest + (largest * 2.0 ** -7 if kw["dtype"] == "bf16" else 0.0)
    moved = max(float((state[n].float() - p).abs().max()) for n, p in initial.items())
    assert moved <= bound, (moved, bound)
    model.offload_engine.close()
