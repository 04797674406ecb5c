"""`mopd-debug shell`: the srun argv of an interactive shell on a node of a running job.

`shell_argv(job_id, components, node, python, run_dir=...)`: `srun --jobid=J [--het-group=N] --overlap --pty
--nodes=1 --ntasks=1 --nodelist=NODE bash -c 'export ...; <mopd-debug topology>; exec bash -i'`; the het
group is the component whose node list holds the node (`scontrol show job -o` parsed by
`parse_scontrol_job`). The shell gets what the job's own steps have and an srun from outside the batch shell
does not: MOPD_RUN_DIR (`job_run_dir`: from the batch log path scontrol reports) and, in a het job,
SLURM_HET_SIZE (the number of components) and MOPD_HET_GROUP (what the node launcher exports).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mopd_hpc.launch.debug_session import JobLookupError
from mopd_hpc.records.run_dir import LOGS_DIR
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.hostlist import expand_hostlist


@dataclass(frozen=True, slots=True)
class JobComponent:
    """One component of a job as `scontrol show job -o` reports it (`stdout`: its StdOut, the batch log)."""

    job_id: str
    het_group: int | None
    state: str
    nodes: tuple[str, ...]
    stdout: str | None = None


_SCONTROL_FIELD = re.compile(r"(?:^|\s)(JobId|HetJobId|HetJobOffset|JobState|NodeList)=(\S*)")
#: `StdOut=PATH` (a path may hold spaces: up to the next ` Key=` or the end of the line).
_SCONTROL_STDOUT = re.compile(r"(?:^|\s)StdOut=(.*?)(?=\s+[A-Za-z:]+=|\s*$)")
#: The batch log of a job (sbatch_templates/_job_options.j2: `--output=<run_dir>/logs/batch.%j.log`).
_BATCH_LOG = re.compile(r"^batch\.[0-9]+(?:\+[0-9]+)?\.log$")


def parse_scontrol_job(text: str) -> tuple[JobComponent, ...]:
    """The components in `scontrol show job -o JOB` output (one line per component; `(null)` node lists of
    pending jobs are empty). Raises JobLookupError when no line names a job."""
    comps = []
    for line in text.splitlines():
        fields = dict(_SCONTROL_FIELD.findall(line))
        if "JobId" not in fields:
            continue
        offset = fields.get("HetJobOffset")
        nodes = fields.get("NodeList", "")
        stdout = _SCONTROL_STDOUT.search(line)
        comps.append(
            JobComponent(
                job_id=fields["JobId"],
                het_group=int(offset) if offset and offset.isdigit() else None,
                state=fields.get("JobState", "UNKNOWN"),
                nodes=tuple(expand_hostlist(nodes)) if nodes and nodes != "(null)" else (),
                stdout=stdout.group(1) if stdout and stdout.group(1) else None,
            )
        )
    if not comps:
        raise JobLookupError(f"scontrol printed no job record: {text.strip()[:200]!r}")
    return tuple(sorted(comps, key=lambda c: c.het_group or 0))


def pick_component(
    job_id: str, components: Sequence[JobComponent], node: str | None
) -> tuple[JobComponent, str]:
    """The running component holding `node` (default: the first node of the first component) and the node.

    Raises:
        JobLookupError: the job is not running, or `node` is not one of its nodes (the message lists them).
    """
    running = [c for c in components if c.state == "RUNNING" and c.nodes]
    if not running:
        states = ", ".join(f"{c.job_id} {c.state}" for c in components)
        raise JobLookupError(f"job {job_id} is not running ({states}): a shell needs a running job")
    if node is None:
        return running[0], running[0].nodes[0]
    for comp in running:
        if node in comp.nodes:
            return comp, node
    where = "; ".join(
        f"{','.join(c.nodes)}" + (f" (het group {c.het_group})" if c.het_group is not None else "")
        for c in running
    )
    raise JobLookupError(f"--node {node!r} is not a node of job {job_id}: its nodes are {where}")


def job_run_dir(components: Sequence[JobComponent]) -> str | None:
    """The run dir of a job mopd-submit rendered: its batch log is `<run_dir>/logs/batch.<job id>.log`
    (scontrol's StdOut); None when no component's StdOut has that form (a job submitted another way)."""
    for comp in components:
        if comp.stdout:
            log = Path(comp.stdout)
            if log.parent.name == LOGS_DIR and _BATCH_LOG.match(log.name):
                return str(log.parent.parent)
    return None


def debug_command(python: str) -> list[str]:
    """argv of `mopd-debug` beside `python` (its venv), else `python -m mopd_hpc.cli.debug`."""
    script = Path(python).with_name("mopd-debug")
    return [str(script)] if script.exists() else [python, "-m", "mopd_hpc.cli.debug"]


def shell_argv(
    job_id: str,
    components: Sequence[JobComponent],
    node: str | None,
    python: str,
    srun: str = "srun",
    *,
    run_dir: str | None = None,
) -> list[str]:
    """The `srun --pty` argv of an interactive shell on `node` of running job `job_id`, printing the node's
    topology first (`mopd-debug topology`). The shell exports MOPD_RUN_DIR=`run_dir` (when known) and, in a
    het job, SLURM_HET_SIZE=<number of components> and MOPD_HET_GROUP=<the node's component>, as the job's
    own steps see them. Raises JobLookupError."""
    comp, host = pick_component(job_id, components, node)
    leader = job_id.split("+", 1)[0]
    argv = [srun, f"--jobid={leader}"]
    where = f"job {leader}"
    exports = {child_env.RUN_DIR: run_dir} if run_dir else {}
    if comp.het_group is not None and len(components) > 1:
        argv.append(f"--het-group={comp.het_group}")
        where += f" het group {comp.het_group} (component job {comp.job_id})"
        # An srun from outside the batch shell gets no SLURM_HET_* variables: give the step the job's.
        exports |= {"SLURM_HET_SIZE": str(len(components)), child_env.HET_GROUP: str(comp.het_group)}
    where += f", node {host}; run dir {run_dir or f'unknown ({child_env.RUN_DIR} unset)'}"
    banner = shlex.quote(f"mopd-debug shell: {where}; the step's rank topology:")
    topology = " ".join(shlex.quote(a) for a in [*debug_command(python), "topology"])
    export = f"export {' '.join(f'{k}={shlex.quote(v)}' for k, v in exports.items())}; " if exports else ""
    script = (
        f"{export}echo {banner}; {topology} || echo 'mopd-debug topology failed (see above)'; exec bash -i"
    )
    argv += ["--overlap", "--pty", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "bash", "-c", script]
    return argv
