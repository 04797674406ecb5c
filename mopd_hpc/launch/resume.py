"""Before a run starts in a run directory that already holds checkpoints: may this config resume there?

A resumed run restores the data stream (its position in every source), the RNG states and the optimizer
(with its lr schedule) from the newest checkpoint. The sources' sizes are steps × batch_size × their share,
and the lr schedule runs over `steps`, so these settings must equal the checkpointed run's
(`resume_fixed`); anything else (the loss, the lr, the cluster shape) may change on resume. Checking here,
in `mopd-submit`, turns what would be the actor's RoutingError after every process started into one line
that names the field, both values and the way out.

The checkpoint is verified here too, before any child starts (trainer/checkpoint_verify.py, the shallow
checks: files present, sizes as the manifest says, state.json and the zip directories readable): a damaged
newest checkpoint is reported and the previous good one named; when none is good the submission is refused
naming each damaged file. The actor's `load_latest` repeats the walk with the deep checks (SHA-256).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mopd_hpc.config import RunConfig
from mopd_hpc.records.run_dir import CHECKPOINTS_DIR, CONFIG_FILE
from mopd_hpc.trainer import checkpoint_verify
from mopd_hpc.trainer.checkpoint_verify import Choice

#: The checkpoint root of a run directory (trainer/checkpoint.py's layout: checkpoints/latest, step_*/).
CHECKPOINTS = Path(CHECKPOINTS_DIR)


class ResumeError(ValueError):
    """The config differs from the checkpointed run's in a setting a resume cannot change."""


def resume_fixed(cfg: RunConfig) -> dict[str, Any]:
    """The settings a resume must keep, by YAML path: steps, seed, and the data stream's shape (sources
    without their file paths, which a submission may rewrite to absolute ones)."""
    sources = [{k: v for k, v in s.model_dump(mode="json").items() if k != "path"} for s in cfg.data.sources]
    return {
        "steps": cfg.steps,
        "seed": cfg.seed,
        "data.batch_size": cfg.data.batch_size,
        "data.samples_per_prompt": cfg.data.samples_per_prompt,
        "data.mixture": cfg.data.mixture,
        "data.sources": sources,
    }


def resume_choice(run_dir: Path) -> Choice:
    """The newest checkpoint of `run_dir` that passes the shallow checks, and those skipped on the way."""
    return checkpoint_verify.choose(run_dir / CHECKPOINTS, deep=False)


def check_resume(run_dir: Path, cfg: RunConfig, choice: Choice | None = None) -> str | None:
    """The checkpoint `cfg` will resume from in `run_dir` (None: a fresh start).

    Args:
        choice: `resume_choice(run_dir)` when the caller has it (to print its `skipped` lines).
    Raises:
        ResumeError: the run has checkpoints and none is good (the message names each damaged file); or
            `cfg` changes a `resume_fixed` setting of the run's config.yaml (the message names the first
            such field, the run's value and this config's).
    """
    choice = choice if choice is not None else resume_choice(run_dir)
    if choice.name is None and choice.any_found:
        raise ResumeError(
            f"no good checkpoint in {run_dir / CHECKPOINTS} to resume from: "
            + " | ".join(choice.skipped)
            + f"; remove the damaged checkpoint directories (and {run_dir / CHECKPOINTS / 'latest'}) to start "
            "over in this run dir, restore them from a copy, or start a new run with --run-dir"
        )
    name = choice.name
    if name is None or not (run_dir / CONFIG_FILE).is_file():
        return name
    before, now = resume_fixed(RunConfig.from_yaml(run_dir / CONFIG_FILE)), resume_fixed(cfg)
    for key, value in before.items():
        if now[key] != value:
            shown = (value, now[key]) if key != "data.sources" else ("(its sources)", "(other sources)")
            raise ResumeError(
                f"{key}: the run in {run_dir} was checkpointed ({name}) with {key} = {shown[0]}, this config "
                f"has {shown[1]}; a resume keeps steps, seed and the data stream (the checkpoint's stream "
                "position and lr schedule are built on them): keep the run's value, or start a new run "
                f"with --run-dir (or remove {run_dir} to start it over)"
            )
    return name
