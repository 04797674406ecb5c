"""Named failure causes: a table of text patterns, most specific first (STYLE.md rule 7).

`classify_text(lines)` returns the first cause whose pattern matches, trying each pattern in table order over
all lines, so an `OSError: [Errno 98]` under a generic `RuntimeError` is still "address already in use".
Only exception lines (`pkg.SomeError: message`, with their indented continuation) and log lines are matched,
never the frames of a traceback (`  File "..."` and the quoted source under it, e.g. `raise HFValidationError(`).
Signals and exit codes are causes too (`signal_cause`, `exit_cause`), built from guard events, not text.
Signatures come from launchers.md §4.5 item 3 and the project's own exception names.
"""

from __future__ import annotations

import re
import signal as signal_mod
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
        "peer_lost",
        "a peer rank was lost first (connection closed or collective timed out)",
        _p(
            r"PeerLostError|Connection closed by peer|Connection reset by peer|gloo.*(?:Timed out|timed out)|"
            r"rank 0's store is unreachable"
        ),
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
    CausePattern(
        "cancelled", "cancelled (scancel)", _p(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT (?!.*DUE TO)")
    ),
    CausePattern("host_oom", "host out of memory (OOM killer)", _p(r"oom-kill|Out Of Memory|OUT_OF_MEMORY")),
    CausePattern(
        "model_path",
        "model path missing or invalid",
        _p(
            r"HFValidationError|Repo id must be in the form|is not a local folder and is not a valid model "
            r"identifier|does not appear to have a file named|Incorrect path_or_model_id|\bModelFilesError\b"
        ),
    ),
    CausePattern(
        "config_error",
        "config error",
        _p(r"\b(?:\w*ConfigError|TopologyError|RuleViolation|ValidationError|CompatibilityError)\b"),
    ),
)
#: Causes that are, as a rule, the consequence of another rank's failure: a rank that lost its peer (its
#: gloo connection closed, a collective timed out waiting, rank 0's store gone) fails AFTER the rank that
#: died, so the summarizer names the failure that is not one of these first (`logs/failure.py`).
CONSEQUENCE_KEYS = frozenset({"peer_lost"})
#: Keys that are not text patterns.
KILLED_BY_SIGNAL = "killed_by_signal"
INTERRUPTED = "interrupted"  # SIGINT to the guards (Ctrl-C)
TERMINATED = "terminated"  # another stop signal to a local run's guard (SIGTERM to mopd-submit --local)
GUARD_DIED = "guard_died"  # the guard process ended without stopping (SIGKILL, crash)
EXCEPTION = "exception"
EXIT_CODE = "exit_code"
STEP_FAILED = "step_failed"
UNKNOWN = "unknown"
#: Every cause key the summarizer may report.
CAUSE_KEYS = (
    *(c.key for c in CAUSE_PATTERNS),
    KILLED_BY_SIGNAL,
    INTERRUPTED,
    TERMINATED,
    GUARD_DIED,
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


#: A traceback frame line, `  File "x.py", line 3, in f` (after an optional torch `[rank0]: ` prefix).
_FRAME_RE = re.compile(r'^(?:\[rank\d+\]:)?\s+File "')
_RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]:")


def message_lines(lines: Iterable[str]) -> list[str]:
    """`lines` without the frames of a traceback: a `File "..."` line and the indented lines under it (the
    quoted source and its `^^^^` markers) are dropped; exception lines, their indented continuation and log
    lines stay."""
    out, in_frame = [], False
    for line in lines:
        if _FRAME_RE.match(line) or line.startswith("... ("):  # a frame, or scan's cut marker inside one
            in_frame = True
            continue
        body = _RANK_PREFIX_RE.sub("", line, count=1)
        if in_frame and body[:1].isspace():
            continue
        in_frame = False
        out.append(line)
    return out


def model_path_of(line: str) -> str | None:
    """The absolute path in a model loader's message: the last quoted one (`... repo_name': '/models/nope'.`),
    else the first unquoted one (`OSError: /models/x does not appear to have a file named config.json`)."""
    quoted = re.findall(r"""['"](/[^'"]+)['"]""", line)
    if quoted:
        return quoted[-1]
    bare = re.search(r"""(?:^|[\s:])(/[^\s'"]+)""", line)
    return bare.group(1) if bare else None


def classify_text(lines: Iterable[str]) -> Cause | None:
    """The first table cause matching any of `lines` (table order first, then line order); None if none.

    Traceback frames are skipped (`message_lines`). A `model_path` cause names the path in its title."""
    lines = message_lines(lines)
    for row in CAUSE_PATTERNS:
        for line in lines:
            if row.pattern.search(line):
                title = row.title
                if row.key == "model_path" and (path := model_path_of(line)) is not None:
                    title = f"{title}: {path}"
                return Cause(row.key, title, line.strip())
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


#: sacct's state of a job someone cancelled: "CANCELLED by 1000" (the uid of who ran scancel).
_CANCELLED_BY_RE = re.compile(r"^CANCELLED by (?P<uid>\d+)")


def cancelled_cause(states: Iterable[tuple[str, str]], text_cause: Cause | None) -> Cause | None:
    """The job was cancelled (scancel): sacct's `CANCELLED by UID` on a component ((component id, state) in
    `states`; the uid is named), or slurmstepd's `*** JOB N ON host CANCELLED AT ... ***` without a DUE TO
    reason (`text_cause` of key "cancelled"); None otherwise. A bare `CANCELLED` step state is not enough (the
    steps of a timed-out job are CANCELLED too)."""
    uid, state_of = None, None
    for component_id, state in states:
        match = _CANCELLED_BY_RE.match(state or "")
        if match:
            uid, state_of = match["uid"], f"sacct {component_id} State={state}"
            break
    text = text_cause if text_cause is not None and text_cause.key == "cancelled" else None
    if uid is None and text is None:
        return None
    who = f"by uid {uid}{' (root)' if uid == '0' else ''} " if uid is not None else ""
    evidence = "; ".join(x for x in (text.evidence if text else None, state_of) if x)
    return Cause("cancelled", f"cancelled {who}(scancel)", evidence)


def signal_cause(signal_name: str, signum: int | None) -> Cause:
    """`killed by signal 9 (SIGKILL)`."""
    number = f"{signum} " if signum is not None else ""
    return Cause(
        KILLED_BY_SIGNAL, f"killed by signal {number}({signal_name})".replace(" ()", ""), signal_name
    )


def exit_cause(exit_code: int) -> Cause:
    return Cause(EXIT_CODE, f"exited with code {exit_code}", f"exit_code={exit_code}")


def guard_signal_cause(name: str, local: bool = False) -> Cause:
    """The cause of a stop by a signal to the guards, worded by the signal: SIGINT is Ctrl-C (key
    "interrupted"); on a local run (`local`: no Slurm sends signals there) any other one was sent to
    `mopd-submit --local` (which forwards it) or to the guard (key "terminated"); on Slurm it is scancel,
    preemption or time limit (key "killed_by_signal")."""
    if name == "SIGINT":
        return Cause(INTERRUPTED, "interrupted (Ctrl-C)", f"guard got {name}")
    if local:
        return Cause(
            TERMINATED,
            f"terminated by {name} (sent to mopd-submit --local or its guard)",
            f"guard got {name}",
        )
    cause = signal_cause(name, None)
    return Cause(cause.key, f"guard got {name} (scancel, preemption or time limit)", cause.evidence)


def guard_death_cause(exit_signal: str | None, exit_code: int | None) -> Cause:
    """The guard process ended without its `guard_stop` teardown (its keeper's `guard_exit` event): killed
    by a signal ("guard died: killed by signal 9 (SIGKILL)") or a crash ("guard died: exited with code 1");
    its children were killed with it (their parent-death signal, then the keeper's sweep)."""
    if exit_signal is not None:
        try:
            number = f"{int(signal_mod.Signals[exit_signal])} "
        except KeyError:
            number = ""
        how = f"killed by signal {number}({exit_signal})"
    else:
        how = f"exited with code {exit_code} without stopping its children"
    evidence = "guard_exit " + (f"signal={exit_signal}" if exit_signal else f"exit_code={exit_code}")
    return Cause(GUARD_DIED, f"guard died: {how}", evidence)


def guard_gone_cause() -> Cause:
    """A local guard with neither `guard_stop` nor `guard_exit` whose job no longer holds the run-dir lock
    (runtime/run_lock.py): the guard and its keeper were both killed (SIGKILL of the process group)."""
    return Cause(
        GUARD_DIED,
        "guard died: no guard_stop or guard_exit event, and the job no longer holds its run-dir lock "
        "(the guard and its keeper were killed)",
        "run.lock not held by the job",
    )
