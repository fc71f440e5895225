"""The engine on a real GPU (``pytest -m gpu``; every test here skips without CUDA).

The same equivalences as the CPU suite, with compute on cuda and budgets small enough that
chunks go through all three tiers (GPU, pinned CPU, NVMe): fp32 with TF32 off equals plain
PyTorch; bf16 follows a mixed-precision reference; fp16 skips a forced overflow; accumulation,
clipping, overlap on and off, tied embeddings and activation checkpointing (TinyGPT has both),
an HF Llama, ``lazy_init``, a user stream. Then what only a GPU shows: every CPU-tier buffer is
pinned, completed copies are reaped (prefetch hits), peak GPU memory stays within the device
budget plus activations, running out is a DeviceMemoryError, and state_dict / checkpoint /
safetensors round trips with chunks resident on the GPU. ``test_sanitizer_run`` repeats training
runs under ``TORCH_CUDA_SANITIZER=1`` (stream-ordering races raise there), the engine's threads and
activation offload included (see conftest.py for what the sanitizer sees).

fp32 runs are judged as on the CPU (tests/helpers/trajectory.py): as close to the same run in float64 as
plain PyTorch's fp32 run on the same card is.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from tests.helpers.tiny_gpt import TinyGPT, batches
from tests.helpers.trajectory import assert_losses_within_drift, assert_within_drift, float64_twin

ROOT = Path(__file__).resolve().parents[2]
# What runs under the sanitizer (node ids from the repository's root), the test that last failed
# there first: device-resident round trips, the Adam worker's copies (overlapped updates),
# accumulation's fp32 gradient chunks, a user stream, activation offload's parks and prefetches.
SANITIZED = ("tests/gpu/test_gpu_path.py::test_round_trips_with_device_resident_chunks",
             "tests/gpu/test_gpu_path.py::test_fp32_equals_torch",
             "tests/gpu/test_gpu_path.py::test_accumulation_and_clipping",
             "tests/gpu/test_gpu_path.py::test_user_stream",
             "tests/gpu/test_gpu_activations.py")

pytestmark = pytest.mark.gpu

LR, WD = 1e-2, 0.1
CUDA = "cuda"


@pytest.fixture(autouse=True)
def exact_fp32():
    """TF32 off: fp32 matmuls on both sides round the same way."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    torch.cuda.synchronize()


def gpu_config(path, **kw) -> offload.OffloadConfig:
    base = dict(device=CUDA, dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
                nvme_paths=[str(path)], chunk_size=8192)
    base.update(kw)
    return offload.OffloadConfig(**base)


def models(seed=0, checkpointing=True):
    torch.manual_seed(seed)
    ref = TinyGPT(checkpointing=checkpointing)
    return ref, copy.deepcopy(ref)


def cuda_batches(n, **kw):
    for x, y in batches(n, **kw):
        yield x.to(CUDA), y.to(CUDA)


def reference(ref, steps, *, accumulate=1, clip=None, skip=()):
    ref = ref.to(CUDA)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    losses, data = [], iter(cuda_batches(steps * accumulate))
    for step in range(steps):
        total = 0.0
        for _ in range(accumulate):
            x, y = next(data)
            loss = ref(x, y) / accumulate
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        if step not in skip:
            opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


class Reference:
    """Plain PyTorch's fp32 run on the card and the same run in float64 (the exact one)."""

    def __init__(self, ref, steps, **kw):
        exact = float64_twin(ref)
        self.fp32, self.losses = ref, reference(ref, steps, **kw)
        self.exact, self.exact_losses = exact, reference(exact, steps, **kw)

    def check(self, model, losses, *, params=True) -> None:
        assert_losses_within_drift(losses, self.losses, self.exact_losses)
        if params:
            got = {k: v.cpu() for k, v in model.state_dict().items()}
            assert_within_drift(got, {k: v.cpu() for k, v in self.fp32.state_dict().items()},
                                {k: v.cpu() for k, v in self.exact.state_dict().items()})


def train(model, cfg, steps, *, accumulate=1, clip=None, overflow_at=None, stream=None):
    model = offload.wrap(model, cfg)
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=clip)
    losses, data = [], iter(cuda_batches(steps * accumulate))
    ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream())
    with ctx:
        for step in range(steps):
            total = 0.0
            for _ in range(accumulate):
                x, y = next(data)
                loss = model(x, y) / accumulate
                if step == overflow_at:
                    loss = loss * float("inf")
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
    torch.cuda.synchronize()
    return model, opt, losses


def assert_params_close(model, ref, rtol, atol):
    got = model.state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name].float().cpu(), want.float().cpu(), rtol=rtol, atol=atol, msg=name)


def assert_three_tiers_used(model):
    engine = model.offload_engine
    assert engine.store.order == ["device", "cpu", "nvme"], engine.store.order
    assert engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"], "nothing reached NVMe"


# ---- equivalence -------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False])
def test_fp32_equals_torch(disk_tmp, overlap):
    ref, mine = models()
    want = Reference(ref, 20)
    model, _, got = train(mine, gpu_config(disk_tmp, overlap_optimizer=overlap), 20)
    want.check(model, got)
    assert_three_tiers_used(model)
    model.offload_engine.close()


def test_bf16_follows_mixed_precision_reference(disk_tmp):
    ref32, mine = models()
    master = copy.deepcopy(ref32).to(CUDA)
    compute = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD)
    want = []
    for x, y in cuda_batches(20):
        loss = compute(x, y)
        loss.backward()
        for pm, pc in zip(master.parameters(), compute.parameters()):
            pm.grad, pc.grad = pc.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pc in zip(master.parameters(), compute.parameters()):
                pc.copy_(pm)
        want.append(loss.item())
    model, _, got = train(mine, gpu_config(disk_tmp, dtype="bf16"), 20)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)
    assert_params_close(model, master, rtol=0, atol=2e-2)
    model.offload_engine.close()


def test_fp16_skips_a_forced_overflow(disk_tmp):
    ref, mine = models()
    want = reference(ref, 12, skip={5})
    model, opt, got = train(mine, gpu_config(disk_tmp, dtype="fp16", initial_loss_scale=2.0**12), 12, overflow_at=5)
    engine = model.offload_engine
    assert engine.scaler.skipped == 1 and engine.step_count == 11
    torch.testing.assert_close(torch.tensor([l for i, l in enumerate(got) if i != 5]),
                               torch.tensor([l for i, l in enumerate(want) if i != 5]), rtol=3e-2, atol=0)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    engine.close()


def test_accumulation_and_clipping(disk_tmp):
    ref, mine = models()
    want = Reference(ref, 8, accumulate=3, clip=0.5)
    model, opt, got = train(mine, gpu_config(disk_tmp, gradient_accumulation_steps=3), 8, accumulate=3, clip=0.5)
    want.check(model, got)
    assert opt.last_grad_norm > 0.5
    model.offload_engine.close()


def test_user_stream(disk_tmp):
    """Training issued under ``torch.cuda.stream(s)``: copies order against ``s``, not the default stream."""
    ref, mine = models()
    want = Reference(ref, 12)
    model, _, got = train(mine, gpu_config(disk_tmp), 12, stream=torch.cuda.Stream())
    want.check(model, got)
    model.offload_engine.close()


def test_hf_llama_equals_torch(disk_tmp):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    mine, exact = copy.deepcopy(ref), float64_twin(ref).to(CUDA)
    ref = ref.to(CUDA)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1)).to(CUDA)
    want, want_exact = [], []
    for m, out in ((ref, want), (exact, want_exact)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(6):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
    model = offload.wrap(mine, gpu_config(disk_tmp, device_budget="256KiB", cpu_budget="512KiB"))
    oopt = offload.AdamW(model.parameters(), lr=1e-3)
    got = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        oopt.step()
        oopt.zero_grad()
        got.append(loss.item())
    assert_losses_within_drift(got, want, want_exact)
    model.offload_engine.close()


def test_lazy_init_equals_eager_on_cuda(disk_tmp):
    from offload.models.llama import LlamaForCausalLM, get_preset

    cfg = get_preset("tiny")
    torch.manual_seed(123)
    eager = LlamaForCausalLM(cfg)
    config = gpu_config(disk_tmp, device_budget="6MiB", cpu_budget="6MiB", chunk_size="auto")
    torch.manual_seed(123)
    with offload.lazy_init(config):
        lazy = LlamaForCausalLM(cfg)
    model = offload.wrap(lazy)
    got = model.state_dict()
    for name, want in eager.state_dict().items():
        assert torch.equal(got[name].cpu(), want), name
    model.offload_engine.close()


def test_default_device_cuda_keeps_host_buffers_on_the_host(disk_tmp):
    """``torch.set_default_device("cuda")`` must not move the engine's host buffers to the GPU."""
    ref, mine = models()
    want = Reference(ref, 4)
    torch.set_default_device(CUDA)
    try:
        model, _, got = train(mine, gpu_config(disk_tmp), 4)
    finally:
        torch.set_default_device(None)
    want.check(model, got, params=False)
    for rec in model.offload_engine.store.records.values():
        if "cpu" in rec.buffers:
            assert rec.buffers["cpu"].device.type == "cpu", rec.key
    model.offload_engine.close()


# ---- what only a GPU shows -------------------------------------------------------------------

def test_cpu_tier_buffers_are_pinned(disk_tmp):
    _, mine = models()
    model, _, _ = train(mine, gpu_config(disk_tmp), 3)
    store = model.offload_engine.store
    host = [rec.buffers["cpu"] for rec in store.records.values() if "cpu" in rec.buffers]
    assert host, "nothing was resident in the CPU tier"
    assert all(buf.is_pinned() for buf in host)
    model.offload_engine.close()


def test_copies_are_reaped_and_prefetch_hits(disk_tmp):
    """A repeating trace with room for the prefetch window: fetches land before they are needed."""
    _, mine = models()
    model = offload.wrap(mine, gpu_config(disk_tmp, device_budget="2MiB", cpu_budget="4MiB", prefetch_depth=4))
    opt = offload.AdamW(model.parameters(), lr=LR)
    rates = []
    for i, (x, y) in enumerate(cuda_batches(12)):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if i >= 4:
            rates.append(model.offload_stats()["prefetch_hit_rate"])
    assert statistics.median(rates) > 0.9, rates
    model.offload_engine.close()


def test_peak_gpu_memory_within_budget_plus_activations(disk_tmp):
    """Outside its device budget the engine adds only the activations plain PyTorch has too, and
    one parameter's gradient in flight (autograd's tensor, until it is copied into its chunk)."""
    ref, mine = models()
    ref = ref.to(CUDA)
    x, y = next(cuda_batches(1))
    weights = sum(p.numel() * p.element_size() for p in ref.parameters())
    largest_grad = max(p.numel() * p.element_size() for p in ref.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()            # the weights are in it already
    ref(x, y).backward()
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - base - weights      # beyond the weights' gradients
    del ref                  # and its gradients with it
    torch.cuda.empty_cache()
    budget = 256 << 10
    model = offload.wrap(mine, gpu_config(disk_tmp, device_budget=budget, cpu_budget="512KiB"))
    opt = offload.AdamW(model.parameters(), lr=LR)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() - model.offload_engine.store.tiers["device"].reserved
    for x, y in cuda_batches(4):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    slack = 1 << 20          # cuBLAS workspace and allocator rounding
    # Parameters and their gradients live in the budget: nothing weights-sized beside it.
    assert peak <= budget + activations + largest_grad + slack, (peak, budget, activations, largest_grad)
    model.offload_engine.close()


def test_running_out_of_gpu_memory_is_a_clear_error(disk_tmp):
    """A device budget the configuration accepts but the card cannot back (the rest of its memory
    is taken): the first chunk buffer fails in CUDA, and that is a DeviceMemoryError naming the
    budget, not a raw OutOfMemoryError. The wrap itself must succeed: an error there (a
    ConfigError) would not be the one under test."""
    from offload.errors import DeviceMemoryError

    torch.manual_seed(0)
    mine = TinyGPT(vocab=4096, d=256, layers=4, heads=4)        # 4.2 M parameters: 17 MB of fp32
    chunk = 1 << 20                                              # 4 MiB chunk buffers
    model = offload.wrap(mine, gpu_config(disk_tmp, device_budget="64MiB", cpu_budget="64MiB",
                                          chunk_size=chunk))
    opt = offload.AdamW(model.parameters(), lr=LR)
    x, y = next(cuda_batches(1, vocab=4096))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    hog, step = [], 64 << 20
    while step >= (1 << 20):           # take the card's memory until less than a chunk is left
        try:
            hog.append(torch.empty(step, dtype=torch.uint8, device=CUDA))
        except torch.OutOfMemoryError:
            step //= 2
    try:
        free, _ = torch.cuda.mem_get_info()
        assert free < chunk * 4, free
        with pytest.raises(DeviceMemoryError, match="device budget") as info:
            model(x, y).backward()
            opt.step()
        assert not isinstance(info.value, torch.OutOfMemoryError)
    finally:
        del hog
        torch.cuda.empty_cache()
    model.offload_engine.close()


def test_round_trips_with_device_resident_chunks(disk_tmp):
    from offload.models.llama import LlamaForCausalLM, get_preset

    cfg = get_preset("tiny")
    torch.manual_seed(0)
    big = "64MiB"           # everything fits on the GPU tier
    model = offload.wrap(LlamaForCausalLM(cfg), offload.OffloadConfig(device=CUDA, dtype="bf16", device_budget=big,
                                                                      cpu_budget=big))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 32)).to(CUDA)
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    osd = copy.deepcopy(opt.state_dict())
    offload.save_checkpoint(model, opt, disk_tmp / "ckpt", step=3)
    offload.export_safetensors(model, disk_tmp / "st")

    torch.manual_seed(1)
    other = offload.wrap(LlamaForCausalLM(cfg), offload.OffloadConfig(device=CUDA, dtype="bf16",
                                                                      device_budget=big, cpu_budget=big))
    oopt = offload.AdamW(other.parameters(), lr=1e-3)
    offload.load_checkpoint(other, oopt, disk_tmp / "ckpt")
    got = other.state_dict()
    assert all(torch.equal(got[k].cpu(), v.cpu()) for k, v in sd.items())
    ostate = oopt.state_dict()["state"]
    assert ostate.keys() == osd["state"].keys()
    for i, s in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ostate[i][key].cpu(), s[key].cpu()), (i, key)
        assert float(ostate[i]["step"]) == float(s["step"]) == 3, i

    torch.manual_seed(2)
    third = offload.wrap(LlamaForCausalLM(cfg), offload.OffloadConfig(device=CUDA, dtype="bf16",
                                                                      device_budget=big, cpu_budget=big))
    offload.load_safetensors(third, disk_tmp / "st")
    third.load_state_dict(sd)           # and the plain state_dict path
    got = third.state_dict()
    assert all(torch.equal(got[k].cpu(), v.cpu()) for k, v in sd.items())
    for m in (model, other, third):
        m.offload_engine.close()


def test_trace_has_a_gpu_timeline(disk_tmp, monkeypatch):
    import json

    trace = disk_tmp / "trace.json"
    monkeypatch.setenv("OFFLOAD_TRACE", str(trace))
    _, mine = models()
    model, _, _ = train(mine, gpu_config(disk_tmp / "nvme"), 3)
    model.offload_engine.close()
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"] for e in events}
    assert {"gpu compute", "gpu h2d", "gpu d2h"} <= tracks, tracks


def test_sanitizer_run(disk_tmp):
    """The tests of ``SANITIZED`` again under CUDA's stream sanitizer (CSAN): any unsynchronized
    access between our copy streams and compute raises there. ``benchmarks/gpu_check.sh
    sanitizer`` runs the same tests as a stage of their own (under CSAN they take minutes)."""
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        pytest.skip("already running under the sanitizer")
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    timeout = float(os.environ.get("OFFLOAD_SANITIZER_TIMEOUT_S", 900))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "gpu",
                           *SANITIZED], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "CSAN" not in out and "data race" not in out.lower(), out[-4000:]
