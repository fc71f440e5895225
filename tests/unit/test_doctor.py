"""`offload doctor`: stable JSON schema, verdicts, one-line errors for bad paths."""

from __future__ import annotations

import json
import subprocess
import sys

import offload
from offload.cli import main


def test_native_info_reports_simd_and_libaio():
    info = offload.native_info()
    assert info["simd_level"] in ("scalar", "avx2", "avx512")
    assert isinstance(info["libaio"], bool) and info["version"] == "0.1.0"


def test_doctor_json_schema(capsys, disk_tmp):
    assert main(["doctor", "--path", str(disk_tmp), "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == 1
    assert set(report) == {"schema", "ok", "torch", "cuda", "cpu", "memory", "native", "path", "findings"}
    assert set(report["cuda"]) == {"available", "device", "memory_bytes", "pinned_probe_bytes", "pinned_ok"}
    assert set(report["cpu"]) == {"model", "physical_cores", "logical_cores", "simd_level", "simd_supported"}
    assert set(report["memory"]) == {"total_bytes", "available_bytes", "memlock_bytes"}
    assert {"libaio", "simd_level", "version"} <= set(report["native"])
    path = report["path"]
    assert path["path"] == str(disk_tmp) and path["o_direct"] in (True, False)
    assert path["free_bytes"] > 0 and path["io_backend"] in ("libaio", "threads")
    assert all(f["level"] in ("ok", "warn", "error") and f["message"] for f in report["findings"])
    assert list(disk_tmp.iterdir()) == []  # the probe file is gone


def test_doctor_human_output(capsys):
    assert main(["doctor"]) in (0, 1)
    out = capsys.readouterr().out
    assert "SIMD" in out and "verdict:" in out


def test_doctor_missing_path_is_one_line_error():
    done = subprocess.run([sys.executable, "-m", "offload.cli", "doctor", "--path", "/nonexistent"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "/nonexistent" in done.stderr
