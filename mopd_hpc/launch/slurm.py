"""Submit a rendered sbatch script through submitit's machinery, as it is: het jobs included.

submitit cannot express heterogeneous jobs (its issue #1741: one parameter set per job) and keys job states
by the id sacct prints, so `123+0`/`123+1` never match the `123` sbatch returned (launchers.md §1.1). We
keep submitit's submission plumbing (`PicklingExecutor._submit_command` flow: script file in the folder,
`sbatch`, id parsing, `Job` handle with `cancel()`, `<id>_submission.sh` kept beside) and replace:

- the script text: `render(spec).script`, not submitit's `_make_sbatch_string`;
- the command: `sbatch --parsable <file>` run with the scrubbed environment (`launch.env`);
- the state watcher: sacct, then squeue, parsed by `runtime.jobids` with het ids folded to the leader.

Nothing is pickled: `submit(fn)` is refused; guards are started by the script itself.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from submitit.core import core, utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from mopd_hpc.launch.env import SubmitEnv, submit_environment
from mopd_hpc.launch.render import SbatchRequest
from mopd_hpc.launch.rundir import prepare_run_dir
from mopd_hpc.runtime.jobids import JobState, JobStatus, fold_job_id, query_status, run_command

logger = logging.getLogger(__name__)

#: sbatch output: "123" or "123;cluster" (--parsable), or "Submitted batch job 123".
_SBATCH_ID = re.compile(r"^\s*(?P<id>[0-9]+)(?:;\S+)?\s*$|job (?P<id2>[0-9]+)")


class SubmitError(utils.FailedSubmissionError):
    """sbatch is missing, refused the script, or printed no job id; the message carries its output."""


class HetInfoWatcher(SlurmInfoWatcher):
    """submitit's state watcher, asking sacct then squeue through `jobids.query_status`, het ids folded.

    `get_state(job_id)` returns a `JobState` value ("RUNNING", "FAILED", ...); submitit's `is_done` treats
    SUCCEEDED/FAILED/CANCELLED as done and PENDING/RUNNING/UNKNOWN as not yet.
    """

    def __init__(self, delay_s: int = 60, run: Callable[[Sequence[str]], str] = run_command) -> None:
        super().__init__(delay_s=delay_s)
        self._run = run
        self._statuses: dict[str, JobStatus] = {}

    def register_job(self, job_id: str) -> None:
        super().register_job(fold_job_id(job_id))

    def get_info(self, job_id: str, mode: str = "standard") -> dict[str, str]:
        return super().get_info(fold_job_id(job_id), mode=mode)

    def status(self, job_id: str, mode: str = "standard") -> JobStatus:
        """The JobStatus of `job_id` (any of its ids): asked now with `mode="force"` (even within submitit's
        1 ms debounce), else refreshed as submitit's `mode` says ("standard": at most every delay_s)."""
        leader = fold_job_id(job_id)
        if mode == "force":
            self.register_job(leader)
            self._finished.discard(leader)  # a requeue can bring a finished job back
            self.update()
        else:
            self.get_info(leader, mode=mode)
        return self._statuses.get(leader, JobStatus(leader=leader, source="none"))

    def update(self) -> None:
        """Refresh every registered, unfinished job (one sacct call each, squeue when sacct fails)."""
        to_check = sorted(self._registered - self._finished)
        if not to_check:
            return
        self._num_calls += 1
        for leader in to_check:
            status = query_status(leader, self._run)
            self._statuses[leader] = status
            self._info_dict[leader] = {"State": status.state.value, "Source": status.source}
        self._last_status_check = time.time()
        for leader in to_check:
            if self.is_done(leader, mode="cache"):
                self._finished.add(leader)


class HetSlurmJob(SlurmJob):
    """A submitted job, known by its leader id; `state` folds every het component (a `JobState` value)."""

    watcher = HetInfoWatcher(delay_s=60)

    def status(self, mode: str = "force") -> JobStatus:
        """Components and steps as sacct (or squeue) reports them now (`mode="force"`) or as cached."""
        return self.watcher.status(self.job_id, mode=mode)

    @property
    def job_state(self) -> JobState:
        """The folded state as a `JobState` (refreshed at most every `watcher` delay)."""
        return JobState(self.state)


class HetSlurmExecutor(SlurmExecutor):
    """submitit's SlurmExecutor, submitting a rendered script as it is (`submit_request`).

    Args:
        folder: where the script is written and kept as `<job_id>_submission.sh` (run_dir/submit).
        environ: the caller's environment (read at the edge); sbatch runs with it scrubbed of inherited
            `SLURM_*`/`SBATCH_*`/`SRUN_*`/`PMI*` when it comes from inside an allocation (`launch.env`).
    Raises:
        SubmitError: `sbatch` is not on the environment's PATH, or `folder` contains `%` (submitit reads
            `%j`/`%t` in folder names as job-id placeholders).
    """

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, environ: Mapping[str, str]) -> None:
        if "%" in str(folder):
            raise SubmitError(f"submission folder {str(folder)!r} contains '%': choose a run_dir without '%'")
        # SlurmExecutor.__init__ insists on `srun` here; submitting needs `sbatch` in the caller's PATH.
        core.PicklingExecutor.__init__(self, folder)
        self.python = sys.executable
        self.submit_env: SubmitEnv = submit_environment(environ)
        if shutil.which("sbatch", path=self.submit_env.environ.get("PATH")) is None:
            raise SubmitError(
                "sbatch is not on PATH: submit from a Slurm login node, or use `mopd-submit --dry-run` "
                "(print the script) or `--local` (this machine, no Slurm)"
            )
        self._request: SbatchRequest | None = None

    def submit_request(self, request: SbatchRequest) -> HetSlurmJob:
        """Write `request.script` to the folder, run `request.cmd <file>`, and return the job handle.

        Raises:
            SubmitError: sbatch exited non-zero (its stderr is in the message) or printed no job id.
        """
        if self.submit_env.inside_allocation:
            logger.info(
                "submitting from inside an allocation: not passing %s", ", ".join(self.submit_env.removed)
            )
        self._request = request
        try:
            job = self._submit_command("rendered by mopd_hpc.launch.render")
        except utils.FailedJobError as exc:
            raise SubmitError(f"{' '.join(request.cmd)} failed: {exc}") from exc
        finally:
            self._request = None
        assert isinstance(job, HetSlurmJob)
        return job

    def _submit_command(self, command: str) -> core.Job[Any]:
        # submitit's PicklingExecutor._submit_command, with the scrubbed environment passed to sbatch.
        tmp_uuid = uuid.uuid4().hex
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        submission_file_path = folder / f".submission_file_{tmp_uuid}.sh"
        submission_file_path.write_text(self._make_submission_file_text(command, tmp_uuid), encoding="utf-8")
        command_list = self._make_submission_command(submission_file_path)
        output = utils.CommandFunction(command_list, verbose=False, env=self.submit_env.environ)()
        job_id = self._get_job_id_from_submission_command(output)
        job: core.Job[Any] = self.job_class(folder=self.folder, job_id=job_id, tasks=[0])
        job.paths.move_temporary_file(submission_file_path, "submission_file", keep_as_symlink=True)
        return job

    def _internal_process_submissions(self, delayed_submissions: list[utils.DelayedSubmission]) -> list[Any]:
        raise SubmitError("HetSlurmExecutor submits rendered scripts only: use submit_request(render(spec))")

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        assert self._request is not None, "called outside submit_request"
        return self._request.script

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        assert self._request is not None, "called outside submit_request"
        return [*self._request.cmd, str(submission_file_path)]

    def _num_tasks(self) -> int:
        return 1

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        for line in text.splitlines():
            match = _SBATCH_ID.search(line)
            if match:
                return match["id"] or match["id2"]
        raise SubmitError(f"could not read a job id from sbatch's output {text!r}")


def submit(request: SbatchRequest, environ: Mapping[str, str]) -> HetSlurmJob:
    """Create the run dir (0700) and the token (0600), then sbatch `request` (torchx: dryrun + schedule).

    Args:
        request: `render(spec)`; `spec.secret_file` must be the run dir's token file.
        environ: the caller's environment (`os.environ` at the CLI edge).
    Raises:
        SubmitError: sbatch missing or failing, or the spec's secret file is not the run dir's token file.
        RunDirError: the run dir cannot be made private.
    """
    run_dir = prepare_run_dir(request.spec.run_dir)
    if Path(request.spec.secret_file) != run_dir.secret_file:
        raise SubmitError(
            f"JobSpec.secret_file={request.spec.secret_file!r}: expected {str(run_dir.secret_file)!r}, the "
            "token file prepare_run_dir creates (build it with RunDir.at(run_dir).secret_file)"
        )
    return HetSlurmExecutor(run_dir.submit, environ).submit_request(request)
