"""A child's environment: the guard's own, the spawn's overrides (checked), identity, GPU tokens, named ports.

What an override may not set: the identity keys, `MOPD_PORT_*`, `CUDA_VISIBLE_DEVICES` when GPUs are given
(400), and any key off the allow-list (runtime/guard/env_policy.py: 403). How big it may be (400 naming the
key and the limit; Linux refuses an exec whose one `KEY=VALUE` string passes 128 KiB, MAX_ARG_STRLEN, and
whose whole environment and arguments pass a quarter of the stack limit, ARG_MAX):
`MAX_ENV_KEYS` keys, `MAX_ENV_KEY_BYTES` per key, `MAX_ENV_VALUE_BYTES` per value and `MAX_ENV_BYTES` for
all overrides together (UTF-8 bytes of `KEY=VALUE\0`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.gpus import NodeGpus, gpus_refusal
from mopd_hpc.runtime.guard import env_policy
from mopd_hpc.runtime.ports import PortLease

_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Bounds of a spawn's env overrides (module docstring).
MAX_ENV_KEYS = 256
MAX_ENV_KEY_BYTES = 256
MAX_ENV_VALUE_BYTES = 32 * 1024
MAX_ENV_BYTES = 256 * 1024


class ChildEnvError(ValueError):
    """An env override is malformed or collides with a key the guard sets (HTTP 400)."""


class ChildEnvDeniedError(ChildEnvError):
    """An env override sets a loader, interpreter or shell variable (env_policy.py; HTTP 403)."""


def check_overrides(
    overrides: Mapping[str, str],
    reserved: Collection[str] = child_env.IDENTITY_KEYS,
    site_keys: Collection[str] = (),
) -> None:
    """Refuse what a spawn's env overrides may not carry (nothing is leased or started before this).

    Args:
        overrides: the spawn's env overrides.
        reserved: keys the guard sets itself (identity, GPU tokens, named ports), besides `MOPD_PORT_*`.
        site_keys: keys the site allowed besides the policy's own (`mopd-guard --allow-env`).
    Raises:
        ChildEnvError: a key is not an identifier, a value holds NUL, an override sets a guard-set key, or a
            size bound is passed (the message names the key and the limit).
        ChildEnvDeniedError: a key is off the allow-list (env_policy.denial).
    """
    if len(overrides) > MAX_ENV_KEYS:
        raise ChildEnvError(f"env has {len(overrides)} keys: at most {MAX_ENV_KEYS} (MAX_ENV_KEYS)")
    total = 0
    for key, value in overrides.items():
        key_bytes, value_bytes = (
            len(key.encode("utf-8", "surrogatepass")),
            len(value.encode("utf-8", "surrogatepass")),
        )
        if key_bytes > MAX_ENV_KEY_BYTES:
            raise ChildEnvError(f"env key {key[:40]!r}... is {key_bytes} bytes: at most {MAX_ENV_KEY_BYTES}")
        if value_bytes > MAX_ENV_VALUE_BYTES:
            raise ChildEnvError(
                f"env value of {key} is {value_bytes} bytes: at most {MAX_ENV_VALUE_BYTES} (MAX_ENV_VALUE_BYTES)"
            )
        total += key_bytes + value_bytes + 2
        if not _ENV_KEY_RE.match(key):
            raise ChildEnvError(f"env key {key!r} is invalid: expected [A-Za-z_][A-Za-z0-9_]*")
        if "\0" in value:
            raise ChildEnvError(f"env value of {key} contains a NUL byte, which no environment can carry")
        if key in reserved or key.startswith(child_env.PORT_PREFIX):
            raise ChildEnvError(
                f"env key {key} is set by the guard (identity, GPU tokens or named ports); "
                "pass GPUs in 'gpus' and ports in 'ports' instead"
            )
    if total > MAX_ENV_BYTES:
        raise ChildEnvError(f"env overrides total {total} bytes: at most {MAX_ENV_BYTES} (MAX_ENV_BYTES)")
    why = env_policy.first_denial(overrides, site_keys)
    if why is not None:
        raise ChildEnvDeniedError(why)


def spawn_refusal(
    overrides: Mapping[str, str],
    gpus: list[str] | None,
    node: NodeGpus | None = None,
    site_keys: Collection[str] = (),
) -> tuple[int, str, str] | None:
    """`(HTTP status, error kind, message)` when a spawn is refused for its env overrides (`check_overrides`
    with CUDA_VISIBLE_DEVICES reserved when `gpus` are given) or its `gpus` (`gpus_refusal` against `node`,
    when given), else None."""
    reserved = (*child_env.IDENTITY_KEYS, *(("CUDA_VISIBLE_DEVICES",) if gpus is not None else ()))
    try:
        check_overrides(overrides, reserved, site_keys)
    except ChildEnvDeniedError as exc:
        return 403, "env_denied", str(exc)
    except ChildEnvError as exc:
        return 400, "bad_env", str(exc)
    if gpus is not None and node is not None and (why := gpus_refusal(gpus, node)) is not None:
        return 400, "bad_gpus", why
    return None


def build_child_env(
    base: Mapping[str, str],
    overrides: Mapping[str, str],
    identity: Mapping[str, str],
    gpus: list[str] | None,
    ports: Mapping[str, PortLease],
    site_keys: Collection[str] = (),
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
    check_overrides(overrides, reserved, site_keys)
    env = {k: v for k, v in base.items() if not k.startswith(child_env.PORT_PREFIX)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(overrides)
    env.update(identity)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    for lease in ports.values():
        env[lease.env_key] = str(lease.port)
    return env
