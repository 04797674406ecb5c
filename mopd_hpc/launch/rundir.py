"""Create the run directory (0700) and the job's secret token (0600) before anything is submitted.

Layout: `run_dir/` (0700), `run_dir/logs/` (batch and per-component step logs), `run_dir/state/` (the batch
shell's records: job.json, first_failure.json, last_signal.json, requeue.json), `run_dir/submit/`
(submitit's folder: the submitted script as `<job_id>_submission.sh`), and the guard's token file
(`mopd_hpc.records.run_dir.TOKEN_FILE`, mode 0600; the token never appears in a script, argv or log).
`write_run_files` then writes what the guards and `mopd-logs` read: config.yaml, plan.json, unverified.json.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mopd_hpc.atomic import atomic_write_text
from mopd_hpc.config import RunConfig
from mopd_hpc.config.job_gaps import unverified_gaps, unverified_warning
from mopd_hpc.launch.model_check import unverified_model_warnings
from mopd_hpc.records.job_token import create_token_file, read_token_file
from mopd_hpc.records.run_dir import CONFIG_FILE, LOGS_DIR, PLAN_FILE, STATE_DIR, SUBMIT_DIR, TOKEN_FILE
from mopd_hpc.records.unverified import write_unverified
from mopd_hpc.runtime.plan import JobPlan

#: Mode of the run directory and its subdirectories: the owner only (the token lives there).
RUN_DIR_MODE = 0o700
#: Subdirectories created with the run directory.
SUBDIRS = (LOGS_DIR, STATE_DIR, SUBMIT_DIR)


class RunDirError(ValueError):
    """The run directory or its token file cannot be made private to this user."""


@dataclass(frozen=True, slots=True)
class RunDir:
    """Paths of a prepared run directory (all absolute)."""

    root: Path
    logs: Path
    state: Path
    submit: Path
    secret_file: Path

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> RunDir:
        """The paths under `root` (nothing is created)."""
        path = Path(root).expanduser().absolute()
        return cls(
            root=path,
            logs=path / LOGS_DIR,
            state=path / STATE_DIR,
            submit=path / SUBMIT_DIR,
            secret_file=path / TOKEN_FILE,
        )


def prepare_run_dir(root: str | os.PathLike[str]) -> RunDir:
    """Create `root` and its subdirectories with mode 0700 and, if missing, the token file with mode 0600.

    Idempotent: an existing directory is tightened to 0700 and an existing token is kept (a resubmission
    into the same run dir reuses it) after checking it is 0600 and owned by this user.

    Raises:
        RunDirError: `root` (or a subdirectory) exists but is not a directory owned by this user, or the
            existing token file is readable by others; the message names the path and mode.
    """
    run_dir = RunDir.at(root)
    for path in (run_dir.root, run_dir.logs, run_dir.state, run_dir.submit):
        _make_private_dir(path)
    if run_dir.secret_file.exists():
        try:
            read_token_file(run_dir.secret_file)
        except ValueError as exc:
            raise RunDirError(f"run dir {run_dir.root}: {exc}") from None
    else:
        create_token_file(run_dir.secret_file)
    return run_dir


def write_run_files(run_dir: RunDir, cfg: RunConfig, plan: JobPlan) -> None:
    """Write the resolved config (CONFIG_FILE: what `--resume` and `mopd-logs` read), what it lets through
    unverified (records/unverified.py) and the job plan (PLAN_FILE: what the guards read), each atomically.
    Raises OSError when the run directory is not writable."""
    atomic_write_text(run_dir.root / CONFIG_FILE, cfg.to_yaml())
    write_unverified(
        run_dir.root, [unverified_warning(p) for p in unverified_gaps(cfg)] + unverified_model_warnings(cfg)
    )
    plan.write(run_dir.root / PLAN_FILE)


def _make_private_dir(path: Path) -> None:
    try:
        path.mkdir(mode=RUN_DIR_MODE, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: reported below
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"{path} exists and is not a directory: choose another run_dir")
    if st.st_uid != os.geteuid():
        raise RunDirError(
            f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}): choose another run_dir"
        )
    if stat.S_IMODE(st.st_mode) != RUN_DIR_MODE:
        os.chmod(path, RUN_DIR_MODE)
