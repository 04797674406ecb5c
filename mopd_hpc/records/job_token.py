"""The job's secret token: `run_dir/guard.token` (records/run_dir.py TOKEN_FILE), mode 0600, created once per job
before anything is submitted (launch/rundir.py) and read by the guard, the servers and their clients.

The token never travels in argv, the environment, a URL or a log line: it is read from the file (its path on the
command line) and sent as `Authorization: Bearer <token>`, which runtime/http_auth.py checks. Below the HTTP
layer so that what only writes or reads the file (`mopd-submit`, the roles' environment) imports no aiohttp.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from mopd_hpc.atomic import atomic_write_text

#: Bytes of randomness in a new token (256 bits).
TOKEN_BYTES = 32


class GuardAuthError(ValueError):
    """The token file is missing, empty, or readable by others."""


def create_token_file(path: str | os.PathLike[str]) -> None:
    """Write a new random token to `path` with mode 0600, atomically (the launcher calls this once per job)."""
    atomic_write_text(path, secrets.token_urlsafe(TOKEN_BYTES) + "\n", perms=0o600)


def read_token_file(path: str | os.PathLike[str]) -> str:
    """Read the token from `path`.

    Raises:
        GuardAuthError: the file is missing, not owned by this user, group/other-accessible (mode must be
            0600 or stricter), or empty. The message names the path and mode, never the token.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise GuardAuthError(
            f"token file {p} does not exist: create it with mode 0600 in the run dir"
        ) from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise GuardAuthError(f"token file {p} has mode {mode:04o}: expected 0600 (chmod 600 {p})")
    if st.st_uid != os.geteuid():
        raise GuardAuthError(f"token file {p} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
    token = p.read_text(encoding="utf-8").strip()
    if not token:
        raise GuardAuthError(f"token file {p} is empty")
    return token
