"""``offload doctor``: what this machine can do for the engine, each finding a verdict to act on.

The JSON schema (``--json``) is stable; version it with ``schema`` when it changes:
{
  "schema": 1,
  "ok": bool,                       # no finding is an error
  "torch": {"version": str},
  "cuda": {"available": bool, "device": str|null, "memory_bytes": int|null, "pinned_probe_bytes": int|null,
           "pinned_ok": bool|null},
  "cpu": {"model": str, "physical_cores": int, "logical_cores": int, "simd_level": str, "simd_supported": str},
  "memory": {"total_bytes": int, "available_bytes": int, "memlock_bytes": int|null},   # null = unlimited
  "native": {"version": str, "libaio": bool, "simd_level": str, ...},
  "path": null | {"path": str, "exists": bool, "o_direct": bool, "o_direct_reason": str,
                  "filesystem": str, "free_bytes": int, "io_backend": "libaio"|"threads",
                  "leftovers": [{"path": str, "kind": "swap file"|"private dir", "bytes": int,
                                 "pid": int|null, "in_use": bool, "removed": bool}],
                  "leftover_bytes": int},   # disk held by leftovers not in use
  "findings": [{"level": "ok"|"warn"|"error", "topic": str, "message": str}]
}
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import resource
import tempfile
from pathlib import Path

from .errors import ConfigError

SCHEMA_VERSION = 1
PROBE_BYTES = 4096
PINNED_PROBE_BYTES = 256 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", help="directory you would give as nvme_paths: checks O_DIRECT and free space")
    parser.add_argument("--clean", action="store_true",
                        help="with --path: remove the leftovers of dead runs it reports (swap files of older "
                             "versions that no process has open, private directories of dead processes)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON (stable schema)")
    parser.add_argument("--pinned-bytes", default=str(PINNED_PROBE_BYTES),
                        help="size of the pinned-buffer probe when CUDA is present (default 256M)")


def run(args: argparse.Namespace) -> int:
    from .config import parse_bytes

    if args.clean and not args.path:
        raise ConfigError("--clean", True, "needs --path DIR")
    report = diagnose(args.path, pinned_bytes=parse_bytes(args.pinned_bytes, "--pinned-bytes"), clean=args.clean)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0 if report["ok"] else 1


def diagnose(path: str | None = None, *, pinned_bytes: int = PINNED_PROBE_BYTES, clean: bool = False) -> dict:
    """Collect every fact and verdict. Raises ConfigError when ``path`` does not exist.
    ``clean``: remove the leftovers of dead runs found in ``path``."""
    if path is not None and not Path(path).is_dir():
        what = "is not a directory" if Path(path).exists() else "does not exist"
        raise ConfigError("--path", path, what)
    findings: list[dict] = []
    report = {"schema": SCHEMA_VERSION, "ok": True}
    report["torch"], report["cuda"] = _torch_facts(findings, pinned_bytes)
    report["native"] = _native_facts(findings)
    report["cpu"] = _cpu_facts(report["native"])
    report["memory"] = _memory_facts(findings, report["cuda"]["available"])
    report["path"] = _path_facts(path, report["native"], findings) if path is not None else None
    if path is not None:
        report["path"].update(_leftover_facts(path, findings, clean))
    report["findings"] = findings
    report["ok"] = not any(f["level"] == "error" for f in findings)
    return report


def _say(findings: list, level: str, topic: str, message: str) -> None:
    findings.append({"level": level, "topic": topic, "message": message})


def _torch_facts(findings: list, pinned_bytes: int) -> tuple[dict, dict]:
    import torch

    cuda = {"available": False, "device": None, "memory_bytes": None,
            "pinned_probe_bytes": None, "pinned_ok": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda.update(available=True, device=props.name, memory_bytes=int(props.total_memory),
                    pinned_probe_bytes=pinned_bytes)
        # The engine's own path: mmap'd, huge-page-advised memory registered with
        # cudaHostRegister (not cudaHostAlloc, which pin_memory=True would probe).
        from .aio import aligned_empty
        from .errors import PinnedMemoryError

        try:
            aligned_empty(pinned_bytes, torch.uint8, pin=True)     # pinned, then unpinned and freed
            cuda["pinned_ok"] = True
            _say(findings, "ok", "cuda", f"CUDA device {props.name} with {_gib(props.total_memory)}; "
                 f"{_gib(pinned_bytes)} of host memory was pinned with cudaHostRegister, as the CPU tier is")
        except PinnedMemoryError as exc:
            cuda["pinned_ok"] = False
            _say(findings, "error", "cuda", f"could not pin {_gib(pinned_bytes)} of host memory the way "
                 f"the CPU tier does ({exc}); lower cpu_budget or free host memory")
    else:
        _say(findings, "warn", "cuda", "no CUDA device: the engine computes on the CPU "
             "(device='cpu'); fine for tests and small models, slow for real training")
    return {"version": torch.__version__}, cuda


def _native_facts(findings: list) -> dict:
    from .errors import NativeError
    from .native import native_info

    try:
        info = native_info()
    except NativeError as exc:
        _say(findings, "error", "native", str(exc))
        return {"version": None, "libaio": False, "simd_level": "unknown", "simd_supported": "unknown"}
    if info["simd_level"] == "scalar":
        _say(findings, "warn", "simd", "no AVX2/AVX-512: the CPU Adam runs its scalar kernel (several times slower)")
    else:
        _say(findings, "ok", "simd", f"CPU Adam uses {info['simd_level']} "
             f"(best supported: {info['simd_supported']})")
    if info["libaio"]:
        _say(findings, "ok", "libaio", "libaio is linked: NVMe I/O uses kernel AIO with O_DIRECT")
    else:
        _say(findings, "warn", "libaio", "built without libaio: NVMe I/O uses the thread backend; "
             "install libaio-dev (apt) and reinstall the package for full disk bandwidth")
    return info


def _cpu_facts(native: dict) -> dict:
    import psutil

    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"model": model, "physical_cores": psutil.cpu_count(logical=False) or 1,
            "logical_cores": psutil.cpu_count(logical=True) or 1,
            "simd_level": native.get("simd_level"), "simd_supported": native.get("simd_supported")}


def _memory_facts(findings: list, cuda: bool) -> dict:
    import psutil

    vm = psutil.virtual_memory()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = None if soft == resource.RLIM_INFINITY else int(soft)
    _say(findings, "ok", "memory", f"RAM {_gib(vm.total)} total, {_gib(vm.available)} available")
    if memlock is not None:
        # Consistent with offload.aio.buffers.check_host_budget: CUDA registration is not charged
        # to RLIMIT_MEMLOCK, only mlock is (used to pin without CUDA, e.g. BufferPool(pin=True)).
        where = ("does not limit the CPU tier, which CUDA's cudaHostRegister pins" if cuda else
                 "limits mlock'd buffers only; a CPU-only run pins nothing by default")
        _say(findings, "ok", "memlock", f"`ulimit -l` is {_gib(memlock)}: it {where}")
    return {"total_bytes": int(vm.total), "available_bytes": int(vm.available), "memlock_bytes": memlock}


def probe_o_direct(directory: str) -> tuple[bool, str]:
    """A real 4 KiB aligned O_DIRECT write and read-back in a temp file (removed after)."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    fd, name = tempfile.mkstemp(prefix=".offload-doctor-", dir=directory)
    os.close(fd)
    buf = mmap.mmap(-1, PROBE_BYTES)  # anonymous mmap is page-aligned, as O_DIRECT needs
    try:
        buf.write(os.urandom(PROBE_BYTES))
        try:
            fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            return False, f"open(O_DIRECT) failed: {exc.strerror}"
        try:
            if os.pwritev(fd, [buf], 0) != PROBE_BYTES:
                return False, "short O_DIRECT write"
            back = mmap.mmap(-1, PROBE_BYTES)
            try:
                if os.preadv(fd, [back], 0) != PROBE_BYTES or back[:] != buf[:]:
                    return False, "O_DIRECT read-back differs from what was written"
            finally:
                back.close()
        except OSError as exc:
            return False, f"O_DIRECT I/O failed: {exc.strerror}"
        finally:
            os.close(fd)
        return True, "4 KiB aligned O_DIRECT write and read-back succeeded"
    finally:
        buf.close()
        os.unlink(name)


def _filesystem(path: str) -> str:
    best, fstype = "", "unknown"
    real = os.path.realpath(path)
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            mount = parts[1].replace("\\040", " ")
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, fstype = mount, parts[2]
    except OSError:
        pass
    return fstype


def _path_facts(path: str, native: dict, findings: list) -> dict:
    import shutil

    fstype = _filesystem(path)
    writable = os.access(path, os.W_OK)
    if writable:
        ok, reason = probe_o_direct(path)
    else:
        ok, reason = False, "directory is not writable by this user"
    free = shutil.disk_usage(path).free
    backend = "libaio" if ok and native.get("libaio") else "threads"
    if not writable:
        _say(findings, "error", "path", f"{path} is not writable: choose a directory you own for nvme_paths")
    elif ok:
        _say(findings, "ok", "o_direct", f"O_DIRECT works on {path} ({fstype}): the {backend} backend would be used")
    else:
        _say(findings, "warn", "o_direct", f"O_DIRECT is not supported on {path} ({fstype}: {reason}): "
             "use a directory on a real disk; the thread backend would be used here")
    level = "ok" if free >= 16 << 30 else "warn"
    _say(findings, level, "space", f"{_gib(free)} free on {path}"
         + ("" if level == "ok" else ": little room for offloaded state (a 1B model needs ~15 GB)"))
    return {"path": str(path), "exists": True, "writable": writable, "o_direct": ok, "o_direct_reason": reason,
            "filesystem": fstype, "free_bytes": int(free), "io_backend": backend}


def _leftover_facts(path: str, findings: list, clean: bool) -> dict:
    """Swap files of older versions and private directories of crashed runs, with their sizes."""
    from .tiers.swapfiles import find_leftovers, reclaim_stale

    found = find_leftovers(path)
    removed = {item.path for item in reclaim_stale(path, old_swap_files=True)} if clean else set()
    items = [{"path": f.path, "kind": f.kind, "bytes": f.nbytes, "pid": f.pid, "in_use": f.in_use,
              "removed": f.path in removed} for f in found]
    stale = [f for f in found if not f.in_use and f.path not in removed]
    held = sum(f.nbytes for f in stale)
    for f in found:
        if f.path in removed:
            _say(findings, "ok", "leftovers", f"removed {f.kind} {f.path} ({_gib(f.nbytes)})")
    if stale:
        listed = ", ".join(f"{f.path} ({_gib(f.nbytes)})" for f in stale[:5])
        more = f" and {len(stale) - 5} more" if len(stale) > 5 else ""
        _say(findings, "warn", "leftovers",
             f"{len(stale)} leftover swap file(s)/directories of dead runs hold {_gib(held)} in {path}: "
             f"{listed}{more}; `offload doctor --path {path} --clean` removes them")
    elif not removed:
        busy = [f for f in found if f.in_use]
        _say(findings, "ok", "leftovers", f"no leftover swap files in {path}"
             + (f" ({len(busy)} in use by running processes)" if busy else ""))
    return {"leftovers": items, "leftover_bytes": int(held)}


def _gib(n: int) -> str:
    from .units import format_bytes

    return format_bytes(n)


def render(report: dict) -> str:
    marks = {"ok": "ok  ", "warn": "WARN", "error": "FAIL"}
    cpu, mem = report["cpu"], report["memory"]
    lines = [
        f"torch {report['torch']['version']}; offload native {report['native'].get('version')}",
        f"CPU {cpu['model']} ({cpu['physical_cores']} cores, {cpu['logical_cores']} threads); "
        f"SIMD {cpu['simd_level']}",
        f"memlock limit: {'unlimited' if mem['memlock_bytes'] is None else _gib(mem['memlock_bytes'])}",
        "",
    ]
    lines += [f"[{marks[f['level']]}] {f['topic']}: {f['message']}" for f in report["findings"]]
    lines.append("")
    lines.append("verdict: " + ("ready" if report["ok"] else "fix the FAIL lines above first"))
    return "\n".join(lines)
