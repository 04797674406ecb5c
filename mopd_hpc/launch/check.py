"""`mopd-submit --check`: validate a run config (its models' files too) and print it resolved.

The rule it keeps: if --check passes, the job's roles can run it (config/rules.py `job_gaps`), its memory plan
fits the GPUs' memory where that is known (launch/memory_check.py) and its models can be read
(launch/model_check.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from mopd_hpc.config import ConfigError, RunConfig, load_run_config
from mopd_hpc.config.job_gaps import job_gaps
from mopd_hpc.config.parallel import ActorParallel
from mopd_hpc.launch.memory_check import memory_check
from mopd_hpc.launch.model_check import prepare_models, resolution_notes
from mopd_hpc.launch.prepare import gaps_refusal, memory_refusal, submit_warnings, summary
from mopd_hpc.runtime.signals import EXIT_USAGE


def print_config(cfg: RunConfig, out: TextIO, source: str = "", notes: Sequence[str] = ()) -> None:
    """Print the resolved config as syntax-highlighted YAML (plain text when `out` is not a terminal), after
    its header, the `notes` (hub ids resolved) and the warnings as comment lines."""
    from rich.console import Console
    from rich.syntax import Syntax

    from mopd_hpc.launch.rankmap import shape_line

    console = Console(file=out, soft_wrap=True)
    console.print(f"# {source or 'config'} is valid — {summary(cfg)}", markup=False, highlight=False)
    console.print(f"# {shape_line(ActorParallel.from_config(cfg))}", markup=False, highlight=False)
    for note in notes:
        console.print(f"# {note}", markup=False, highlight=False)
    for warning in submit_warnings(cfg):
        console.print(f"# warning: {warning}", markup=False, highlight=False)
    console.print(
        Syntax(cfg.to_yaml(), "yaml", theme="ansi_dark", background_color="default", word_wrap=False)
    )


def check(config: str, overrides: Sequence[str], force_local: bool, out: TextIO, err: TextIO) -> int:
    """Load, validate (the models' files too: launch/model_check.py) and print; returns 0, or EXIT_USAGE with
    every problem on `err`: the config's errors, else the models' problems and what the job's roles do not
    run (`job_gaps`, from config/capabilities.py; both, so that fetching a model does not reveal a refusal
    only then), else what the roles do not run. The rule: if --check passes, the job's roles can run it."""
    try:
        written = load_run_config(config, overrides, force_local)
    except ConfigError as exc:
        print(str(exc), file=err)
        return EXIT_USAGE
    try:
        cfg = prepare_models(written, config)
    except ConfigError as exc:
        print(str(exc), file=err)
        if gaps := job_gaps(written):  # the fields only: a hub id's resolution does not change them
            print(f"mopd-submit: {gaps_refusal(gaps, 'its fields are valid, and it also asks')}", file=err)
        return EXIT_USAGE
    gaps, memory = job_gaps(cfg), memory_check(cfg)
    if gaps:
        print(f"mopd-submit: {gaps_refusal(gaps)}", file=err)
    if memory.refusals:
        print(f"mopd-submit: {memory_refusal(memory.refusals)}", file=err)
    if gaps or memory.refusals:
        return EXIT_USAGE
    notes = [*resolution_notes(written, cfg), *([memory.unchecked] if memory.unchecked else [])]
    print_config(cfg, out, source=config, notes=notes)
    return 0
