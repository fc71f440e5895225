"""Precision flags a user gets wrong, on the command line: each error names the flag as typed
(``--master``, ``--dtype``), the way the trainer's other cross-flag checks do, and comes before
anything is built."""

from __future__ import annotations

import pytest

from offload import ConfigError
from offload.train.flags import parse
from offload.train.inputs import check_config

QUICK = ["--preset", "tiny", "--no-plan", "--steps", "2", "--batch-tokens", "256", "--seq-len", "128"]


def test_a_bf16_master_under_fp32_compute_names_the_flags():
    with pytest.raises(ConfigError) as info:
        check_config(parse(QUICK + ["--dtype", "fp32", "--master", "bf16"]))
    assert info.value.field == "--master" and info.value.value == "bf16"
    assert "--dtype fp32" in str(info.value) and "--dtype bf16" in str(info.value)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_bf16_master_under_half_compute_is_accepted(dtype):
    check_config(parse(QUICK + ["--dtype", dtype, "--master", "bf16", "--optimizer-state", "8bit"]))
