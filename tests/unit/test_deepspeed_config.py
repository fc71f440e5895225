"""OffloadConfig.from_deepspeed: mapped keys, ignored knobs (one warning line), refused settings."""

from __future__ import annotations

import copy
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import AioConfig, ConfigError, OffloadConfig
from offload.compat import deepspeed_optimizer_kwargs, from_deepspeed

# The ZeRO-Infinity example circulated in the Hugging Face DeepSpeed docs (NVMe for both kinds),
# with "aio" at the top level where DeepSpeed reads it.
HF_INFINITY = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
            "single_submit": False, "overlap_events": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def hf(**changes):
    cfg = copy.deepcopy(HF_INFINITY)
    for path, value in changes.items():
        node = cfg
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if value is _DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return cfg


_DELETE = object()


def test_hf_zero_infinity_config_maps(caplog):
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        cfg = OffloadConfig.from_deepspeed(hf(bf16__enabled=True))
    assert cfg.dtype == "bf16"
    assert cfg.nvme_paths == ("/local_nvme",)
    assert cfg.pin_memory is True
    assert cfg.aio == AioConfig(block_size=262144, queue_depth=32, threads=1)
    assert cfg.chunk_size == "auto" and cfg.prefetch_depth == 2  # sub_group_size 1e9 = DeepSpeed's default
    assert cfg.device_budget == "auto" and cfg.cpu_budget == "auto"
    assert cfg.gradient_accumulation_steps == 1
    # one warning line listing every knob accepted without effect, with the key path
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.config"]
    assert len(lines) == 1
    for key in ("zero_optimization.overlap_comm", "zero_optimization.stage3_max_live_parameters",
                "zero_optimization.offload_param.buffer_size", "aio.single_submit", "train_batch_size",
                "scheduler", "gradient_accumulation_steps='auto'"):
        assert key in lines[0]


def test_hf_config_as_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(hf(fp16__enabled=True, bf16__enabled=False)))
    cfg = OffloadConfig.from_deepspeed(path)
    assert cfg.dtype == "fp16" and cfg.initial_loss_scale == 2.0**16 and cfg.loss_scale_window == 1000
    assert cfg == OffloadConfig.from_deepspeed(str(path))


def test_bad_json_file_names_it(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json"):
        from_deepspeed(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        from_deepspeed(tmp_path / "missing.json")


def test_auto_precision_keeps_default_dtype_and_overrides_apply():
    cfg = from_deepspeed(HF_INFINITY, device="cpu", dtype="fp32", cpu_budget="1GiB")
    assert cfg.dtype == "fp32" and cfg.device == "cpu" and cfg.cpu_budget == 1 << 30
    assert from_deepspeed(HF_INFINITY).dtype == OffloadConfig().dtype


def test_fp32_when_nothing_enabled_and_minimal_configs():
    assert from_deepspeed({}).dtype == "fp32"
    cfg = from_deepspeed({"bf16": {"enabled": True}, "gradient_accumulation_steps": 8})
    assert cfg.dtype == "bf16" and cfg.gradient_accumulation_steps == 8 and cfg.nvme_paths is None


def test_fp16_scale_mapping():
    cfg = from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 200}})
    assert cfg.initial_loss_scale == 4096.0 and cfg.loss_scale_window == 200


def test_stage2_cpu_optimizer_offload_is_accepted():
    cfg = from_deepspeed({"bf16": {"enabled": True},
                          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                  "pin_memory": False}}})
    assert cfg.nvme_paths is None and cfg.pin_memory is False and cfg.device_budget == "auto"


def test_two_nvme_paths_are_striped():
    cfg = from_deepspeed(hf(zero_optimization__offload_param__nvme_path="/nvme1"))
    assert cfg.nvme_paths == ("/nvme1", "/local_nvme")


def test_param_cpu_optimizer_nvme():
    cfg = from_deepspeed(hf(zero_optimization__offload_param={"device": "cpu"}))
    assert cfg.nvme_paths == ("/local_nvme",)


def test_sub_group_and_prefetch_bucket_map_to_chunks():
    cfg = from_deepspeed(hf(zero_optimization__sub_group_size=1e6,
                            zero_optimization__stage3_prefetch_bucket_size=5e6))
    assert cfg.chunk_size == 1_000_000 // 2048 * 2048
    assert cfg.prefetch_depth == -(-5_000_000 // cfg.chunk_size)
    assert from_deepspeed(hf(zero_optimization__sub_group_size=100)).chunk_size == 2048


def test_legacy_cpu_offload_and_intra_op_parallelism():
    cfg = from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": True},
                          "aio": {"intra_op_parallelism": 2}})
    assert cfg.aio.threads == 2


@pytest.mark.parametrize("changes,key,words", [
    ({"zero_optimization__offload_param__nvme_path": _DELETE},
     "zero_optimization.offload_param.device", "requires zero_optimization.offload_param.nvme_path"),
    ({"zero_optimization__offload_optimizer__nvme_path": None},
     "zero_optimization.offload_optimizer.device", "requires zero_optimization.offload_optimizer.nvme_path"),
    ({"aio__use_gds": True}, "aio.use_gds", "not supported"),
    ({"fp16__enabled": True, "bf16__enabled": False, "fp16__loss_scale": 128},
     "fp16.loss_scale", "(static) is not supported: offload uses dynamic loss scaling"),
    ({"fp16__enabled": True, "bf16__enabled": True}, "fp16.enabled", "cannot both"),
    ({"optimizer__type": "Lamb"}, "optimizer.type", "not supported"),
    ({"optimizer__params__amsgrad": True}, "optimizer.params.amsgrad", "not supported"),
    ({"zero_optimization__offload_optimizer__ratio": 0.3}, "zero_optimization.offload_optimizer.ratio",
     "not supported"),
    ({"zero_optimization__offload_param__device": "hpu"}, "zero_optimization.offload_param.device",
     "not supported"),
    ({"zero_optimization__stage": 2}, "zero_optimization.offload_param.device", "requires zero_optimization.stage=3"),
    ({"zero_optimization__stage": 4}, "zero_optimization.stage", "must be"),
    ({"zero_optimization__zero_quantized_weights": True}, "zero_optimization.zero_quantized_weights",
     "not supported"),
    ({"zero_optimization__aio": {"block_size": 262144}}, "zero_optimization.aio", "top level"),
    ({"zero_optimization__offload_param__nvme_pth": "/x"}, "zero_optimization.offload_param.nvme_pth",
     "unknown key"),
    ({"aio__block_size": 1000}, "aio.block_size", "4096"),
    ({"aio__queue_depth": 0}, "aio.queue_depth", ">= 1"),
    ({"aio__thread_count": 1, "aio__intra_op_parallelism": 4}, "aio.intra_op_parallelism", "thread_count"),
    ({"aio__thread_count": 1000}, "aio.thread_count", "between"),
    ({"fp16__enabled": True, "bf16__enabled": False, "fp16__initial_scale_power": 40},
     "fp16.initial_scale_power", "at most 32"),
    ({"amp": {"enabled": True}}, "amp.enabled", "not supported"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps", ">= 1"),
    ({"zero_optimization__offload_param__pin_memory": "yes"}, "zero_optimization.offload_param.pin_memory",
     "true or false"),
])
def test_refused_settings_name_the_deepspeed_key(changes, key, words):
    with pytest.raises(ConfigError) as err:
        from_deepspeed(hf(**changes))
    assert err.value.field == key
    assert str(err.value).startswith(key) and words in str(err.value)


def test_optimizer_kwargs():
    ds = {"optimizer": {"type": "Adam", "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1}},
          "gradient_clipping": 1.0}
    assert deepspeed_optimizer_kwargs(ds) == {"lr": 3e-5, "betas": (0.9, 0.95), "eps": 1e-8,
                                              "weight_decay": 0.1, "max_grad_norm": 1.0}
    assert deepspeed_optimizer_kwargs({"gradient_clipping": 0}) == {"max_grad_norm": None}
    assert deepspeed_optimizer_kwargs(HF_INFINITY) == {}
    # DeepSpeed's Adam in L2 mode: only without weight decay
    assert deepspeed_optimizer_kwargs({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}) \
        == {"weight_decay": 0.0}
    with pytest.raises(ConfigError, match="optimizer.params.adam_w_mode"):
        deepspeed_optimizer_kwargs({"optimizer": {"type": "Adam",
                                                  "params": {"adam_w_mode": False, "weight_decay": 0.1}}})
    with pytest.raises(ConfigError, match="gradient_clipping"):
        deepspeed_optimizer_kwargs({"gradient_clipping": -1})


def test_optimizer_kwargs_build_an_adamw():
    import torch

    import offload

    p = torch.nn.Parameter(torch.zeros(4))
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.0}},
          "gradient_clipping": 1.0}
    opt = offload.AdamW([p], **deepspeed_optimizer_kwargs(ds))
    assert opt.max_grad_norm == 1.0 and opt.param_groups[0]["betas"] == (0.9, 0.99)


@settings(max_examples=200, deadline=None)
@given(block=st.integers(min_value=-1, max_value=(1 << 31)),
       depth=st.integers(min_value=-1, max_value=70000),
       threads=st.integers(min_value=-1, max_value=300))
def test_aio_numbers_map_or_name_their_key(block, depth, threads):
    ds = {"aio": {"block_size": block, "queue_depth": depth, "thread_count": threads}}
    ok_block = 4096 <= block <= 1 << 30 and block % 4096 == 0
    ok_depth = 1 <= depth <= 65536
    ok_threads = 1 <= threads <= 256
    if ok_block and ok_depth and ok_threads:
        aio = from_deepspeed(ds).aio
        assert (aio.block_size, aio.queue_depth, aio.threads) == (block, depth, threads)
    else:
        with pytest.raises(ConfigError) as err:
            from_deepspeed(ds)
        assert err.value.field in {"aio.block_size", "aio.queue_depth", "aio.thread_count"}
        bad = {"aio.block_size": not ok_block, "aio.queue_depth": not ok_depth,
               "aio.thread_count": not ok_threads}
        assert bad[err.value.field]


@given(power=st.integers(min_value=0, max_value=32), window=st.integers(min_value=1, max_value=10**6))
def test_fp16_numbers_property(power, window):
    cfg = from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": power, "loss_scale_window": window}})
    assert cfg.initial_loss_scale == 2.0**power and cfg.loss_scale_window == window


# ---- every key from_deepspeed does not use is listed (issue 26 point 9) ---------------------------
def warning_of(caplog, ds):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        from_deepspeed(ds)
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.config"]
    assert len(lines) <= 1
    return lines[0] if lines else ""


def test_optimizer_and_clipping_are_listed_with_where_they_go(caplog):
    line = warning_of(caplog, {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "eps": "auto"}},
                               "gradient_clipping": 1.0})
    assert "optimizer (AdamW, lr=3e-05, eps='auto'" in line
    assert "gradient_clipping=1.0 (-> max_grad_norm=1.0" in line
    assert line.count("deepspeed_optimizer_kwargs(ds)") == 2
    assert "gradient_clipping='auto' (-> AdamW's default" in warning_of(caplog, {"gradient_clipping": "auto"})
    assert "gradient_clipping" in warning_of(caplog, HF_INFINITY) and "optimizer (AdamW" in warning_of(caplog, HF_INFINITY)


@pytest.mark.parametrize("ds,listed", [
    ({"bf16": {"enabled": True}, "fp16": {"enabled": False, "loss_scale_window": 500}},
     "fp16.loss_scale_window (fp16 is not enabled)"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bfloat16 (bf16 is read"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1e6, "prefetch_bucket_size": 1e6}},
     "zero_optimization.prefetch_bucket_size (zero_optimization.stage3_prefetch_bucket_size is read"),
    ({"zero_optimization": {"cpu_offload_use_pin_memory": True}},
     "zero_optimization.cpu_offload_use_pin_memory (neither"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.cpu_offload (zero_optimization.offload_optimizer is read"),
])
def test_keys_shadowed_or_switched_off_are_listed(caplog, ds, listed):
    assert listed in warning_of(caplog, ds)


def test_nothing_listed_when_every_key_is_used(caplog):
    assert warning_of(caplog, {"bf16": {"enabled": True}, "gradient_accumulation_steps": 4,
                               "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                     "offload_optimizer": {"device": "cpu"}}}) == ""


def test_deepspeed_optimizer_kwargs_is_exported_and_documented():
    import pathlib

    import offload

    assert "deepspeed_optimizer_kwargs" in offload.__all__
    assert offload.deepspeed_optimizer_kwargs({"gradient_clipping": 2.0}) == {"max_grad_norm": 2.0}
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    assert "offload.deepspeed_optimizer_kwargs(" in readme
