"""Is a checkpoint directory whole? The manifest written last, its checks, and the choice of the newest good one.

`save_checkpoint` (trainer/checkpoint.py) writes `manifest.json` last, atomically, into the directory before
it is renamed into place: `{"format": 1, "files": {"model.pt": {"bytes": N, "sha256": HEX}, ...}}`. A
directory without it is incomplete (or was written before manifests existed: see `LEGACY_NOTE`). Besides
`FILES`, the manifest lists the checkpoint's own files (engine-state entries written apart from model.pt,
engines/own_file.py: e.g. optimizer_param_state.pt), which state.json names under "files"; they are checked
as model.pt is, unless a caller that never reads them says so (`own_files=False`: a follower rank, whose
rank 0 verified them before naming the checkpoint).

Two depths (no torch here, so `mopd-submit` can check at submit time without importing it):

- `shallow`: every file present, sizes as the manifest says (a truncated model.pt), state.json parses with
  the right format and step, the zip directory of each `.pt` opens (torch files are zip archives: a
  truncated one has no central directory). Reads a few kB per file.
- `deep`: also the SHA-256 of each file (streamed, ~1 GB/s), or, for a checkpoint without a manifest, the
  CRC-32 that the zip format keeps per entry (`zipfile.testzip`). `torch.load` itself checks neither:
  a flipped byte in a tensor loads silently.

`choose(root)` walks from the checkpoint `latest` names back through the older ones, newest first, and
returns the first good one plus one line per checkpoint skipped (the file and what is wrong).
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.records.run_dir import LATEST

#: The completeness marker, written last.
MANIFEST = "manifest.json"
#: The files of a checkpoint (trainer/checkpoint.py's layout; the pointer is records/run_dir.LATEST).
FILES = ("model.pt", "rng.pt", "state.json")
#: What an own file's name must be: a plain `.pt` name in the step directory (no path, not hidden).
OWN_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.pt$")
#: Layout version in state.json and the manifest.
FORMAT_VERSION = 1
#: What a checkpoint without a manifest gets: accepted when its files load (written before manifests).
LEGACY_NOTE = "has no manifest.json (written before checkpoints carried one): accepted on its zip CRCs"

STEP_RE = re.compile(r"^step_(\d{6,})$")
_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, streamed in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_for(directory: Path, own: tuple[str, ...] = ()) -> dict[str, Any]:
    """The manifest of the files `FILES` and the own files `own` in `directory` (their sizes and SHA-256)."""
    files = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_of(directory / name)}
        for name in (*FILES, *own)
    }
    return {"format": FORMAT_VERSION, "files": files}


def own_files(directory: Path, manifest: dict[str, Any] | None = None) -> list[str]:
    """The own files of a checkpoint directory: those state.json names under "files" and those the manifest
    lists beyond `FILES`, in that order, each once ([] for an unreadable state.json and no manifest)."""
    names: list[str] = []
    try:
        state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = None
    if isinstance(state, dict) and isinstance(state.get("files"), dict):
        names.extend(str(n) for n in state["files"].values())
    if manifest is not None:
        names.extend(n for n in manifest["files"] if n not in FILES)
    return [n for n in dict.fromkeys(names) if n not in FILES]


def problems(directory: Path, deep: bool, own: bool = True) -> list[str]:
    """What is wrong with one checkpoint directory, one line each naming the file; [] when it is whole.

    A directory without a manifest gets no line for that alone (see `legacy`): it is checked on its files.
    `own` False: the own files (`own_files`) are left alone, not even opened.
    """
    found: list[str] = []
    manifest: dict[str, Any] | None = None
    if (directory / MANIFEST).is_file():
        try:
            manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
            if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
                raise ValueError("not a manifest")
        except (OSError, ValueError) as exc:
            return [f"{directory / MANIFEST}: unreadable ({exc}); expected the JSON save_checkpoint writes"]
    for name in FILES:
        found.extend(
            _file_problems(directory / name, manifest["files"].get(name, {}) if manifest else {}, deep)
        )
    for name in own_files(directory, manifest) if own else ():
        if not OWN_FILE_RE.match(name):
            found.append(f"{directory / 'state.json'}: own file {name!r} is not a plain name like 'x.pt'")
        elif manifest is not None and name not in manifest["files"]:
            found.append(
                f"{directory / name}: state.json names it, the manifest does not (not this checkpoint's)"
            )
        else:
            found.extend(_file_problems(directory / name, manifest["files"][name] if manifest else {}, deep))
    return found


def _file_problems(path: Path, want: dict[str, Any], deep: bool) -> list[str]:
    """One file of a checkpoint against its manifest entry `want` ({} without a manifest)."""
    if not path.is_file():
        return [f"{path}: missing"]
    size = path.stat().st_size
    if "bytes" in want and size != want["bytes"]:
        return [f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated or rewritten)"]
    if path.suffix == ".json":
        found = _state_problems(path, path.parent.name)
    else:
        found = _zip_problems(path, check_crc=deep and "sha256" not in want)
    if not found and deep and "sha256" in want and sha256_of(path) != want["sha256"]:
        found = [f"{path}: SHA-256 differs from the manifest's (the file is damaged)"]
    return found


def legacy(directory: Path) -> bool:
    """True when the directory has no manifest (a checkpoint written before manifests existed)."""
    return not (directory / MANIFEST).is_file()


def _state_problems(path: Path, dir_name: str) -> list[str]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        what = "empty" if path.stat().st_size == 0 else f"not JSON ({exc})"
        return [f"{path}: {what}; expected the JSON save_checkpoint writes"]
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        return [f"{path}: format {got!r}; expected {FORMAT_VERSION}"]
    match = STEP_RE.match(dir_name)
    if match and state.get("step") != int(match.group(1)):
        return [f"{path}: step {state.get('step')!r}, but its directory is {dir_name}"]
    return []


def _zip_problems(path: Path, check_crc: bool) -> list[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip() if check_crc else None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        return [f"{path}: not a whole torch file ({exc})"]
    return [f"{path}: entry {bad} fails its CRC-32 (the file is damaged)"] if bad else []


@dataclass(frozen=True, slots=True)
class Choice:
    """The result of `choose`.

    Attributes:
        name: the directory name of the newest good checkpoint ('step_000050'), or None.
        skipped: one line per damaged checkpoint passed over (or the pointer's own problem), newest first.
        any_found: a pointer or a checkpoint directory exists (False: a fresh run).
    """

    name: str | None
    skipped: tuple[str, ...]
    any_found: bool


def candidates(root: Path) -> tuple[list[str], list[str]]:
    """Checkpoint names to try, newest first, and the pointer's problem (0 or 1 line).

    The one `latest` names first, then the older directories (those newer than it were never committed:
    the pointer moves last). With a damaged pointer (empty, garbage, naming nothing), every directory.
    """
    dirs = (
        sorted(
            (
                (int(m.group(1)), p.name)
                for p in root.iterdir()
                if p.is_dir() and (m := STEP_RE.match(p.name))
            ),
            reverse=True,
        )
        if root.is_dir()
        else []
    )
    pointer = root / LATEST
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return [], []  # nothing was ever committed (a save that died before its first pointer write)
    except (OSError, UnicodeDecodeError) as exc:
        return [n for _, n in dirs], [f"{pointer}: unreadable ({exc})"]
    match = STEP_RE.match(name)
    if not match:
        what = "empty" if not name else f"holds {name[:40]!r}"
        return [n for _, n in dirs], [f"{pointer}: {what}; expected a name like 'step_000050'"]
    step = int(match.group(1))
    return [name, *(n for s, n in dirs if s < step)], []


def missing_dir(directory: Path) -> str:
    """The line for a checkpoint directory the pointer names but that is not there."""
    return f"{directory}: missing (the checkpoint has no model.pt, rng.pt, state.json)"


def choose(root: str | Path, deep: bool) -> Choice:
    """The newest good checkpoint under `root` (see the module docstring for what `deep` checks)."""
    base = Path(root)
    names, skipped = candidates(base)
    any_found = (base / LATEST).exists() or bool(names)
    for name in names:
        found = problems(base / name, deep) if (base / name).is_dir() else [missing_dir(base / name)]
        if not found:
            return Choice(name, tuple(skipped), any_found)
        skipped.append("; ".join(found))
    return Choice(None, tuple(skipped), any_found)
