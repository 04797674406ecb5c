"""`--check` of the jsonl prompt files a job reads, on the submit host: each one that exists here is read whole
(data/sources.py `JsonlSource.from_path`) and a bad one is refused naming the field and `file:line`:

    data.sources[1].path: /data/mine.jsonl:61: not valid JSON (Unterminated string ... at column 12) (...)

An invalid line, a missing `prompt` or `answer`, an empty file and binary bytes are each refused before any
process starts. A file that does not exist here is not this module's: launch/paths.py warns of it (a Slurm
submit: it may exist on the cluster alone) or refuses it (a local run).
"""

from __future__ import annotations

from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.config.problems import Problem
from mopd_hpc.data.errors import DataSourceError
from mopd_hpc.data.sources import JsonlSource


def data_problems(cfg: RunConfig, base: Path | None = None) -> list[Problem]:
    """One problem per jsonl source of `cfg` whose file exists under `base` (default: the cwd) and does not
    read (`JsonlSource.from_path`'s error, on the source's `path` field)."""
    root = base or Path.cwd()
    problems = []
    for i, source in enumerate(cfg.data.sources):
        path = root / Path(getattr(source, "path", "") or "").expanduser()
        if source.kind != "jsonl" or not path.is_file():
            continue
        try:
            JsonlSource.from_path(source.name, path)
        except DataSourceError as exc:
            problems.append(Problem(f"data.sources[{i}].path", str(exc)))
    return problems
