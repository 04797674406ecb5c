"""Local paths a RunConfig names (model and tokenizer directories, jsonl files) that do not exist here.

`mopd-submit --check` and a Slurm submit warn about them (on a cluster they may exist only on the job's
nodes; the job checks them at start); a local run (`cluster.backend: local`) refuses to start with one,
except the tiny CPU models that `--local` builds on first use (launch/local_setup.py BUILT_NAMES; one whose
directory an interrupted first build left without its config.json counts as not built, `awaits_build`).
Relative paths are relative to the submit directory (`base`), as the job resolves them
(roles/env.py with_absolute_paths).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class MissingPath:
    """One configured path that does not exist here.

    field: the config field (`models.teachers[1].path`, `data.sources[0].path`); value: the path as
    configured; what: 'directory' (a model or tokenizer) or 'file' (a jsonl source); built: a tiny model
    that `--local` builds on first use (not a problem for a local run).
    """

    field: str
    value: str
    what: str
    built: bool = False

    def warning(self) -> str:
        """The --check / Slurm submit warning (the path may exist on the job's nodes)."""
        if self.built:
            return (
                f"{self.field}: {self.value} is not built yet (`--local` builds the tiny models on first use)"
            )
        return (
            f"{self.field}: no such {self.what} here: {self.value} "
            "(the job fails at start unless it exists there)"
        )

    def error(self) -> str:
        """The refusal of a local run, which would start every child and fail in the one that reads it."""
        return f"{self.field}: no such {self.what} here: {self.value} (expected an existing {self.what})"


def _names_a_directory(value: str) -> bool:
    """A leading '.', '/' or '~', or more than one '/': a directory, not a hub id like 'Qwen/Qwen3-0.6B'."""
    return value.startswith((".", "/", "~")) or value.count("/") > 1


def missing_paths(cfg: Any, base: Path | None = None) -> list[MissingPath]:
    """The model/tokenizer directories and jsonl source files of the RunConfig `cfg` missing under `base`
    (default: the cwd), in config order, each field once. Hub ids are not checked."""
    from mopd_hpc.launch.local_setup import awaits_build

    root = base or Path.cwd()
    models = [
        ("models.actor.path", cfg.models.actor.path),
        ("models.tokenizer.path", cfg.models.tokenizer.path),
    ]
    models += [(f"models.teachers[{i}].path", t.path) for i, t in enumerate(cfg.models.teachers)]
    out = []
    for field, value in dict.fromkeys(models):
        path = root / Path(value).expanduser()
        if not _names_a_directory(value) or (path.exists() and not awaits_build(cfg, path)):
            continue  # an unfinished tiny model (an interrupted first build) is missing: --local rebuilds it
        out.append(MissingPath(field, value, "directory", awaits_build(cfg, path)))
    for i, source in enumerate(cfg.data.sources):
        if source.kind != "jsonl":
            continue
        for name in ("path", "eval_path"):
            value = getattr(source, name)
            if value is not None and not (root / Path(value).expanduser()).is_file():
                out.append(MissingPath(f"data.sources[{i}].{name}", value, "file"))
    return out


def path_warnings(cfg: Any, base: Path | None = None) -> list[str]:
    """One warning per path of `cfg` missing under `base` (`missing_paths`), for --check and a Slurm submit."""
    return [m.warning() for m in missing_paths(cfg, base)]


def local_path_errors(cfg: Any, base: Path | None = None) -> list[str]:
    """The missing paths a local run must not start with: every one but the tiny models `--local` builds."""
    return [m.error() for m in missing_paths(cfg, base) if not m.built]
