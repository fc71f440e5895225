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


NUMERIC = {"--lora-rank": ["0", "-1", "x"], "--gpu-mem": ["0", "80X", "-1G"], "--cpu-mem": ["0", "lots"],
           "--nvme-capacity": ["0", "8Q"], "--nvme-gbps": ["0", "-2", "nan", "inf", "x"],
           "--nvme-write-gbps": ["0"], "--gpu-tflops": ["-400"], "--cpu-gflops": ["0"], "--pcie-gbps": ["0"],
           "--adam-params-per-s": ["-1"], "--batch-tokens": ["-5", "0", "2.5"], "--seq-len": ["0"],
           "--device-budget": ["0", "1Z"], "--cpu-budget": ["-3"], "--micro-batches": ["0"], "--world": ["0"],
           "--local-world": ["-2"]}


@pytest.mark.parametrize("flag,value", [(f, v) for f, values in NUMERIC.items() for v in values])
def test_every_numeric_flag_is_checked_at_parse_time(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(CLI_100B + [f"{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"offload plan: error: argument {flag}:"), err
    assert "Traceback" not in err


def test_every_missing_figure_of_a_described_box_is_named_at_once(capsys):
    assert main(["plan", "--model", "llama-100b", "--nvme-capacity", "8T"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("offload: error: to describe another box, give"), err
    for flag in ("--cpu-mem", "--gpu-mem and --gpu-tflops, or --cpu-gflops", "--nvme-gbps or --nvme-bench FILE"):
        assert flag in err[0], flag
    assert main(["plan", "--model", "llama-100b", "--gpu-mem", "80G", "--nvme-gbps", "25"]) == 1
    err = capsys.readouterr().err
    assert "--cpu-mem" in err and "--gpu-tflops" in err and "--nvme-capacity" not in err


def test_lora_rank_on_a_preset_plans_full_and_lora(capsys):
    assert main(CLI_100B + ["--lora-rank", "16", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "llama-100b + LoRA r=16" and data["policy"]["lora_rank"] == 16
    assert data["nvme_bytes_needed"] < 0.25e12            # the README: 0.20 TB instead of 1.81 TB
    assert main(CLI_100B + ["--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert "NVMe space needed: 1.81 TB" in out and "NVMe space needed: 202 GB" in out


def test_readme_lora_plan_for_a_24g_gpu_runs_on_a_box_without_one(capsys, tmp_path, monkeypatch):
    """README: `offload plan --model ./Llama-3.1-8B --lora-rank 16 --gpu-mem 24G --nvme-path /mnt/nvme0`,
    here with no GPU: the GPU's rate is assumed by its memory (and said), the rest measured here."""
    pytest.importorskip("peft")
    from offload.plan import figures, probes
    from tests.helpers.hf_models import tiny_config

    model = tmp_path / "model"
    tiny_config("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2).save_pretrained(model)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    monkeypatch.setattr(probes, "cuda_or_none", lambda: None)
    monkeypatch.setattr(probes, "measure_nvme", lambda paths: (2.0, 1.5))
    monkeypatch.setattr(probes, "measure_adam", lambda dtype: 1e9)
    argv = ["plan", "--model", str(model), "--lora-rank", "16", "--gpu-mem", "24G", "--nvme-path", str(nvme)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.count("offload plan:") == 2 and "LoRA r=16" in captured.out
    assert f"assuming {figures.assumed_gpu_tflops(24 << 30):g} TFLOPS for a GPU of 24 GiB" in captured.err
    assert "--gpu-tflops" in captured.err
    assert main(argv + ["--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["gpu_mem"] == 24 << 30 and data["hardware"]["pcie_gbps"] == figures.ASSUMED_PCIE_GBPS
    assert data["hardware_sources"]["compute_tflops"].startswith("assumed")


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A directory the process may not write (os.access says so: root would write through chmod)."""
    import os

    path = tmp_path / "ro"
    path.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if (mode & os.W_OK and str(p) == str(path))
                        else real_access(p, mode, **kw))
    return path


def test_read_only_nvme_path_names_what_each_command_takes(capsys, read_only, monkeypatch):
    from offload.errors import ConfigError
    from offload.plan import probes
    from offload.plan.figures import hardware_for

    monkeypatch.setattr(probes, "cuda_or_none", lambda: None)
    assert main(["plan", "--model", "tiny", "--cpu-mem", "8G", "--cpu-gflops", "100", "--adam-params-per-s", "1e9",
                 "--nvme-path", str(read_only)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--nvme-path={str(read_only)!r}: is not writable" in err[0], err
    assert "to plan without measuring it, give --nvme-gbps or --nvme-bench FILE" in err[0]
    # the trainer's call: no --nvme-gbps flag to offer, the path named as not writable
    with pytest.raises(ConfigError) as info:
        hardware_for([str(read_only)], cpu_mem="8G", cpu_gflops=100, adam_params_per_s=1e9)
    assert info.value.field == "--nvme-path" and "is not writable" in str(info.value)
    assert "nvme-gbps" not in str(info.value) and "nvme_gbps" not in str(info.value)


def test_failing_nvme_probe_offers_only_the_running_commands_flags(tmp_path, monkeypatch):
    from offload.errors import OffloadError
    from offload.plan.figures import PLAN_FLAGS, hardware_for

    def broken(path, **kw):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("offload.bench.nvme.measure", broken)
    figures = dict(cpu_mem="8G", cpu_gflops=100, adam_params_per_s=1e9)
    with pytest.raises(OffloadError) as info:
        hardware_for([str(tmp_path)], **figures)
    assert "could not measure NVMe bandwidth" in str(info.value) and "--nvme-gbps" not in str(info.value)
    with pytest.raises(OffloadError) as info:
        hardware_for([str(tmp_path)], flags=PLAN_FLAGS, **figures)
    assert str(info.value).endswith("give --nvme-gbps or --nvme-bench FILE")


def test_a_mistyped_model_directory_is_named_as_a_directory_not_only_a_preset(capsys, tmp_path):
    """`--model ./Qwen2.5-7b` (a typo of ./Qwen2.5-7B) used to say only "unknown preset"."""
    missing = tmp_path / "Qwen2.5-7b"
    assert main(CLI_100B[:1] + ["--model", str(missing)] + CLI_100B[3:]) == 1
    err = capsys.readouterr().err
    assert f"--model='{missing}': is neither a model directory" in err and "llama-7b" in err
