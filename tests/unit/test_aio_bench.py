"""`offload bench nvme`: the measure() dict, refusals, clean-up, the CLI's output and JSON."""

from __future__ import annotations

import json
import os

import pytest

from offload import ConfigError
from offload.bench import fio, nvme
from offload.cli import main

KEYS = {"path", "backend", "block_size", "queue_depth", "threads", "size", "read_gbps", "write_gbps", "fio"}


def test_measure_schema_and_cleanup(disk_tmp):
    r = nvme.measure(disk_tmp, size=8 << 20, block_size=1 << 20, queue_depth=4, threads=2, repeats=1,
                     with_fio=fio.available())
    assert set(r) == KEYS and r["size"] == 8 << 20 and r["threads"] == 2
    assert r["read_gbps"] > 0 and r["write_gbps"] > 0
    if fio.available():
        assert set(r["fio"]) == {"read_gbps", "write_gbps"} and r["fio"]["read_gbps"] > 0
    else:
        assert r["fio"] is None
    assert os.listdir(disk_tmp) == []


def test_measure_one_mode(disk_tmp):
    r = nvme.measure(disk_tmp, size=4 << 20, block_size=1 << 20, queue_depth=2, repeats=1, mode="read",
                     with_fio=False)
    assert r["write_gbps"] is None and r["read_gbps"] > 0 and r["fio"] is None


def test_refuses_more_than_free_space(disk_tmp, monkeypatch):
    import offload.aio

    monkeypatch.setattr(offload.aio, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(ConfigError) as exc:
        nvme.measure(disk_tmp, size=64 << 20, with_fio=False)
    assert str(1 << 20) in str(exc.value) and str(64 << 20) in str(exc.value)
    assert os.listdir(disk_tmp) == []


def test_bad_sizes(disk_tmp):
    with pytest.raises(ConfigError):
        nvme.measure(disk_tmp, size=(1 << 20) + 4096, block_size=1 << 20)
    with pytest.raises(ConfigError):
        nvme.measure(disk_tmp / "missing", size=1 << 20, block_size=1 << 20)


def test_cli_prints_table_and_writes_json(disk_tmp, capsys, tmp_path):
    out = tmp_path / "r.json"
    rc = main(["bench", "nvme", "--path", str(disk_tmp / "new"), "--size", "4M", "--queue-depth", "4",
               "--repeats", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ours GB/s" in text and "write" in text and "read" in text
    assert set(json.loads(out.read_text())) == KEYS
    assert not (disk_tmp / "new").exists()            # a directory it made is removed again


def test_cli_user_errors_are_one_line(disk_tmp, capsys):
    assert main(["bench", "nvme", "--path", str(disk_tmp), "--size", "4M", "--plot", "x.png"]) == 1
    assert "--sweep" in capsys.readouterr().err
    assert main(["bench", "nvme", "--path", str(disk_tmp / "a" / "b"), "--size", "4M"]) == 1
    assert "--path" in capsys.readouterr().err


def test_fio_command_matches_the_engine_parameters():
    cmd = fio.command("/x/f", "write", size=8 << 20, block_size=1 << 20, queue_depth=16, threads=2,
                      iomem="shmhuge")
    for flag in ("--direct=1", "--ioengine=libaio", "--bs=1048576", "--iodepth=16", "--numjobs=2",
                 "--size=4194304", "--iomem=shmhuge", "--filename=/x/f", "--rw=write"):
        assert flag in cmd


def test_sweep_prints_best_config_and_plots(disk_tmp, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "SWEEP_BLOCK_SIZES", (256 << 10, 1 << 20))
    monkeypatch.setattr(nvme, "SWEEP_QUEUE_DEPTHS", (1, 4))
    monkeypatch.setattr(nvme, "SWEEP_THREADS", (1,))
    plot = tmp_path / "sweep.png"
    args = ["bench", "nvme", "--path", str(disk_tmp), "--size", "4M", "--repeats", "1", "--sweep",
            "--json", str(tmp_path / "best.json")]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(plot)]
    except ImportError:
        plot = None
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "offload.AioConfig(backend=" in text and text.count("\n") >= 6
    best = json.loads((tmp_path / "best.json").read_text())
    assert set(best) == KEYS
    snippet = [line for line in text.splitlines() if line.startswith("offload.AioConfig(")][0]
    import offload

    config = eval(snippet, {"offload": offload})    # the printed snippet is accepted as is
    assert config.block_size == best["block_size"] and config.queue_depth == best["queue_depth"]
    if plot is not None:
        assert plot.stat().st_size > 1000


def test_plot_without_matplotlib_says_how_to_get_it(disk_tmp, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["bench", "nvme", "--path", str(disk_tmp), "--sweep", "--plot", "x.png"]) == 1
    assert "pip install 'offload[plot]'" in capsys.readouterr().err
