"""Engine-state entries that a checkpoint keeps in files of their own, read only on the ranks that need them.

An engine's `state_dict()` may wrap a large entry that only some ranks read at load in `OwnFile(name, value)`:
the megatron actor's distributed-optimizer parameter state (fp32 main params and two Adam moments, 12 bytes
per parameter: ~96 GB for an 8B model), which only data-parallel rank 0 reads, to scatter each rank its
shard. `save_checkpoint` (trainer/checkpoint.py) writes `value` to `<step dir>/<name>` (torch.save, through
the same atomic write as model.pt) instead of into model.pt, lists the file in the manifest (size, SHA-256:
verified like model.pt) and records `{key: name}` under state.json's "files". Loading puts a `FileRef` in
the entry's place: the path, not the contents. The engine reads it (`FileRef.load`: torch.load with
weights_only and mmap) on the rank that needs it; the other ranks never open the file, so their host memory
holds model.pt's contents only.

`resolve(entry, read)` is what an engine's `load_state_dict` calls on such an entry, whatever its form: an
`OwnFile` (an in-memory round trip, state_dict → load_state_dict), a `FileRef` (a checkpoint of this
layout), or the value itself (an older checkpoint that held it inside model.pt, or None).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class OwnFileError(ValueError):
    """A checkpoint's own file does not load (damaged after the verification, or not a torch file)."""


@dataclass(frozen=True, slots=True)
class OwnFile:
    """On save: an engine-state entry written to the checkpoint directory's file `name` (a plain name such as
    'optimizer_param_state.pt'; trainer/checkpoint_verify.OWN_FILE_RE), not into model.pt.

    Attributes:
        name: the file's name in the step directory.
        value: what goes into it (anything `torch.load(weights_only=True)` reads back).
    """

    name: str
    value: Any


@dataclass(frozen=True, slots=True)
class FileRef:
    """On load: an entry that `save_checkpoint` wrote as an `OwnFile`, not yet read.

    Attributes:
        path: the file in the checkpoint directory (verified against the manifest by `load_latest`).
    """

    path: Path

    def load(self) -> Any:
        """The entry's value, CPU tensors memory-mapped from the file (`torch.load(mmap=True)`: pages are read
        as they are used, and stay page cache, not the process's own memory); a plain read where mmap is
        refused (a file torch did not write as a zip archive).

        Raises:
            OwnFileError: the file is missing or does not load; the message names it.
        """
        errors = (RuntimeError, OSError, ValueError, EOFError, pickle.UnpicklingError)
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except errors as first:
            try:
                return torch.load(self.path, map_location="cpu", weights_only=True)
            except errors:
                raise OwnFileError(f"{self.path}: does not load ({type(first).__name__}: {first})") from None


def resolve(entry: Any, read: bool) -> Any:
    """An engine-state entry's value: a `FileRef` is read when `read` (None otherwise: the file is not
    opened); an `OwnFile` gives its value; anything else (an older checkpoint's value, None) is returned
    as it is.

    Raises:
        OwnFileError: `FileRef.load`'s.
    """
    if isinstance(entry, FileRef):
        return entry.load() if read else None
    if isinstance(entry, OwnFile):
        return entry.value
    return entry
