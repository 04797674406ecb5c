"""Reward names a source may pick, and `module:function` import paths of a user's reward function.

The config imports a reward path when it is validated (so `mopd-submit --check` refuses a bad one, naming
the field) and the data layer imports the same path again in the job's processes; both go through
`load_object`, so they accept and refuse the same paths.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The built-in rewards (`mopd_hpc.data.verifiers`): the reasoning-gym dataset's own `score_answer`
#: (reasoning-gym sources only), exact match, regex match (with `reward_pattern`), math final answers.
BUILTIN_REWARDS: tuple[str, ...] = ("reasoning_gym", "exact", "regex", "math")
#: The reward of a source that names none: what each kind scored with before sources could pick.
DEFAULT_REWARD: dict[str, str] = {"reasoning_gym": "reasoning_gym", "jsonl": "exact"}


class ImportPathError(ValueError):
    """An import path that is malformed, whose module does not import, or whose object is not callable."""


def load_object(path: str) -> Any:
    """The callable named by `path`, `package.module:function` (the function may be dotted: `mod:Class.f`).

    Raises:
        ImportPathError: no `:` or an empty part; the module raised on import (the exception is named);
            the module has no such attribute; the attribute is not callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ImportPathError(f"not an import path of the form 'package.module:function' (got {path!r})")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of the user's module is reported, not raised through
        raise ImportPathError(
            f"module {module_name!r} does not import: {type(exc).__name__}: {exc} "
            "(is it on PYTHONPATH on the submit host and on the job's nodes?)"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportPathError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ImportPathError(f"{path!r} is a {type(obj).__name__}, not a callable")
    return obj
