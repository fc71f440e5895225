"""`offload plan` as a user meets it: its defaults are the trainer's and its help says them, every
numeric flag is checked at parse time, every missing figure of a described box is named at once."""

from __future__ import annotations

import json

import pytest

from offload.cli import main
from offload.plan.defaults import BATCH_TOKENS, SEQ_LEN

CLI_100B = ["plan", "--model", "llama-100b", "--gpu-mem", "80G", "--cpu-mem", "512G",
            "--nvme-capacity", "8T", "--nvme-gbps", "25", "--gpu-tflops", "400"]


def test_plan_defaults_are_the_trainers_and_help_says_them(capsys):
    assert (BATCH_TOKENS, SEQ_LEN) == (2048, 256)
    assert main(CLI_100B + ["--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["policy"]["batch_tokens"] == BATCH_TOKENS
    assert data["breakdown"]["seq_len"] == SEQ_LEN
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"default {BATCH_TOKENS}" in help_text and f"default {SEQ_LEN}" in help_text
    assert "16384" not in help_text
