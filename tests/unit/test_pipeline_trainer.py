"""``offload finetune --pp`` settings checked before anything is built (offload/train/pipeline_checks.py):
each bad combination a ConfigError naming the flag; --pp 1 checks nothing new."""

from __future__ import annotations

import pytest

from offload.errors import ConfigError
from offload.pipeline import SCHEDULES
from offload.train import config as train_config
from offload.train.flags import parse
from offload.train.inputs import check_config
from offload.train.pipeline_checks import data_world, micro_batches
from offload.train.ranks import Ranks

BASE = ["--preset", "tiny", "--batch-tokens", "256", "--seq-len", "32"]     # 8 sequences a step


def test_the_flag_offers_the_librarys_schedules():
    assert set(train_config.SCHEDULES) == set(SCHEDULES)


@pytest.mark.parametrize("flags, world, message", [
    (["--pp", "2"], 3, "--pp=2: must divide the 3 ranks torchrun started"),
    (["--pp", "2", "--dtype", "fp16"], 2, "--dtype='fp16': is refused under --pp"),
    (["--pp", "2", "--output", "out"], 2, "--output='out': is not written under --pp yet"),
    (["--pp", "2", "--micro-batches", "1"], 2, "--micro-batches=1: must be >= the 2 stages under --schedule 1f1b"),
    (["--pp", "2", "--schedule", "interleaved-1f1b", "--micro-batches", "5"], 2,
     "--micro-batches=5: must be a multiple of its 2 rounds"),
    (["--pp", "2", "--micro-batches", "3"], 2, "--micro-batches=3: must divide the step's 8 sequences"),
    (["--pp", "2", "--batch-tokens", "96"], 4, "must split evenly over 2 data-parallel ranks"),
    # tiny: embedding, 4 layers, norm + head = 6 units; 4 ranks x 2 stages each = 8 stages
    (["--pp", "4", "--schedule", "interleaved-1f1b", "--micro-batches", "4"], 4,
     "--pp=4: 8 stages under --schedule interleaved-1f1b exceed llama-tiny's 6 units to cut"),
    (["--pp", "8"], 8, "--pp=8: 8 stages under --schedule 1f1b exceed llama-tiny's 6 units to cut"),
    # a schedule without stages would be ignored without a word
    (["--schedule", "gpipe"], 1, "--schedule='gpipe': schedules pipeline stages: give --pp 2 or more"),
    (["--schedule", "1f1b"], 2, "--schedule='1f1b': schedules pipeline stages"),
])
def test_a_bad_pipeline_combination_names_its_flag(flags, world, message):
    with pytest.raises(ConfigError) as err:
        check_config(parse(BASE + flags), Ranks(0, world))
    assert message in str(err.value)


def test_a_model_directory_is_refused_under_stages(tmp_path):
    with pytest.raises(ConfigError, match="--pp=2: trains --preset models only"):
        check_config(parse(["--model", str(tmp_path), "--pp", "2"]), Ranks(0, 2))


def test_the_ranks_split_as_pp_by_dp():
    c = parse(BASE + ["--pp", "2"])
    check_config(c, Ranks(0, 4))
    assert data_world(c, 4) == 2 and micro_batches(c) == 2      # default: as many micro-batches as stages
    assert data_world(parse(BASE), 4) == 4 and micro_batches(parse(BASE + ["--micro-batches", "4"])) == 4
