"""offload bench step --state/--master: the precisions compared, their bytes per parameter, the
refusals at the command line, and one short side-by-side run through real engines and NVMe files."""

from __future__ import annotations

import json

import pytest

from offload.bench import step_precision
from offload.bench.workload import bytes_per_param
from offload.errors import ConfigError
from offload.models import llama

MIB = 1 << 20


def test_precisions_pair_by_position_and_a_single_value_applies_to_all():
    assert step_precision.parse_precisions(None, None) == [("fp32", "fp32")]
    assert step_precision.parse_precisions("fp32,8bit", "fp32,bf16") == [("fp32", "fp32"), ("8bit", "bf16")]
    assert step_precision.parse_precisions("fp32,bf16,8bit", None) == [("fp32", "fp32"), ("bf16", "fp32"),
                                                                        ("8bit", "fp32")]
    assert step_precision.parse_precisions("8bit", "fp32, bf16") == [("8bit", "fp32"), ("8bit", "bf16")]


@pytest.mark.parametrize("state, master, match", [
    ("fp16", None, r"--state='fp16': must be one of fp32, bf16, 8bit"),
    (None, "8bit", r"--master='8bit': must be one of fp32, bf16"),
    ("fp32,8bit,bf16", "fp32,bf16", r"--master='fp32,bf16': has 2 values where the other flag has 3"),
    ("fp32,8bit,fp32", None, r"'fp32/fp32': is listed twice"),
])
def test_bad_precision_lists_name_the_flag(state, master, match):
    with pytest.raises(ConfigError, match=match):
        step_precision.parse_precisions(state, master)


def test_bytes_per_parameter_follow_the_contract():
    # bf16 parameter 2 B; fp32 master 4 B (a bf16 master IS the bf16 parameter); moments 2 x 4 B
    # (fp32), 2 x 2 B (bf16), 2 x (1 B code + a 4 B absmax per 256-element block) (8-bit)
    assert bytes_per_param("fp32", "fp32") == 14.0
    assert bytes_per_param("bf16", "fp32") == 10.0
    assert bytes_per_param("8bit", "fp32") == 2 + 4 + 2 * (1 + 4 / 256)
    assert bytes_per_param("8bit", "bf16") == 2 + 2 * (1 + 4 / 256)


@pytest.mark.parametrize("argv, message", [
    (["--state", "fp32,8bit", "--nproc", "2"], "--state/--master='fp32/fp32': is measured with --nproc 1 only"),
    (["--state", "fp32,8bit", "--batch-curve", "64"], "--batch-curve='64': is not measured when several"),
    (["--state", "4bit"], "--state='4bit': must be one of"),
])
def test_refusals_at_the_command_line_are_one_line(argv, message, tmp_path, capsys):
    from offload.cli import main

    rc = main(["bench", "step", "--path", str(tmp_path / "nvme"), *argv])
    err = capsys.readouterr().err
    assert rc == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "nvme").exists()


@pytest.mark.nvme
def test_side_by_side_run_reports_each_precision_against_the_first(tmp_path, monkeypatch):
    micro = llama.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_layers=2,
                              num_heads=2, num_kv_heads=1, max_seq_len=64, tie_embeddings=True)
    monkeypatch.setitem(llama.PRESETS, "micro", micro)
    out, nvme_dir = tmp_path / "cmp.json", tmp_path / "nvme"
    from offload.cli import main

    rc = main(["bench", "step", "--path", str(nvme_dir), "--preset", "micro", "--steps", "2", "--warmup", "1",
               "--batch-tokens", "64", "--state", "fp32,8bit", "--master", "fp32,bf16", "--json", str(out)])
    assert rc == 0
    assert not nvme_dir.exists()             # created for the run, removed with its swap files
    r = json.loads(out.read_text())
    assert r["baseline"] == "state fp32 / master fp32" and r["batch_tokens"] == 64
    fp32, q = r["results"]
    assert (fp32["state"], fp32["master"], q["state"], q["master"]) == ("fp32", "fp32", "8bit", "bf16")
    assert fp32["speedup"] == 1.0 and q["speedup"] == pytest.approx(fp32["step_s"] / q["step_s"])
    assert len(fp32["step_times_s"]) == len(q["step_times_s"]) == 2
    for x in (fp32, q):
        assert x["state_bytes"] == int(bytes_per_param(x["state"], x["master"]) * r["params"])
        assert x["nvme_read_bytes"] > 0 and x["nvme_write_bytes"] > 0     # the state went through NVMe
    assert q["nvme_bytes_ratio"] == pytest.approx((q["nvme_read_bytes"] + q["nvme_write_bytes"])
                                                  / (fp32["nvme_read_bytes"] + fp32["nvme_write_bytes"]))
    # Fewer bytes per parameter, fewer bytes through NVMe each step.
    assert q["nvme_bytes_ratio"] < 1
