"""A single process's checkpoint (format version 1) rewritten by hand as if ``world`` ranks had
saved it: round-robin whole chunks (version 2, which nothing writes any more) or sliced pieces
(version 3), laid out as ``offload/checkpoint/format.py`` describes. The bytes are the same
chunk bytes, moved and checksummed again, so the rewritten checkpoint holds the same state."""

from __future__ import annotations

import json
from pathlib import Path

from offload.checkpoint.format import (DTYPES, MANIFEST, MANIFEST_CRC, SHARDED_VERSION, SLICED_VERSION, checksum_bytes,
                                       entry_bytes, manifest_bytes)


def rewrite(ckpt: Path, world: int, version: int) -> None:
    """Rewrite version-1 checkpoint ``ckpt`` in place as one of ``world`` ranks in ``version`` (2 or 3)."""
    if version not in (SHARDED_VERSION, SLICED_VERSION):
        raise ValueError(f"version {version}: only 2 and 3 are written by hand")
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest.pop(MANIFEST_CRC)
    if manifest["version"] != 1:
        raise ValueError(f"{ckpt} is version {manifest['version']}, not a single process's (1)")
    algorithm = manifest["checksum"]
    for kind, info in list(manifest["kinds"].items()):
        data = (ckpt / info["file"]).read_bytes()
        itemsize = DTYPES[info["dtype"]].itemsize
        files = [f"rank-{r:05d}/{kind}.bin" for r in range(world)]
        out = [bytearray() for _ in range(world)]
        entries = []
        for c, entry in enumerate(info["chunks"]):
            if entry is None:
                entries.append(None)
                continue
            raw = data[entry["offset"]:entry["offset"] + entry_bytes(info, entry)]
            if version == SHARDED_VERSION:
                r = c % world
                entries.append({**entry, "offset": len(out[r]), "rank": r})
                out[r] += raw
                continue
            numel = len(raw) // itemsize
            p = -(-numel // world)
            pieces = []
            for r in range(world):
                lo, hi = min(r * p, numel), min(r * p + p, numel)
                if lo == hi:
                    continue
                part = bytes(raw[lo * itemsize:hi * itemsize])
                pieces.append({"rank": r, "lo": lo, "hi": hi, "file": files[r], "offset": len(out[r]),
                               "nbytes": len(part), "crc": checksum_bytes(algorithm, part)})
                out[r] += part
            entries.append({"numel": numel, "pieces": pieces})
        for name, content in zip(files, out):
            (ckpt / name).parent.mkdir(exist_ok=True)
            (ckpt / name).write_bytes(bytes(content))
        (ckpt / info["file"]).unlink()
        new = {"files": files, "dtype": info["dtype"], "chunks": entries}
        if version == SHARDED_VERSION:
            new["chunk_bytes"] = info["chunk_bytes"]
        manifest["kinds"][kind] = new
    manifest["version"] = version
    manifest["world"] = world
    (ckpt / MANIFEST).write_bytes(manifest_bytes(manifest))
