"""Periodic Hugging Face exports of the student: `run_dir/exports/step_<n>/`, the newest `export.keep` kept.

    path = write_export(engine, tokenizer, run_dir, step, keep)

An export is what the engine's `save_pretrained` writes (torch: transformers' `save_pretrained`, config.json and
model.safetensors; megatron: the HF tensors its converter gives, `engines/megatron/convert.py mcore_to_hf`,
gathered over the TP group, with the actor's config.json) plus the shared tokenizer (`tokenizer.save_pretrained`
when the engine wrote none), so `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load
it and a run config can name it as a teacher or actor path. It is written into a hidden
`exports/.step_<n>.tmp-<pid>/` and renamed to `step_<n>` (atomic on POSIX): a reader never sees a partial
export. Every file is fsynced before the rename. A stale temporary directory (a crashed export) is removed by the next export; a step exported again
(a resumed run) replaces its old copy. Older exports beyond `keep` are deleted after each export.

The caller (the controller, actor rank 0) makes the engine resident first, and announces the gather to the
other TP ranks of a TP engine (they join `named_weights`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import publish_dir
from mopd_hpc.engines.torch.hf_model import TOKENIZER_FILES
from mopd_hpc.records.run_dir import EXPORTS_DIR

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def export_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    """`run_dir/exports/step_<step, 6 digits>`."""
    return Path(run_dir) / EXPORTS_DIR / f"step_{step:06d}"


def list_exports(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete exports under run_dir/exports, oldest first, as (step, path)."""
    base = Path(run_dir) / EXPORTS_DIR
    if not base.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in base.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def write_export(engine: Any, tokenizer: Any, run_dir: str | os.PathLike[str], step: int, keep: int) -> Path:
    """Export the engine's weights of `step` (module docstring); returns the export's directory.

    Args:
        engine: a `TrainEngine` (its `save_pretrained(directory)`), resident.
        tokenizer: the shared HF tokenizer (`save_pretrained(directory)`).
        keep: exports kept, >= 1 (export.keep).

    Raises:
        ValueError: keep < 1. OSError: the disk write failed (the previous exports are untouched).
    """
    if keep < 1:
        raise ValueError(f"export.keep is {keep}; expected >= 1")
    final = export_dir(run_dir, step)
    base = final.parent
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(".step_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = base / f".{final.name}.tmp-{os.getpid()}"
    try:
        engine.save_pretrained(tmp)
        if not any((tmp / name).is_file() for name in TOKENIZER_FILES[:2]):
            tokenizer.save_pretrained(str(tmp))
        _fsync_tree(tmp)
        publish_dir(tmp, final)  # a step exported again (a resumed run) replaces its old copy
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in list_exports(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(directory: Path) -> None:
    """Every file under `directory` and the directory itself to disk, before the rename publishes them."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
