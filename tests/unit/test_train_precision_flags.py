"""``offload finetune --optimizer-state {fp32,bf16,8bit} --master {fp32,bf16}``: parsed from the
command line and the TOML file like every trainer setting, refused by name when wrong, and handed
to the engine the run builds (``OffloadConfig.optimizer_state`` / ``.master``)."""

from __future__ import annotations

import math

import pytest

from offload import ConfigError
from offload.train.config import load_config
from offload.train.flags import parse

QUICK = ["--preset", "tiny", "--no-plan", "--steps", "2", "--warmup", "1", "--batch-tokens", "256",
         "--seq-len", "128"]


def test_defaults_are_exact_fp32_adam():
    c = parse([])
    assert (c.optimizer.state, c.optimizer.master) == ("fp32", "fp32")


def test_flags_and_toml_set_the_precision(tmp_path):
    c = parse(["--optimizer-state", "8bit", "--master", "bf16"])
    assert (c.optimizer.state, c.optimizer.master) == ("8bit", "bf16")
    toml = tmp_path / "run.toml"
    toml.write_text('[optimizer]\nstate = "bf16"\nmaster = "bf16"\n')
    c = load_config(toml)
    assert (c.optimizer.state, c.optimizer.master) == ("bf16", "bf16")
    assert parse(["--config", str(toml), "--optimizer-state", "8bit"]).optimizer.state == "8bit"   # flag wins
    toml.write_text('[optimizer]\nstate = "int4"\n')
    with pytest.raises(ConfigError, match=r"\[optimizer\] state='int4': must be one of fp32, bf16, 8bit") as info:
        load_config(toml)
    assert str(toml) in str(info.value)


@pytest.mark.parametrize("flag, value, options", [("--optimizer-state", "4bit", "fp32, bf16, 8bit"),
                                                  ("--master", "fp16", "fp32, bf16")])
def test_a_bad_value_exits_2_naming_the_flag(flag, value, options, capsys):
    with pytest.raises(SystemExit) as info:
        parse([flag, value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {flag}: must be one of {options}" in err and "Traceback" not in err


def test_the_run_trains_with_the_chosen_precision(tmp_path, monkeypatch):
    from offload.train.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    trainer = Trainer(parse(QUICK + ["--optimizer-state", "8bit", "--master", "bf16"]))
    assert trainer.train() == 0
    config = trainer.model.offload_engine.config
    assert (config.optimizer_state, config.master) == ("8bit", "bf16")
    kinds = set(trainer.model.offload_engine.chunks.kinds)
    # 8-bit moments carry one fp32 scale per block; a bf16 master under bf16 compute is the parameter itself
    assert {"exp_avg_absmax", "exp_avg_sq_absmax"} <= kinds and "master" not in kinds
    assert len(trainer.losses) == 2 and all(math.isfinite(x) for x in trainer.losses)


def test_the_run_plans_with_the_chosen_precision():
    """The trainer's plan counts the optimizer state the engine will hold: 8-bit moments and a bf16
    master (the bf16 parameters themselves) leave 4.03 B a parameter of state beside the
    parameters and fp32 gradients, where fp32 Adam keeps 12."""
    import offload
    from offload.models import get_preset
    from offload.train.planning import make_plan

    per_param = {}
    for state, master in (("fp32", "fp32"), ("8bit", "bf16")):
        config = parse(QUICK[:-4] + ["--optimizer-state", state, "--master", master])
        engine_config = offload.OffloadConfig(dtype="bf16", optimizer_state=state, master=master)
        plan, _, _ = make_plan(config, get_preset("tiny"), engine_config)
        per_param[state] = plan.breakdown["state_bytes_per_param"]
    # fp32 master + moments (12 B) against 8-bit moments with their scales (2 x (1 + 4/256) B)
    assert per_param["fp32"] - per_param["8bit"] == pytest.approx(12 - 2 * (1 + 4 / 256))


def test_a_resume_under_another_precision_names_the_flags_to_give(tmp_path, monkeypatch):
    """The checkpoint's chunks hold 8-bit moments and no master: resuming it with the default fp32
    state is refused before anything is built, with the flags that resume it."""
    from offload.train.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    saving = QUICK + ["--checkpoint-dir", "ck", "--optimizer-state", "8bit", "--master", "bf16"]
    assert Trainer(parse(saving)).train() == 0
    with pytest.raises(ConfigError, match=r"--optimizer-state='fp32': the checkpoint .*step-00000002 holds 8bit "
                                          r"optimizer state with a bf16 master: resume it with "
                                          r"--optimizer-state 8bit --master bf16"):
        Trainer(parse(QUICK + ["--checkpoint-dir", "ck", "--resume"])).prepare()
    with pytest.raises(ConfigError, match=r"--master='fp32'"):
        Trainer(parse(QUICK + ["--checkpoint-dir", "ck", "--resume", "--optimizer-state", "8bit"])).prepare()
    resumed = Trainer(parse(QUICK + ["--checkpoint-dir", "ck", "--resume", "--steps", "3", "--optimizer-state", "8bit",
                                     "--master", "bf16"]))
    assert resumed.train() == 0 and len(resumed.losses) == 1
