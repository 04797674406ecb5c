"""What one Slurm job asks for: a frozen, validated record that `render` turns into an sbatch script.

A `JobSpec` is independent of the run config (the lead's `jobspec_from_config(RunConfig)` builds it), so
rendering is testable without YAML. Shapes (DESIGN.md §1, sbatch_templates/):

- ``heterogeneous``: a Slurm het job, one `Component` per het group (component 0 = `trainer`, the actor and
  teachers; component 1 = `rollout`), each with its own `#SBATCH` block and its own `srun --het-group=N` step;
- ``colocated``: one component, one step, every role on the same nodes.

Every string that reaches an `#SBATCH` line is checked here for what sbatch's directive parser cannot
carry (newlines, NUL, backslashes: it eats them as escapes); everything else is quoted by `render`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Literal

#: Default `--signal`: USR2 to the batch shell 120 s before the time limit (submitit's signal; NCCL may catch USR1).
DEFAULT_SIGNAL = "B:USR2@120"
#: Slurm `--signal=[{R|B}:]<sig_num>[@sig_time]` (sbatch.1); names with or without the SIG prefix, or numbers.
SIGNAL_PATTERN = re.compile(
    r"^(?:(?P<flags>[RB]{1,2}):)?(?:SIG)?(?P<sig>[A-Z][A-Z0-9]*|[0-9]{1,2})(?:@(?P<lead>[0-9]+))?$"
)
#: Signals a batch shell can trap and Slurm can deliver (KILL and STOP cannot be trapped).
TRAPPABLE_SIGNALS = frozenset(
    {"HUP", "INT", "QUIT", "USR1", "USR2", "TERM", "ALRM", "CONT", "URG", "XCPU", "PWR"}
)
#: Slurm's largest signal lead time, in seconds (sbatch.1: "sig_time ... between 0 and 65535").
MAX_SIGNAL_LEAD_S = 65535
#: Component and role names: what the state files and log names may contain unquoted.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")
#: `#SBATCH` options `render` writes itself; `extra_sbatch` setting them again is an error naming the field.
MANAGED_OPTIONS: dict[str, str] = {
    "--job-name": "JobSpec.job_name",
    "--time": "JobSpec.time_min",
    "--signal": "JobSpec.signal",
    "--requeue": "JobSpec.requeue",
    "--no-requeue": "JobSpec.requeue",
    "--open-mode": "JobSpec.requeue (append when requeue is on)",
    "--output": "JobSpec.run_dir (logs go to run_dir/logs)",
    "--error": "JobSpec.run_dir (logs go to run_dir/logs)",
    "--nodes": "Component.nodes",
    "--ntasks": "nothing (one guard per node, fixed)",
    "--ntasks-per-node": "nothing (one guard per node, fixed)",
    "--cpus-per-task": "Component.cpus_per_task",
    "--mem": "Component.mem_gb",
    "--gpus-per-node": "Component.gpus_per_node",
    "--partition": "Component.partition",
    "--account": "Component.account",
    "--qos": "Component.qos",
    "--het-group": "Component.het_group",
    "--hetjob": "JobSpec.shape",
}
_OPTION_PATTERN = re.compile(r"^--[a-z][a-z0-9-]*(=.*)?$")


class JobSpecError(ValueError):
    """A JobSpec field cannot be rendered into a working sbatch script; the message names field and value."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Component:
    """One het group of the job: the nodes of one `#SBATCH` block and the one step that runs on them.

    Attributes:
        het_group: index of the component in the het job (0, 1, ...); 0 for a colocated job.
        name: `trainer`, `rollout`, or the colocated group's name; names its log files and state records.
        nodes: nodes in the component (one guard task per node).
        gpus_per_node: GPUs per node (0 = CPU only; no `--gpus-per-node` line then).
        cpus_per_task: CPUs of the guard task on each node (its children share them).
        mem_gb: memory per node, in GB (fractions become MB); None = the partition default.
        partition, account, qos: Slurm names; None = the cluster/user default.
        roles: the roles this component's guards host, e.g. ("actor", "teacher"); exported as MOPD_ROLES.
        overlap: give the step `--overlap` (share resources with other steps on purpose); default False:
            every step owns its component, so concurrent steps never wait for each other.
        extra_sbatch: more `#SBATCH` options for this component only, e.g. ("--constraint=h200",).
    """

    het_group: int
    name: str
    nodes: int
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    roles: tuple[str, ...] = ()
    overlap: bool = False
    extra_sbatch: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "extra_sbatch", tuple(self.extra_sbatch))
        where = f"component {self.name!r}"
        _check_int(f"{where}.het_group", self.het_group, low=0)
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name):
            raise JobSpecError(
                f"Component.name={self.name!r}: expected a lower-case identifier like 'trainer'"
            )
        _check_int(f"{where}.nodes", self.nodes, low=1)
        _check_int(f"{where}.gpus_per_node", self.gpus_per_node, low=0)
        _check_int(f"{where}.cpus_per_task", self.cpus_per_task, low=1)
        if self.mem_gb is not None and (
            isinstance(self.mem_gb, bool) or not isinstance(self.mem_gb, int | float) or not self.mem_gb > 0
        ):
            raise JobSpecError(f"{where}.mem_gb={self.mem_gb!r}: expected a positive number of GB or None")
        for key in ("partition", "account", "qos"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value or not value.isprintable()):
                raise JobSpecError(
                    f"{where}.{key}={value!r}: expected a non-empty printable Slurm name or None"
                )
            if isinstance(value, str) and "\\" in value:
                raise JobSpecError(f"{where}.{key}={value!r}: sbatch drops backslashes from #SBATCH lines")
        for role in self.roles:
            if not isinstance(role, str) or not NAME_PATTERN.match(role):
                raise JobSpecError(f"{where}.roles contains {role!r}: expected lower-case identifiers")
        _check_extra_sbatch(f"{where}.extra_sbatch", self.extra_sbatch)

    @property
    def mem_option(self) -> str | None:
        """The `--mem` value: whole GB as "NG", fractions as whole MB ("1536M"); None when unset."""
        if self.mem_gb is None:
            return None
        if float(self.mem_gb).is_integer():
            return f"{int(self.mem_gb)}G"
        return f"{max(1, round(self.mem_gb * 1024))}M"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """One sbatch job: its components, limits, signal policy, and what each node runs.

    Build it with `JobSpec.heterogeneous(...)`, `JobSpec.colocated(...)` or the constructor; all validate.

    Attributes:
        job_name: Slurm job name (`--job-name`); any printable text (it is quoted).
        run_dir: absolute run directory shared by every node; logs go to run_dir/logs, state records
            (first_failure.json, last_signal.json, requeue.json) to run_dir/state.
        shape: "heterogeneous" (>= 2 components, a het job) or "colocated" (exactly 1 component).
        components: in het-group order; `components[i].het_group == i`.
        time_min: time limit, in minutes.
        signal: Slurm `--signal` value, `[B:|R:]SIG[@lead_s]`; with `B:` it reaches the batch shell, which
            forwards it to the steps with `scancel --signal` (never to its own srun processes).
        requeue: `--requeue --open-mode=append`, and `scontrol requeue` after the signal while
            SLURM_RESTART_COUNT < max_requeues; False: `--no-requeue`.
        max_requeues: most requeues, counted by SLURM_RESTART_COUNT.
        requeue_on_term: also requeue after SIGTERM. Off by default: a plain `scancel` delivers SIGTERM too,
            and requeueing then would revive a job its user cancelled (Slurm's PreemptMode=REQUEUE requeues
            preempted jobs itself).
        stop_grace_s: after the first step ends (or fails), seconds the other steps get after SIGTERM
            before the batch script exits (Slurm then kills what is left).
        checkpoint_grace_s: after the signal, seconds the steps get to checkpoint and exit before the
            batch script requeues/exits; keep it below the signal's lead time.
        launcher: absolute path of `launchers/node.sh` as the nodes see it.
        guard_command: argv of the node guard, e.g. ("/venv/bin/mopd-guard",); node.sh appends
            `--run-dir DIR --job-id ID`.
        secret_file: absolute path of the job's 0600 token file (exported to the guard as MOPD_SECRET_FILE;
            the token itself never appears in the script).
        extra_sbatch: job-level `#SBATCH` options, written in component 0's block (e.g. "--mail-type=END").
    """

    job_name: str
    run_dir: str
    shape: Literal["heterogeneous", "colocated"]
    components: tuple[Component, ...]
    launcher: str
    guard_command: tuple[str, ...]
    secret_file: str
    time_min: int = 60
    signal: str = DEFAULT_SIGNAL
    requeue: bool = True
    max_requeues: int = 3
    requeue_on_term: bool = False
    stop_grace_s: int = 20
    checkpoint_grace_s: int = 90
    extra_sbatch: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("components", "guard_command", "extra_sbatch"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("run_dir", "launcher", "secret_file"):
            object.__setattr__(self, name, str(getattr(self, name)))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.job_name, str) or not self.job_name or not self.job_name.isprintable():
            raise JobSpecError(f"JobSpec.job_name={self.job_name!r}: expected non-empty printable text")
        if "\\" in self.job_name:
            raise JobSpecError(
                f"JobSpec.job_name={self.job_name!r}: sbatch drops backslashes from #SBATCH lines"
            )
        for name in ("run_dir", "launcher", "secret_file"):
            _check_path(f"JobSpec.{name}", getattr(self, name))
        if self.shape not in ("heterogeneous", "colocated"):
            raise JobSpecError(f"JobSpec.shape={self.shape!r}: expected 'heterogeneous' or 'colocated'")
        count = len(self.components)
        if self.shape == "colocated" and count != 1:
            raise JobSpecError(f"JobSpec.components has {count} components: a colocated job has exactly 1")
        if self.shape == "heterogeneous" and count < 2:
            raise JobSpecError(
                f"JobSpec.components has {count} component(s): a heterogeneous job has >= 2 "
                "(use shape='colocated' for one)"
            )
        for index, component in enumerate(self.components):
            if not isinstance(component, Component):
                raise JobSpecError(f"JobSpec.components[{index}]={component!r}: expected a Component")
            if component.het_group != index:
                raise JobSpecError(
                    f"JobSpec.components[{index}].het_group={component.het_group}: expected {index} "
                    "(components are listed in het-group order)"
                )
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise JobSpecError(f"JobSpec.components names {names}: expected unique names")
        if not self.guard_command or not all(isinstance(a, str) and a for a in self.guard_command):
            raise JobSpecError(f"JobSpec.guard_command={self.guard_command!r}: expected a non-empty argv")
        if any("\0" in a for a in self.guard_command):
            raise JobSpecError(f"JobSpec.guard_command={self.guard_command!r}: NUL cannot be passed in argv")
        _check_int("JobSpec.time_min", self.time_min, low=1)
        _check_int("JobSpec.max_requeues", self.max_requeues, low=0)
        _check_int("JobSpec.stop_grace_s", self.stop_grace_s, low=1)
        _check_int("JobSpec.checkpoint_grace_s", self.checkpoint_grace_s, low=1)
        for name in ("requeue", "requeue_on_term"):
            if not isinstance(getattr(self, name), bool):
                raise JobSpecError(f"JobSpec.{name}={getattr(self, name)!r}: expected True or False")
        match = SIGNAL_PATTERN.match(self.signal) if isinstance(self.signal, str) else None
        if match is None:
            raise JobSpecError(
                f"JobSpec.signal={self.signal!r}: expected [B:|R:]SIG[@SECONDS], e.g. {DEFAULT_SIGNAL!r}"
            )
        sig = match["sig"]
        if not sig.isdigit() and sig not in TRAPPABLE_SIGNALS:
            raise JobSpecError(
                f"JobSpec.signal={self.signal!r}: {sig} cannot be trapped by the batch shell; "
                f"expected one of {sorted(TRAPPABLE_SIGNALS)}"
            )
        if sig.isdigit() and int(sig) in (9, 19):
            raise JobSpecError(f"JobSpec.signal={self.signal!r}: signal {sig} (KILL/STOP) cannot be trapped")
        if match["lead"] is not None and int(match["lead"]) > MAX_SIGNAL_LEAD_S:
            raise JobSpecError(
                f"JobSpec.signal={self.signal!r}: lead time above Slurm's {MAX_SIGNAL_LEAD_S} s"
            )
        if self.signal_lead_s >= self.time_min * 60:
            raise JobSpecError(
                f"JobSpec.signal={self.signal!r} fires {self.signal_lead_s} s before the end of a "
                f"{self.time_min}-minute job, i.e. at its start: expected a lead below time_min"
            )
        _check_extra_sbatch("JobSpec.extra_sbatch", self.extra_sbatch)

    @classmethod
    def heterogeneous(
        cls, *, job_name: str, run_dir: str, trainer: Component, rollout: Component, **kwargs: object
    ) -> JobSpec:
        """A two-component het job: het group 0 = `trainer`, het group 1 = `rollout`.

        Raises:
            JobSpecError: a field cannot be rendered (see the class docstring).
        """
        return cls(
            job_name=job_name, run_dir=run_dir, shape="heterogeneous", components=(trainer, rollout), **kwargs
        )  # type: ignore[arg-type]

    @classmethod
    def colocated(cls, *, job_name: str, run_dir: str, component: Component, **kwargs: object) -> JobSpec:
        """A one-component job where every role shares the nodes.

        Raises:
            JobSpecError: a field cannot be rendered (see the class docstring).
        """
        return cls(job_name=job_name, run_dir=run_dir, shape="colocated", components=(component,), **kwargs)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> JobSpec:
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def signal_name(self) -> str:
        """The signal without flags, lead time or SIG prefix: "USR2" (or its number, as given)."""
        match = SIGNAL_PATTERN.match(self.signal)
        assert match is not None  # validated
        return match["sig"]

    @property
    def signal_lead_s(self) -> int:
        """Seconds before the time limit that Slurm sends the signal (Slurm's default: 60)."""
        match = SIGNAL_PATTERN.match(self.signal)
        assert match is not None  # validated
        return int(match["lead"]) if match["lead"] is not None else 60

    @property
    def signals_batch_shell(self) -> bool:
        """Whether Slurm sends the signal to the batch shell (`B:`), which then forwards it to the steps."""
        match = SIGNAL_PATTERN.match(self.signal)
        assert match is not None  # validated
        return "B" in (match["flags"] or "")


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise JobSpecError(f"{name}={value!r}: expected an integer >= {low}")


def _check_path(name: str, value: str) -> None:
    if not value or not PurePosixPath(value).is_absolute():
        raise JobSpecError(
            f"{name}={value!r}: expected an absolute path (every node resolves it the same way)"
        )
    bad = [c for c in value if c in "\\\0" or not c.isprintable()]
    if bad:
        raise JobSpecError(
            f"{name}={value!r} contains {bad[0]!r}: sbatch's #SBATCH parser cannot carry newlines, "
            "control characters or backslashes; choose another directory"
        )


def _check_extra_sbatch(name: str, options: tuple[str, ...]) -> None:
    for index, option in enumerate(options):
        if not isinstance(option, str) or not _OPTION_PATTERN.match(option) or not option.isprintable():
            raise JobSpecError(
                f"{name}[{index}]={option!r}: expected one long option like '--constraint=h200'"
            )
        if "\\" in option:
            raise JobSpecError(f"{name}[{index}]={option!r}: sbatch drops backslashes from #SBATCH lines")
        flag = option.split("=", 1)[0]
        if flag in MANAGED_OPTIONS:
            raise JobSpecError(f"{name}[{index}]={option!r}: {flag} is rendered from {MANAGED_OPTIONS[flag]}")
