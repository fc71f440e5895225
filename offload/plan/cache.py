"""The planner's measurements kept on disk, so the next launch on the same box plans without
measuring anything (a probe takes seconds, and the NVMe one writes 256 MiB to the drive).

One JSON file per machine under ``OFFLOAD_CACHE_DIR`` (default ``~/.cache/offload``), named by a
hash of what the measurements depend on: the CPU (model, flags, cores), the RAM, the GPUs (name,
count) and the torch version (``machine_key``). A change to any of them is another file, so a
measurement made on other hardware is never read. Inside it, an NVMe entry is keyed by each path's
filesystem (``path_key``: device, mount point, filesystem type), so moving ``--nvme-path`` to another
drive measures again; the other entries by the settings the probe ran with (dtype, model shape).

The cache is an optimisation, never a source of errors: a file that cannot be read or parsed is a
warning and a fresh measurement; a file that cannot be written is a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Callable

FORMAT = 1
"""Version of the file layout; files of another version are measured over."""


def cache_dir() -> Path:
    """Where the measurement files live: ``$OFFLOAD_CACHE_DIR``, else ``~/.cache/offload``."""
    return Path(os.environ.get("OFFLOAD_CACHE_DIR") or Path.home() / ".cache" / "offload")


def _cpu() -> dict:
    """The CPU's model name and a hash of its feature flags (Linux: /proc/cpuinfo)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                found.setdefault(name.strip(), value.strip())   # the first CPU's
    except OSError:
        pass
    model = found.get("model name") or platform.processor() or platform.machine()
    flags = found.get("flags") or found.get("Features") or ""
    return {"cpu": model, "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def machine_key() -> dict:
    """What the box's measurements depend on: CPU model, flags and cores, RAM, GPUs, torch."""
    import psutil
    import torch

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {**_cpu(), "cores": os.cpu_count(), "ram": psutil.virtual_memory().total,
            "gpus": gpus, "torch": torch.__version__}


def path_key(path: str) -> dict:
    """The filesystem ``path`` is on: its device number, mount point and type."""
    import psutil

    real = os.path.realpath(path)
    mount, fstype = "/", ""
    for part in psutil.disk_partitions(all=True):     # the longest mount point holding the path
        mp = part.mountpoint
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        if inside and (len(mp) > len(mount) or not fstype):
            mount, fstype = mp, part.fstype
    return {"st_dev": os.stat(real).st_dev, "mount": mount, "fstype": fstype}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]


class MeasurementCache:
    """The measurement file of this machine: ``measure(name, key, probe)`` returns the value stored
    under (name, key), or runs ``probe()`` and stores what it returns (JSON-able)."""

    def __init__(self, directory: Path | None = None, *, enabled: bool = True, machine: dict | None = None):
        """``machine``: this box's ``machine_key()``, worked out on the first ``measure`` when not given
        (a plan that measures nothing never asks)."""
        self.enabled = enabled
        self._directory = directory
        self._machine = machine
        self._entries: dict | None = None
        self.hits: list[str] = []
        """Names of the measurements read from the file on this run (for the plan's sources)."""

    @property
    def path(self) -> Path:
        """This machine's measurement file."""
        if self._machine is None:
            self._machine = machine_key()
        return (self._directory or cache_dir()) / f"measurements-{_digest(self._machine)}.json"

    def measure(self, name: str, key: dict, probe: Callable[[], object]):
        """The value measured for ``name`` under ``key`` on this machine, measuring it if not stored."""
        if not self.enabled:
            return probe()
        entry_id = f"{name}-{_digest(key)}"
        entries = self._load()
        stored = entries.get(entry_id)
        if isinstance(stored, dict) and stored.get("key") == key and "value" in stored:
            self.hits.append(name)
            return stored["value"]
        value = probe()
        entries[entry_id] = {"name": name, "key": key, "value": value}
        self._save(entries)
        return value

    def _load(self) -> dict:
        if self._entries is not None:
            return self._entries
        self._entries = {}
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return self._entries
        except (OSError, ValueError) as exc:
            warnings.warn(f"offload: ignoring the measurement cache {self.path} ({exc}); measuring again",
                          RuntimeWarning, stacklevel=3)
            return self._entries
        if isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("entries"), dict):
            self._entries = data["entries"]
        else:
            warnings.warn(f"offload: ignoring the measurement cache {self.path} (not a measurement file "
                          f"of format {FORMAT}); measuring again", RuntimeWarning, stacklevel=3)
        return self._entries

    def _save(self, entries: dict) -> None:
        """Write the file whole through a temporary beside it (a reader never sees half a file)."""
        data = {"format": FORMAT, "machine": self._machine, "entries": entries}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".measurements-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as exc:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            warnings.warn(f"offload: cannot write the measurement cache {self.path} ({exc})", RuntimeWarning, stacklevel=3)
