"""What the step benchmarks train and how a sample of it is timed (``offload bench step``, alone
and with ``--nproc``): the reference LLaMA at a preset in bf16, a fixed batch of random token
ids, and the offloaded steps timed until the engine is idle (see ``offload.bench.step``).
"""

from __future__ import annotations

import time

from ..errors import OffloadError

BYTES_PER_PARAM = 14          # bf16 param (2) + fp32 master, exp_avg, exp_avg_sq (4 each)
DISK_MARGIN = 1.5             # swap files: state plus chunk padding and a second parameter copy
STEPS_PER_SAMPLE = 2          # a sample is two steps back to back (offload.bench.step's docstring)


def bytes_per_param(state: str = "fp32", master: str = "fp32") -> float:
    """State bytes per parameter of the bf16 model the step benchmarks train: the bf16 parameter,
    the master (none beside a bf16 parameter when the master is bf16) and both moments at ``state``
    (14.0 for fp32 state, about 4.03 for 8-bit moments with a bf16 master)."""
    import torch

    from ..engine.precision import StatePrecision

    return 2.0 + StatePrecision(state, master, torch.bfloat16).state_bytes()


class BenchStepError(OffloadError):
    """The step benchmark cannot run as asked (disk space, sizes); the message says what to change."""


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def build_model(preset, device: str, seed: int = 0):
    """(the bf16 ``LlamaForCausalLM`` of ``preset``, a name or a ``LlamaConfig``, seeded, on
    ``device``; its config)."""
    import torch

    from ..models.llama import LlamaConfig, LlamaForCausalLM, get_preset

    cfg = preset if isinstance(preset, LlamaConfig) else get_preset(preset)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.to(device) if device == "cuda" else model, cfg


def token_batch(cfg, batch_tokens: int, device: str):
    """The same random token ids every time: rows of min(``batch_tokens``, ``cfg.max_seq_len``)."""
    import torch

    seq = min(batch_tokens, cfg.max_seq_len)
    rows = max(1, batch_tokens // seq)
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (rows, seq), generator=gen).to(device)


def time_compute(model, ids, device: str, repeats: int) -> list[float]:
    """Plain PyTorch forward + backward of the bf16 model, no optimizer."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        sync(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times


def offload_steps(model, opt, ids, device: str, n: int = STEPS_PER_SAMPLE) -> float:
    """Seconds per step of ``n`` offloaded steps back to back, on the clock until the updates still
    queued after the last one and the writes they started have finished (``offload.bench.step``)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.offload_engine.chunks.drain(moves=True)
    sync(device)
    return (time.perf_counter() - t0) / n
