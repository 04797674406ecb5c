"""Run one Python program as several real processes (the ranks of a gloo group) and collect what they print.

The ranks are forked from the worker's fork server (tests/helpers_fork.py: torch, transformers and megatron-core
imported once)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from helpers_fork import popen

REPO = Path(__file__).resolve().parents[2]


def run_ranks(
    program: str, argv: Callable[[int], Sequence[str]], world: int = 2, timeout_s: float = 300
) -> list[str]:
    """`python -c program *argv(rank)` for rank 0..world-1 at once (cwd: the repository); every rank must exit 0
    (the assertion carries its stderr tail). Returns each rank's stdout, in rank order."""
    procs = [
        popen(["-c", program, *argv(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for r in range(world)
    ]
    outs = [p.communicate(timeout=timeout_s) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}: " + err[-3000:]
    return [out for out, _ in outs]
