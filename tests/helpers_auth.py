"""The job's token for tests that run the job's servers by hand: one token per test session, written to a
0600 file where a server reads it (`--token-file`, a run dir's `guard.token`) and sent by the clients."""

from __future__ import annotations

import secrets
from pathlib import Path

from mopd_hpc.atomic import atomic_write_text
from mopd_hpc.records.job_token import read_token_file
from mopd_hpc.records.run_dir import TOKEN_FILE
from mopd_hpc.runtime.http_auth import AUTH_HEADER, authorization_value

#: The token every hand-started server of a test session requires.
TOKEN = secrets.token_urlsafe(32)
#: The header that carries it.
AUTH = {AUTH_HEADER: authorization_value(TOKEN)}


def write_token_file(path: Path) -> Path:
    """Write TOKEN to `path` with mode 0600 (as a job's token file); returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, TOKEN + "\n", perms=0o600)
    assert read_token_file(path) == TOKEN
    return path


def write_run_dir_token(run_dir: Path) -> Path:
    """TOKEN as `run_dir`'s token file (`run_dir/guard.token`), where a role or standalone server reads it."""
    return write_token_file(run_dir / TOKEN_FILE)
