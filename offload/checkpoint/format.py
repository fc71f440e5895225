"""The on-disk format of one checkpoint: names, the manifest, checksums of chunks and files.

The manifest's ``kinds`` say where each chunk of each kind is. Three versions, all read:

* 1 -- one process: ``{"file", "dtype", "chunk_bytes", "chunks": [entry | null]}``, an entry
  ``{"offset", <algorithm>: crc, "nbytes"?}`` (``nbytes`` when not ``chunk_bytes``): the whole chunk.
* 2 -- round-robin ranks (no longer written): ``"files"`` (one per rank) instead of ``"file"``, and an
  entry's ``"rank"`` says whose file holds the whole chunk.
* 3 -- sliced ranks: ``{"files", "dtype", "chunks": [{"numel", "pieces": [piece]} | null]}``, a piece
  ``{"rank", "lo", "hi", "file", "offset", "nbytes", "crc"}``: elements ``[lo, hi)`` of the chunk
  (``hi`` cut at ``numel``), ``nbytes`` at ``offset`` of ``file``, its checksum under the manifest's
  ``"checksum"`` algorithm; or ``{"rank", "lo", "hi", "zeros": true}``: Adam moments its rank never
  initialized while others did, nothing stored (``pieces``). The pieces of a chunk tile ``[0, numel)``.

* 4 -- compressed optimizer state: the kinds as version 1 (one process) or 3 (several ranks), and
  ``"precision": {"optimizer_state", "master", "block_size"}``. 8-bit moments: ``exp_avg`` /
  ``exp_avg_sq`` are uint8 codes, ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` one fp32 scale per block:
  their chunks and pieces count blocks (a chunk of ``numel`` elements has ``numel / block_size``
  scales, rank r's piece ``[lo / block_size, hi / block_size)``: pieces are whole blocks). A bf16
  master under bf16 compute has no ``master`` kind (the parameters are the master).

``chunk_pieces`` reads any of them as ``pieces.Piece`` lists (a whole chunk is one piece
``[0, numel)``), so loading and verifying treat the three alike.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import torch

from ..errors import ChecksumError, OffloadError
from .pieces import Piece

FORMAT = "offload-checkpoint"
VERSION = 1            # what a single process writes: whole chunks
SHARDED_VERSION = 2    # round-robin ranks, whole chunks in their owner's file (read, no longer written)
SLICED_VERSION = 3     # written by several ranks: each rank's piece of every chunk in its own files
PRECISION_VERSION = 4  # compressed optimizer state (8-bit moments, a bf16 master): versions 1/3 + its precision
VERSIONS = (VERSION, SHARDED_VERSION, SLICED_VERSION, PRECISION_VERSION)
FP32_STATE = {"optimizer_state": "fp32", "master": "fp32"}     # what versions 1-3 hold
MANIFEST = "manifest.json"
LATEST = "latest"
SAVED_KINDS = ("param", "master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")   # grads never
STEP_NAME = re.compile(r"^step-(\d+)$")
TEMP_NAME = re.compile(r"^\.(tmp|trash)-(.+)-(\d+)$")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.uint8: "uint8"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def saved_precision(manifest: dict) -> dict:
    """``{"optimizer_state", "master"}`` of a checkpoint's optimizer state (fp32 before version 4)."""
    got = manifest.get("precision") or {}
    return {k: got.get(k, v) for k, v in FP32_STATE.items()}


def step_name(step: int) -> str:
    return f"step-{int(step):08d}"


def checksum_algorithm() -> str:
    try:
        from ..native import crc32c

        crc32c(0, 0)
        return "crc32c"
    except Exception:       # no native extension: zlib's CRC-32 (a different polynomial, recorded as such)
        return "crc32"


def checksum(algorithm: str, data: torch.Tensor) -> int:
    """Checksum of a contiguous CPU tensor's bytes."""
    nbytes = data.numel() * data.element_size()
    if algorithm == "crc32c":
        from ..native import crc32c

        return crc32c(data.data_ptr(), nbytes)
    if algorithm == "crc32":
        return zlib.crc32(bytes_view(data)) & 0xFFFFFFFF
    raise OffloadError(f"unknown checksum algorithm {algorithm!r} in the manifest")


def checksum_bytes(algorithm: str, data: bytes) -> int:
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8, device="cpu")
    return checksum(algorithm, t)


def bytes_view(t: torch.Tensor):
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


MANIFEST_CRC = "manifest_crc32"


def _manifest_crc(manifest: dict) -> int:
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CRC}
    # Through JSON and back first: the CRC is of what a reader parses (keys as strings).
    return zlib.crc32(json.dumps(json.loads(json.dumps(body)), sort_keys=True).encode()) & 0xFFFFFFFF


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written, carrying a CRC-32 of its own canonical JSON: a flipped bit in a
    step count or an offset is caught like one in the chunk data."""
    return json.dumps({**manifest, MANIFEST_CRC: _manifest_crc(manifest)}, indent=1).encode()


def read_manifest(ckpt: Path) -> dict:
    """The parsed, format- and checksum-checked manifest of checkpoint directory ``ckpt``."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise OffloadError(f"checkpoint manifest {ckpt / MANIFEST} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") not in VERSIONS:
        got = manifest if not isinstance(manifest, dict) else manifest.get("format")
        raise OffloadError(f"{ckpt / MANIFEST}: not an {FORMAT} version {' or '.join(map(str, VERSIONS))} manifest "
                           f"(format {got!r}, version "
                           f"{manifest.get('version') if isinstance(manifest, dict) else None!r})")
    if MANIFEST_CRC in manifest:          # absent in checkpoints of older versions
        want, got = manifest.pop(MANIFEST_CRC), _manifest_crc(manifest)
        if want != got:
            raise ChecksumError(str(ckpt / MANIFEST), 0, 0, f"checksum mismatch of the manifest's own "
                                                            f"crc32 (expected {want:#010x}, got {got:#010x})")
    return manifest


def read_checked_file(ckpt: Path, entry: dict, algorithm: str) -> bytes:
    """The bytes of a whole-file entry (``{"file", "bytes", <algorithm>}``), checksum verified."""
    path = ckpt / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise OffloadError(f"checkpoint file {path} cannot be read: {exc}") from exc
    got = checksum_bytes(algorithm, data)
    if len(data) != entry["bytes"] or got != entry[algorithm]:
        raise ChecksumError(str(path), 0, len(data),
                            f"checksum mismatch ({algorithm}: expected {entry[algorithm]:#010x} over "
                            f"{entry['bytes']} bytes, got {got:#010x} over {len(data)})")
    return data


def small_files(manifest: dict) -> list[dict]:
    """The whole-file entries of a manifest (buffers, optimizer state, ``extra``): those present."""
    return [e for e in (manifest.get("buffers"), manifest.get("extra_file"),
                        (manifest.get("optimizer") or {}).get("state")) if e]


def entry_bytes(info: dict, entry: dict) -> int:
    """Bytes of one whole saved chunk (versions 1 and 2): the kind's bulk ``chunk_bytes``, or its
    own ``nbytes`` (an oversized parameter's chunk, or a class's last chunk cut to what it holds)."""
    return int(entry.get("nbytes", info["chunk_bytes"]))


def entry_file(info: dict, entry: dict) -> str:
    """The file (relative to the checkpoint) holding one whole saved chunk (versions 1 and 2): the
    kind's one ``file``, or in a round-robin checkpoint the ``files[rank]`` of the rank that wrote it."""
    if "rank" in entry:
        return info["files"][int(entry["rank"])]
    return info["file"]


def kind_files(info: dict) -> list[str]:
    """Every chunk file of one kind (one per rank in a checkpoint of several ranks)."""
    return list(info["files"]) if "files" in info else [info["file"]]


def entry_rank(entry: dict) -> int:
    """The rank whose files hold a whole saved chunk (0 in a single process's checkpoint)."""
    return int(entry.get("rank", 0))


def chunk_numel(info: dict, entry: dict) -> int:
    """Elements of one saved chunk (a non-null ``entry`` of kind ``info``), in any version."""
    if "pieces" in entry:
        return int(entry["numel"])
    nbytes, itemsize = entry_bytes(info, entry), DTYPES[info["dtype"]].itemsize
    if nbytes % itemsize:
        raise OffloadError(f"a saved chunk of {nbytes} bytes is not a whole number of {info['dtype']} elements")
    return nbytes // itemsize


def chunk_pieces(info: dict, entry: dict, algorithm: str | None = None) -> list[Piece]:
    """The saved pieces of one chunk (a non-null ``entry`` of kind ``info``), in any version: a
    whole chunk (versions 1, 2) is one piece ``[0, numel)``. ``algorithm``: the manifest's
    ``"checksum"``, for the pieces' ``crc`` (None: sizes only)."""
    if "pieces" in entry:
        return [Piece(rank=int(p["rank"]), lo=int(p["lo"]), hi=int(p["hi"]), file=None, offset=0, nbytes=0, crc=None)
                if p.get("zeros") is True else
                Piece(rank=int(p["rank"]), lo=int(p["lo"]), hi=int(p["hi"]), file=str(p["file"]),
                      offset=int(p["offset"]), nbytes=int(p["nbytes"]),
                      crc=None if algorithm is None else int(p["crc"])) for p in entry["pieces"]]
    return [Piece(rank=entry_rank(entry), lo=0, hi=chunk_numel(info, entry), file=entry_file(info, entry),
                  offset=int(entry["offset"]), nbytes=entry_bytes(info, entry),
                  crc=None if algorithm is None else int(entry[algorithm]))]


def check_kind_file_size(ckpt: Path, kind: str, info: dict, files: list[str] | None = None) -> None:
    """Each chunk file of ``kind`` (``files``: only those) holds exactly the pieces the manifest
    lists in it (else it is truncated or overwritten)."""
    expected = {f: [0, 0] for f in kind_files(info)}
    for e in info["chunks"]:
        if e is not None:
            for piece in chunk_pieces(info, e):
                if not piece.stored:
                    continue
                if piece.file not in expected:
                    raise OffloadError(f"{ckpt / MANIFEST}: a piece of {kind} is in {piece.file}, not one of "
                                       f"the kind's files {sorted(expected)}")
                count = expected[piece.file]
                count[0] += 1
                count[1] += piece.nbytes
    for name, (stored, nbytes) in expected.items():
        if files is not None and name not in files:
            continue
        path = ckpt / name
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise OffloadError(f"checkpoint file {path} is missing: {exc}") from exc
        if size != nbytes:
            what = "pieces" if any(e is not None and "pieces" in e for e in info["chunks"]) else "chunks"
            raise ChecksumError(str(path), size, nbytes,
                                f"file holds {size} bytes, the manifest says {stored} {what} of "
                                f"{nbytes} bytes in all (truncated or overwritten)")
