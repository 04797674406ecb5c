"""Config documents for tests: dotted-key edits of a YAML mapping, and `mopd-submit` run in this process on one."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Mapping
from typing import Any


def set_dotted(doc: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """Set each "a.b.c" key of `changes` in `doc` (nested dicts, keys must exist up to the last); returns doc."""
    for key, value in changes.items():
        *head, last = key.split(".")
        node = doc
        for part in head:
            node = node[part]
        node[last] = value
    return doc


def submit_here(*argv: str) -> tuple[int, str, str]:
    """`mopd-submit ARGV` in this process (`cli/submit.execute`, an empty environment): (exit code, its
    stdout, its stderr)."""
    from mopd_hpc.cli import submit

    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    rc = submit.execute(parser.parse_args(list(argv)), out=out, err=err, environ={}, python=sys.executable)
    return rc, out.getvalue(), err.getvalue()
