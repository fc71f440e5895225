"""``offload checkpoint verify`` on a ``finetune --pp`` checkpoint root: each step-N/ with a
pipeline.json is verified stage by stage (each stage-*/ holds an engine checkpoint), not reported
as 'incomplete, ignored by --resume' (a resume does load it)."""

from __future__ import annotations

import json

import torch

import offload
from offload.checkpoint import save_checkpoint
from offload.checkpoint.verify import verify_root


def stage_checkpoint(directory, seed):
    torch.manual_seed(seed)
    model = offload.wrap(torch.nn.Linear(8, 8), offload.OffloadConfig(device="cpu", dtype="fp32"))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    save_checkpoint(model, opt, directory, step=2)


def pipeline_root(tmp_path):
    step = tmp_path / "step-00000002"
    for s in range(2):
        stage_checkpoint(step / f"stage-00{s}", s)
    (step / "pipeline.json").write_text(json.dumps({"format": "offload-pipeline-checkpoint", "pp": 2}))
    (tmp_path / "latest").write_text("step-00000002\n")
    return tmp_path


def test_each_stage_of_a_pipeline_checkpoint_is_verified(tmp_path):
    verdicts, notes = verify_root(pipeline_root(tmp_path))
    assert [v.ok for v in verdicts] == [True, True]
    assert not any("incomplete" in n for n in notes)
    assert verify_root(tmp_path / "step-00000002")[0] and all(v.ok for v in verify_root(tmp_path / "step-00000002")[0])


def test_a_damaged_stage_is_reported_corrupt(tmp_path):
    root = pipeline_root(tmp_path)
    data = next((root / "step-00000002" / "stage-001").rglob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    verdicts, _ = verify_root(root)
    assert [v.ok for v in verdicts] == [True, False]
    assert "stage-001" in verdicts[1].path


def test_a_missing_stage_is_a_problem_not_silence(tmp_path):
    root = pipeline_root(tmp_path)
    import shutil
    shutil.rmtree(root / "step-00000002" / "stage-001")
    (root / "step-00000002" / "stage-001").mkdir()
    verdicts, _ = verify_root(root)
    assert any(not v.ok and "stage-001" in v.path for v in verdicts)
