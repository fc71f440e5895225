"""Activation offload end to end: training with activations parked in the CPU area (and spilled to
NVMe) equals training without it, bit for bit, on the built-in LLaMA and on a Hugging Face
``LlamaForCausalLM``, with and without ``torch.utils.checkpoint``; the bytes moved per step are the
offloaded tensors' bytes; the area stays within its budget; the trace shows the copies.

Parking is a copy out and a copy back, so the numbers cannot change at all: these compare against
the same engine with ``activation_offload="none"`` exactly, and one run against plain PyTorch."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

import offload
from offload.engine import build
from offload.models.llama import LlamaConfig, LlamaForCausalLM
from tests.helpers.sim_streams import SimStreams
from tests.helpers.trajectory import (assert_losses_within_drift, assert_within_drift, float64_twin,
                                      train_in_lockstep)

pytestmark = pytest.mark.slow
LLAMA = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                    num_kv_heads=2, max_seq_len=32)
BATCH, SEQ, STEPS, LR = 2, 16, 2, 1e-2


def builtin(checkpointing: bool):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LLAMA)
    model.gradient_checkpointing = checkpointing
    return model


def hf(checkpointing: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    if checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def batches():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def train(model, cfg: offload.OffloadConfig, streams=None):
    """Losses, final state dict and per-step stats of STEPS offloaded steps."""
    if streams is not None:
        with mock.patch.object(build, "copy_streams", lambda device: streams):
            model = offload.wrap(model, cfg)
    else:
        model = offload.wrap(model, cfg)
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, stats = [], []
    try:
        for ids in batches():
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            stats.append(model.offload_stats())
        return losses, model.state_dict(), stats
    finally:
        model.offload_engine.close()


def config(path, mode="none", dtype="fp32", **kw):
    # chunk state in memory (the chunk paths have their own tests); NVMe only for spills
    return offload.OffloadConfig(device="cpu", dtype=dtype, chunk_size=65536, activation_offload=mode,
                                 nvme_paths=[str(path)] if mode == "nvme" else None, **kw)


def assert_identical(a, b):
    (la, sa, _), (lb, sb, _) = a, b
    assert la == lb
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def spill_kw(mode, checkpointing, dtype="fp32"):
    kw = {}
    if mode == "nvme":
        # A fraction of a step's activations, the same fraction in either dtype under checkpointing:
        # most spill, early enough in forward that their writes have landed when backward needs
        # them (a write still in flight then is uploaded from the area: nothing read back from
        # NVMe). Without checkpointing the area must still hold the largest saved tensor (15 KiB).
        kw["activation_budget"] = "12KiB" if checkpointing and dtype == "bf16" else "24KiB"
    if not checkpointing:
        kw["activation_min_bytes"] = 0              # without boundaries, park every saved activation
    return kw


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_builtin_llama_trains_the_same_with_activations_parked(disk_tmp, dtype, checkpointing):
    want = train(builtin(checkpointing), config(disk_tmp, dtype=dtype))
    for mode in ("cpu", "nvme"):
        got = train(builtin(checkpointing), config(disk_tmp, mode, dtype, **spill_kw(mode, checkpointing, dtype)))
        assert_identical(got, want)
        acts = got[2][-1]["activations"]
        assert acts["bytes"]["device->cpu"] > 0 and acts["kept_on_device_bytes"] == 0
        if mode == "nvme":
            assert acts["bytes"]["cpu->nvme"] > 0 and acts["bytes"]["nvme->cpu"] > 0
            assert acts["area_peak"] <= 24 << 10


@pytest.mark.parametrize("checkpointing", [True, False])
def test_hf_llama_trains_the_same_with_activations_parked(disk_tmp, checkpointing):
    want = train(hf(checkpointing), config(disk_tmp))
    for mode in ("cpu", "nvme"):
        got = train(hf(checkpointing), config(disk_tmp, mode, **spill_kw(mode, checkpointing)))
        assert_identical(got, want)
        assert got[2][-1]["activations"]["bytes"]["cpu->device"] > 0


def test_hf_llama_bf16_with_checkpointing(disk_tmp):
    want = train(hf(True), config(disk_tmp, dtype="bf16"))
    assert_identical(train(hf(True), config(disk_tmp, "nvme", "bf16", activation_budget="24KiB")), want)


def test_offloaded_training_matches_plain_pytorch(disk_tmp):
    ref = builtin(True)
    exact = float64_twin(ref)
    runs = [(m, torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1)) for m in (ref, exact)]
    want, want_exact = train_in_lockstep(runs, batches(), lambda m, ids: m(ids, labels=ids).loss)
    losses, state, _ = train(builtin(True), config(disk_tmp, "nvme", activation_budget="24KiB"))
    assert_losses_within_drift(losses, want, want_exact)
    assert_within_drift(state, ref.state_dict(), exact.state_dict())


def test_bytes_per_step_are_the_checkpointed_layers_inputs(disk_tmp):
    """Under checkpointing what is parked is each layer's input (batch x seq x hidden) plus the
    RoPE tables every layer is given (seq x head_dim, twice, parked once): down once, up once."""
    _, _, stats = train(builtin(True), config(disk_tmp, "cpu"))
    e = 4
    inputs = LLAMA.num_layers * BATCH * SEQ * LLAMA.hidden_size * e
    rope = 2 * SEQ * LLAMA.head_dim * e
    for s in stats:
        moved = s["activations"]["bytes"]
        assert moved["device->cpu"] == moved["cpu->device"] == inputs + rope
        assert moved["cpu->nvme"] == moved["nvme->cpu"] == 0
        assert s["activations"]["parked"] == LLAMA.num_layers + 2
        assert s["activations"]["live"] == 0 and s["activations"]["area_in_use"] == 0


def test_accumulated_micro_batches_park_each_pass(disk_tmp):
    """With gradient accumulation each forward parks its own layer inputs; a step's statistics
    count every pass, and training equals accumulation without parking."""
    def run(mode):
        model = offload.wrap(builtin(True), config(disk_tmp, mode, gradient_accumulation_steps=2))
        opt = offload.AdamW(model.parameters(), lr=LR)
        try:
            for ids in batches():
                for half in ids.split(1):
                    (model(half, labels=half).loss / 2).backward()
                opt.step()
                opt.zero_grad()
            return model.state_dict(), model.offload_stats()["activations"]
        finally:
            model.offload_engine.close()

    want, _ = run("none")
    got, acts = run("cpu")
    assert all(torch.equal(got[k], want[k]) for k in want)
    per_pass = LLAMA.num_layers * SEQ * LLAMA.hidden_size * 4 + 2 * SEQ * LLAMA.head_dim * 4
    assert acts["bytes"]["device->cpu"] == acts["bytes"]["cpu->device"] == 2 * per_pass


def test_asynchronous_copies_give_the_same_training(disk_tmp):
    """The GPU path's ordering on simulated copy streams: parking on the device-to-host stream,
    bringing back on the host-to-device one, chunks through three tiers with their own copies."""
    want = train(builtin(True), config(disk_tmp))
    streams = SimStreams(delay_s=0.0005)
    try:
        got = train(builtin(True), config(disk_tmp, "nvme", merge_host_tiers=False, device_budget="4MiB",
                                          cpu_budget="4MiB", activation_budget="24KiB"), streams)
    finally:
        streams.close()
    assert_identical(got, want)


def test_the_trace_shows_activation_copies(disk_tmp, monkeypatch):
    path = Path(disk_tmp) / "trace.json"
    monkeypatch.setenv("OFFLOAD_TRACE", str(path))
    train(builtin(True), config(disk_tmp, "nvme", activation_budget="24KiB"))
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {ev["tid"] for ev in events if ev.get("cat") == "activations"}
    assert {"activations device->cpu", "activations cpu->device", "activations cpu->nvme",
            "activations nvme->cpu"} <= tracks
    assert all(ev["args"]["bytes"] > 0 for ev in events if ev.get("cat") == "activations")


@pytest.mark.gpu
def test_gpu_peak_memory_and_step_time():
    """On a GPU: the same batch with activations parked in pinned memory takes less device memory.
    The step times are printed, not judged (speed lives in `offload bench step`)."""
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=8, num_heads=16,
                      num_kv_heads=4, max_seq_len=2048)
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    results = {}
    for mode in ("none", "cpu"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        model.gradient_checkpointing = True
        model = offload.wrap(model, offload.OffloadConfig(device="cuda", activation_offload=mode))
        opt = offload.AdamW(model.parameters(), lr=1e-4)
        times = []
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()     # the peak is this run's: from what it started with
        for _ in range(5):
            torch.cuda.synchronize()
            started = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        results[mode] = (torch.cuda.max_memory_allocated() - start, sorted(times[1:])[len(times[1:]) // 2])
        model.offload_engine.close()
        del model, opt
        gc.collect()        # the wrapped model and its engine refer to each other
        torch.cuda.empty_cache()
    print("activation offload on GPU (peak bytes, median step s):", results)
    assert results["cpu"][0] < results["none"][0]
