"""srun debug sessions (`mopd-debug shell | run`): the logic, with Slurm's commands as seams.

- `mopd-debug shell`: the srun argv is built in `launch/debug_shell.py` (its JobLookupError is here).
- `Allocation.from_env(env)` + `check_fit(alloc, plan)` + `step_argvs(spec)`: what `mopd-debug run` starts
  inside an `salloc` allocation: the batch script's steps (one `srun [--het-group=N]` per component, each
  running `launchers/node.sh` → `mopd-guard --plan`), in the foreground (`run_steps`).

A step that ends with code 0 (the trainer, done) leaves the others `end_grace_s` to end on their own (the
actor announced the job end in the run dir, records/job_end.py): only those still running then are
interrupted, and that interrupt is not a failure of the run.

Ctrl-C (`run_steps`): the sruns run in their own session (the terminal's SIGINT reaches only this process)
with `--disable-status`, so one SIGINT forwarded to each srun reaches the guards at once (srun turns its own
SIGTERM into a SIGKILL of its tasks: not a clean stop); each guard kills its children and releases their
leases, then exits. After `stop_wait_s` (or a second Ctrl-C) srun gets SIGTERM (tasks SIGKILLed), then
SIGKILL. Every srun runs behind the parent-death wrapper: if this process dies, srun gets SIGTERM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mopd_hpc.launch.jobspec import JobSpec
from mopd_hpc.logs.tailing import find_child_logs
from mopd_hpc.records.run_dir import EVENTS_DIR, EVENTS_SUFFIX, LOGS_DIR
from mopd_hpc.runtime.guard.children import PDEATH_EXEC
from mopd_hpc.runtime.hostlist import HostlistError, expand_counts, expand_hostlist
from mopd_hpc.runtime.plan import JobPlan
from mopd_hpc.runtime.signals import killpg_quiet

#: After the stop (Ctrl-C, or a step that ended), seconds the steps get before srun is told to kill them.
DEFAULT_STOP_WAIT_S = 30.0
#: After a step ended with code 0, seconds the other steps get to end on their own (they stop on the job end
#: the actor announced in the run dir, records/job_end.py) before they are interrupted.
DEFAULT_END_GRACE_S = 30.0
#: Step log of `mopd-debug run`, per component, under run_dir/logs (`%t`: Slurm's task id).
STEP_LOG_PATTERN = "{name}.debug.t%t.log"
#: Exit code after Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 128 + int(signal.SIGINT)
#: Period of the foreground loop (step exits, new log lines), seconds.
_POLL_S = 0.2


class DebugSessionError(ValueError):
    """A debug session cannot start; the message names what is wrong and the way out."""


class OutsideAllocationError(DebugSessionError):
    """`mopd-debug run` was started outside a Slurm allocation (no SLURM_JOB_ID)."""


class AllocationShapeError(DebugSessionError):
    """The allocation's het groups, node counts or CPUs per node do not fit the config."""


class JobLookupError(DebugSessionError):
    """The job of `mopd-debug shell` is unknown, not running, or has no such node."""


# ---- run ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Allocation:
    """The Slurm allocation this process runs in: its job id, the hosts of each het group and, per group, the
    fewest CPUs allocated on one of its nodes (`cpus_per_node`; None where Slurm set no count, () when not
    read): the job's steps run one task per node, so that is the most CPUs per task a step can ask for."""

    job_id: str
    groups: tuple[tuple[str, ...], ...]
    heterogeneous: bool
    cpus_per_node: tuple[int | None, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation:
        """Read SLURM_JOB_ID, SLURM_HET_SIZE, the node lists (`SLURM_JOB_NODELIST_HET_GROUP_<n>`, else
        SLURM_JOB_NODELIST) and the CPU counts (`SLURM_JOB_CPUS_PER_NODE_HET_GROUP_<n>`, else
        SLURM_JOB_CPUS_PER_NODE, e.g. "2(x3),1"). Raises OutsideAllocationError without SLURM_JOB_ID,
        AllocationShapeError when a node list is missing or a CPU count list is malformed."""
        job_id = env.get("SLURM_JOB_ID", "").strip()
        if not job_id:
            raise OutsideAllocationError(
                "mopd-debug run starts the job's steps inside an allocation, but SLURM_JOB_ID is unset: "
                "run it under salloc, e.g. `salloc -N1 : -N2 mopd-debug run run.yaml` for a 2-group het job"
            )
        het_size = env.get("SLURM_HET_SIZE", "").strip()
        if het_size.isdigit() and int(het_size) > 0:
            groups = []
            for n in range(int(het_size)):
                nodelist = env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{n}")
                if not nodelist:
                    raise AllocationShapeError(
                        f"SLURM_HET_SIZE={het_size} but SLURM_JOB_NODELIST_HET_GROUP_{n} is unset"
                    )
                groups.append(tuple(expand_hostlist(nodelist)))
            cpus = tuple(_fewest_cpus(env, cpus_variable(True, n)) for n in range(int(het_size)))
            return cls(job_id, tuple(groups), True, cpus)
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise AllocationShapeError(f"job {job_id}: SLURM_JOB_NODELIST is unset")
        return cls(
            job_id, (tuple(expand_hostlist(nodelist)),), False, (_fewest_cpus(env, cpus_variable(False, 0)),)
        )


def cpus_variable(heterogeneous: bool, het_group: int) -> str:
    """The variable with the CPUs allocated on each node of a het group (of the job when not heterogeneous)."""
    return f"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{het_group}" if heterogeneous else "SLURM_JOB_CPUS_PER_NODE"


def _fewest_cpus(env: Mapping[str, str], name: str) -> int | None:
    """The smallest count of the count list `env[name]` ("2(x3),1" → 1); None when unset."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return min(expand_counts(raw))
    except HostlistError as exc:
        raise AllocationShapeError(f"{name}={raw!r}: {exc}") from None


def salloc_hint(plan: JobPlan, cpus_per_task: Sequence[int] = ()) -> str:
    """The salloc command whose allocation fits `plan`: `salloc -N1 -c2 : -N2 -c1` for a 2-group het job
    whose groups ask for 2 and 1 CPUs per task (`cpus_per_task`, one per group in plan order; without it
    the -c options are left out). The job's steps run one task per node with --cpus-per-task, so an
    allocation without those CPUs fails at `srun` ("More processors requested than permitted")."""
    return salloc_for([g.nodes for g in plan.groups], cpus_per_task)


def salloc_for(nodes: Sequence[int], cpus_per_task: Sequence[int] = ()) -> str:
    """`salloc_hint` from the node counts of the het groups (and their CPUs per task), in plan order."""
    cpus = list(cpus_per_task) or [None] * len(nodes)
    return "salloc " + " : ".join(
        f"-N{n}" + (f" -c{c}" if c else "") for n, c in zip(nodes, cpus, strict=True)
    )


def check_fit(alloc: Allocation, plan: JobPlan, cpus_per_task: Sequence[int] = ()) -> None:
    """Raise AllocationShapeError unless the allocation has the plan's het groups with its node counts and,
    when `cpus_per_task` (the config's, one per group in plan order) is given, at least that many CPUs on
    every node of each group (the steps run one task per node with --cpus-per-task; fewer CPUs fail at srun
    with "More processors requested than permitted"). A group whose CPU count Slurm did not set is not
    checked."""
    hint = salloc_hint(plan, cpus_per_task)
    want = [g.nodes for g in plan.groups]
    have = [len(g) for g in alloc.groups]
    if plan.het_size > 1 and not alloc.heterogeneous:
        raise AllocationShapeError(
            f"config {plan.name!r} is a heterogeneous job with groups "
            f"{', '.join(f'{g.name}={g.nodes} node(s)' for g in plan.groups)}, but allocation {alloc.job_id} "
            f"is not a het job ({have[0]} node(s) {','.join(alloc.groups[0])}): allocate with `{hint} ...`"
        )
    if have != want:
        detail = "; ".join(
            f"het group {i} ({g.name}) needs {g.nodes} node(s)"
            + (f", has {have[i]} ({','.join(alloc.groups[i])})" if i < len(have) else ", missing")
            for i, g in enumerate(plan.groups)
        )
        raise AllocationShapeError(
            f"allocation {alloc.job_id} does not fit config {plan.name!r}: {detail}; "
            f"the allocation has {len(have)} group(s) of {have} node(s): allocate with `{hint} ...`"
        )
    short = [
        f"het group {i} ({g.name}): cpus_per_task is {config_cpus} in the config, {alloc_cpus} in the allocation "
        f"(the fewest CPUs on one of its nodes, {cpus_variable(alloc.heterogeneous, i)}; its steps run one "
        "task per node)"
        for i, (g, config_cpus, alloc_cpus) in enumerate(
            zip(plan.groups, cpus_per_task, alloc.cpus_per_node, strict=False)
        )
        if alloc_cpus is not None and alloc_cpus < config_cpus
    ]
    if short:
        raise AllocationShapeError(
            f"allocation {alloc.job_id} does not fit config {plan.name!r}: {'; '.join(short)}: "
            f"allocate with `{hint} ...`"
        )


def step_argvs(spec: JobSpec, srun: str = "srun") -> list[tuple[str, list[str]]]:
    """(component name, srun argv) per component: the batch script's steps (sbatch_templates/_control.sh.j2),
    plus `--disable-status` (one Ctrl-C forwards SIGINT to the guards)."""
    logs = f"{spec.run_dir.rstrip('/')}/logs"
    out = []
    for c in spec.components:
        argv = [srun]
        if spec.shape == "heterogeneous":
            argv.append(f"--het-group={c.het_group}")
        argv += [f"--nodes={c.nodes}", f"--ntasks={c.nodes}", "--ntasks-per-node=1"]
        argv.append(f"--cpus-per-task={c.cpus_per_task}")
        if c.gpus_per_node:
            argv.append(f"--gpus-per-node={c.gpus_per_node}")
        if c.overlap:
            argv.append("--overlap")
        argv += ["--kill-on-bad-exit=1", "--mpi=none", "--unbuffered", "--disable-status"]
        argv.append("--output=" + logs.replace("%", "%%") + "/" + STEP_LOG_PATTERN.format(name=c.name))
        argv += [spec.launcher, "--het-group", str(c.het_group), "--component", c.name]
        argv += ["--roles", ",".join(c.roles), "--run-dir", spec.run_dir, "--secret-file", spec.secret_file]
        argv += ["--", *spec.guard_command]
        out.append((c.name, argv))
    return out


class _Follower:
    """Prints new lines of the child logs (`[host role-index] line`), the step logs (`[component step]`) and
    the guards' spawn/exit events (`[host guard]`); files that exist at the start are followed from their end."""

    def __init__(self, run_dir: Path, out: TextIO) -> None:
        self.run_dir, self.out = run_dir, out
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        for path, _ in self._files():
            self.offsets[path] = path.stat().st_size if path.exists() else 0

    def _files(self) -> list[tuple[Path, str]]:
        files = [(log.path, log.prefix) for log in find_child_logs(self.run_dir)]
        logs = self.run_dir / LOGS_DIR
        files += [(p, f"[{p.name.split('.')[0]} step]") for p in sorted(logs.glob("*.debug.t*.log"))]
        events = self.run_dir / EVENTS_DIR
        files += [(p, "") for p in sorted(events.glob(f"*{EVENTS_SUFFIX}"))] if events.is_dir() else []
        return files

    def poll(self) -> None:
        for path, prefix in self._files():
            try:
                size = path.stat().st_size
            except OSError:
                continue
            start = self.offsets.get(path, 0)
            if size <= start:
                continue
            with open(path, "rb") as fh:
                fh.seek(start)
                data = self.partial.get(path, b"") + fh.read(size - start)
            self.offsets[path] = size
            cut = data.rfind(b"\n") + 1
            self.partial[path] = data[cut:]
            for raw in data[:cut].splitlines():
                line = raw.decode("utf-8", errors="replace")
                text = _event_line(line) if not prefix else f"{prefix} {line}"
                if text:
                    self.out.write(text + "\n")
        self.out.flush()


def _event_line(line: str) -> str | None:
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    kind, host = ev.get("event"), ev.get("host")
    who = f"{ev.get('role')}-{ev.get('index')}"
    if kind == "guard_ready":
        return f"[{host} guard] ready at {ev.get('url')}"
    if kind == "spawn":
        ports = ", ".join(f"{k}={v}" for k, v in (ev.get("ports") or {}).items()) or "no ports"
        return f"[{host} guard] started {who}: pid {ev.get('pid')}, {ports}"
    if kind == "exit":
        how = f"signal {ev['signal']}" if ev.get("signal") else f"exit code {ev.get('exit_code')}"
        return f"[{host} guard] {who} ended: {how}"
    if kind in ("plan_failed", "plan_spawn_failed", "guard_signal", "guard_stop"):
        detail = ev.get("error") or ev.get("signal") or ev.get("code") or ""
        return f"[{host} guard] {kind.replace('_', ' ')} {detail}".rstrip()
    return None


def run_steps(
    steps: Sequence[tuple[str, Sequence[str]]],
    run_dir: Path,
    *,
    environ: Mapping[str, str],
    out: TextIO,
    python: str = sys.executable,
    stop_wait_s: float = DEFAULT_STOP_WAIT_S,
    end_grace_s: float = DEFAULT_END_GRACE_S,
    poll_s: float = _POLL_S,
) -> int:
    """Start every step (srun argv) in the foreground, print the run's logs live, and stop them all when one
    fails or on Ctrl-C (module docstring).

    A step that ends with code 0 (the trainer after its last step) does not stop the others at once: they
    get `end_grace_s` seconds to end on their own (the actor announced the job end in
    run_dir/state/job_end.json, records/job_end.py; their servers stop on it). Only the steps still running
    after that get SIGINT, and their exit codes (130 after that SIGINT) do not count as failures.

    Returns:
        130 after Ctrl-C; else the exit code of the first step that failed on its own (0 when every step
        ended 0, or was stopped only after another step's clean end).
    """
    follower = _Follower(run_dir, out)
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    wrapper = [python, "-S", str(PDEATH_EXEC), str(os.getpid()), str(int(signal.SIGTERM))]
    interrupts: list[float] = []
    previous = {
        s: signal.signal(s, lambda n, _f: interrupts.append(time.monotonic()))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    stop_at: float | None = None  # set once the steps were told to stop (SIGINT): when to escalate
    grace_until: float | None = None  # set when a step ended 0: until when the others may end on their own
    clean_end: str | None = None  # the step whose code 0 started the grace period
    after_clean_end: set[str] = set()  # steps stopped after that clean end (their codes are not failures)
    ended: set[str] = set()
    escalated = 0
    first_rc: int | None = None

    def stop_all(signum: int) -> None:
        for _, proc in procs:
            if proc.poll() is None:
                killpg_quiet(proc.pid, signum)

    def start_stop(message: str) -> None:
        nonlocal stop_at
        print(f"[debug run] {message}", file=out, flush=True)
        stop_all(signal.SIGINT)
        stop_at = time.monotonic() + stop_wait_s

    def note_ended() -> None:
        """Act on the steps that ended since the last call (a failure stops the others, a clean end starts
        the grace period)."""
        nonlocal first_rc, clean_end, grace_until
        for name, proc in procs:
            rc = proc.poll()
            if rc is None or name in ended:
                continue
            ended.add(name)
            if stop_at is not None:
                continue  # stopping already: this step ended on the SIGINT (or escalation)
            running = any(p.poll() is None for _, p in procs)
            if rc != 0:
                first_rc = rc if first_rc is None else first_rc
                start_stop(f"the step of {name} ended with code {rc}" + (": stopping the others" * running))
            elif grace_until is None and running:
                clean_end, grace_until = name, time.monotonic() + end_grace_s
                print(
                    f"[debug run] the step of {name} ended with code 0: the others get {end_grace_s:g} s "
                    "to end on their own (the job end is announced in the run dir)",
                    file=out,
                    flush=True,
                )

    try:
        for name, argv in steps:
            program = shutil.which(argv[0], path=environ.get("PATH"))
            if program is None:
                raise DebugSessionError(f"{argv[0]} is not on PATH: mopd-debug run needs Slurm's srun")
            proc = subprocess.Popen(
                [*wrapper, program, *argv[1:]],
                env=dict(environ),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            procs.append((name, proc))
            print(f"[debug run] started the step of {name}: srun pid {proc.pid}", file=out, flush=True)
        handled = 0
        while any(p.poll() is None for _, p in procs):
            follower.poll()
            if len(interrupts) > handled:
                handled = len(interrupts)
                if stop_at is None:
                    start_stop("interrupted: stopping the guards (SIGINT)")
                else:
                    stop_at = time.monotonic()  # a second Ctrl-C: escalate now
            note_ended()
            if stop_at is None and grace_until is not None and time.monotonic() >= grace_until:
                after_clean_end = {n for n, p in procs if p.poll() is None}
                start_stop(
                    f"{', '.join(sorted(after_clean_end))} still running {end_grace_s:g} s after the step of "
                    f"{clean_end} ended with code 0: stopping them (SIGINT; not counted as a failure)"
                )
            if stop_at is not None and time.monotonic() >= stop_at:
                escalated += 1
                sig = signal.SIGTERM if escalated == 1 else signal.SIGKILL
                print(f"[debug run] steps still running: sending {sig.name} to srun", file=out, flush=True)
                stop_all(sig)
                stop_at = time.monotonic() + 10.0
            time.sleep(poll_s)
        note_ended()
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                killpg_quiet(proc.pid, signal.SIGKILL)
            proc.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    follower.poll()
    codes = {name: proc.returncode for name, proc in procs}
    note = (
        f" ({', '.join(sorted(after_clean_end))}: stopped after the clean end of {clean_end}, not a failure)"
        if after_clean_end
        else ""
    )
    print(f"[debug run] done: step exit codes {codes}{note}", file=out, flush=True)
    if interrupts:
        return EXIT_INTERRUPTED
    if first_rc:
        return first_rc
    return next((rc for name, rc in codes.items() if rc and name not in after_clean_end), 0)
