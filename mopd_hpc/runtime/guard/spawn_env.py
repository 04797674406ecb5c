"""A child's environment: the guard's own, the spawn's overrides (checked), identity, GPU tokens, named ports.

What an override may not set: the identity keys, `MOPD_PORT_*`, `CUDA_VISIBLE_DEVICES` when GPUs are given
(400), and loader, interpreter and shell variables (runtime/guard/env_policy.py: 403).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.guard import env_policy
from mopd_hpc.runtime.ports import PORT_ENV_PREFIX, PortLease

#: Environment keys the guard sets for every child; overrides may not set them (`runtime/child_env.py`).
IDENTITY_KEYS = child_env.IDENTITY_KEYS
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ChildEnvError(ValueError):
    """An env override is malformed or collides with a key the guard sets (HTTP 400)."""


class ChildEnvDeniedError(ChildEnvError):
    """An env override sets a loader, interpreter or shell variable (env_policy.py; HTTP 403)."""


def check_overrides(overrides: Mapping[str, str], reserved: Collection[str] = IDENTITY_KEYS) -> None:
    """Refuse what a spawn's env overrides may not carry (nothing is leased or started before this).

    Args:
        overrides: the spawn's env overrides.
        reserved: keys the guard sets itself (identity, GPU tokens, named ports), besides `MOPD_PORT_*`.
    Raises:
        ChildEnvError: a key is not an identifier, a value holds NUL, or an override sets a guard-set key.
        ChildEnvDeniedError: a key is a loader, interpreter or shell variable (env_policy.denial).
    """
    for key, value in overrides.items():
        if not _ENV_KEY_RE.match(key):
            raise ChildEnvError(f"env key {key!r} is invalid: expected [A-Za-z_][A-Za-z0-9_]*")
        if "\0" in value:
            raise ChildEnvError(f"env value of {key} contains a NUL byte, which no environment can carry")
        if key in reserved or key.startswith(PORT_ENV_PREFIX):
            raise ChildEnvError(
                f"env key {key} is set by the guard (identity, GPU tokens or named ports); "
                "pass GPUs in 'gpus' and ports in 'ports' instead"
            )
    why = env_policy.first_denial(overrides)
    if why is not None:
        raise ChildEnvDeniedError(why)


def spawn_refusal(overrides: Mapping[str, str], gpus: list[str] | None) -> tuple[int, str, str] | None:
    """`(HTTP status, error kind, message)` when a spawn's env overrides are refused (`check_overrides`
    with CUDA_VISIBLE_DEVICES reserved when `gpus` are given), else None."""
    reserved = (*IDENTITY_KEYS, *(("CUDA_VISIBLE_DEVICES",) if gpus is not None else ()))
    try:
        check_overrides(overrides, reserved)
    except ChildEnvDeniedError as exc:
        return 403, "env_denied", str(exc)
    except ChildEnvError as exc:
        return 400, "bad_env", str(exc)
    return None


def build_child_env(
    base: Mapping[str, str],
    overrides: Mapping[str, str],
    identity: Mapping[str, str],
    gpus: list[str] | None,
    ports: Mapping[str, PortLease],
) -> dict[str, str]:
    """The child's environment: `base` (the guard's), minus inherited `MOPD_PORT_*`, plus `overrides`,
    identity keys, `CUDA_VISIBLE_DEVICES` (GPU tokens as given, comma-joined; only when `gpus` is not
    None) and `MOPD_PORT_<NAME>` per named port. Values pass through unchanged (commas, quotes, `=`,
    newlines): no `k=v,k=v` serialization anywhere.

    Raises:
        ChildEnvError: as `check_overrides` (ChildEnvDeniedError for a loader or interpreter variable).
    """
    reserved = set(identity) | {lease.env_key for lease in ports.values()}
    if gpus is not None:
        reserved.add("CUDA_VISIBLE_DEVICES")
    check_overrides(overrides, reserved)
    env = {k: v for k, v in base.items() if not k.startswith(PORT_ENV_PREFIX)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(overrides)
    env.update(identity)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    for lease in ports.values():
        env[lease.env_key] = str(lease.port)
    return env
