"""finetune_100b.py's own bad inputs end in one line naming what is wrong, never a traceback:
a tokenizer directory with missing files, a checkpoint of another dtype, a checkpoint that does not
verify (skipped with a line saying which and why). (--resume with no checkpoint starts fresh:
test_trainer_library.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import offload
from offload.train import cli as script
from tests.helpers import finetune_runs as runs

pytestmark = pytest.mark.slow


def test_tokenizer_missing_files_one_line_no_traceback(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.json").write_text("{}")
    done = subprocess.run([sys.executable, str(runs.SCRIPT), "--tokenizer", str(tok),
                           "--no-plan", "--steps", "1"], capture_output=True, text=True, env=runs.env(), timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("finetune: error: --tokenizer=") and "merges.txt" in last and str(tok) in last


def test_resume_errors_name_what_differs(reference_run, disk_tmp, capsys):
    reference, steps = reference_run
    (disk_tmp / "nvme").mkdir()
    args = runs.TRAIN_ARGS + ["--nvme-path", str(disk_tmp / "nvme"), "--steps", str(steps)]
    bf16 = [a if a != "fp32" else "bf16" for a in args]
    with pytest.raises(offload.ConfigError, match="dtype.*float32|dtype.*fp32") as info:
        script.main(bf16 + ["--checkpoint-dir", str(reference / "ckpt"), "--resume"])
    assert str(reference / "ckpt") in str(info.value)

    # The newest checkpoint is corrupt: a line names it and why, and the run resumes from the one before.
    ckpt = disk_tmp / "ckpt"
    shutil.copytree(reference / "ckpt", ckpt)
    newest = offload.checkpoint.list_checkpoints(ckpt)[-1]
    raw = bytearray((newest / "param.bin").read_bytes())
    raw[1234] ^= 1
    (newest / "param.bin").write_bytes(bytes(raw))
    previous = offload.checkpoint.list_checkpoints(ckpt)[-2]
    capsys.readouterr()
    assert script.main(args + ["--checkpoint-dir", str(ckpt), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"finetune: skipped checkpoint {newest}: " in err and "param[0]" in err and "mismatch" in err
    assert f"resumed from {previous} at step {steps - 1}" in err
    # ... and, having redone the last step, it ends where the uninterrupted run ended.
    assert runs.compare(reference / "ckpt" / newest.name, ckpt / newest.name) == []
