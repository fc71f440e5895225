"""A script that ends right after ``optimizer.step()``, without ``engine.close()``: that step's updates
are still queued on the Adam worker (a daemon thread). At exit Python stops daemon threads before it
collects the engine, whose close then waited for the stopped worker forever: the process hung.
Engines left open are now drained and closed by an ``atexit`` hook (offload/engine/lifetime.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers.processes import python_env

SCRIPT = textwrap.dedent("""
    import sys, torch, offload
    from offload.config import OffloadConfig
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(16)])
    where = {} if sys.argv[1] == "memory" else dict(cpu_budget=8 << 20, device_budget=4 << 20, nvme_paths=[sys.argv[1]])
    model = offload.wrap(net, OffloadConfig(device="cpu", optimizer_state=sys.argv[2], **where))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    for _ in range(3):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if sys.argv[3] == "raise":
        raise SystemExit("user error after the step")
""")


@pytest.mark.parametrize("tiers,state,ending", [("memory", "fp32", "end"), ("memory", "fp32", "raise"),
                                                ("nvme", "fp32", "end"), ("nvme", "8bit", "end")])
def test_process_exits_with_updates_queued(disk_tmp, tiers, state, ending):
    script = disk_tmp / "train.py"
    script.write_text(SCRIPT)
    nvme = disk_tmp / "nvme"
    nvme.mkdir()
    try:
        proc = subprocess.run([sys.executable, str(script), "memory" if tiers == "memory" else str(nvme), state,
                               ending], env=python_env(), capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung at exit")
    want = 0 if ending == "end" else 1
    assert proc.returncode == want, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr or ending == "raise", proc.stderr[-2000:]
    # Closed at exit: the swap files (and their private directories) are gone.
    assert [p for p in nvme.rglob("*") if p.is_file()] == []
