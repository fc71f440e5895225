"""`offload doctor`: stable JSON schema, verdicts, one-line errors for bad paths.

What the doctor reports is checked against this machine, read here by other means: libaio is
linked iff the loaded native module mapped libaio.so into this process; O_DIRECT works on the
suite's disk-backed temp dir iff an aligned O_DIRECT write and read-back there succeed here; the SIMD
level is the best that /proc/cpuinfo's flags allow; CUDA, cores, memory and the filesystem come
from torch, os, /proc/meminfo, resource and psutil.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import offload
from offload.cli import main
from tests.helpers.processes import python_env

# A small pinned-memory probe: on a GPU box the verdict then does not depend on how much host
# memory is free to pin at the moment.
PINNED = ["--pinned-bytes", "1M"]


def libaio_mapped() -> bool:
    """Whether libaio is mapped into this process (it is iff the loaded native module links it)."""
    offload.native_info()       # loads the native module
    return any("libaio.so" in line for line in Path("/proc/self/maps").read_text().splitlines())


def o_direct_works(directory: Path) -> bool:
    """A page-aligned 4 KiB O_DIRECT write and read-back in ``directory``."""
    path = directory / "probe"
    page = mmap.mmap(-1, 4096)
    page.write(os.urandom(4096))
    back = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        return os.pwritev(fd, [page], 0) == 4096 and os.preadv(fd, [back], 0) == 4096 and back[:] == page[:]
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


def best_simd() -> str:
    """The best kernel /proc/cpuinfo's flags allow (native/dispatch.c's rule)."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    if not {"avx2", "fma", "f16c"} <= set(flags):
        return "scalar"
    return "avx512" if "avx512f" in flags else "avx2"


def filesystem(path: Path) -> str:
    real = os.path.realpath(path)
    mounts = [p for p in psutil.disk_partitions(all=True)
              if real == p.mountpoint or real.startswith(p.mountpoint.rstrip("/") + "/")]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype


def test_native_info_reports_simd_and_libaio():
    info = offload.native_info()
    assert info["simd_supported"] == best_simd()
    if "OFFLOAD_SIMD" not in os.environ:
        assert info["simd_level"] == info["simd_supported"]
    assert info["libaio"] is libaio_mapped() and info["version"] == "0.1.0"


def test_doctor_json_reports_this_machine(capsys, disk_tmp):
    # Nothing on this machine is an error (the native module loads, the directory is writable,
    # a small buffer can be pinned): the verdict is ready and the exit status 0.
    assert main(["doctor", "--path", str(disk_tmp), "--json", *PINNED]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == 1 and report["ok"] is True
    assert set(report) == {"schema", "ok", "torch", "cuda", "cpu", "memory", "native", "path", "findings"}
    assert all(f["level"] in ("ok", "warn") and f["message"] for f in report["findings"])
    topics = {f["topic"]: f["level"] for f in report["findings"]}

    assert report["torch"] == {"version": torch.__version__}
    cuda = report["cuda"]
    assert set(cuda) == {"available", "device", "memory_bytes", "pinned_probe_bytes", "pinned_ok"}
    assert cuda["available"] is torch.cuda.is_available()
    if cuda["available"]:
        assert cuda["device"] == torch.cuda.get_device_name(0) and cuda["pinned_ok"] is True
        assert cuda["pinned_probe_bytes"] == 1 << 20 and topics["cuda"] == "ok"
    else:
        assert cuda == {"available": False, "device": None, "memory_bytes": None, "pinned_probe_bytes": None,
                        "pinned_ok": None}
        assert topics["cuda"] == "warn"

    cpu = report["cpu"]
    assert set(cpu) == {"model", "physical_cores", "logical_cores", "simd_level", "simd_supported"}
    assert cpu["logical_cores"] == os.cpu_count() and 1 <= cpu["physical_cores"] <= cpu["logical_cores"]
    assert cpu["simd_supported"] == best_simd() and cpu["simd_level"] == offload.native_info()["simd_level"]
    assert topics["simd"] == ("warn" if cpu["simd_level"] == "scalar" else "ok")

    memory = report["memory"]
    assert set(memory) == {"total_bytes", "available_bytes", "memlock_bytes"}
    meminfo = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    assert memory["total_bytes"] == int(meminfo.split()[1]) * 1024
    assert 0 < memory["available_bytes"] <= memory["total_bytes"]
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert memory["memlock_bytes"] == (None if soft == resource.RLIM_INFINITY else soft)

    native = report["native"]
    assert {"libaio", "simd_level", "version"} <= set(native)
    assert native["libaio"] is libaio_mapped() and native["version"] == "0.1.0"
    assert topics["libaio"] == ("ok" if native["libaio"] else "warn")

    path = report["path"]
    assert path["path"] == str(disk_tmp) and path["exists"] is True and path["writable"] is True
    direct = o_direct_works(disk_tmp)       # on the disk the suite runs from: True wherever it was run so far
    assert path["o_direct"] is direct and topics["o_direct"] == ("ok" if direct else "warn")
    assert path["io_backend"] == ("libaio" if direct and native["libaio"] else "threads")
    assert path["filesystem"] == filesystem(disk_tmp)
    assert 0 < path["free_bytes"] <= psutil.disk_usage(str(disk_tmp)).total
    assert path["leftovers"] == [] and path["leftover_bytes"] == 0 and topics["leftovers"] == "ok"
    assert list(disk_tmp.iterdir()) == []  # the probe file is gone


def test_doctor_human_output(capsys):
    assert main(["doctor", *PINNED]) == 0
    out = capsys.readouterr().out
    simd = offload.native_info()["simd_level"]
    assert f"SIMD {simd}" in out and out.rstrip().endswith("verdict: ready")
    assert f" {os.cpu_count()} threads); SIMD" in out


@pytest.mark.slow
def test_doctor_missing_path_is_one_line_error():
    done = subprocess.run([sys.executable, "-m", "offload.cli", "doctor", "--path", "/nonexistent"],
                          capture_output=True, text=True, env=python_env())
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "/nonexistent" in done.stderr
