"""Hugging Face hub ids as model paths: resolved once, on the submit host, through its local hub cache.

A model path (`models.actor.path`, `models.teachers[i].path`, `models.tokenizer.path`) is a local directory
when one exists under the submit directory (or it is absolute); otherwise a name shaped like a hub repo id
(`Qwen/Qwen3-0.6B`, `gpt2`: no leading '.', '/' or '~', at most one '/', `huggingface_hub`'s repo-id rules)
is looked up in this host's hub cache with `snapshot_download(repo_id, local_files_only=True)`: no network,
the snapshot `refs/main` names (`<cache>/models--org--name/snapshots/<revision>/`). The job then receives
that snapshot directory in place of the id (run_dir/config.yaml), so every child reads the same files of
the same revision, whatever its own cache or network. An id the cache does not hold is refused by
`--check` with the commands that fetch it (`hf download <id>`; `huggingface-cli download <id>` before
huggingface_hub 0.34). The cache directory is huggingface_hub's own (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub), read by that library; tests pass `cache_dir`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class HubSnapshot:
    """A hub id found in the cache: `repo_id` as configured, `path` the snapshot directory (absolute),
    `revision` the commit hash it is (the snapshot directory's name)."""

    repo_id: str
    path: str
    revision: str


class HubNotCachedError(LookupError):
    """A hub id this host's cache does not hold; the message says how to fetch it."""


def is_hub_id(value: str) -> bool:
    """Whether `value` has the shape of a hub repo id (module docstring); says nothing of a directory."""
    if value.startswith((".", "/", "~")) or value.count("/") > 1:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def is_local_directory(value: str, base: Path) -> bool:
    """Whether `value` names a directory here: absolute, or under `base` (the submit directory)."""
    return (base / Path(value).expanduser()).is_dir()


def fetch_hint(repo_id: str) -> str:
    """The commands that put `repo_id` into this host's cache."""
    return (
        f"fetch it on this host with `hf download {repo_id}` (huggingface-cli download {repo_id} before "
        "huggingface_hub 0.34), point HF_HOME or HF_HUB_CACHE at the cache that holds it, or give a local "
        f"checkpoint directory (one that exists on the job's nodes only: write it ./{repo_id} or absolute)"
    )


def cached_snapshot(repo_id: str, cache_dir: str | Path | None = None) -> HubSnapshot:
    """The snapshot directory of `repo_id` (refs/main) in the hub cache, without the network.

    Args:
        repo_id: a hub model id (`is_hub_id`).
        cache_dir: the hub cache (the directory holding `models--org--name/`); None = huggingface_hub's default.

    Raises:
        HubNotCachedError: the cache holds no snapshot of it (the message names the cache and `fetch_hint`).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        where = cache_dir if cache_dir is not None else _default_cache()
        raise HubNotCachedError(
            f"neither a directory here nor in the Hugging Face cache of this host ({where}): "
            f"{type(exc).__name__}; {fetch_hint(repo_id)}"
        ) from None
    resolved = Path(str(path)).resolve()
    return HubSnapshot(repo_id=repo_id, path=str(resolved), revision=resolved.name)


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
