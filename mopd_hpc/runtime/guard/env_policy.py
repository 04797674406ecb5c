"""Which environment overrides a spawn may carry: loader, interpreter and shell variables are refused.

The guard runs only registered role modules, but an environment can make any program run something else:
`PYTHONPATH=DIR` with a `sitecustomize.py` in DIR runs DIR's code in the child before the role's module,
`LD_PRELOAD` loads a library into every process, `PATH` decides what `gcc` or `nvidia-smi` is. A spawn
override whose key is in `DENIED_KEYS` or starts with a prefix of `DENIED_PREFIXES` is refused (HTTP 403
naming the key) before any port is leased or any process started. The job's own plan sets only `MOPD_*`
keys (runtime/plan.py `child_environment`, plan/placement.py), so nothing it needs is refused; the guard's
own environment (inherited by every child, PYTHONPATH included) is not an override and is not filtered.

Sources of the list:
- glibc's "unsecure" variables, those ld.so drops for set-user-ID programs (`sysdeps/generic/unsecvars.h`):
  `LD_*`, GCONV_PATH, GETCONF_DIR, HOSTALIASES, LOCALDOMAIN, LOCPATH, MALLOC_TRACE, NIS_PATH, NLSPATH,
  RESOLV_HOST_CONF, RES_OPTIONS, TZDIR, and GLIBC_TUNABLES (CVE-2023-4911). TMPDIR, also on that list,
  is allowed: it picks a directory, not code, and jobs set it for scratch space;
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
from collections.abc import Mapping

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


def denial(key: str) -> str | None:
    """Why `key` may not be overridden (a sentence naming the key), or None when it may."""
    reason = DENIED_KEYS.get(key)
    if reason is None:
        reason = next((why for prefix, why in DENIED_PREFIXES.items() if key.startswith(prefix)), None)
    if reason is None:
        return None
    return (
        f"env key {key} may not be set by a spawn: {reason}; loader, interpreter and shell variables come "
        "from the guard's own environment only (runtime/guard/env_policy.py lists them)"
    )


def first_denial(overrides: Mapping[str, str]) -> str | None:
    """The `denial` of the first refused key of `overrides` (in sorted order), or None."""
    return next((why for key in sorted(overrides) if (why := denial(key)) is not None), None)


def looks_secret(key: str) -> bool:
    """True when `key` names a secret (TOKEN, SECRET, PASSWORD, KEY, ... in it, any case)."""
    return _SECRET_RE.search(key.upper()) is not None


def recorded(overrides: Mapping[str, str]) -> dict[str, str]:
    """`overrides` as the guard's events record them: secret-looking keys' values replaced by REDACTED."""
    return {k: (REDACTED if looks_secret(k) else v) for k, v in sorted(overrides.items())}
