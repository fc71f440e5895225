"""Frozen parameters cost only their parameter chunks; oversized parameters get chunks of their own.

LoRA through peft's ``get_peft_model`` on a tiny HF Llama: the frozen base model's chunks have no
gradient, fp32 master or moment chunks and no NVMe slots for them, training equals plain PyTorch,
and the frozen weights do not move. A Mixtral model (transformers 5 fuses each layer's experts into
one tensor) runs with a chunk size smaller than its expert tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from tests.helpers.trajectory import assert_losses_within_drift, assert_within_drift, float64_twin

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow
STATE_KINDS = ("grad", "master", "exp_avg", "exp_avg_sq")


def tiny_llama(hidden=64, layers=2, vocab=128, inter=128, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def lora(model, r=4):
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


def batches(n, vocab=128, seq=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, seq), generator=gen) for _ in range(n)]


def test_lora_frozen_chunks_have_no_state_and_training_matches_torch(disk_tmp):
    torch.manual_seed(1)
    ref = lora(tiny_llama(hidden=128, inter=256))       # 1.2 MB of fp32 parameters
    for name, p in ref.named_parameters():
        if "lora_B" in name:          # peft starts B at zero: give the adapters something to train from
            torch.nn.init.normal_(p, std=0.02)
    mine = copy.deepcopy(ref)
    exact = float64_twin(ref)
    frozen_before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="640KiB", cpu_budget="256KiB",
                                nvme_paths=[str(disk_tmp)], chunk_size=16384)
    model = offload.wrap(mine, cfg)
    engine = model.offload_engine
    layout = engine.layout
    frozen = [c for c in range(layout.num_chunks) if not layout.trainable[c]]
    assert frozen and layout.trainable_chunks
    for c in range(layout.num_chunks):
        members = engine.params.chunk_members[c]
        assert {p.requires_grad for p in members} == {layout.trainable[c]}     # never mixed
        for kind in ("grad", "exp_avg", "exp_avg_sq"):
            assert ((kind, c) in engine.store.records) == layout.trainable[c]
        assert ("master", c) not in engine.store.records        # fp32: the parameters are the master
    runs = [(m, o(m.parameters(), lr=1e-2, weight_decay=0.1), [])
            for m, o in ((model, offload.AdamW), (ref, torch.optim.AdamW), (exact, torch.optim.AdamW))]
    for ids in batches(6):
        for m, opt, losses in runs:
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    (_, _, got_losses), (_, _, ref_losses), (_, _, exact_losses) = runs
    assert_losses_within_drift(got_losses, ref_losses, exact_losses)
    got = model.state_dict()
    assert_within_drift(got, ref.state_dict(), exact.state_dict())
    for name, before in frozen_before.items():
        assert torch.equal(got[name], before), name
    assert engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"].get("param")   # NVMe was used
    engine.close()


def nvme_run(path, *, use_lora: bool, steps: int = 3):
    """Train the same model, LoRA or full, in bf16 with a CPU budget a quarter of its full state:
    returns (NVMe bytes reserved, NVMe bytes moved per step after the first, state bytes, losses)."""
    base = tiny_llama(hidden=128, layers=4, vocab=512, inter=256)
    if use_lora:
        base = lora(base)
    cfg = offload.OffloadConfig(device="cpu", dtype="bf16", device_budget="2MiB", cpu_budget="2MiB",
                                nvme_paths=[str(path)], chunk_size=65536)
    model = offload.wrap(base, cfg)
    engine = model.offload_engine
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    moved, losses = [], []
    for ids in batches(steps, vocab=512, seq=32):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        moved.append(sum(n for d, n in model.offload_stats()["moved_bytes"].items() if "nvme" in d))
    engine.adam.drain()
    state = sum(r.nbytes for r in engine.store.records.values() if r.key[0] != "grad")
    reserved = engine.store.tiers["nvme"].in_use
    engine.close()
    return reserved, sorted(moved[1:])[len(moved[1:]) // 2], state, losses


def test_lora_reserves_and_moves_a_fraction_of_a_full_fine_tune(disk_tmp):
    full_nvme, full_moved, full_state, _ = nvme_run(disk_tmp / "full", use_lora=False)
    lora_nvme, lora_moved, _, losses = nvme_run(disk_tmp / "lora", use_lora=True)
    assert full_state >= 4 * (2 << 20)                  # the state is at least 4x the CPU budget
    # Frozen chunks hold bf16 parameters only (2 of the 18 bytes a trainable element costs).
    assert lora_nvme < full_nvme / 5
    assert lora_moved < full_moved / 3
    assert all(torch.isfinite(torch.tensor(losses)))


def tiny_mixtral(seed=0):
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg)
    model.config.use_cache = False
    return model


def test_mixtral_runs_with_chunks_smaller_than_its_expert_tensor(disk_tmp):
    ref = tiny_mixtral()
    experts = ref.model.layers[0].mlp.experts.gate_up_proj.numel()
    chunk = 8192
    assert experts > chunk
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="2MiB", cpu_budget="1MiB",
                                nvme_paths=[str(disk_tmp)], chunk_size=chunk)
    model = offload.wrap(copy.deepcopy(ref), cfg)
    layout = model.offload_engine.layout
    own = layout.slot("model.layers.0.mlp.experts.gate_up_proj").chunk
    assert layout.chunk_size == chunk and layout.chunk_numel(own) == experts and layout.oversized(own)
    # lr 1e-3: Adam turns the last-ulp differences of near-zero gradients (a token or expert a batch
    # barely touches) into visible ones in proportion to lr; plain torch runs are bit-identical.
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches(4) * 2:
        l_ref = ref(input_ids=ids, labels=ids).loss
        l_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - l_ref.item()) <= 1e-5 * abs(l_ref.item())
        losses.append(loss.item())
    assert losses[-1] < losses[3]                       # the second pass over the data: loss fell
    got = model.state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
    model.offload_engine.close()


def lora_wrapped(path, seed):
    torch.manual_seed(seed)
    model = lora(tiny_llama(hidden=128, inter=256, seed=seed))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    # 8192-element chunks: the 32768-element MLP matrices and the 16384-element embedding are oversized.
    cfg = offload.OffloadConfig(device="cpu", dtype="bf16", device_budget="640KiB", cpu_budget="512KiB",
                                nvme_paths=[str(path)], chunk_size=8192)
    model = offload.wrap(model, cfg)
    return model, offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def steps(model, opt, data):
    out = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_checkpoint_and_safetensors_round_trip_frozen_and_oversized_chunks(disk_tmp):
    (disk_tmp / "nvme").mkdir()
    data = batches(4, seed=3)
    model, opt = lora_wrapped(disk_tmp / "nvme", seed=0)
    layout = model.offload_engine.layout
    assert any(layout.oversized(c) for c in range(layout.num_chunks))
    assert any(layout.oversized(c) and not layout.trainable[c] for c in range(layout.num_chunks))
    steps(model, opt, data[:2])
    offload.save_checkpoint(model, opt, disk_tmp / "ckpt", step=2)
    offload.export_safetensors(model, disk_tmp / "st")
    exported = {k: v.clone() for k, v in model.state_dict().items()}
    later = steps(model, opt, data[2:])
    final = {k: v.clone() for k, v in model.state_dict().items()}
    model.offload_engine.close()

    model2, opt2 = lora_wrapped(disk_tmp / "nvme", seed=5)          # other weights until loaded
    offload.load_checkpoint(model2, opt2, disk_tmp / "ckpt")
    assert steps(model2, opt2, data[2:]) == later
    got = model2.state_dict()
    for k, v in final.items():
        assert torch.equal(got[k], v), k
    model2.offload_engine.close()

    model3, _ = lora_wrapped(disk_tmp / "nvme", seed=7)
    offload.load_safetensors(model3, disk_tmp / "st")
    got = model3.state_dict()
    for k, v in exported.items():             # exported in the compute dtype (bf16)
        assert torch.equal(got[k], v.to(torch.bfloat16).float()), k
    model3.offload_engine.close()
