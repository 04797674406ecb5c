"""`FirstFailure`, the frozen record of a run's first failure (`failure.find_first_failure` decides it), with the
evidence it carries (STYLE.md rule 9: the log that shows it and that log's tail)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mopd_hpc.logs.causes import Cause

#: Lines of the failing log shown as evidence (STYLE.md rule 9).
EVIDENCE_TAIL_LINES = 40


@dataclass(frozen=True, slots=True)
class FirstFailure:
    """The earliest failure. Child fields are None when the failure is not a child's (time limit, guard).

    Attributes:
        source: what decided: "events", "slurm_signal", "guard", "batch_state", "sacct" or "logs".
        traceback: the fatal traceback, bounded (scan.TB_HEAD_LINES + TB_TAIL_LINES lines).
        same_on: labels of the other children whose fatal traceback is the same after normalization.
        cascade: (label, cause key) of the later failing children, in time order.
        log_path / log_tail: the log that shows it and its last EVIDENCE_TAIL_LINES lines.
    """

    cause: Cause
    source: str
    host: str | None = None
    role: str | None = None
    index: int | None = None
    generation: int | None = None
    ts: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    exception: str | None = None
    traceback: tuple[str, ...] = ()
    same_on: tuple[str, ...] = ()
    cascade: tuple[tuple[str, str], ...] = ()
    log_path: str | None = None
    log_tail: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause.to_dict(),
            "source": self.source,
            "host": self.host,
            "role": self.role,
            "index": self.index,
            "generation": self.generation,
            "ts": self.ts,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "exception": self.exception,
            "traceback": list(self.traceback),
            "same_on": list(self.same_on),
            "same_on_count": len(self.same_on),
            "cascade": [{"child": label, "cause": key} for label, key in self.cascade],
            "log_path": self.log_path,
            "log_tail": list(self.log_tail),
        }
