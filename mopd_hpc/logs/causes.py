"""Named failure causes: a table of text patterns, most specific first (STYLE.md rule 7).

`classify_text(lines)` returns the first cause whose pattern matches, trying each pattern in table order over
all lines, so an `OSError: [Errno 98]` under a generic `RuntimeError` is still "address already in use".
Signals and exit codes are causes too (`signal_cause`, `exit_cause`), built from guard events, not text.
Signatures come from launchers.md §4.5 item 3 and the project's own exception names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CausePattern:
    """One row of the table: `key` (stable, in --json), `title` (for people), `pattern` (a regex on one line)."""

    key: str
    title: str
    pattern: re.Pattern[str]


def _p(text: str) -> re.Pattern[str]:
    return re.compile(text)


#: The table, most specific first. Keys are part of the --json schema (docs/en/logs.md).
CAUSE_PATTERNS: tuple[CausePattern, ...] = (
    CausePattern(
        "address_in_use", "address already in use", _p(r"Address already in use|EADDRINUSE|\[Errno 98\]")
    ),
    CausePattern(
        "cuda_oom",
        "CUDA out of memory",
        _p(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation"),
    ),
    CausePattern(
        "invalid_device_ordinal",
        "invalid device ordinal",
        _p(r"invalid device ordinal|CUDA_ERROR_INVALID_DEVICE|cudaErrorInvalidDevice"),
    ),
    CausePattern(
        "nccl",
        "NCCL error or timeout",
        _p(
            r"NCCL (?:error|WARN|timeout)|nccl\w*Error|ncclUnhandled|ncclSystemError|ncclInternalError|"
            r"Watchdog caught collective operation timeout|DistBackendError|ProcessGroupNCCL.*[Tt]ime"
        ),
    ),
    CausePattern(
        "tokenizer_mismatch",
        "tokenizer mismatch",
        _p(r"TokenizerMismatchError|does not share the tokenizer|tokenizer mismatch"),
    ),
    CausePattern(
        "port_lease_denied",
        "port lease denied",
        _p(r"PortLeaseError|PortInUseError|PortsExhaustedError|port lease (?:denied|failed)"),
    ),
    CausePattern(
        "guard_unreachable",
        "guard unreachable",
        _p(r"GuardUnreachableError|guard (?:is )?unreachable"),
    ),
    CausePattern("time_limit", "time limit", _p(r"DUE TO TIME LIMIT")),
    CausePattern("preempted", "preempted/requeued", _p(r"DUE TO PREEMPTION|DUE TO JOB REQUEUE")),
    CausePattern("host_oom", "host out of memory (OOM killer)", _p(r"oom-kill|Out Of Memory|OUT_OF_MEMORY")),
    CausePattern(
        "config_error",
        "config error",
        _p(r"ConfigError|TopologyError|RuleViolation|ValidationError|CompatibilityError|ModelFilesError"),
    ),
)
#: Keys that are not text patterns.
KILLED_BY_SIGNAL = "killed_by_signal"
INTERRUPTED = "interrupted"  # SIGINT to the guards (Ctrl-C)
EXCEPTION = "exception"
EXIT_CODE = "exit_code"
STEP_FAILED = "step_failed"
UNKNOWN = "unknown"
#: Every cause key the summarizer may report.
CAUSE_KEYS = (
    *(c.key for c in CAUSE_PATTERNS),
    KILLED_BY_SIGNAL,
    INTERRUPTED,
    EXCEPTION,
    EXIT_CODE,
    STEP_FAILED,
    UNKNOWN,
)
#: A Python exception line: `pkg.mod.SomeError: message` or a bare `KeyboardInterrupt`.
EXCEPTION_LINE_RE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\w*)(?::\s?(?P<msg>.*))?$"
)


@dataclass(frozen=True, slots=True)
class Cause:
    """A named cause. `key` is from CAUSE_KEYS; `title` reads "CUDA out of memory", "killed by signal 9
    (SIGKILL)"; `evidence` is the line that matched (or the event that decided), `None` when nothing did."""

    key: str
    title: str
    evidence: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {"key": self.key, "title": self.title, "evidence": self.evidence}


def classify_text(lines: Iterable[str]) -> Cause | None:
    """The first table cause matching any of `lines` (table order first, then line order); None if none."""
    lines = list(lines)
    for row in CAUSE_PATTERNS:
        for line in lines:
            if row.pattern.search(line):
                return Cause(row.key, row.title, line.strip())
    return None


def exception_cause(lines: Iterable[str]) -> Cause | None:
    """A generic cause from the last Python exception line among `lines` ("unhandled ValueError")."""
    found = None
    for line in lines:
        match = EXCEPTION_LINE_RE.match(line.strip())
        if match:
            found = match
    if found is None:
        return None
    return Cause(EXCEPTION, f"unhandled {found['type'].rsplit('.', 1)[-1]}", found.group(0))


def signal_cause(signal_name: str, signum: int | None) -> Cause:
    """`killed by signal 9 (SIGKILL)`."""
    number = f"{signum} " if signum is not None else ""
    return Cause(
        KILLED_BY_SIGNAL, f"killed by signal {number}({signal_name})".replace(" ()", ""), signal_name
    )


def exit_cause(exit_code: int) -> Cause:
    return Cause(EXIT_CODE, f"exited with code {exit_code}", f"exit_code={exit_code}")


def guard_signal_cause(name: str) -> Cause:
    """The cause of a stop by a signal to the guards, worded by the signal: SIGINT is Ctrl-C (key
    "interrupted"), anything else Slurm's scancel, preemption or time limit (key "killed_by_signal")."""
    if name == "SIGINT":
        return Cause(INTERRUPTED, "interrupted (Ctrl-C)", f"guard got {name}")
    cause = signal_cause(name, None)
    return Cause(cause.key, f"guard got {name} (scancel, preemption or time limit)", cause.evidence)
