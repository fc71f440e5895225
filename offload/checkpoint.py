"""Checkpoints of a wrapped model and its optimizer, streamed chunk by chunk from every tier.

``save_checkpoint(model, optimizer, root, step=n)`` writes ``root/step-0000000n/`` and points
``root/latest`` at it; ``load_checkpoint(model, optimizer, root)`` loads what ``latest`` names
(or ``root`` itself when it is one checkpoint, i.e. holds a ``manifest.json``).

A checkpoint directory holds::

    manifest.json          format version, layout, dtype, per-chunk CRC32C and file offsets,
                           per-parameter Adam step counts, loss scaler, engine step count,
                           optimizer hyper-parameters, the caller's ``extra``
    param.bin              raw chunk bytes of each kind, one file per kind: the chunks that
    master.bin             hold data, in chunk order, each ``chunk_size * itemsize`` bytes
    exp_avg.bin            (FREE chunks -- e.g. Adam state before the first step -- take no
    exp_avg_sq.bin         space and are recorded as ``null``)
    buffers.pt             persistent module buffers (only when the model has any)
    optimizer_state.pt     optimizer state of parameters the engine does not own (only if any)
    extra.pt               ``extra`` when it is not JSON-serializable

Gradients are not saved: a checkpoint is taken between ``optimizer.step()`` and the next
backward, and loading leaves a clean accumulation window.

Streaming: chunks go through two reused chunk-sized staging buffers. Saving reads chunk i+1
(``store.read_into``, from the device, pinned CPU or straight from NVMe) and checksums it on a
thread while chunk i is written to its file; loading reads and verifies chunk i+1 from its file
while chunk i goes into the store (``store.write``). Extra memory is two chunks of the largest
kind, whatever the model size. Written data is synced every ``SYNC_EVERY`` bytes and dropped
from the page cache, so a 1 TB checkpoint does not push the training state out of RAM.

Atomicity: everything is written into ``root/.tmp-<name>-<pid>/``, each file fsynced, the
manifest last, the directory fsynced and renamed to ``root/<name>``; then ``latest`` is replaced
atomically (temp file + fsync + ``os.replace`` + fsync of ``root``). A process killed at any
point leaves the previous checkpoint and ``latest`` intact; the next save removes stale
``.tmp-*`` directories of dead processes. If ``latest`` is missing or names an incomplete
directory, loading falls back to the newest complete ``step-*`` checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import zlib
from pathlib import Path

import torch

from .chunks.states import ChunkState
from .errors import ChecksumError, ConfigError, OffloadError

FORMAT = "offload-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
SAVED_KINDS = ("param", "master", "exp_avg", "exp_avg_sq")   # grads are never saved
SYNC_EVERY = 256 << 20
_NAME = re.compile(r"^step-(\d+)$")
_TEMP = re.compile(r"^\.(tmp|trash)-(.+)-(\d+)$")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


# ---- checksums -------------------------------------------------------------------------------
def _checksum_algorithm() -> str:
    try:
        from .native import crc32c

        crc32c(0, 0)
        return "crc32c"
    except Exception:       # no native extension: zlib's CRC-32 (a different polynomial, recorded as such)
        return "crc32"


def _checksum(algorithm: str, data: torch.Tensor) -> int:
    """Checksum of a contiguous CPU tensor's bytes."""
    nbytes = data.numel() * data.element_size()
    if algorithm == "crc32c":
        from .native import crc32c

        return crc32c(data.data_ptr(), nbytes)
    if algorithm == "crc32":
        return zlib.crc32(_bytes_view(data)) & 0xFFFFFFFF
    raise OffloadError(f"unknown checksum algorithm {algorithm!r} in the manifest")


def _checksum_bytes(algorithm: str, data: bytes) -> int:
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8, device="cpu")
    return _checksum(algorithm, t)


def _bytes_view(t: torch.Tensor):
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


# ---- file helpers ----------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data, path: Path, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.write(fd, view[done:])
        except OSError as exc:
            from .errors import NvmeIOError

            raise NvmeIOError(exc.errno or 5, str(path), offset + done, len(view) - done,
                              "writing a checkpoint") from exc
        if n <= 0:
            from .errors import NvmeIOError

            raise NvmeIOError(5, str(path), offset + done, len(view) - done, "short write")
        done += n


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file, fsync, ``os.replace``, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            _write_all(fd, data, tmp, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class _KindWriter:
    """Appends whole chunks to one file, syncing and dropping written pages every ``SYNC_EVERY``."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.offset = 0
        self.synced = 0

    def append(self, data: torch.Tensor) -> int:
        at = self.offset
        _write_chunk(self, data)
        self.offset += data.numel() * data.element_size()
        if self.offset - self.synced >= SYNC_EVERY:
            self._sync()
        return at

    def _sync(self) -> None:
        os.fdatasync(self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.synced, self.offset - self.synced, os.POSIX_FADV_DONTNEED)
        self.synced = self.offset

    def close(self) -> None:
        try:
            os.fsync(self.fd)
            if hasattr(os, "posix_fadvise") and self.offset > self.synced:
                os.posix_fadvise(self.fd, self.synced, self.offset - self.synced, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(self.fd)


def _write_chunk(writer: _KindWriter, data: torch.Tensor) -> None:
    # A module-level function so that tests can slow it down to kill a save midway.
    _write_all(writer.fd, _bytes_view(data), writer.path, writer.offset)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(root: Path) -> None:
    """Remove ``.tmp-*`` directories of dead processes; put back a ``.trash-*`` whose rename did not finish."""
    for entry in root.iterdir():
        m = _TEMP.match(entry.name)
        if not m or not entry.is_dir():
            continue
        kind, name, pid = m.group(1), m.group(2), int(m.group(3))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        target = root / name
        if kind == "trash" and not target.exists() and (entry / MANIFEST).exists():
            os.rename(entry, target)           # killed between moving the old one aside and the new one in
            _fsync_dir(root)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete ``step-*`` checkpoints under ``directory``, oldest first (by step)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and _complete(p)]
    return [p for _, p in sorted(found)]


def resolve_checkpoint(directory: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint directory that ``load_checkpoint(..., directory, step=step)`` would read."""
    root = Path(directory)
    if step is None and _complete(root):
        return root
    if step is not None:
        path = root / _name(step)
        if not _complete(path):
            raise OffloadError(f"no complete checkpoint for step {step} at {path}")
        return path
    latest = root / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        if name and "/" not in name and _complete(root / name):
            return root / name
    found = list_checkpoints(root)
    if not found:
        raise OffloadError(f"no checkpoint in {root} (no {MANIFEST}, no {LATEST} pointer, no complete step-* directory)")
    return found[-1]


def _name(step: int) -> str:
    return f"step-{int(step):08d}"


# ---- the model side --------------------------------------------------------------------------
def _engine(model):
    engine = getattr(model, "offload_engine", None)
    if engine is None:
        raise ConfigError("model", type(model).__name__, "is not wrapped by offload.wrap (no offload_engine)")
    if getattr(engine, "_closed", False):
        raise OffloadError("the model's offload engine is closed: its state is gone")
    return engine


def persistent_buffers(model) -> dict[str, tuple[torch.nn.Module, str]]:
    out = {}
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is None or bname in module._non_persistent_buffers_set:
                continue
            out[f"{mname}.{bname}" if mname else bname] = (module, bname)
    return out


def _json_value(v):
    """A JSON-safe copy of a hyper-parameter value, or raise TypeError."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise TypeError("tensor with more than one element")
        return v.item()
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise TypeError("non-finite float")
        return v
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    raise TypeError(type(v).__name__)


def _group_hypers(optimizer) -> list[dict]:
    groups = []
    for group in optimizer.param_groups:
        saved = {"num_params": len(group["params"])}
        for k, v in group.items():
            if k == "params":
                continue
            try:
                saved[k] = _json_value(v)
            except TypeError:
                pass            # not representable: the optimizer's constructor value stays
        groups.append(saved)
    return groups


def _restore_hypers(optimizer, groups: list[dict], where: Path) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ConfigError("optimizer.param_groups", len(optimizer.param_groups),
                          f"the checkpoint {where} has {len(groups)} parameter groups")
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, groups)):
        if saved.get("num_params", len(group["params"])) != len(group["params"]):
            raise ConfigError(f"optimizer.param_groups[{gi}]", len(group["params"]),
                              f"the checkpoint {where} has {saved['num_params']} parameters in this group")
        for k, v in saved.items():
            if k == "num_params":
                continue
            cur = group.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple) and isinstance(v, list):
                group[k] = tuple(v)
            else:
                group[k] = v


def _foreign_optimizer_state(optimizer, engine) -> dict[int, dict]:
    """Optimizer state of parameters the engine does not own (plain CPU parameters), by index."""
    out, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not engine.params.owns(p) and p in optimizer.state and optimizer.state[p]:
                out[i] = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                          for k, v in optimizer.state[p].items()}
            i += 1
    return out


def _layout_entries(engine) -> list[list]:
    return [[s.name, s.chunk, s.offset, s.numel, list(s.shape)] for s in engine.layout.slots]


def _torch_save_checked(obj, path: Path, algorithm: str) -> dict:
    torch.save(obj, path)
    with open(path, "rb+") as f:
        data = f.read()
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": len(data), algorithm: _checksum_bytes(algorithm, data)}


def _torch_load_checked(ckpt: Path, entry: dict, algorithm: str):
    path = ckpt / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise OffloadError(f"checkpoint file {path} cannot be read: {exc}") from exc
    got = _checksum_bytes(algorithm, data)
    if len(data) != entry["bytes"] or got != entry[algorithm]:
        raise ChecksumError(str(path), 0, len(data), f"{algorithm} mismatch in {entry['file']} "
                                                     f"(expected {entry[algorithm]:#010x}, got {got:#010x})")
    import io

    return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


# ---- save ------------------------------------------------------------------------------------
def save_checkpoint(model, optimizer, directory: str | os.PathLike, *, step: int | None = None,
                    extra: dict | None = None, keep: int | None = None) -> Path:
    """Save ``model``'s chunks and ``optimizer``'s state as ``directory/step-<step>``; returns its path.

    ``step`` defaults to the engine's optimizer step count. ``extra`` (e.g. the data position or
    an LR scheduler's ``state_dict()``) comes back from ``load_checkpoint`` as ``manifest["extra"]``.
    ``keep``: after a successful save, delete all but the newest ``keep`` checkpoints.
    Call it between ``optimizer.step()`` and the next backward; ``optimizer`` may be None (then no
    hyper-parameters are saved; the engine's Adam state still is).
    """
    engine = _engine(model)
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ConfigError("keep", keep, "must be a positive integer or None")
    engine.adam.drain()
    if engine.micro_batches or engine.window_applied:
        raise OffloadError("save_checkpoint came in the middle of an accumulation window (backward ran, "
                           "optimizer.step() did not): call it after optimizer.step()")
    if optimizer is not None and engine.optimizer is not None and optimizer is not engine.optimizer:
        raise ConfigError("optimizer", type(optimizer).__name__, "is not the optimizer attached to this model")
    step = engine.step_count if step is None else int(step)
    if step < 0:
        raise ConfigError("step", step, "must be >= 0")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root)
    name = _name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        manifest = _write_contents(engine, optimizer, tmp, step, extra)
        write_file_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / name
    trash = None
    if final.exists():
        trash = root / f".trash-{name}-{os.getpid()}"
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync_dir(root)
    write_file_atomic(root / LATEST, (name + "\n").encode())
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _pipelined(items: list, fetch, consume) -> None:
    """``consume(i, fetch(i, buf))`` for each item, fetching item i+1 on a thread while item i is consumed.

    ``fetch`` fills one of two alternating buffers; item i's buffer is reused by item i+2 only
    after ``consume(i)`` returned.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not items:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="offload-ckpt") as pool:
        future = pool.submit(fetch, 0)
        for i in range(len(items)):
            result = future.result()
            if i + 1 < len(items):
                future = pool.submit(fetch, i + 1)
            try:
                consume(i, result)
            except BaseException:
                if i + 1 < len(items):
                    future.cancel()
                    try:
                        future.result()
                    except BaseException:
                        pass
                raise


def _write_contents(engine, optimizer, tmp: Path, step: int, extra) -> dict:
    store, layout = engine.store, engine.layout
    algorithm = _checksum_algorithm()
    t0 = time.perf_counter()
    kinds = {}
    items: list[tuple[str, int]] = []
    for kind in SAVED_KINDS:
        # Frozen chunks have no master or optimizer state; an oversized parameter's chunk is
        # larger than the bulk ``chunk_bytes`` (its entry then says its own ``nbytes``).
        recs = {c: store.records[(kind, c)] for c in range(layout.num_chunks) if (kind, c) in store.records}
        if not recs:
            continue
        rec0 = next(iter(recs.values()))
        kinds[kind] = {"file": f"{kind}.bin", "dtype": _DTYPE_NAMES[rec0.dtype],
                       "chunk_bytes": layout.chunk_size * rec0.dtype.itemsize,
                       "chunks": [None] * layout.num_chunks}
        items += [(kind, c) for c, rec in recs.items() if rec.state is not ChunkState.FREE]
    bufs = store.staging_buffers(max((store.largest_bytes(kind) for kind in kinds), default=0))
    writers: dict[str, _KindWriter] = {}

    def fetch(i):
        data = store.read_into(items[i], bufs[i % 2])
        return data, _checksum(algorithm, data)

    def consume(i, result):
        kind, c = items[i]
        data, crc = result
        kinds[kind]["chunks"][c] = {"offset": writers[kind].append(data), algorithm: crc}
        if data.numel() * data.element_size() != kinds[kind]["chunk_bytes"]:
            kinds[kind]["chunks"][c]["nbytes"] = data.numel() * data.element_size()

    try:
        for kind, info in kinds.items():     # inside the try: a failed open closes the others
            writers[kind] = _KindWriter(tmp / info["file"])
        _pipelined(items, fetch, consume)
    finally:
        for w in writers.values():
            w.close()
    total = sum(w.offset for w in writers.values())
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "created": time.time(),
        "checksum": algorithm,
        "dtype": engine.config.dtype,
        "engine_step_count": engine.step_count,
        "layout": {"chunk_size": layout.chunk_size, "num_chunks": layout.num_chunks,
                   "params": _layout_entries(engine)},
        "kinds": kinds,
        "adam_steps": list(engine.adam.steps),
        "scaler": None if engine.scaler is None else {
            "scale": engine.scaler.scale, "good_steps": engine.scaler.good_steps,
            "skipped": engine.scaler.skipped},
        "optimizer": None,
        "buffers": None,
        "extra": None,
        "extra_file": None,
    }
    if optimizer is not None:
        manifest["optimizer"] = {"class": type(optimizer).__name__, "param_groups": _group_hypers(optimizer),
                                 "max_grad_norm": getattr(optimizer, "max_grad_norm", None), "state": None}
        foreign = _foreign_optimizer_state(optimizer, engine)
        if foreign:
            manifest["optimizer"]["state"] = _torch_save_checked(foreign, tmp / "optimizer_state.pt", algorithm)
    buffers = {n: getattr(m, b).detach().cpu() for n, (m, b) in persistent_buffers(engine.model).items()}
    if buffers:
        manifest["buffers"] = _torch_save_checked(buffers, tmp / "buffers.pt", algorithm)
    if extra is not None:
        try:
            json.dumps(extra, allow_nan=False)
            manifest["extra"] = extra
        except (TypeError, ValueError):
            manifest["extra_file"] = _torch_save_checked(extra, tmp / "extra.pt", algorithm)
    manifest["bytes"] = total
    manifest["write_s"] = time.perf_counter() - t0
    return manifest


# ---- load ------------------------------------------------------------------------------------
def load_checkpoint(model, optimizer, directory: str | os.PathLike, *, step: int | None = None) -> dict:
    """Load a checkpoint into a wrapped ``model`` (and ``optimizer``); returns its manifest.

    ``directory`` is a checkpoint root (``latest`` is loaded, or ``step=``) or one checkpoint.
    ``manifest["extra"]`` is what ``save_checkpoint`` got as ``extra``, ``manifest["path"]`` the
    directory read. Checksums are verified chunk by chunk as the data streams in: on a mismatch
    ``ChecksumError`` names the file and chunk, and the model's state is then partly loaded
    (load another checkpoint).
    """
    engine = _engine(model)
    ckpt = resolve_checkpoint(directory, step)
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise OffloadError(f"checkpoint manifest {ckpt / MANIFEST} cannot be read: {exc}") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise OffloadError(f"{ckpt / MANIFEST}: not an {FORMAT} version {VERSION} manifest "
                           f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})")
    if optimizer is not None and engine.optimizer is not None and optimizer is not engine.optimizer:
        raise ConfigError("optimizer", type(optimizer).__name__, "is not the optimizer attached to this model")
    _check_compatible(engine, manifest, ckpt)
    algorithm = manifest["checksum"]
    engine.adam.drain()
    engine.zero_grad()                       # a clean window: no gradients, nothing applied
    t0 = time.perf_counter()
    _load_chunks(engine, manifest, ckpt, algorithm)
    read_s = time.perf_counter() - t0
    engine.adam.steps[:] = [int(s) for s in manifest["adam_steps"]]
    engine.step_count = int(manifest["engine_step_count"])
    if engine.scaler is not None and manifest.get("scaler"):
        engine.scaler.scale = float(manifest["scaler"]["scale"])
        engine.scaler.good_steps = int(manifest["scaler"]["good_steps"])
        engine.scaler.skipped = int(manifest["scaler"]["skipped"])
    opt = manifest.get("optimizer")
    if optimizer is not None and opt is not None:
        _restore_hypers(optimizer, opt["param_groups"], ckpt)
        if hasattr(optimizer, "max_grad_norm") and "max_grad_norm" in opt:
            optimizer.max_grad_norm = opt["max_grad_norm"]
        if opt.get("state"):
            foreign = _torch_load_checked(ckpt, opt["state"], algorithm)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for i, st in foreign.items():
                p = params[i]
                optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() else v)
                                      for k, v in st.items()}
    if manifest.get("buffers"):
        saved = _torch_load_checked(ckpt, manifest["buffers"], algorithm)
        live = persistent_buffers(engine.model)
        for name, value in saved.items():
            if name not in live:
                raise ConfigError("buffer", name, f"is in the checkpoint {ckpt} but not in the model")
            module, b = live[name]
            getattr(module, b).copy_(value)
    if manifest.get("extra_file"):
        manifest["extra"] = _torch_load_checked(ckpt, manifest["extra_file"], algorithm)
    manifest["path"] = str(ckpt)
    manifest["read_s"] = read_s
    return manifest


def _check_compatible(engine, manifest: dict, ckpt: Path) -> None:
    lay = manifest["layout"]
    if manifest["dtype"] != engine.config.dtype:
        raise ConfigError("dtype", engine.config.dtype, f"the checkpoint {ckpt} was saved with dtype "
                                                        f"{manifest['dtype']!r}")
    saved = {e[0]: e for e in lay["params"]}
    mine = {e[0]: e for e in _layout_entries(engine)}
    for name, e in mine.items():
        if name not in saved:
            raise ConfigError("parameter", name, f"is not in the checkpoint {ckpt}")
        s = saved[name]
        if s[4] != e[4]:
            raise ConfigError("parameter", name, f"has shape {tuple(e[4])} but {tuple(s[4])} in the checkpoint {ckpt}")
        if s[1:4] != e[1:4]:
            raise ConfigError("parameter", name, f"sits at chunk {e[1]} offset {e[2]} but at chunk {s[1]} "
                                                 f"offset {s[2]} in the checkpoint {ckpt} (a different chunk "
                                                 f"layout: use the same chunk_size and parameter order)")
    extra = sorted(set(saved) - set(mine))
    if extra:
        raise ConfigError("parameter", extra[0], f"is in the checkpoint {ckpt} but not in the model "
                                                 f"({len(extra)} such)")
    if lay["chunk_size"] != engine.layout.chunk_size or lay["num_chunks"] != engine.layout.num_chunks:
        raise ConfigError("chunk_size", engine.layout.chunk_size,
                          f"the checkpoint {ckpt} has {lay['num_chunks']} chunks of {lay['chunk_size']} elements")
    if len(manifest["adam_steps"]) != len(engine.adam.steps):
        raise OffloadError(f"{ckpt / MANIFEST}: {len(manifest['adam_steps'])} step counts for "
                           f"{len(engine.adam.steps)} parameters")
    store = engine.store
    for kind, info in manifest["kinds"].items():
        recs = {c: r for (k, c), r in store.records.items() if k == kind}
        if not recs:
            raise ConfigError("kind", kind, f"the checkpoint {ckpt} has {kind!r} chunks this model does not")
        rec = next(iter(recs.values()))
        bulk = engine.layout.chunk_size * rec.dtype.itemsize
        if _DTYPES.get(info["dtype"]) != rec.dtype or info["chunk_bytes"] != bulk:
            raise ConfigError("kind", kind, f"{info['dtype']} chunks of {info['chunk_bytes']} bytes in the "
                                            f"checkpoint {ckpt}, {rec.dtype} of {bulk} in the model")
        for c, entry in enumerate(info["chunks"]):
            if entry is not None and (c not in recs or _entry_bytes(info, entry) != recs[c].nbytes):
                raise ConfigError("kind", kind, f"chunk {c} of the checkpoint {ckpt} does not match the "
                                                "model's (a different chunk layout or set of frozen parameters)")
        if len(info["chunks"]) != engine.layout.num_chunks:
            raise OffloadError(f"{ckpt / MANIFEST}: {len(info['chunks'])} {kind} chunk entries, expected "
                               f"{engine.layout.num_chunks}")
        path = ckpt / info["file"]
        stored = sum(1 for e in info["chunks"] if e is not None)
        expected = sum(_entry_bytes(info, e) for e in info["chunks"] if e is not None)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise OffloadError(f"checkpoint file {path} is missing: {exc}") from exc
        if size != expected:
            raise ChecksumError(str(path), size, expected,
                                f"file holds {size} bytes, the manifest says {stored} chunks of "
                                f"{expected} bytes in all (truncated or overwritten)")
    registered = {k for k, _ in store.records}
    for kind in SAVED_KINDS:
        if kind in registered and kind not in manifest["kinds"]:
            raise ConfigError("kind", kind, f"the model has {kind!r} chunks, the checkpoint {ckpt} none")


def _entry_bytes(info: dict, entry: dict) -> int:
    """Bytes of one saved chunk: the kind's ``chunk_bytes``, or its own for an oversized chunk."""
    return int(entry.get("nbytes", info["chunk_bytes"]))


def _load_chunks(engine, manifest: dict, ckpt: Path, algorithm: str) -> None:
    store = engine.store
    items: list[tuple[str, int, dict]] = []
    for kind, info in manifest["kinds"].items():
        for c, entry in enumerate(info["chunks"]):
            if entry is None:
                rec = store.records.get((kind, c))
                if rec is not None and rec.state is not ChunkState.FREE:
                    store.release_storage((kind, c))
            else:
                items.append((kind, c, entry))
    biggest = max((_entry_bytes(manifest["kinds"][k], e) for k, _, e in items), default=0)
    bufs = [torch.zeros(biggest, dtype=torch.uint8, device="cpu") for _ in range(2)]
    files = {}

    def fetch(i):
        kind, c, entry = items[i]
        info = manifest["kinds"][kind]
        path, nbytes = ckpt / info["file"], _entry_bytes(info, entry)
        if kind not in files:
            files[kind] = open(path, "rb", buffering=0)
        f = files[kind]
        view = bufs[i % 2][:nbytes]
        mv = memoryview(view.numpy()).cast("B")
        got = 0
        while got < nbytes:
            n = os.preadv(f.fileno(), [mv[got:]], entry["offset"] + got)
            if not n:
                raise ChecksumError(str(path), entry["offset"] + got, nbytes - got,
                                    f"short read of chunk {kind}[{c}]")
            got += n
        crc = _checksum(algorithm, view)
        if crc != entry[algorithm]:
            raise ChecksumError(str(path), entry["offset"], nbytes,
                                f"{algorithm} mismatch in chunk {kind}[{c}] of {info['file']} "
                                f"(expected {entry[algorithm]:#010x}, got {crc:#010x})")
        return view.view(_DTYPES[info["dtype"]])

    def consume(i, data):
        kind, c, _ = items[i]
        store.write((kind, c), data)

    try:
        _pipelined(items, fetch, consume)
    finally:
        for f in files.values():
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            f.close()
