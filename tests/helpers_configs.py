"""Config documents for tests: dotted-key edits of a YAML mapping, configs/local_cpu.yaml without its SFT warm-up or
with a uniform mixture, and `mopd-submit` run in this process on one."""

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


#: The override that turns configs/local_cpu.yaml's SFT warm-up (`loss.sft_warmup_ratio`, `make run`'s recipe) off:
#: MOPD from step 1, as in a config without the field. For its derivations that test the on-policy step (with
#: `--set steps=3` the warm-up would make 2 of the 3 steps SFT steps) or a run without distillation (a warm-up is
#: refused with `distillation_coefficient: 0`).
NO_SFT_WARMUP = "loss.sft_warmup_ratio=null"


def without_sft_warmup(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (a loaded configs/*.yaml mapping) with MOPD from step 1: `loss.sft_warmup_ratio` removed (the schema's
    default, null: no SFT warm-up; `NO_SFT_WARMUP` as a mapping edit). Returns doc."""
    doc["loss"].pop("sft_warmup_ratio", None)
    return doc


def uniform_mixture(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (a loaded configs/*.yaml mapping) with a uniform mixture: `data.mixture: uniform` and no source `weight`
    (configs/local_cpu.yaml weighs chain 0.3 / legs 0.7 for `make run`). For its derivations that add, replace or
    reweigh sources, or that compare with runs made on the uniform batch. Returns doc."""
    doc["data"]["mixture"] = "uniform"
    for source in doc["data"]["sources"]:
        source.pop("weight", None)
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
