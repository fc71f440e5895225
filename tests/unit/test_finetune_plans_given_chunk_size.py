"""Issue 27 review (R7): the planner must plan the chunk layout the engine will build. With
``--chunk-size`` given (or a resumed checkpoint's chunk size) ``offload finetune`` planned its own
layout (offload/train/planning.py builds ``Policy`` without ``chunk_size``): ``--chunk-size 8192``
printed "chunks of 3,059,712 elements x 1" and the verdict was about that layout, so budgets it
called a fit could fail in the engine (review27 R1, R7)."""

from __future__ import annotations

from offload.cli import main


def test_dry_run_plans_the_given_chunk_size(capsys, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    code = main(["finetune", "--preset", "tiny", "--steps", "1", "--dtype", "fp32", "--chunk-size", "8192",
                 "--nvme-path", str(nvme), "--dry-run"])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code in (0, None), out[-2000:]
    assert "chunks of 8,192 elements" in out, [line for line in out.splitlines() if "chunks of" in line]
