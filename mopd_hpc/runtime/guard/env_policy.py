"""Which environment overrides a spawn may carry: an allow-list (`MOPD_*` keys and `ALLOWED_KEYS`).

The guard runs only registered role modules, but an environment can make any program run something else:
`PYTHONPATH=DIR` with a `sitecustomize.py` in DIR runs DIR's code in the child before the role's module,
`LD_PRELOAD` loads a library into every process, `PATH` decides what `gcc` or `nvidia-smi` is, `HF_HOME`,
`TRITON_CACHE_DIR` or `TORCHINDUCTOR_CACHE_DIR` decide which cached code and weights a child loads, and
`SSL_CERT_FILE` or `HTTPS_PROXY` which certificate or proxy it trusts. So a spawn override is accepted only
when its key starts with `MOPD_` or is in `ALLOWED_KEYS` (or in the site's own list, given at guard start:
`mopd-guard --allow-env KEY`, never through the HTTP API); any other key is refused (HTTP 403 naming the key,
a `spawn_refused` event in the guard's log) before any port is leased or any process started. The job's own
plan sets only `MOPD_*` keys (runtime/plan.py `child_environment`, plan/placement.py: the rank, teacher,
rollout and topology keys of runtime/child_env.py), so nothing it needs is refused; the guard's own
environment (inherited by every child, PYTHONPATH included) is not an override and is not filtered.

A site adds a key with `mopd-guard --allow-env KEY` (repeatable); a key of `DENIED_KEYS` or `DENIED_PREFIXES`
cannot be added (`check_site_key`), since each of them loads code. The reasons below name why.

Sources of the deny list (keys no site may allow):
- glibc's "unsecure" variables, those ld.so drops for set-user-ID programs (`sysdeps/generic/unsecvars.h`):
  `LD_*`, GCONV_PATH, GETCONF_DIR, HOSTALIASES, LOCALDOMAIN, LOCPATH, MALLOC_TRACE, NIS_PATH, NLSPATH,
  RESOLV_HOST_CONF, RES_OPTIONS, TZDIR, and GLIBC_TUNABLES (CVE-2023-4911). TMPDIR, also on that list,
  may be allowed by a site: it picks a directory, not code, and jobs set it for scratch space;
- python(1) ENVIRONMENT: every `PYTHON*` variable (PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, PYTHONUSERBASE and
  its `.pth` files, PYTHONWARNINGS, which imports a warning category's module, PYTHONBREAKPOINT, ...);
  and HOME, which locates the user site-packages (`~/.local/lib/pythonX.Y/site-packages`, `.pth` files);
- bash(1) and sh: BASH_ENV and ENV (a file every non-interactive shell sources), exported functions
  (`BASH_FUNC_*`), SHELLOPTS, BASHOPTS, PS4 (expanded under `set -x`), IFS;
- other interpreters a child may start: PERL5LIB, PERLLIB, PERL5OPT, RUBYLIB, RUBYOPT, NODE_OPTIONS,
  NODE_PATH, JAVA_TOOL_OPTIONS, _JAVA_OPTIONS, JDK_JAVA_OPTIONS, CLASSPATH;
- PATH, and CC / CXX, the compilers Triton and torch's C++ extensions run at first use.

Overrides that pass are recorded in the guard's `spawn` event: `recorded(env)` keeps each key and its
value, except values of keys that look secret (`SECRET_MARKERS`), written as `REDACTED`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from mopd_hpc.runtime import child_env

#: Keys a spawn may set: every key with this prefix (the plan's own keys, runtime/child_env.py) ...
ALLOWED_PREFIX = child_env.PREFIX
#: ... and these, each a setting that names no file, module or host (reason shown in the docs).
ALLOWED_KEYS: Mapping[str, str] = {
    "PYTORCH_CUDA_ALLOC_CONF": "torch's CUDA caching-allocator options (sizes and flags)",
    "OMP_NUM_THREADS": "the CPU thread count of OpenMP and torch",
    "TOKENIZERS_PARALLELISM": "whether the tokenizers library uses threads",
    "CUDA_LAUNCH_BLOCKING": "synchronous CUDA launches, for debugging",
    "NCCL_DEBUG": "NCCL's log level (a level, not a file: NCCL_DEBUG_FILE is not allowed)",
}
#: Key prefixes refused in a spawn's env overrides, with the reason shown in the 403.
DENIED_PREFIXES: Mapping[str, str] = {
    "LD_": "the dynamic loader reads it (ld.so(8): LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT load code)",
    "PYTHON": "the Python interpreter reads it (python(1): PYTHONPATH with a sitecustomize.py runs code)",
    "BASH_FUNC_": "bash imports it as a function into every shell the child starts",
}
#: Exact keys refused, with the reason.
DENIED_KEYS: Mapping[str, str] = {
    "PATH": "it decides which program a command name runs",
    "HOME": "it locates the user site-packages and its .pth files, and the dotfiles programs read",
    "CC": "Triton and torch's C++ extensions run it as the compiler",
    "CXX": "torch's C++ extensions run it as the compiler",
    "GLIBC_TUNABLES": "glibc's loader parses it (CVE-2023-4911)",
    **dict.fromkeys(
        (
            "GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH",
            "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
        ),
        "glibc loads files or modules it names (glibc's unsecvars.h)",
    ),
    **dict.fromkeys(("BASH_ENV", "ENV"), "every non-interactive shell sources the file it names"),
    **dict.fromkeys(("SHELLOPTS", "BASHOPTS", "PS4", "IFS"), "it changes how every shell the child starts runs"),
    **dict.fromkeys(
        ("PERL5LIB", "PERLLIB", "PERL5OPT", "RUBYLIB", "RUBYOPT", "NODE_OPTIONS", "NODE_PATH"),
        "an interpreter the child may start loads code from it",
    ),
    **dict.fromkeys(
        ("JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "CLASSPATH"),
        "a JVM the child may start loads code from it",
    ),
}  # fmt: skip
#: Substrings (upper case) of a key whose value is never recorded.
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
#: What a secret value is recorded as.
REDACTED = "REDACTED"

_SECRET_RE = re.compile("|".join(SECRET_MARKERS))
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def danger(key: str) -> str | None:
    """Why `key` loads code or files (the reason of `DENIED_KEYS` / `DENIED_PREFIXES`), or None."""
    reason = DENIED_KEYS.get(key)
    if reason is None:
        reason = next((why for prefix, why in DENIED_PREFIXES.items() if key.startswith(prefix)), None)
    return reason


def allowed(key: str, site_keys: Collection[str] = ()) -> bool:
    """True when a spawn may set `key`: `MOPD_*`, `ALLOWED_KEYS`, or one of the site's `site_keys`."""
    return key.startswith(ALLOWED_PREFIX) or key in ALLOWED_KEYS or key in site_keys


def denial(key: str, site_keys: Collection[str] = ()) -> str | None:
    """Why `key` may not be overridden (a sentence naming the key and the way out), or None when it may."""
    if allowed(key, site_keys):
        return None
    why = danger(key)
    reason = (
        f"{why}; loader, interpreter and shell variables come from the guard's own environment only"
        if why is not None
        else f"it is not on the allow-list ({ALLOWED_PREFIX}* and {', '.join(sorted(ALLOWED_KEYS))}"
        + (f", and the site's {', '.join(sorted(site_keys))}" if site_keys else "")
        + f"); a site adds a key with `mopd-guard --allow-env {key}`"
    )
    return f"env key {key} may not be set by a spawn: {reason} (runtime/guard/env_policy.py)"


def first_denial(overrides: Mapping[str, str], site_keys: Collection[str] = ()) -> str | None:
    """The `denial` of the first refused key of `overrides` (in sorted order), or None."""
    return next((why for key in sorted(overrides) if (why := denial(key, site_keys)) is not None), None)


def check_site_key(key: str) -> str:
    """`key` if a site may add it to the allow-list (`mopd-guard --allow-env`); returns it.

    Raises:
        ValueError: `key` is not an environment name, or it loads code (`danger`), naming why.
    """
    if not _KEY_RE.match(key):
        raise ValueError(
            f"--allow-env {key!r} is invalid: expected an environment name [A-Za-z_][A-Za-z0-9_]*"
        )
    why = danger(key)
    if why is not None:
        raise ValueError(f"--allow-env {key}: this key cannot be allowed: {why}")
    return key


def looks_secret(key: str) -> bool:
    """True when `key` names a secret (TOKEN, SECRET, PASSWORD, KEY, ... in it, any case)."""
    return _SECRET_RE.search(key.upper()) is not None


def recorded(overrides: Mapping[str, str]) -> dict[str, str]:
    """`overrides` as the guard's events record them: secret-looking keys' values replaced by REDACTED."""
    return {k: (REDACTED if looks_secret(k) else v) for k, v in sorted(overrides.items())}
