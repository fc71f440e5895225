"""OffloadConfig's activation fields: choices, budgets, and errors that name the field."""

from __future__ import annotations

import pytest

from offload import OffloadConfig
from offload.errors import ConfigError


def test_defaults_keep_activations_on_the_device():
    cfg = OffloadConfig()
    assert cfg.activation_offload == "none" and cfg.activation_tier == "none"
    assert cfg.activation_budget == "auto" and cfg.activation_min_bytes is None


def test_auto_spills_only_where_there_is_nvme(tmp_path):
    assert OffloadConfig(activation_offload="auto").activation_tier == "cpu"
    assert OffloadConfig(activation_offload="auto", nvme_paths=[str(tmp_path)]).activation_tier == "nvme"


def test_budget_strings_are_bytes():
    assert OffloadConfig(activation_offload="cpu", activation_budget="2GiB").activation_budget == 2 << 30


@pytest.mark.parametrize("kw, field", [
    ({"activation_offload": "gpu"}, "activation_offload"),
    ({"activation_offload": "nvme"}, "activation_offload"),          # no nvme_paths
    ({"activation_budget": 0}, "activation_budget"),
    ({"activation_budget": "lots"}, "activation_budget"),
    ({"activation_min_bytes": -1}, "activation_min_bytes"),
    ({"activation_min_bytes": 1.5}, "activation_min_bytes"),
    ({"activation_prefetch": -2}, "activation_prefetch"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        OffloadConfig(**kw)


def test_round_trips_through_a_dict(tmp_path):
    cfg = OffloadConfig(activation_offload="nvme", nvme_paths=[str(tmp_path)], activation_budget="64MiB",
                        activation_min_bytes=4096)
    assert OffloadConfig.from_dict(cfg.to_dict()) == cfg
