"""The job's secret token: a 0600 file in the run directory, compared in constant time.

The token never travels in argv, the environment, a URL or a log line: the guard and its clients read it
from the file (path on the command line) and send it as `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from mopd_hpc.atomic import atomic_write_text

#: Bytes of randomness in a new token (256 bits).
TOKEN_BYTES = 32
#: The HTTP header and scheme that carry the token.
AUTH_HEADER = "Authorization"
AUTH_SCHEME = "Bearer "


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


def authorization_value(token: str) -> str:
    """The `Authorization` header value for `token`."""
    return AUTH_SCHEME + token


def token_matches(header_value: str | None, token: str) -> bool:
    """Constant-time check of an `Authorization` header value against the job's token."""
    if not header_value or not header_value.startswith(AUTH_SCHEME):
        return False
    return hmac.compare_digest(header_value[len(AUTH_SCHEME) :].encode(), token.encode())
