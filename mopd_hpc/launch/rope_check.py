"""The RoPE scaling of a megatron actor's or teacher's checkpoint, read from its config.json at `--check`: what
megatron-core cannot reproduce (engines/megatron/rope.py: llama3 scaling with megatron's fixed parameters, or
none) is refused before any process starts, naming the field, the value and the way out (engine torch)."""

from __future__ import annotations

import json
from pathlib import Path

from mopd_hpc.config.problems import Problem
from mopd_hpc.engines.megatron.rope import RopeScalingError, megatron_rope_scaling


def rope_problems(field: str, engine: str | None, directory: Path) -> list[Problem]:
    """[] unless `engine` is megatron and the config.json of `directory` asks for a RoPE scaling megatron does
    not compute; an unreadable config.json is the file check's to report."""
    if engine != "megatron":
        return []
    try:
        hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(hf, dict):
        return []
    try:
        megatron_rope_scaling(hf)
    except RopeScalingError as err:
        return [
            Problem(
                field, f"{directory}/config.json: {err}", hf.get("rope_scaling") or hf.get("rope_parameters")
            )
        ]
    return []
