"""The planner's measurements kept on disk (issue 26 point 6): a second plan on the same box and NVMe
path calls no probe and writes nothing to the NVMe directory; new hardware or another filesystem
measures again; a broken cache file is a warning and a fresh measurement; `cache=False` and
`offload plan --no-cache` measure again."""

from __future__ import annotations

import json
import os
import sys
import time
import types

import pytest

from offload.cli import main
from offload.plan import cache, figures, probes
from offload.plan.figures import hardware_for

CPU_ONLY = dict(cpu_mem="24G")


@pytest.fixture
def probed(monkeypatch):
    """Fake probes that count their calls; the NVMe one writes its test file into the directory, as
    the real one does."""
    calls = {"nvme": 0, "adam": 0, "cpu": 0}

    def nvme(path, **kw):
        calls["nvme"] += 1
        with open(os.path.join(path, "probe.tmp"), "wb") as f:
            f.write(b"x" * 4096)
        os.unlink(os.path.join(path, "probe.tmp"))
        return {"read_gbps": 1.5, "write_gbps": 2.5}

    def adam(**kw):
        calls["adam"] += 1
        return {"params_per_s": 2e9}

    def cpu(*args):
        calls["cpu"] += 1
        return 150.0, "one decoder layer, fwd + bwd"

    for name, fn in (("nvme", nvme), ("adam", adam)):
        mod = types.ModuleType(f"offload.bench.{name}")
        mod.measure, mod.add_arguments, mod.run = fn, lambda parser: None, lambda args: 0
        monkeypatch.setitem(sys.modules, f"offload.bench.{name}", mod)
    monkeypatch.setattr(probes, "probe_cpu_gflops", cpu)
    monkeypatch.setattr(probes, "cuda_or_none", lambda: None)
    return calls


def _snapshot(directory):
    """Every entry of ``directory`` with its size and times (a write shows in the directory's mtime)."""
    st = os.stat(directory)
    return (st.st_mtime_ns, st.st_ctime_ns,
            sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory)))


def test_second_plan_calls_no_probe_and_writes_nothing_to_the_nvme_directory(probed, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    hw1, src1, _ = hardware_for([str(nvme)], model="tiny", **CPU_ONLY)
    assert probed == {"nvme": 1, "adam": 1, "cpu": 1}
    assert src1["nvme_gbps"] == "measured (offload.bench.nvme)"
    before = _snapshot(nvme)
    time.sleep(0.01)
    t0 = time.perf_counter()
    hw2, src2, notes = hardware_for([str(nvme)], model="tiny", **CPU_ONLY)
    elapsed = time.perf_counter() - t0
    assert probed == {"nvme": 1, "adam": 1, "cpu": 1}             # no probe ran
    assert _snapshot(nvme) == before                               # nothing written there
    assert elapsed < 0.5, elapsed
    assert (hw2.nvme_read_gbps, hw2.nvme_write_gbps, hw2.adam_params_per_s, hw2.compute_tflops) == \
        (hw1.nvme_read_gbps, hw1.nvme_write_gbps, hw1.adam_params_per_s, hw1.compute_tflops) == (1.5, 2.5, 2e9, 0.15)
    assert src2["nvme_gbps"].endswith(", cached") and src2["compute_tflops"].endswith(", cached")
    assert any("measured on this box before" in n for n in notes)
    assert not any(p.name.startswith("measurements-") for p in nvme.iterdir())


def test_other_hardware_or_filesystem_measures_again(probed, tmp_path, monkeypatch):
    hardware_for([str(tmp_path)], model="tiny", **CPU_ONLY)
    real_machine = cache.machine_key()
    monkeypatch.setattr(cache, "machine_key", lambda: {**real_machine, "gpus": ["NVIDIA H100"]})
    hardware_for([str(tmp_path)], model="tiny", **CPU_ONLY)
    assert probed == {"nvme": 2, "adam": 2, "cpu": 2}              # another machine: everything again
    monkeypatch.setattr(cache, "machine_key", lambda: real_machine)
    hardware_for([str(tmp_path)], model="tiny", **CPU_ONLY)
    assert probed == {"nvme": 2, "adam": 2, "cpu": 2}              # back on this one: all kept
    real_path_key = cache.path_key
    monkeypatch.setattr(figures, "path_key", lambda p: {**real_path_key(p), "st_dev": 12345, "mount": "/mnt/b"})
    hardware_for([str(tmp_path)], model="tiny", **CPU_ONLY)
    assert probed == {"nvme": 3, "adam": 2, "cpu": 2}              # another drive: only NVMe again
    hardware_for([str(tmp_path)], model="tiny", dtype="fp32", **CPU_ONLY)
    assert probed == {"nvme": 3, "adam": 3, "cpu": 3}              # other probe settings


def test_machine_key_names_what_the_measurements_depend_on():
    key = cache.machine_key()
    assert set(key) == {"cpu", "cpu_flags", "cores", "ram", "gpus", "torch"}
    assert set(cache.path_key("/")) == {"st_dev", "mount", "fstype"}


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]), json.dumps({"format": 99}), None])
def test_a_broken_cache_file_is_a_warning_and_a_new_measurement(probed, tmp_path, content):
    hardware_for([str(tmp_path)], model="tiny", **CPU_ONLY)
    path = cache.MeasurementCache().path
    path.unlink()
    if content is None:
        path.mkdir()                                                # unreadable: a directory
    else:
        path.write_text(content)
    with pytest.warns(RuntimeWarning, match="measurement cache"):
        hw, _, _ = hardware_for([str(tmp_path)], model="tiny", **CPU_ONLY)
    assert probed == {"nvme": 2, "adam": 2, "cpu": 2} and hw.nvme_read_gbps == 1.5


def test_no_cache_measures_again_and_keeps_the_result(probed, tmp_path):
    hardware_for([str(tmp_path)], model="tiny", **CPU_ONLY)
    hardware_for([str(tmp_path)], model="tiny", cache=False, **CPU_ONLY)
    assert probed == {"nvme": 2, "adam": 2, "cpu": 2}
    argv = ["plan", "--model", "tiny", "--cpu-mem", "24G", "--nvme-path", str(tmp_path), "--json", "-"]
    assert main(argv) == 0 and probed["nvme"] == 2
    assert main(argv + ["--no-cache"]) == 0 and probed["nvme"] == 3


def test_cache_lives_in_offload_cache_dir(probed, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "c"))
    hardware_for([], model="tiny", **CPU_ONLY)
    files = list((tmp_path / "c").iterdir())
    assert len(files) == 1 and files[0].name.startswith("measurements-")
    data = json.loads(files[0].read_text())
    assert data["machine"] == cache.machine_key() and data["format"] == cache.FORMAT


def test_describing_another_box_measures_nothing(probed, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "c"))
    hardware_for([], gpu_mem="80G", gpu_tflops=400, cpu_mem="512G", nvme_capacity="8T", nvme_gbps=25)
    assert probed == {"nvme": 0, "adam": 0, "cpu": 0} and not (tmp_path / "c").exists()
