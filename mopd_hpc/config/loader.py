"""`load_run_config`: file + `--set` overrides + `--local` → a validated RunConfig, or one ConfigError."""

from __future__ import annotations

import os
from collections.abc import Iterable

from mopd_hpc.config.overrides import overrides_applied
from mopd_hpc.config.problems import ConfigError, Problem
from mopd_hpc.config.run import RunConfig, read_config_text
from mopd_hpc.config.yaml_io import load_yaml_text

#: What `--local` sets (DESIGN.md §1: the command line overrides the YAML's backend).
LOCAL_OVERRIDE = "cluster.backend=local"


def load_run_config(
    path: str | os.PathLike[str], overrides: Iterable[str] = (), force_local: bool = False
) -> RunConfig:
    """Read `path`, apply `overrides` (`key=value`, in order), force the local backend, validate.

    Args:
        path: the run.yaml.
        overrides: `--set` items, e.g. ["loss.correction=mask", "data.sources[0].route=legs"].
        force_local: `--local`: cluster.backend becomes 'local' (applied after `overrides`).
    Returns:
        the validated, resolved RunConfig.
    Raises:
        ConfigError: every problem at once: unreadable file, YAML syntax, duplicate keys, bad
            overrides, field errors, cross-field rules.
    """
    source = str(path)
    document, problems = load_yaml_text(read_config_text(path))
    if document is None and problems:
        raise ConfigError(problems, source)
    items = [*overrides, *([LOCAL_OVERRIDE] if force_local else [])]
    if items and isinstance(document, dict):
        document, bad = overrides_applied(document, items)  # the good ones still apply: report them all
        problems.extend(bad)
    try:
        cfg = RunConfig.from_dict(document, source)
    except ConfigError as exc:
        raise ConfigError(_merge(problems, exc.problems), source) from None
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _merge(first: list[Problem], second: Iterable[Problem]) -> list[Problem]:
    return [*first, *second]
