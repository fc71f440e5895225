"""Every invalid config field raises ConfigError naming it; valid ones normalise to bytes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import offload
from offload import AioConfig, ConfigError, OffloadConfig, parse_bytes


def test_defaults_are_valid():
    cfg = OffloadConfig()
    assert cfg.device == "auto" and cfg.dtype == "bf16" and cfg.aio.block_size == 1 << 20


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 << 30), ("512MB", 512_000_000), ("2G", 2 << 30), ("1.5 MiB", 3 << 19),
    ("4096", 4096), (" 8k ", 8192), ("1TiB", 1 << 40),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("field,value", [
    ("device", "tpu"), ("dtype", "int8"), ("device_budget", "lots"), ("cpu_budget", -1),
    ("cpu_budget", 0), ("device_budget", True), ("nvme_paths", []), ("nvme_paths", ["/a", "/a"]),
    ("nvme_paths", [3]), ("chunk_size", 1000), ("chunk_size", 4097 * 2048 + 1), ("chunk_size", "big"),
    ("prefetch_depth", -1), ("prefetch_depth", 1.5), ("optimizer_threads", 0), ("optimizer_threads", "many"),
    ("aio", "fast"),
])
def test_bad_offload_field_names_itself(field, value):
    with pytest.raises(ConfigError) as err:
        OffloadConfig(**{field: value})
    assert err.value.field == field
    assert field in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize("field,value", [
    ("backend", "io_uring"), ("block_size", 1000), ("block_size", 0), ("block_size", "3K"),
    ("queue_depth", 0), ("threads", 0), ("checksum", "yes"),
])
def test_bad_aio_field_names_itself(field, value):
    with pytest.raises(ConfigError) as err:
        AioConfig(**{field: value})
    assert err.value.field == f"aio.{field}"


@given(st.integers())
def test_prefetch_depth_property(n):
    if 0 <= n <= 1024:
        assert OffloadConfig(prefetch_depth=n).prefetch_depth == n
    else:
        with pytest.raises(ConfigError, match="prefetch_depth"):
            OffloadConfig(prefetch_depth=n)


@given(st.integers(min_value=-(1 << 40), max_value=1 << 40))
def test_budget_property(n):
    if n > 0:
        assert OffloadConfig(cpu_budget=n).cpu_budget == n
    else:
        with pytest.raises(ConfigError, match="cpu_budget"):
            OffloadConfig(cpu_budget=n)


@given(st.integers(min_value=-(1 << 32), max_value=1 << 32))
def test_chunk_size_property(n):
    if n >= 2048 and n % 2048 == 0:
        assert OffloadConfig(chunk_size=n).chunk_size == n
    else:
        with pytest.raises(ConfigError, match="chunk_size"):
            OffloadConfig(chunk_size=n)


@given(st.integers(min_value=-(1 << 31), max_value=1 << 31), st.integers(-10, 70000), st.integers(-2, 300))
def test_aio_numeric_property(block, depth, threads):
    valid = block >= 4096 and block % 4096 == 0 and block <= 1 << 30 and 1 <= depth <= 65536 and 1 <= threads <= 256
    if valid:
        cfg = AioConfig(block_size=block, queue_depth=depth, threads=threads)
        assert (cfg.block_size, cfg.queue_depth, cfg.threads) == (block, depth, threads)
    else:
        with pytest.raises(ConfigError, match=r"aio\.(block_size|queue_depth|threads)"):
            AioConfig(block_size=block, queue_depth=depth, threads=threads)


def test_budget_strings_normalise():
    cfg = OffloadConfig(device_budget="512MB", cpu_budget="4GiB", nvme_paths="/mnt/nvme0")
    assert cfg.device_budget == 512_000_000 and cfg.cpu_budget == 4 << 30
    assert cfg.nvme_paths == ("/mnt/nvme0",)


def test_frozen_and_keyword_only():
    cfg = OffloadConfig()
    with pytest.raises(AttributeError):
        cfg.dtype = "fp32"
    with pytest.raises(TypeError):
        OffloadConfig("cpu")
    assert cfg.replace(dtype="fp32").dtype == "fp32"
    with pytest.raises(ConfigError, match="dtype"):
        cfg.replace(dtype="fp8")


def test_from_dict_and_json_round_trip(tmp_path):
    cfg = OffloadConfig(device="cpu", dtype="fp32", cpu_budget="1GiB", nvme_paths=["/x", "/y"],
                        chunk_size=1 << 20, aio=AioConfig(backend="threads", queue_depth=8))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert OffloadConfig.from_json(path) == cfg
    assert OffloadConfig.from_dict(cfg.to_dict()) == cfg


def test_from_dict_unknown_keys_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cpu_budgt"):
        OffloadConfig.from_dict({"cpu_budgt": "1G"})
    with pytest.raises(ConfigError, match=r"aio\.depth"):
        OffloadConfig.from_dict({"aio": {"depth": 3}})
    with pytest.raises(ConfigError, match="missing.json"):
        OffloadConfig.from_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="line 1"):
        OffloadConfig.from_json(bad)


def test_errors_importable_from_package():
    for name in ("OffloadError", "ConfigError", "NvmeIOError", "TierFullError", "PinnedMemoryError",
                 "ChecksumError", "StateError", "NativeError", "UnsupportedError"):
        assert issubclass(getattr(offload, name), offload.OffloadError)
    err = offload.NvmeIOError(28, "/mnt/x", 4096, 8192, "write")
    assert err.errno == 28 and err.path == "/mnt/x" and err.offset == 4096 and err.length == 8192
    assert "ENOSPC" in str(err) and "/mnt/x" in str(err) and "4096" in str(err)
