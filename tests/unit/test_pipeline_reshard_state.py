"""Resharding compressed optimizer state by parameter name (``offload.pipeline.reshard`` /
``reshard_state``), in one process: two stages (each its own engine, saved as a pipeline saves
its stages) resumed by one engine holding the whole model, and back, under another chunk size.

* 8-bit moments: a parameter whose blocks hold the same elements before and after (same offset
  modulo the block, no other parameter in them) gets the very codes and scales it was saved
  with, so the resumed optimizer's (dequantised) state equals the saving one's and training goes
  on with the same losses; a block that now straddles other parameters is quantised again, each
  element within half a step of the map (at its block's new scale) of its saved value, and the
  chunk's padding holds zero's code.
* bf16 moments and a bf16 master are copied element for element.
* a checkpoint of another precision than the model's is refused naming the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import offload
from offload.checkpoint import resolve_checkpoint
from offload.checkpoint.listing import intact
from offload.engine.access import engine_of
from offload.engine.quant_step import zero_code
from offload.errors import ConfigError
from offload.optim.quantized import BLOCK_SIZE, qmap
from offload.pipeline.reshard import Source, load_resharded

LR, WD = 1e-2, 0.1
WIDTH, LAYERS, CUT = 32, 6, 6       # Linear(32, 32) x 6 and a head; stage 0: modules [0, CUT)
SIGNED = {"exp_avg": True, "exp_avg_sq": False}
SCALES = {"exp_avg": "exp_avg_absmax", "exp_avg_sq": "exp_avg_sq_absmax"}
# precision -> OffloadConfig fields: 8-bit moments with an fp32 master (fp32 compute), with a bf16
# master (bf16 compute: the parameters are the master), bf16 moments with a bf16 master
PRECISIONS = {"8bit": dict(optimizer_state="8bit"),
              "8bit-bf16": dict(optimizer_state="8bit", master="bf16", dtype="bf16"),
              "bf16-bf16": dict(optimizer_state="bf16", master="bf16", dtype="bf16")}


def make_model(bias: bool) -> torch.nn.Sequential:
    """Without biases every parameter is a whole number of blocks (1024 or 256 elements), so in
    any layout each starts a block and shares none: all blocks align. With biases (32 elements)
    a bias and the next weight share a block, at offsets that change with the chunk size."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH, bias=bias), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(WIDTH, 8, bias=bias))
    return torch.nn.Sequential(*layers)


def build(tmp: Path, tag: str, pp: int, chunk_size: int, bias: bool, precision: dict):
    """The model as ``pp`` (1 or 2) wrapped stages (slices keep the whole model's names) and one
    AdamW over them; budgets below the state put chunks on NVMe."""
    model = make_model(bias)
    parts = [model] if pp == 1 else [model[:CUT], model[CUT:]]
    base = dict(device="cpu", dtype="fp32", device_budget=32 * chunk_size, cpu_budget=32 * chunk_size,
                chunk_size=chunk_size)
    base.update(precision)
    mods = [offload.wrap(part, offload.OffloadConfig(**base, nvme_paths=[str(tmp / f"nvme-{tag}-{i}")]))
            for i, part in enumerate(parts)]
    opt = offload.AdamW([p for m in mods for p in m.parameters()], lr=LR, weight_decay=WD)
    return mods, opt


def batches(n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, WIDTH, generator=g).to(dtype), torch.randn(16, 8, generator=g)) for _ in range(n)]


def step(mods, opt, batch) -> float:
    x, y = batch
    for m in mods:
        x = m(x)
    loss = ((x.float() - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def save(mods, opt, root: Path) -> list[Source]:
    """Each stage's engine checkpoint, as ``save_pipeline_checkpoint`` writes them."""
    out = []
    for s, m in enumerate(mods):
        offload.save_checkpoint(m, opt, root / f"stage-{s:03d}", step=2)
        ckpt = resolve_checkpoint(root / f"stage-{s:03d}")
        out.append(Source(ckpt, intact(ckpt), None))
    return out


def names(mods) -> list[str]:
    return [n for m in mods for n, _ in m.named_parameters()]


def optimizer_state(mods, opt) -> dict:
    """The optimizer's state_dict (8-bit moments dequantised) by parameter name."""
    sd = opt.state_dict()["state"]
    return {n: {k: v.clone() for k, v in sd[i].items()} for i, n in enumerate(names(mods)) if i in sd}


def slots(mods) -> dict:
    """name -> (engine, slot, the other slots of its chunk)."""
    out = {}
    for m in mods:
        e = engine_of(m, required=True)
        for info in e.chunks.chunks():
            for s in info.params:
                out[s.name] = (e, s, [o for o in info.params if o is not s])
    return out


def blocks_of(s) -> tuple[int, int]:
    return s.offset // BLOCK_SIZE, -(-s.end // BLOCK_SIZE)


def alone(s, others) -> bool:
    a, b = blocks_of(s)
    return all(o.end <= a * BLOCK_SIZE or o.offset >= b * BLOCK_SIZE for o in others)


def codes_and_scales(mods) -> dict:
    """name -> kind -> (its stored codes, the stored scales of the blocks it touches); one
    process: ``chunks.read`` gives the whole chunk (``read_full`` would dequantise)."""
    out = {}
    for name, (e, s, _) in slots(mods).items():
        a, b = blocks_of(s)
        out[name] = {k: (e.chunks.read(k, s.chunk)[s.offset:s.end].clone(),
                         e.chunks.read(SCALES[k], s.chunk)[a:b].clone()) for k in SIGNED}
    return out


def half_step_bound(saved: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """Per element: how far requantising ``saved`` in a block of absmax ``scale`` may move it --
    half the gap between the two map values around saved / scale, plus the fp32 rounding of
    that quotient and of map * scale (2^-23 and 2^-24 of the scale, |quotient| <= 1)."""
    values = qmap(signed)
    y = saved / scale
    hi = torch.searchsorted(values, y).clamp(1, values.numel() - 1)
    gap = values[hi] - values[hi - 1]
    return scale * (gap / 2 + 2.0**-22)


def trained_and_saved(tmp: Path, pp: int, bias: bool, precision: dict, data):
    mods, opt = build(tmp, "saved", pp, 2048, bias, precision)
    for batch in data[:2]:
        step(mods, opt, batch)
    return mods, opt, save(mods, opt, tmp / "ckpt")


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("pp_from,pp_to", [(2, 1), (1, 2)])
def test_aligned_blocks_reshard_to_the_same_state_and_train_on(tmp_path, precision, pp_from, pp_to):
    dtype = torch.bfloat16 if "bf16" in precision else torch.float32
    data = batches(5, dtype)
    saved, opt, sources = trained_and_saved(tmp_path, pp_from, False, PRECISIONS[precision], data)
    mods, new_opt = build(tmp_path, "resumed", pp_to, 4096, False, PRECISIONS[precision])      # other chunks
    load_resharded([(m, None) for m in mods], new_opt, sources)
    before, after = optimizer_state(saved, opt), optimizer_state(mods, new_opt)
    assert before.keys() == after.keys() and len(before) == LAYERS + 1
    for name in before:
        for key in before[name]:
            assert torch.equal(before[name][key], after[name][key]), (name, key)
    if precision.startswith("8bit"):        # the stored codes and scales themselves, not only their values
        old, new = codes_and_scales(saved), codes_and_scales(mods)
        for name in old:
            for kind in SIGNED:
                assert torch.equal(old[name][kind][0], new[name][kind][0]), (name, kind)
                assert torch.equal(old[name][kind][1], new[name][kind][1]), (name, kind)
    a = {n: p.detach().clone() for m in saved for n, p in m.state_dict().items()}
    b = {n: p.detach().clone() for m in mods for n, p in m.state_dict().items()}
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # The next step sees the same parameters and state: the same loss. With fp32 masters nothing
    # depends on where an element sits, so every later step matches too; a bf16 master or bf16
    # moments are rounded stochastically with bits keyed by the element's index in the layout,
    # which the new cut moves.
    assert step(saved, opt, data[2]) == step(mods, new_opt, data[2])
    if precision == "8bit":
        for batch in data[3:]:
            assert step(saved, opt, batch) == step(mods, new_opt, batch)
        a = {n: p.detach().clone() for m in saved for n, p in m.state_dict().items()}
        b = {n: p.detach().clone() for m in mods for n, p in m.state_dict().items()}
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("pp_from,pp_to", [(2, 1), (1, 2)])
def test_blocks_straddling_other_parameters_requantise_within_half_a_step(tmp_path, pp_from, pp_to):
    data = batches(3, torch.float32)
    saved, opt, sources = trained_and_saved(tmp_path, pp_from, True, PRECISIONS["8bit"], data)
    mods, new_opt = build(tmp_path, "resumed", pp_to, 4096, True, PRECISIONS["8bit"])
    load_resharded([(m, None) for m in mods], new_opt, sources)
    before, after = optimizer_state(saved, opt), optimizer_state(mods, new_opt)
    old_slots, new_slots = slots(saved), slots(mods)
    new_codes = codes_and_scales(mods)
    exact = moved = 0
    for name in before:
        _, old, old_others = old_slots[name]
        e, new, new_others = new_slots[name]
        same = old.offset % BLOCK_SIZE == new.offset % BLOCK_SIZE and alone(old, old_others) \
            and alone(new, new_others)
        for kind in SIGNED:
            x, got = before[name][kind].reshape(-1), after[name][kind].reshape(-1)
            if same:
                assert torch.equal(x, got), (name, kind)
                continue
            # each element's block scale in the new chunk
            scale = new_codes[name][kind][1].repeat_interleave(BLOCK_SIZE)
            scale = scale[new.offset % BLOCK_SIZE:new.offset % BLOCK_SIZE + new.numel]
            err = (got - x).abs()
            assert (err <= half_step_bound(x, scale, SIGNED[kind])).all(), (name, kind, err.max())
        exact += same
        moved += not same
    assert exact and moved          # the layouts give both cases
    for e in {id(e): e for e, _, _ in new_slots.values()}.values():        # padding: zero's code
        for info in e.chunks.chunks():
            used = torch.zeros(info.numel, dtype=torch.bool)
            for s in info.params:
                used[s.offset:s.end] = True
            for kind, signed in SIGNED.items():
                codes = e.chunks.read(kind, info.index)
                assert codes.dtype == torch.uint8 and (codes[~used] == zero_code(signed)).all(), (info.index, kind)
    losses = [step(saved, opt, data[2]), step(mods, new_opt, data[2])]
    assert losses[0] == losses[1]               # the parameters themselves moved exactly


@pytest.mark.parametrize("field,saved_kw,target_kw", [
    ("optimizer_state", dict(optimizer_state="8bit"), dict()),
    ("optimizer_state", dict(optimizer_state="bf16", dtype="bf16"), dict(optimizer_state="8bit", dtype="bf16")),
    ("master", dict(master="bf16", dtype="bf16"), dict(dtype="bf16"))])
def test_another_precision_is_refused_naming_the_field(tmp_path, field, saved_kw, target_kw):
    dtype = torch.bfloat16 if saved_kw.get("dtype") == "bf16" else torch.float32
    _, _, sources = trained_and_saved(tmp_path, 2, False, saved_kw, batches(2, dtype))
    mods, opt = build(tmp_path, "resumed", 1, 4096, False, target_kw)
    with pytest.raises(ConfigError, match=f"{field}="):
        load_resharded([(m, None) for m in mods], opt, sources)


def test_dequantise_quantise_is_not_idempotent_so_aligned_blocks_are_copied():
    """Why a block that did not move keeps its codes and scale by copy, not by requantising: the
    signed map has +1.0 but not -1.0, so a block whose largest magnitude is negative dequantises
    to an absmax below its scale and re-rounds; blocks whose largest element is positive (and
    every unsigned block) round-trip exactly."""
    from offload.optim.quantized import dequantize, quantize

    assert qmap(True).max() == 1.0 and qmap(True).min() > -1.0
    x = torch.linspace(-1.0, 0.5, BLOCK_SIZE) * 1e-3        # the largest magnitude is negative
    codes, scale = quantize(x, True)
    again = quantize(dequantize(codes, scale, True), True)
    assert again[1][0] == scale[0] * -qmap(True).min()       # the scale shrinks: every value moves
    for signed, y in ((True, -x), (False, x.abs())):
        codes, scale = quantize(y, signed)
        again = quantize(dequantize(codes, scale, signed), signed)
        assert torch.equal(again[0], codes) and torch.equal(again[1], scale)
