"""Checkpoints of a model cut into pipeline stages, and resuming them under another cut.

``save_pipeline_checkpoint(staged, optimizer, root, step=n)`` writes ``root/step-0000000n/``::

    pipeline.json      pp, dp, schedule, and per stage: its units [lo, hi) of the model's chain,
                       its parameters' names (in the stage -> in the whole model), its directory
    stage-000/         stage 0's engine checkpoint (a checkpoint root: ``offload.checkpoint``'s
    stage-001/         format, written by the stage's data-parallel ranks, any width)
    ...

and points ``root/latest`` at it. Every rank calls it; each writes its own stages (with their
data-parallel peers), and rank 0 writes ``pipeline.json`` into the temp directory only after
every rank's stages are durable, then renames it into place: a run killed at any point leaves
the previous checkpoint current. ``extra`` is saved with every stage and read back from stage 0's.

``load_pipeline_checkpoint(targets, optimizer, root)`` resumes a pipeline checkpoint, or a plain
engine checkpoint (one stage holding the whole model), into ``targets`` (``Target``: this rank's
stages, or one wrapped model): when the cut is the same (as many stages, each holding the same
parameters) each stage loads its own engine checkpoint (``offload.checkpoint.load_checkpoint``:
any data-parallel width, every chunk verified); otherwise each parameter's state is found by
name in the old stages and written into the new layout (``reshard.load_resharded``). A pipeline
resume takes the newest checkpoint (``latest``) and does not fall back to older ones.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ..checkpoint import LATEST, MANIFEST, list_checkpoints, load_checkpoint, resolve_checkpoint, save_checkpoint
from ..checkpoint.files import clean_stale, fsync_dir, write_file_atomic
from ..checkpoint.format import STEP_NAME, read_checked_file, step_name
from ..checkpoint.listing import intact
from ..checkpoint.plain import load_plain
from ..checkpoint.ranks import Ranks
from ..errors import ChecksumError, ConfigError, OffloadError
from .reshard import Source, load_resharded

PIPELINE_MANIFEST = "pipeline.json"
PIPELINE_FORMAT = "offload-pipeline-checkpoint"


def stage_dir(index: int) -> str:
    return f"stage-{index:03d}"


@dataclass(frozen=True)
class Target:
    """A wrapped module to load: stage ``index`` of ``count``, ``names`` its parameters' names in the
    stage -> in the whole model (None: a whole wrapped model, names as they are)."""

    index: int
    count: int
    module: object
    names: dict[str, str] | None = None


def _world() -> Ranks:
    """Every rank of the job (the default group), for agreeing on a step all of them take."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    return Ranks(SimpleNamespace(rank=dist.get_rank(), world=dist.get_world_size(), group=None))


def _crc(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode()) & 0xFFFFFFFF


def save_pipeline_checkpoint(staged, optimizer, directory: str | os.PathLike, *, step: int,
                             extra: dict | None = None, keep: int | None = None) -> Path:
    """Save every stage of ``staged`` (an ``offload.pipeline.StagedModel``) as ``directory/step-<step>``
    (see the module docstring); returns its path on every rank. Call it after ``optimizer.step()``."""
    if not isinstance(step, int) or step < 0:
        raise ConfigError("step", step, "must be an integer >= 0")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ConfigError("keep", keep, "must be a positive integer or None")
    world, root, name = _world(), Path(directory), step_name(step)
    error, plan = None, None
    if world.lead:
        try:
            root.mkdir(parents=True, exist_ok=True)
            clean_stale(root)
            tmp = root / f".tmp-{name}-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            plan = str(tmp)
        except Exception as exc:
            error = exc
    tmp = Path(world.settle(error, f"preparing pipeline checkpoint {root / name}", plan)[0])
    error = None
    try:
        for s, module in zip(staged.indices, staged.modules):
            save_checkpoint(module, optimizer, tmp / stage_dir(s), step=step, extra=extra)
    except Exception as exc:
        error = exc
    try:
        world.settle(error, f"writing its stages of pipeline checkpoint {root / name}")
    except BaseException:
        if world.lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error, final = None, None
    if world.lead:
        try:
            final = str(_commit(staged, root, tmp, step, keep))
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = exc
    return Path(world.settle(error, f"committing pipeline checkpoint {root / name}", final)[0])


def _commit(staged, root: Path, tmp: Path, step: int, keep: int | None) -> Path:
    stages = []
    for s, (units, names) in enumerate(zip(staged.stage_units, staged.stage_names)):
        ckpt = resolve_checkpoint(tmp / stage_dir(s))
        stages.append({"index": s, "dir": stage_dir(s), "units": list(units) if units else None, "names": names,
                       "chunk_size": intact(ckpt)["layout"]["chunk_size"]})
    body = {"format": PIPELINE_FORMAT, "version": 1, "step": step, "pp": staged.pp, "dp": staged.dp,
            "schedule": staged.schedule_name, "stages": stages}
    write_file_atomic(tmp / PIPELINE_MANIFEST, json.dumps({**body, "crc32": _crc(body)}, indent=1).encode())
    fsync_dir(tmp)
    final = root / step_name(step)
    trash = None
    if final.exists():
        trash = root / f".trash-{final.name}-{os.getpid()}"
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_dir(root)
    write_file_atomic(root / LATEST, (final.name + "\n").encode())
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    if keep is not None:
        for old in list_any(root)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def is_pipeline(path: Path) -> bool:
    return (Path(path) / PIPELINE_MANIFEST).is_file()


def list_any(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``directory``, pipeline ones and engine ones, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_NAME.match(p.name)) and is_pipeline(p)]
    found += [(int(STEP_NAME.match(p.name).group(1)), p) for p in list_checkpoints(root)]
    return [p for _, p in sorted(found)]


def newest(directory: str | os.PathLike) -> Path | None:
    """The checkpoint a resume from ``directory`` loads: ``directory`` itself when it is one, what
    ``latest`` names, else the newest complete one; None when there is none."""
    root = Path(directory)
    if is_pipeline(root) or (root / MANIFEST).is_file():
        return root
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        name = ""
    if name and "/" not in name and (is_pipeline(root / name) or (root / name / MANIFEST).is_file()):
        return root / name
    found = list_any(root)
    return found[-1] if found else None


def read_pipeline_manifest(ckpt: Path) -> dict:
    """The checked ``pipeline.json`` of pipeline checkpoint ``ckpt``."""
    path = Path(ckpt) / PIPELINE_MANIFEST
    try:
        manifest = json.loads(path.read_text())
        want = manifest.pop("crc32")
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise OffloadError(f"pipeline checkpoint manifest {path} cannot be read: {exc}") from exc
    if manifest.get("format") != PIPELINE_FORMAT or manifest.get("version") != 1:
        raise OffloadError(f"{path}: not an {PIPELINE_FORMAT} version 1 manifest")
    got = _crc(manifest)
    if got != want:
        raise ChecksumError(str(path), 0, 0, f"checksum mismatch of the manifest's own crc32 (expected "
                                             f"{want:#010x}, got {got:#010x})")
    return manifest


def saved_sources(ckpt: Path) -> list[Source]:
    """The engine checkpoints of pipeline checkpoint ``ckpt`` (or ``ckpt`` itself, an engine
    checkpoint: one source), each checked ``intact``, in stage order."""
    ckpt = Path(ckpt)
    if not is_pipeline(ckpt):
        return [Source(ckpt, intact(ckpt), None)]
    out = []
    for st in read_pipeline_manifest(ckpt)["stages"]:
        inner = resolve_checkpoint(ckpt / st["dir"])
        out.append(Source(inner, intact(inner), st["names"]))
    return out


def saved_chunk_size(directory: str | os.PathLike) -> int | None:
    """The chunk size (elements) of the checkpoint a resume from ``directory`` loads (stage 0's in
    a pipeline checkpoint), or None when there is none."""
    ckpt = newest(directory)
    if ckpt is None:
        return None
    return int(saved_sources(ckpt)[0].manifest["layout"]["chunk_size"])


def saved_extra(source: Source):
    """What ``extra`` the saving run gave (stage 0's copy in a pipeline checkpoint)."""
    m = source.manifest
    if m.get("extra_file"):
        return load_plain(source.ckpt / m["extra_file"]["file"],
                          read_checked_file(source.ckpt, m["extra_file"], m["checksum"]))
    return m.get("extra")


def load_pipeline_checkpoint(targets: list[Target], optimizer, directory: str | os.PathLike, *,
                             aliases: dict[str, str] | None = None) -> dict:
    """Load the checkpoint a resume from ``directory`` takes into ``targets`` (this rank's stages,
    or one wrapped model), resharding by parameter name when the cut differs; returns
    ``{"path", "step", "extra", "resharded"}``. Every rank calls it. ``aliases``: a target
    parameter read under another saved name (see ``reshard.load_resharded``)."""
    ckpt = newest(directory)
    if ckpt is None:
        raise OffloadError(f"no checkpoint in {directory}")
    sources = saved_sources(ckpt)
    same = all(t.count == len(sources) and _same_names(t, sources[t.index]) for t in targets)
    error = None
    try:
        if same:
            for t in targets:
                load_checkpoint(t.module, optimizer, sources[t.index].ckpt)
        else:
            load_resharded([(t.module, t.names) for t in targets], optimizer, sources, aliases)
    except Exception as exc:
        error = exc
    _world().settle(error, f"loading checkpoint {ckpt}")
    return {"path": str(ckpt), "step": int(sources[0].manifest["step"]), "extra": saved_extra(sources[0]),
            "resharded": not same}


def _same_names(target: Target, source: Source) -> bool:
    from ..engine.access import engine_of

    layout = engine_of(target.module, required=True).chunks.layout
    mine = [s.name for s in layout.slots]
    theirs = [e[0] for e in source.manifest["layout"]["params"]]
    if mine != theirs or layout.chunk_size != source.manifest["layout"]["chunk_size"]:
        return False
    full = (lambda names, n: n if names is None else names.get(n, n))
    return all(full(target.names, n) == full(source.names, n) for n in mine)
