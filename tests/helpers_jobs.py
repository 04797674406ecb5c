"""Whole jobs for tests: `mopd-submit CONFIG --local` as a real subprocess, in a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment less the `MOPD_*` and `SLURM_*` variables (a test run inside a job or an
    allocation must not leak it into the job it starts), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    return {**env, **extra}


def submit_local(
    config: Path,
    *args: str,
    cwd: Path,
    timeout_s: float = 300,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `mopd-submit CONFIG --local ARGS...` in `cwd` to its end; stdout and stderr captured as text. The
    caller asserts the exit code (its message: the output tails). `env` None: `job_env()`."""
    return subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--local", *args],
        cwd=cwd,
        env=dict(job_env() if env is None else env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@dataclass(frozen=True, slots=True)
class PlainRun:
    """conftest's `plain_run`: its run directory (read-only) and the `mopd-submit` output of its one job."""

    run_dir: Path
    stdout: str


#: The shared uninterrupted job (conftest's `plain_run`): its steps, a checkpoint every step, 1 eval prompt a
#: route. A test that compares with it writes its own run's config with `plain_config`.
PLAIN_STEPS = 6


def plain_config(models: Path, run_dir: Path, path: Path, **changes: object) -> Path:
    """The config of conftest's `plain_run` (configs/local_cpu.yaml on the micro models, `PLAIN_STEPS` steps,
    a checkpoint every step, eval 1 prompt a route) for `run_dir`, with `changes` (dotted keys) on top."""
    from test_controller import micro_config

    return micro_config(
        models, run_dir, path, steps=PLAIN_STEPS, checkpoint_interval=1, **{"data.eval.size": 1, **changes}
    )
