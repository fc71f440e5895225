"""The trainer's settings (offload.train.config / flags): one declaration per field gives its
default, help and check; impossible numbers are refused when the command line is parsed (exit 2
naming the flag) or the TOML file is read (a ConfigError naming the key and the file); flags
override the file. Run through the script as a user runs it (in-process: runpy), so each test
also pins what ``scripts/finetune_100b.py`` did before (accepted ``--steps -3``, ...)."""

from __future__ import annotations

import runpy
import sys

import pytest

from offload import ConfigError
from tests.helpers.processes import ROOT

SCRIPT = ROOT / "scripts" / "finetune_100b.py"
QUICK = ["--preset", "tiny", "--no-plan", "--dry-run", "--dtype", "fp32"]


def run_script(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """The script as ``python scripts/finetune_100b.py ARGV``: (exit status, stderr)."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("flag, value, why", [
    ("--steps", "-3", "must be >= 1"), ("--warmup", "-1", "must be >= 0"),
    ("--checkpoint-every", "-1", "must be >= 0"), ("--batch-tokens", "-5", "must be >= 1"),
    ("--seq-len", "1", "must be >= 2"), ("--save-every", "-1", "must be >= 0"),
    ("--keep-checkpoints", "0", "must be >= 1"), ("--micro-batches", "0", "must be >= 1"),
    ("--lora-rank", "0", "must be >= 1"), ("--lr", "-1", "must be > 0"), ("--chunk-size", "0", "must be >= 1"),
])
def test_impossible_numbers_exit_2_at_parse_time_naming_the_flag(flag, value, why, monkeypatch, capsys):
    code, err = run_script(QUICK + [flag, value], monkeypatch, capsys)
    assert code == 2, err[-2000:]
    assert f"argument {flag}: {why}" in err and "Traceback" not in err


def test_toml_values_pass_the_same_checks_and_unknown_keys_are_named(tmp_path):
    from offload.train.config import load_config

    bad = tmp_path / "bad.toml"
    bad.write_text("[optimizer]\nsteps = -3\n")
    with pytest.raises(ConfigError, match=r"\[optimizer\] steps=-3: must be >= 1") as info:
        load_config(bad)
    assert str(bad) in str(info.value)
    bad.write_text("[optimiser]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"\[optimiser\].*unknown section") as info:
        load_config(bad)
    assert str(bad) in str(info.value)
    bad.write_text("[data]\nbatch_token = 64\n")
    with pytest.raises(ConfigError, match=r"\[data\] batch_token=64: unknown key") as info:
        load_config(bad)
    assert str(bad) in str(info.value) and "batch_tokens" in str(info.value)
    bad.write_text("[model]\nbyte_tokens = 1\n")
    with pytest.raises(ConfigError, match="must be true or false"):
        load_config(bad)


def test_flags_override_the_file_and_defaults_have_one_source(tmp_path):
    from offload.plan.defaults import BATCH_TOKENS, SEQ_LEN
    from offload.train.config import TrainConfig
    from offload.train.flags import build_parser, parse

    run = tmp_path / "run.toml"
    run.write_text('[model]\npreset = "tiny"\ndtype = "fp32"\n[optimizer]\nsteps = 7\nlr = 1e-3\n'
                   '[budgets]\nnvme_path = ["a", "b"]\n')
    config = parse(["--config", str(run), "--steps", "3"])
    assert config.optimizer.steps == 3 and config.optimizer.lr == 1e-3 and config.model.dtype == "fp32"
    assert config.budgets.nvme_path == ["a", "b"]
    assert parse(["--config", str(run), "--nvme-path", "c"]).budgets.nvme_path == ["c"]
    assert parse([]) == TrainConfig()
    assert TrainConfig().data.batch_tokens == BATCH_TOKENS and TrainConfig().data.seq_len == SEQ_LEN
    text = " ".join(build_parser().format_help().split())
    assert f"tokens per optimizer step, over all ranks under torchrun (default {BATCH_TOKENS})" in text


def test_a_missing_nvme_path_is_an_error_naming_it(tmp_path, monkeypatch, capsys):
    """A mistyped or unmounted drive must not become a directory on the root disk."""
    missing = tmp_path / "mnt" / "nvme0"
    code, err = run_script(QUICK + ["--nvme-path", str(missing)], monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err
    assert f"finetune: error: --nvme-path='{missing}': does not exist" in err
    assert not (tmp_path / "mnt").exists()


def test_inputs_are_checked_before_planning(tmp_path, monkeypatch, capsys):
    """A chat file without a chat template, or a data file that is not there, is reported before
    the planner measures the box (seconds, and 256 MiB written to the NVMe directory)."""
    import offload.plan.figures as figures

    def planned(*args, **kwargs):
        raise RuntimeError("the planner ran before the inputs were checked")

    monkeypatch.setattr(figures, "gather_hardware", planned)
    monkeypatch.setattr(figures, "hardware_for", planned, raising=False)
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "nvme").mkdir()
    base = ["--preset", "tiny", "--steps", "1", "--nvme-path", str(tmp_path / "nvme")]
    code, err = run_script(base + ["--data", str(chat)], monkeypatch, capsys)
    assert code == 1 and "chat template" in err and str(chat) in err
    code, err = run_script(base + ["--data", str(tmp_path / "absent.txt")], monkeypatch, capsys)
    assert code == 1 and "absent.txt" in err and "finetune: error: --data" in err


def test_presets_train_on_bytes_and_say_so(monkeypatch, capsys):
    code, err = run_script(QUICK, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert "tokens: bytes (256 ids; a preset trains from scratch)" in err


def test_a_model_directory_without_a_tokenizer_is_an_error_unless_byte_tokens(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import save_tiny

    src = save_tiny(tmp_path / "src", "llama")
    argv = ["--model", str(src), "--no-plan", "--dry-run", "--dtype", "fp32"]
    code, err = run_script(argv, monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err
    assert f"finetune: error: --model='{src}': has no tokenizer files" in err and "--byte-tokens" in err
    code, err = run_script(argv + ["--byte-tokens"], monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert "tokens: bytes (256 ids; --byte-tokens)" in err


def test_the_script_is_a_thin_entry_point():
    assert len(SCRIPT.read_text().splitlines()) <= 60


def test_an_output_directory_that_cannot_be_replaced_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """--output replaces only an earlier export (or an empty directory): a directory of other files is
    refused at start, not after the whole run has trained (with nothing saved)."""
    mine = tmp_path / "keep"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, err = run_script(QUICK + ["--output", str(mine)], monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err
    assert f"--output='{mine}': exists and is not an earlier export" in err
    assert (mine / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flag, where", [("--checkpoint-dir", "out"), ("--checkpoint-dir", "out/ckpt"),
                                         ("--json-log", "out/log.jsonl"), ("--tensorboard", "out/tb")])
def test_what_writing_the_output_would_delete_is_refused_at_start(flag, where, tmp_path, monkeypatch, capsys):
    """Writing --output replaces its directory whole: checkpoints or logs inside it would be deleted
    (or, the first time, make the output directory 'not an earlier export' after the run trained)."""
    code, err = run_script(QUICK + ["--output", str(tmp_path / "out"), flag, str(tmp_path / where)],
                           monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err
    assert f"finetune: error: {flag}='{tmp_path / where}': is inside --output" in err


def test_a_model_flag_overrides_the_files_preset_and_back(tmp_path):
    """--model and --preset are one choice (what is trained): the flag's replaces the file's, not
    'exclude each other'."""
    from offload.train.flags import parse

    preset = tmp_path / "preset.toml"
    preset.write_text('[model]\npreset = "small"\n')
    config = parse(["--config", str(preset), "--model", "./my-model"])
    assert config.model.model == "./my-model" and config.model.preset is None
    model = tmp_path / "model.toml"
    model.write_text('[model]\nmodel = "./my-model"\n')
    config = parse(["--config", str(model), "--preset", "tiny"])
    assert config.model.preset == "tiny" and config.model.model is None


def test_the_start_up_log_names_the_data_and_the_shipped_corpus_when_no_data_is_given(tmp_path, monkeypatch, capsys):
    """Forgetting --data trains on the corpus shipped with the project: the log must say so."""
    code, err = run_script(QUICK, monkeypatch, capsys)
    assert code == 0 and "data: the corpus shipped with offload (no --data given)" in err
    text = tmp_path / "mine.txt"
    text.write_text("hello world " * 50)
    code, err = run_script(QUICK + ["--data", str(text)], monkeypatch, capsys)
    assert code == 0 and f"data: {text} (text, 600 tokens)" in err


def test_an_adapter_output_dtype_is_refused_before_training():
    """--output-dtype without --merge on a LoRA run failed only when the output was written, after
    the whole run."""
    from offload.train.flags import parse
    from offload.train.inputs import check_config

    with pytest.raises(ConfigError, match="--output-dtype.*--merge"):
        check_config(parse(["--model", "m", "--lora-rank", "4", "--output", "o", "--output-dtype", "bf16"]))
    check_config(parse(["--model", "m", "--lora-rank", "4", "--merge", "--output", "o", "--output-dtype", "bf16"]))


def test_a_checkpoint_dir_that_is_a_file_is_named_as_the_flag(tmp_path, monkeypatch, capsys):
    afile = tmp_path / "ckpt"
    afile.write_text("")
    code, err = run_script(QUICK + ["--checkpoint-dir", str(afile)], monkeypatch, capsys)
    assert code == 1 and f"finetune: error: --checkpoint-dir='{afile}': is not a directory" in err


@pytest.mark.parametrize("where", ["model", "."])
def test_an_output_that_would_replace_the_source_model_is_refused_at_start(where, tmp_path, monkeypatch, capsys):
    """--output the --model directory itself (or a directory holding it) would replace the model the
    run fine-tunes from, and which the export reads again: refused before anything runs."""
    from tests.helpers.hf_models import save_tiny

    model = save_tiny(tmp_path / "model")
    before = sorted(p.name for p in model.iterdir())
    code, err = run_script(["--model", str(model), "--byte-tokens", "--no-plan", "--dry-run", "--dtype", "fp32",
                            "--output", str(tmp_path / where)], monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err
    assert f"finetune: error: --output='{tmp_path / where}': would replace --model {model}" in err
    assert sorted(p.name for p in model.iterdir()) == before
