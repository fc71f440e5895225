"""A model whose state is 10x the device + CPU budgets round-trips through NVMe bit-exactly,
and peak RSS while streaming it stays under the budgets plus a stated overhead."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.processes import python_env

pytestmark = [pytest.mark.nvme, pytest.mark.slow]

# Fixed overhead on top of the tier budgets: one chunk-sized temporary per kind while a chunk is
# generated or verified, the NVMe read-back staging buffer, and allocator slack.
RSS_OVERHEAD = 32 << 20

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import psutil, torch
    from offload import AioConfig
    from offload.chunks import ChunkLayout, ChunkStore
    from offload.scheduler import NextUsePolicy
    from offload.tiers import MemoryTier, NvmeTier

    nvme_dir, device_budget, cpu_budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # A 44-layer MLP-shaped model: ~18 M parameters, 14 bytes of state each.
    shapes = []
    for i in range(44):
        shapes += [(f"l{i}.weight", (640, 640)), (f"l{i}.bias", (640,))]
    shapes.append(("head.weight", (500, 640)))
    layout = ChunkLayout.build(shapes, 512 * 1024)
    kinds = {"param": torch.bfloat16, "master": torch.float32, "exp_avg": torch.float32,
             "exp_avg_sq": torch.float32}
    store = ChunkStore([MemoryTier("device", device_budget), MemoryTier("cpu", cpu_budget, aligned=True),
                        NvmeTier([nvme_dir], AioConfig(queue_depth=16))], NextUsePolicy())
    for kind, dtype in kinds.items():
        store.register(kind, layout.num_chunks, layout.chunk_size, dtype)
    state_bytes = sum(r.nbytes for r in store.records.values())

    # Expected contents are regenerated into preallocated scratch, so the test itself allocates
    # nothing per chunk and RSS reflects the store alone.
    scratch = torch.empty(layout.chunk_size)
    typed = {dtype: torch.empty(layout.chunk_size, dtype=dtype) for dtype in set(kinds.values())}

    def expected(key):
        gen = torch.Generator().manual_seed(hash(key) % (2**31))
        torch.randn(layout.chunk_size, generator=gen, out=scratch)
        out = typed[kinds[key[0]]]
        out.copy_(scratch)
        return out

    proc = psutil.Process()
    expected(("param", 0)), expected(("master", 0))
    baseline = proc.memory_info().rss
    peak = baseline
    for key in store.records:                       # stream the whole model in, chunk by chunk
        store.initialize(key, "cpu", lambda v, key=key: v.copy_(expected(key)))
        peak = max(peak, proc.memory_info().rss)
    exact = True
    for key in store.records:                       # everything back up to the device, and compare
        view = store.access(key, "device")
        exact &= torch.equal(view, expected(key))
        store.release(key, "device")
        peak = max(peak, proc.memory_info().rss)
    for key in list(store.records)[:8]:             # and read() straight from wherever it lives
        exact &= torch.equal(store.read(key), expected(key))
    report = store.memory_report()
    store.tiers["nvme"].close()
    print(json.dumps({"state_bytes": state_bytes, "baseline": baseline, "peak": peak, "exact": exact,
                      "moved": report["moved_bytes"], "nvme_bytes": report["tiers"]["nvme"]["bytes_by_kind"]}))
""")


def test_ten_times_budget_round_trip_and_rss(disk_tmp):
    device_budget, cpu_budget = 8 << 20, 16 << 20
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(disk_tmp), str(device_budget), str(cpu_budget)],
                          capture_output=True, text=True, timeout=600, env=python_env())
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["state_bytes"] >= 10 * (device_budget + cpu_budget)
    assert out["exact"]
    assert out["moved"]["cpu->nvme"] > 0 and out["moved"]["nvme->cpu"] > 0
    growth = out["peak"] - out["baseline"]
    assert growth <= device_budget + cpu_budget + RSS_OVERHEAD, (
        f"peak RSS grew {growth / 2**20:.1f} MiB over the {(device_budget + cpu_budget) / 2**20:.0f} MiB budgets")
