"""Atomic training checkpoints with a `latest` pointer, keep-last-N, and RNG capture/restore.

Layout under a checkpoint root:

    root/step_000050/model.pt        engine state (`TrainEngine.state_dict()`: model, optimizer, ...) except
                                     the entries kept in own files
    root/step_000050/<own>.pt        an engine-state entry the engine wrapped in `OwnFile` (engines/own_file.py),
                                     e.g. optimizer_param_state.pt: the megatron actor's optimizer parameter
                                     state, which only data-parallel rank 0 reads
    root/step_000050/rng.pt          RNG states (python, numpy if present, torch CPU, every CUDA device)
    root/step_000050/state.json      {"step", "data_state", "extra", "format", "files": {entry key: own file}}
    root/step_000050/manifest.json   sizes and SHA-256 of every file above: written last (checkpoint_verify.py)
    root/latest                      "step_000050\\n": the newest complete checkpoint

A save writes every file (each through `mopd_hpc.atomic`: temp file, fsync, rename) into a hidden
`root/.step_000050.tmp-<pid>/`, renames that directory to `step_000050` (atomic on POSIX), and only then
rewrites `latest` atomically. A crash at any point leaves `latest` naming the previous complete checkpoint;
a half-written temp directory is ignored by `load_latest` and removed by the next save. Loading uses
`torch.load(weights_only=True)`: a checkpoint never executes pickled code. An own file is not read at load:
its entry in `Checkpoint.engine_state` is a `FileRef` (the path), which the engine reads where it needs it
(`own_file.resolve`); a checkpoint without "files" in state.json (older: every entry in model.pt) loads as
it always did.

Loading verifies (trainer/checkpoint_verify.py: sizes and SHA-256 against the manifest): a damaged newest
checkpoint (a truncated model.pt, an empty state.json, an empty or garbage `latest`) is logged, naming the
file and what is wrong, and the previous good one is used; when none is good, `load_latest` raises naming
each. A checkpoint without a manifest (written before manifests existed) is accepted, with a warning, when
its zip CRCs check and it loads.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mopd_hpc.atomic import atomic_open, atomic_write_json, atomic_write_text, publish_dir
from mopd_hpc.engines.own_file import FileRef, OwnFile
from mopd_hpc.records.run_dir import LATEST
from mopd_hpc.trainer import checkpoint_verify as verify

log = logging.getLogger(__name__)

#: Checkpoints kept by default (the newest N; `latest` is never removed).
DEFAULT_KEEP_LAST = 3


class CheckpointError(ValueError):
    """A checkpoint root is inconsistent (pointer to a missing directory, unreadable state) or a save
    argument is invalid."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint: `step`, its directory, the engine state, the data-stream state, RNG states and
    `extra` (JSON), as given to `save_checkpoint`. Tensors are on the CPU; an entry saved as an `OwnFile`
    is a `FileRef` (not read). `skipped`: one line per newer
    checkpoint `load_latest` passed over as damaged (the file and what is wrong), newest first."""

    step: int
    path: Path
    engine_state: dict[str, Any]
    data_state: dict[str, Any]
    rng_state: dict[str, Any]
    extra: dict[str, Any]
    skipped: tuple[str, ...] = ()


def step_dir_name(step: int) -> str:
    """`50` → `"step_000050"`."""
    return f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories under `root`, oldest first, as (step, path)."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in base.iterdir() if p.is_dir() and (m := verify.STEP_RE.match(p.name))
    ]
    return sorted(found)


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, in a form `torch.load(weights_only=True)` accepts."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `capture_rng_state` captured (keys absent from `state` are left alone)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _disk_error(exc: BaseException, path: Path) -> OSError | None:
    """The OSError behind `exc` (itself, or the one torch's zip writer hides behind a RuntimeError such as
    "unexpected pos 768 vs 662" when the disk fills up), as an OSError naming `path`; None when there is none."""
    found: BaseException | None = exc
    while found is not None and not isinstance(found, OSError):
        found = found.__context__
    if found is None:
        return None
    if found.filename is not None:
        return found
    return OSError(found.errno, found.strerror or str(found), str(path))


def _torch_save(obj: Any, path: Path) -> None:
    try:
        with atomic_open(path, "wb") as f:
            torch.save(obj, f)
    except (OSError, RuntimeError) as exc:
        disk = _disk_error(exc, path)
        if disk is None or disk is exc:
            raise
        raise disk from exc


def save_checkpoint(
    root: str | Path,
    step: int,
    engine_state: Mapping[str, Any],
    *,
    data_state: Mapping[str, Any] | None = None,
    rng_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    keep_last: int = DEFAULT_KEEP_LAST,
) -> Path:
    """Write `root/step_<step>/` completely, then point `latest` at it, then keep the newest `keep_last`.

    Args:
        root: checkpoint root (created if absent).
        step: the number of completed training steps, ≥ 0.
        engine_state: `TrainEngine.state_dict()` (tensors on any device); each top-level `OwnFile` entry is
            written to its own file (module docstring).
        data_state: where the data stream continues (JSON-serializable).
        rng_state: `capture_rng_state()` by default.
        extra: anything else JSON-serializable (e.g. the metrics line count, the config hash).
        keep_last: checkpoints to keep, ≥ 1.

    Returns:
        the checkpoint directory.

    Raises:
        CheckpointError: step < 0, keep_last < 1, data_state/extra not JSON-serializable, or an own file's
            name not a plain `.pt` name, a reserved one or used twice (nothing is written). OSError: the
            disk write failed (a full disk: ENOSPC), naming the file; `latest` still names the previous
            checkpoint and the half-written directory is removed.
    """
    if step < 0:
        raise CheckpointError(f"step is {step}; expected >= 0")
    if keep_last < 1:
        raise CheckpointError(f"keep_last is {keep_last}; expected >= 1")
    own = {key: entry for key, entry in engine_state.items() if isinstance(entry, OwnFile)}
    _check_own_names(step, own)
    state = {
        "step": step,
        "data_state": dict(data_state or {}),
        "extra": dict(extra or {}),
        "format": verify.FORMAT_VERSION,
        "files": {key: entry.name for key, entry in own.items()},
    }
    try:
        json.dumps(state)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"data_state/extra of step {step} are not JSON-serializable: {err}") from None
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(".step_*.tmp-*"):  # left by a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    final = base / step_dir_name(step)
    tmp = base / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        _torch_save({k: v for k, v in engine_state.items() if k not in own}, tmp / "model.pt")
        for entry in own.values():
            _torch_save(entry.value, tmp / entry.name)
        _torch_save(dict(rng_state if rng_state is not None else capture_rng_state()), tmp / "rng.pt")
        atomic_write_json(tmp / "state.json", state)
        manifest = verify.manifest_for(tmp, tuple(e.name for e in own.values()))
        atomic_write_json(tmp / verify.MANIFEST, manifest)  # last: the completeness marker
        publish_dir(tmp, final)  # re-saving a step (after a resume) retires the old copy first
    except OSError as exc:  # a full disk, a quota: the error names the file, the half-written copy goes
        shutil.rmtree(tmp, ignore_errors=True)
        disk = _disk_error(exc, tmp)
        if disk is None or disk is exc:
            raise
        raise disk from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        atomic_write_text(base / LATEST, final.name + "\n")
    except OSError as exc:
        disk = _disk_error(exc, base / LATEST)
        if disk is None or disk is exc:
            raise
        raise disk from exc
    for _, old in list_checkpoints(base)[:-keep_last]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _check_own_names(step: int, own: Mapping[str, OwnFile]) -> None:
    names = [entry.name for entry in own.values()]
    reserved = {*verify.FILES, verify.MANIFEST}
    for key, entry in own.items():
        if not verify.OWN_FILE_RE.match(entry.name) or entry.name in reserved or names.count(entry.name) > 1:
            raise CheckpointError(
                f"engine-state entry {key!r} of step {step}: own file name {entry.name!r}; expected a plain "
                f"'.pt' name (pattern {verify.OWN_FILE_RE.pattern}), none of {sorted(reserved)}, used once"
            )


#: What torch.load and the state parsing raise on a damaged file that the verification let through.
_LOAD_ERRORS = (RuntimeError, OSError, ValueError, EOFError, KeyError, pickle.UnpicklingError)


def load_latest(root: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint | None:
    """The newest good checkpoint: the one `root/latest` names, else (damaged) the newest good older one.

    Every checkpoint passed over is logged (a warning naming the file and what is wrong) and listed in the
    result's `skipped`. None when there is no `latest` (a fresh run; a directory without a pointer was
    never committed).

    Raises:
        CheckpointError: `latest` exists but no checkpoint it leads to is good; the message names each
            damaged file and the way out.
    """
    base = Path(root)
    names, skipped = verify.candidates(base)
    if not names and not skipped:
        return None
    for name in names:
        directory = base / name
        try:
            ckpt = load_checkpoint(directory, map_location)
        except CheckpointError as exc:
            skipped.append(str(exc))
            log.warning("checkpoint skipped: %s", exc)
            continue
        return replace(ckpt, skipped=tuple(skipped))
    raise CheckpointError(
        f"no good checkpoint under {base}: " + " | ".join(skipped) + "; remove the damaged checkpoint "
        f"directories (and {base / LATEST}) to start over, or restore them from a copy"
    )


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, verify_own_files: bool = True
) -> Checkpoint:
    """Load one checkpoint directory, verified first (checkpoint_verify.problems, deep).

    Own files are verified too unless `verify_own_files` is False: then they are not opened at all (a
    follower rank that never reads them, loading the checkpoint rank 0's `load_latest` verified); their
    entries are `FileRef`s either way.

    Raises:
        CheckpointError: the directory is missing, a file is missing, truncated, damaged or does not load;
            the message names each file and what is wrong.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(verify.missing_dir(directory))
    found = verify.problems(directory, deep=True, own=verify_own_files)
    if found:
        raise CheckpointError("; ".join(found))
    try:
        state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
        engine_state = torch.load(directory / "model.pt", map_location=map_location, weights_only=True)
        files = state.get("files", {})  # absent: an older checkpoint, every entry in model.pt
        if not isinstance(files, dict):
            raise ValueError(f"state.json's 'files' is {type(files).__name__}; expected an object")
        for key, name in files.items():
            if not isinstance(name, str) or not verify.OWN_FILE_RE.match(name):
                raise ValueError(f"state.json's own file {name!r} for {key!r} is not a plain '.pt' name")
            engine_state[key] = FileRef(directory / name)
        ckpt = Checkpoint(
            step=int(state["step"]),
            path=directory,
            engine_state=engine_state,
            data_state=state["data_state"],
            rng_state=torch.load(directory / "rng.pt", map_location="cpu", weights_only=True),
            extra=state["extra"],
        )
    except _LOAD_ERRORS as exc:
        raise CheckpointError(f"{directory}: does not load ({type(exc).__name__}: {exc})") from None
    if verify.legacy(directory):
        log.warning("checkpoint %s %s", directory, verify.LEGACY_NOTE)
    return ckpt
