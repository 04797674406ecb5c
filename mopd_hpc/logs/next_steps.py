"""What to do next: exact `mopd-debug` / `mopd-submit` / `mopd-logs` commands for a cause (paths shell-quoted)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from mopd_hpc.records.run_dir import CONFIG_FILE

#: Commands per cause key; placeholders: {run_dir}, {config}, {job}, {host}, {role}, {rank}.
_BY_CAUSE: Mapping[str, tuple[str, ...]] = {
    "address_in_use": ("mopd-debug shell {job} --node {host}", "mopd-debug ports", "{resume}"),
    "port_lease_denied": ("mopd-debug shell {job} --node {host}", "mopd-debug ports", "{resume}"),
    "cuda_oom": ("mopd-submit {config} --check", "{resume}"),
    "invalid_device_ordinal": ("mopd-debug shell {job} --node {host}", "mopd-debug topology", "{resume}"),
    "nccl": ("mopd-debug shell {job} --node {host}", "mopd-debug topology", "{resume}"),
    "tokenizer_mismatch": ("mopd-submit {config} --check",),
    "config_error": ("mopd-submit {config} --check",),
    "model_path": ("mopd-submit {config} --check",),
    "cancelled": ("{resume}",),
    "guard_unreachable": ("mopd-debug guard status {run_dir}", "{resume}"),
    "time_limit": ("{resume}",),
    "preempted": ("{resume}",),
    "host_oom": ("sacct -j {job} --format=JobID,State,MaxRSS,MaxRSSNode,ReqMem", "{resume}"),
    "killed_by_signal": ("sacct -j {job} --format=JobID,State,ExitCode,MaxRSS,MaxRSSNode", "{resume}"),
    "node_fail": ("{resume}",),
    "interrupted": ("{resume}",),
    "terminated": ("{resume}",),
    "guard_died": ("{resume}",),
    "checkpoint_signal": ("{resume}",),  # not a failure: the actor checkpointed on SIGUSR2 and stopped
}
_DEFAULT = ("mopd-logs tail {run_dir} --role {role} --rank {rank}", "{resume}")
_TAIL = "mopd-logs tail {run_dir} --role {role} --rank {rank}"
#: A Slurm job id (`123`, `123+1`); anything else (`local-42`) ran without Slurm.
_SLURM_JOB_RE = re.compile(r"^[0-9]+(?:\+[0-9]+)?$")
#: Commands that need Slurm (accounting, srun into the allocation): never suggested for a local job.
_SLURM_ONLY = ("sacct ", "mopd-debug shell ")


def _for_backend(templates: tuple[str, ...], slurm: bool) -> tuple[str, ...]:
    """`templates` as they are for a Slurm job; for a local one the Slurm-only commands become a tail of the
    failing child's log."""
    if slurm:
        return templates
    return tuple(_TAIL if t.startswith(_SLURM_ONLY) else t for t in templates)


def next_steps(
    run_dir: str,
    cause_key: str | None,
    job_id: str | None,
    host: str | None,
    role: str | None,
    rank: int | None,
    running: bool,
) -> list[str]:
    """The commands to run next, most useful first.

    A running job gets `mopd-logs tail -f` and a shell on the node; a failed one the commands of its cause
    (`_BY_CAUSE`); one that stopped on a checkpoint signal (cause_key "checkpoint_signal") the resume command;
    a finished one without failure nothing. Templates whose values are unknown are skipped. A job whose id is
    not a Slurm id (`local-42`) gets no Slurm-only command (`sacct`, `mopd-debug shell`): a log tail instead.
    """
    q = shlex.quote
    values = {
        "run_dir": q(run_dir),
        "config": q(f"{run_dir.rstrip('/')}/{CONFIG_FILE}"),
        "job": q(job_id) if job_id else None,
        "host": q(host) if host else None,
        "role": q(role) if role else None,
        "rank": str(rank) if rank is not None else None,
    }
    values["resume"] = f"mopd-submit {values['config']} --resume {values['run_dir']}"
    if running:
        templates: tuple[str, ...] = ("mopd-logs tail {run_dir} -f", "mopd-debug shell {job} --node {host}")
    elif cause_key is None:
        return []
    else:
        templates = _BY_CAUSE.get(cause_key, _DEFAULT)
    templates = _for_backend(templates, job_id is None or bool(_SLURM_JOB_RE.match(job_id)))
    out = []
    for template in templates:
        try:
            command = template.format(**{k: v for k, v in values.items() if v is not None})
        except KeyError:
            continue
        if command not in out:
            out.append(command)
    return out
