"""Compressed optimizer state (8-bit or bf16 moments, a bf16 master) through the Hugging Face
paths a user takes: unseen architectures built from configs, ``transformers.Trainer`` with a
checkpoint and a resume, peft LoRA, and ``optimizer.state_dict()`` across to ``torch.optim.AdamW``
and back. Each run is held to the real thing: torch AdamW within the 8-bit map's lr band
(tests/unit/test_adam8bit_training.py derives it), or the scheme written out on flat chunks bit
for bit (tests/helpers/flat8.py), or the uninterrupted run."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from tests.helpers.hf_models import tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

from tests.helpers.trainer_runs import RecordingTrainer, Tokens  # noqa: E402 (after the skips)

pytestmark = pytest.mark.slow

LR, WD = 1e-2, 0.1


def moments_on_nvme(model) -> bool:
    """Whether a moment chunk's current copy is on NVMe now (which one is a matter of timing: the
    eviction order follows the Adam worker's progress), i.e. the budgets forced state to the disk."""
    on_disk = model.offload_engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"]
    return bool({"exp_avg", "exp_avg_sq"} & set(on_disk))


def config(path, **kw) -> offload.OffloadConfig:
    # Small budgets and an NVMe tier (tests that need the state spilled use smaller ones and check it).
    base = dict(device="cpu", device_budget="512KiB", cpu_budget="320KiB", nvme_paths=[str(path)], chunk_size=16384)
    return offload.OffloadConfig(**{**base, **kw})


# ---- transformers.Trainer: a checkpoint, then a resume in a fresh process's objects ----------

class RoundTrip(transformers.TrainerCallback):
    """When Trainer has saved a checkpoint, pass the optimizer's state through ``state_dict`` /
    ``load_state_dict`` once, as the resume from that checkpoint does: the uninterrupted run a
    resumed one must repeat (8-bit moments come back up to the map's rounding)."""

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        optimizer.load_state_dict(optimizer.state_dict())


def lora(model):
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:            # peft starts B at zero: give the first steps a gradient on A too
            torch.nn.init.normal_(p, std=0.02)
    return model


def trainer(out, nvme, *, steps, save, adapt=None, callbacks=(), **kw):
    model = tiny_llama()
    model = adapt(model) if adapt else model
    model = offload.wrap(model, config(nvme, **kw))
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                        state=kw.get("optimizer_state"), master=kw.get("master"))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=steps, learning_rate=LR,
        max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="steps" if save else "no", save_steps=save or 1,
        logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    t = RecordingTrainer(model=model, args=args, train_dataset=Tokens(2 * steps), optimizers=(opt, None),
                         callbacks=list(callbacks))
    t.losses = []
    return t, model


@pytest.mark.parametrize("state,master", [("8bit", "bf16"), ("bf16", "bf16"), ("8bit", "fp32")])
def test_trainer_resumes_a_lora_checkpoint_in_bf16(disk_tmp, state, master):
    """Trainer resumes a PeftModel by ``model.load_adapter(checkpoint)``, which ends by replacing
    every bf16 adapter parameter with a new fp32 one (peft's ``autocast_adapter_dtype``): on a
    wrapped model those are not the engine's parameters, so forward met an empty placeholder
    ("size mismatch ... vec (0)") and the optimizer would have held the old ones. The resume must
    keep the engine's parameters and load the adapter's values into their chunks: the resumed
    run's losses are then the uninterrupted run's (8-bit moments: the run whose state went through
    the same ``state_dict`` round trip, README "Optimizer state precision")."""
    kw = dict(dtype="bf16", optimizer_state=state, master=master)
    full, model = trainer(disk_tmp / "out", disk_tmp / "a", steps=4, save=2, adapt=lora, callbacks=[RoundTrip()], **kw)
    full.train()
    resumed, again = trainer(disk_tmp / "out2", disk_tmp / "b", steps=4, save=0, adapt=lora, **kw)
    params = [p for p in again.parameters()]
    resumed.train(resume_from_checkpoint=str(disk_tmp / "out" / "checkpoint-2"))
    assert [p for p in again.parameters()] == params            # the same objects the engine holds
    assert len(resumed.losses) == 2 and resumed.losses == full.losses[2:]
    for m in (model, again):
        m.offload_engine.close()


@pytest.mark.parametrize("kw", [dict(dtype="fp32", optimizer_state="8bit"),
                                dict(dtype="bf16", optimizer_state="8bit", master="bf16"),
                                dict(dtype="bf16", optimizer_state="8bit", master="fp32")],
                         ids=["8bit", "8bit-bf16-master", "8bit-fp32-master-bf16"])
def test_trainer_checkpoint_resumes_an_8bit_run_as_the_uninterrupted_run(disk_tmp, kw):
    """Trainer saves ``model.safetensors`` (the model's ``state_dict``) and ``optimizer.pt`` (fp32
    moments), and a resume in fresh objects loads both: from the checkpoint on, its losses and
    final weights are the uninterrupted run's whose state went through the same round trip."""
    full, model = trainer(disk_tmp / "out", disk_tmp / "a", steps=5, save=3, callbacks=[RoundTrip()], **kw)
    full.train()
    resumed, again = trainer(disk_tmp / "out2", disk_tmp / "b", steps=5, save=0, **kw)
    resumed.train(resume_from_checkpoint=str(disk_tmp / "out" / "checkpoint-3"))
    assert len(resumed.losses) == 2 and resumed.losses == full.losses[3:]
    want, got = model.state_dict(), again.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for m in (model, again):
        m.offload_engine.close()


# ---- unseen architectures, sizes that leave block tails everywhere -----------------------------

VOCAB = 130      # 130 x 40 = 5,200 embedding values: 20 blocks and a tail of 80


def hf_model(arch: str):
    """A 2-layer model of ``arch`` with hidden size 40 (no tensor a multiple of 256), dropout off."""
    from tests.helpers.hf_models import tiny_config

    small = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=72, num_attention_heads=4)
    cfg = {"gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=40, n_layer=2, n_head=4, n_positions=32,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False),
           "qwen2": lambda: tiny_config("qwen2", **small, num_key_value_heads=2),
           "gpt_neox": lambda: tiny_config("gpt_neox", **small)}[arch]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def batches(n):
    """Two batches in turn: something to learn in a few steps (random tokens alone hold none)."""
    gen = torch.Generator().manual_seed(0)
    two = [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2)]
    return [two[i % 2] for i in range(n)]


def run(model, opt, data):
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


ARCHS = ["gpt2", "qwen2", "gpt_neox"]
STATES = {"8bit, bf16 master": dict(optimizer_state="8bit", master="bf16"),
          "bf16 moments, bf16 master": dict(optimizer_state="bf16", master="bf16")}


@pytest.mark.parametrize("arch,state", [(a, "8bit, bf16 master") for a in ARCHS] + [("gpt2", "bf16 moments, bf16 master")])
def test_hf_architecture_in_bf16_matches_the_scheme_on_flat_chunks(disk_tmp, arch, state):
    """GPT-2 (tied embeddings, Conv1D weights), Qwen2 (GQA, q/k/v biases), GPT-NeoX (LayerNorm
    biases), bf16 compute, NVMe forced: the engine's losses and weights are those of the scheme
    applied to the same flat chunks on plain PyTorch, bit for bit (blocks straddling parameters
    and tails included). The scheme itself is held to torch AdamW below and in the unit tests."""
    from tests.helpers.flat8 import Flat8Adam

    kw = STATES[state]
    ref = hf_model(arch)
    mine = copy.deepcopy(ref)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    model = offload.wrap(mine, config(disk_tmp, dtype="bf16", device_budget="96KiB", cpu_budget="128KiB",
                                      chunk_size=4096, **kw))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, state=kw["optimizer_state"], master="bf16")
    for p in ref.parameters():          # the engine computes in bf16 and keeps buffers (rotary inv_freq) as they are
        p.data = p.data.to(torch.bfloat16)
    flat = Flat8Adam(ref, model.offload_engine.chunks.layout, torch.bfloat16, lr=LR, weight_decay=WD,
                     initial=initial, moments=kw["optimizer_state"])
    data = batches(6)
    got, want = run(model, opt, data), run(ref, flat, data)
    assert got == want and want[-2] < 0.99 * want[0]
    sd = model.state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(sd[name], p.detach()), name
        assert torch.isfinite(sd[name]).all(), name
    assert moments_on_nvme(model)
    model.offload_engine.close()


def groups(model):
    """HF's usual two groups: no weight decay on biases and norms (runs of other hyper-parameters
    inside one 256-element block: the engine's per-block fallback). By name, as Trainer does:
    a wrapped parameter's ``.data`` is an empty placeholder, so ``p.ndim`` says nothing."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plain = [("bias" in n or "norm" in n or "ln_" in n) for n, _ in named]
    return [{"params": [p for (n, p), no in zip(named, plain) if not no], "weight_decay": WD},
            {"params": [p for (n, p), no in zip(named, plain) if no], "weight_decay": 0.0}]


def torch_losses(arch, lr, steps):
    ref = hf_model(arch)
    return run(ref, torch.optim.AdamW(groups(ref), lr=lr), batches(steps))


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_architecture_with_8bit_state_tracks_torch_adamw_within_the_lr_band(disk_tmp, arch):
    """fp32 compute, 8-bit moments, two parameter groups, NVMe forced, against torch AdamW on the
    same model: the 8-bit map's relative rounding of a moment is at most ~7% (test_adam8bit_training
    derives it), so the run must stay as close to AdamW(lr) as AdamW(lr x 0.93) or AdamW(lr x 1.07)
    does, summed over the steps and at the last step."""
    steps = 8
    ref, low, high = (torch_losses(arch, LR * f, steps) for f in (1.0, 0.93, 1.07))
    model = offload.wrap(hf_model(arch), config(disk_tmp, dtype="fp32", device_budget="160KiB", cpu_budget="160KiB",
                                               chunk_size=4096, optimizer_state="8bit"))
    got = run(model, offload.AdamW(groups(model), lr=LR, state="8bit"), batches(steps))
    band = [max(abs(lo - r), abs(hi - r)) for lo, hi, r in zip(low, high, ref)]
    dist = [abs(o - r) for o, r in zip(got, ref)]
    assert ref[-1] < 0.95 * ref[0]                      # the batches are being learnt
    assert sum(dist) <= sum(band) and dist[-1] <= band[-1], (dist, band)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert moments_on_nvme(model)
    model.offload_engine.close()


# ---- peft LoRA: few trainable elements, blocks mostly tails; the frozen base keeps no state ----

def test_lora_with_8bit_state_tracks_torch_adamw_and_the_frozen_base_gets_no_state(disk_tmp):
    """Rank-3 adapters on q_proj/v_proj of the GQA Llama (192- and 96-element tensors: every block
    a tail or shared), 8-bit moments, the optimizer given *all* parameters as a user might: the
    run stays within torch AdamW's lr band (as above), the base never changes, and only the
    adapters' chunk has gradients, moments and block scales; ``state_dict`` holds state for the
    adapters alone, as torch's does for parameters that never get a gradient."""
    steps = 8
    data = [b[:, :16] % 128 for b in batches(steps)]

    def reference(lr):
        ref = lora(tiny_llama())
        return run(ref, torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=WD), data)

    ref, low, high = (reference(LR * f) for f in (1.0, 0.93, 1.07))
    model = offload.wrap(lora(tiny_llama()), config(disk_tmp, dtype="fp32", optimizer_state="8bit"))
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, state="8bit")
    got = run(model, opt, data)
    band = [max(abs(lo - r), abs(hi - r)) for lo, hi, r in zip(low, high, ref)]
    dist = [abs(o - r) for o, r in zip(got, ref)]
    assert ref[-1] < 0.99 * ref[0] and sum(dist) <= sum(band) and dist[-1] <= band[-1], (dist, band)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    engine = model.offload_engine
    layout = engine.chunks.layout
    trainable = {c for c in range(layout.num_chunks) if layout.trainable[c]}
    assert trainable and len(trainable) < layout.num_chunks
    per_kind = {}
    for kind, c in engine.store.records:
        per_kind.setdefault(kind, set()).add(c)
    for kind in ("grad", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
        assert per_kind[kind] == trainable, kind
    adapters = {i for i, p in enumerate(model.parameters()) if p.requires_grad}
    assert set(opt.state_dict()["state"]) == adapters
    engine.close()


# ---- optimizer.state_dict() across to torch.optim.AdamW and back -------------------------------

@pytest.mark.parametrize("first", ["8bit", "torch"])
def test_state_dict_hands_an_8bit_run_to_torch_adamw_and_back(disk_tmp, first):
    """Qwen2 (hidden 40, two parameter groups), fp32 compute: 4 steps with one optimizer, then its
    ``state_dict`` (and the model's) loaded into the other for 4 more: 8-bit then torch AdamW, or
    torch AdamW then 8-bit. The hand-over keeps every step count and group, and the whole run stays
    within torch AdamW's lr band around 8 uninterrupted torch steps (as above)."""
    steps, data = 8, batches(8)
    ref, low, high = (torch_losses("qwen2", LR * f, steps) for f in (1.0, 0.93, 1.07))
    wrapped = offload.wrap(hf_model("qwen2"), config(disk_tmp, dtype="fp32", device_budget="160KiB",
                                                     cpu_budget="160KiB", chunk_size=4096, optimizer_state="8bit"))
    ours = offload.AdamW(groups(wrapped), lr=LR, state="8bit")
    plain = hf_model("qwen2")
    theirs = torch.optim.AdamW(groups(plain), lr=LR)
    (a, opt_a), (b, opt_b) = ((wrapped, ours), (plain, theirs))[::1 if first == "8bit" else -1]
    losses = run(a, opt_a, data[:4])
    b.load_state_dict({k: v.float() for k, v in a.state_dict().items()})
    opt_b.load_state_dict(opt_a.state_dict())
    sd = opt_b.state_dict()
    assert [g["weight_decay"] for g in sd["param_groups"]] == [WD, 0.0]
    assert len(sd["state"]) == len(list(plain.parameters()))
    assert all(float(st["step"]) == 4 for st in sd["state"].values())
    losses += run(b, opt_b, data[4:])
    band = [max(abs(lo - r), abs(hi - r)) for lo, hi, r in zip(low, high, ref)]
    dist = [abs(o - r) for o, r in zip(losses, ref)]
    assert sum(dist) <= sum(band) and dist[-1] <= band[-1], (dist, band)
    assert all(torch.isfinite(v).all() for v in b.state_dict().values())
    wrapped.offload_engine.close()


# ---- accelerate: save_state / load_state -------------------------------------------------------

def test_accelerate_save_state_and_load_state_resume_an_8bit_run(disk_tmp):
    """``Accelerator.save_state`` writes the model through safetensors, which drops the tied
    ``lm_head.weight`` as a duplicate of ``embed_tokens.weight``; ``load_state`` then loads with
    ``strict=False`` and counts the tied name as unexpected unless ``load_state_dict`` reports it
    missing, as torch's does. Resumed in fresh objects, the run repeats the uninterrupted one whose
    state went through the same ``state_dict`` round trip (8-bit moments, bf16 master)."""
    accelerate = pytest.importorskip("accelerate")
    data = [b[:, :16] % 128 for b in batches(6)]

    def make(path):
        model = offload.wrap(tiny_llama(), config(path, dtype="bf16", optimizer_state="8bit", master="bf16"))
        accelerator = accelerate.Accelerator(cpu=True)
        return (accelerator, *accelerator.prepare(model, offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)))

    def train(accelerator, model, opt, part):
        losses = []
        for ids in part:
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    accelerator, model, opt = make(disk_tmp / "a")
    train(accelerator, model, opt, data[:3])
    accelerator.save_state(str(disk_tmp / "state"))
    opt.load_state_dict(opt.state_dict())
    want = train(accelerator, model, opt, data[3:])
    accelerator2, model2, opt2 = make(disk_tmp / "b")
    accelerator2.load_state(str(disk_tmp / "state"))
    assert train(accelerator2, model2, opt2, data[3:]) == want
    for m in (model, model2):
        m.offload_engine.close()


def test_trainer_without_an_offload_optimizer_is_refused_at_its_clip(disk_tmp):
    """Left without ``optimizers=``, Trainer builds a torch AdamW, which finds no ``p.grad`` on a
    wrapped model and updates nothing. Its default ``max_grad_norm=1.0`` clip goes through
    ``torch.nn.utils.clip_grad_norm_``, which ``offload.wrap`` routes to offload's (it was routed
    only once an ``offload.AdamW`` existed, so in a fresh process the run went on, silently
    untrained): it refuses, naming ``offload.AdamW``. (transformers 5 calls the clip for its
    logged norm even at ``max_grad_norm=0``; a loop of one's own without a clip stays unguarded.)"""
    model = offload.wrap(tiny_llama(), config(disk_tmp, dtype="bf16", optimizer_state="8bit", master="bf16"))
    args = transformers.TrainingArguments(
        output_dir=str(disk_tmp / "out"), per_device_train_batch_size=2, max_steps=3, learning_rate=LR,
        max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
    try:
        with pytest.raises(offload.OffloadError, match="offload.AdamW"):
            transformers.Trainer(model=model, args=args, train_dataset=Tokens(6)).train()
    finally:
        model.offload_engine.close()
