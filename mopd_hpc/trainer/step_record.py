"""The control records rank 0 of the actor group sends to every rank, as binary buffers.

Kinds (`ControlRecord.kind`):

    start   before the first step: `step` = the step the run resumes from (0 for a fresh run); every rank
            loads that checkpoint (trainer/actor_group.py)
    step    one step's rollouts: `step`, the rows (prompt + response token ids), where each response starts,
            each row's route, the behavior log-probs μ of every response token (as the rollout engine gave
            them: kept immutable up to the loss, DESIGN.md §3), the GRPO advantages A_ORM of the whole step
            (group normalization needs every row, so rank 0 computes them; absent when no loss term reads
            them) and the pad id
    stop    the run ends: `step` = steps done, `reason` "finished" or "checkpoint_signal"

Wire format (DESIGN.md §7: tensors as raw bytes with a header, never JSON lists of floats):

    8 bytes   little-endian uint64 n = length of the header
    n bytes   UTF-8 JSON header {"kind", "step", "reason", "routes", "pad_id", "buffers": [[name, dtype,
              count], ...]}
    payload   each buffer's little-endian bytes, in header order: `tokens` int32 (every row concatenated),
              `row_lengths` int32 [B], `starts` int32 [B], `mu` float32 (every response token, rows
              concatenated), `orm` float32 [B] (when present)

`from_bytes(to_bytes(r)) == r` bit for bit (tested). A step record of B rows × L tokens is about
4·(B·L + B·T) bytes: 256 rows of 2,048 tokens is ~3 MB; the teachers' top-k is never in it (each DP rank
fetches its own rows' scores from the teacher servers).

Shape legend: B rows, T response positions.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mopd_hpc.engines.batch import TokenBatch

KINDS = ("start", "step", "stop")
STOP_REASONS = ("finished", "checkpoint_signal")
_DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4")}
_HEADER = struct.Struct("<Q")


class RecordError(ValueError):
    """A control record that is inconsistent (lengths, kind, reason) or bytes that are not one."""


@dataclass(frozen=True, slots=True)
class ControlRecord:
    """One control message of the actor group (module docstring). Build with `start`, `stop` or
    `from_rows`; rows, starts, routes, mu and orm are empty for `start` and `stop`.

    Attributes:
        kind: "start" | "step" | "stop". step: the step (see kinds). reason: the stop's reason, else "".
        rows: prompt + response token ids of each row. starts: index in row b where its response begins.
        routes: each row's route. mu: each row's behavior log-probs (float32 values), one per response token.
        orm: [B] A_ORM as float32 values, or None. pad_id: the padding token id.
    """

    kind: str
    step: int
    reason: str = ""
    rows: tuple[tuple[int, ...], ...] = ()
    starts: tuple[int, ...] = ()
    routes: tuple[str, ...] = ()
    mu: tuple[tuple[float, ...], ...] = ()
    orm: tuple[float, ...] | None = None
    pad_id: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RecordError(f"kind={self.kind!r}: expected one of {KINDS}")
        if self.step < 0:
            raise RecordError(f"step={self.step}: expected >= 0")
        if self.kind == "stop" and self.reason not in STOP_REASONS:
            raise RecordError(f"stop reason={self.reason!r}: expected one of {STOP_REASONS}")
        b = len(self.rows)
        if self.kind == "step" and b == 0:
            raise RecordError(f"step {self.step}: a step record needs at least one row")
        if not len(self.starts) == len(self.routes) == len(self.mu) == b:
            raise RecordError(
                f"step {self.step}: {b} rows but {len(self.starts)} starts, {len(self.routes)} routes and "
                f"{len(self.mu)} behavior log-prob rows; expected one of each per row"
            )
        if self.orm is not None and len(self.orm) != b:
            raise RecordError(f"step {self.step}: {len(self.orm)} ORM advantages for {b} rows")
        for i, (row, start, mu) in enumerate(zip(self.rows, self.starts, self.mu, strict=True)):
            if len(mu) != len(row) - start:
                raise RecordError(
                    f"step {self.step}, row {i}: {len(mu)} behavior log-probs for {len(row) - start} "
                    "response tokens"
                )

    # --------------------------------------------------------------------------------- builders

    @classmethod
    def start(cls, resume_step: int) -> ControlRecord:
        return cls("start", resume_step)

    @classmethod
    def stop(cls, step: int, reason: str) -> ControlRecord:
        return cls("stop", step, reason)

    @classmethod
    def from_rows(
        cls,
        step: int,
        rows: Sequence[Sequence[int]],
        starts: Sequence[int],
        routes: Sequence[str],
        behavior_logprobs: torch.Tensor,
        orm: torch.Tensor | None,
        pad_id: int,
    ) -> ControlRecord:
        """A step record from rank 0's rollouts: behavior_logprobs [B, T] float32 (padding dropped),
        orm [B] float32 or None."""
        lengths = [len(r) - s for r, s in zip(rows, starts, strict=True)]
        mu = behavior_logprobs.detach().float().cpu()
        return cls(
            kind="step",
            step=step,
            rows=tuple(tuple(int(t) for t in r) for r in rows),
            starts=tuple(int(s) for s in starts),
            routes=tuple(routes),
            mu=tuple(tuple(mu[b, :n].tolist()) for b, n in enumerate(lengths)),
            orm=None if orm is None else tuple(orm.detach().float().cpu().tolist()),
            pad_id=pad_id,
        )

    # ------------------------------------------------------------------------------ one shard

    @property
    def response_lengths(self) -> tuple[int, ...]:
        return tuple(len(r) - s for r, s in zip(self.rows, self.starts, strict=True))

    def tokens(self, start: int, stop: int) -> TokenBatch:
        """The `TokenBatch` of rows [start, stop) (padded to their own longest row)."""
        return TokenBatch.from_rows(self.rows[start:stop], self.starts[start:stop], self.pad_id)

    def behavior(self, tokens: TokenBatch, start: int, stop: int) -> torch.Tensor:
        """[b, T] float32 μ of rows [start, stop), padded like `tokens` (0 at padding)."""
        return tokens.pad_response_values(self.mu[start:stop])

    def orm_advantages(self, start: int, stop: int) -> torch.Tensor | None:
        """[b] float32 A_ORM of rows [start, stop), or None."""
        return None if self.orm is None else torch.tensor(self.orm[start:stop], dtype=torch.float32)

    # ------------------------------------------------------------------------------- the wire

    def to_bytes(self) -> bytes:
        """The wire format of the module docstring."""
        buffers: list[tuple[str, str, np.ndarray]] = [
            ("tokens", "int32", _array([t for r in self.rows for t in r], "int32")),
            ("row_lengths", "int32", _array([len(r) for r in self.rows], "int32")),
            ("starts", "int32", _array(self.starts, "int32")),
            ("mu", "float32", _array([x for m in self.mu for x in m], "float32")),
        ]
        if self.orm is not None:
            buffers.append(("orm", "float32", _array(self.orm, "float32")))
        header = {
            "kind": self.kind,
            "step": self.step,
            "reason": self.reason,
            "routes": list(self.routes),
            "pad_id": self.pad_id,
            "buffers": [[name, dtype, int(a.size)] for name, dtype, a in buffers],
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        return b"".join([_HEADER.pack(len(head)), head, *(a.tobytes() for _, _, a in buffers)])

    @classmethod
    def from_bytes(cls, data: bytes) -> ControlRecord:
        """Parse `to_bytes`' output.

        Raises:
            RecordError: truncated or malformed bytes, or a record that fails its own checks.
        """
        try:
            (n,) = _HEADER.unpack_from(data, 0)
            header = json.loads(data[_HEADER.size : _HEADER.size + n].decode())
            offset = _HEADER.size + n
            arrays: dict[str, np.ndarray] = {}
            for name, dtype, count in header["buffers"]:
                size = _DTYPES[dtype].itemsize * int(count)
                if offset + size > len(data):
                    raise RecordError(f"control record truncated in buffer {name!r}")
                arrays[name] = np.frombuffer(data, _DTYPES[dtype], int(count), offset)
                offset += size
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, RecordError):
                raise
            raise RecordError(f"not a control record ({len(data)} bytes): {exc}") from None
        if offset != len(data):
            raise RecordError(f"control record has {len(data) - offset} trailing bytes")
        lengths = arrays["row_lengths"].tolist()
        starts = tuple(arrays["starts"].tolist())
        flat, mu_flat = arrays["tokens"].tolist(), arrays["mu"]
        rows, mu, at, at_mu = [], [], 0, 0
        for length, start in zip(lengths, starts, strict=True):
            rows.append(tuple(flat[at : at + length]))
            mu.append(tuple(mu_flat[at_mu : at_mu + length - start].tolist()))
            at, at_mu = at + length, at_mu + length - start
        orm = tuple(arrays["orm"].tolist()) if "orm" in arrays else None
        return cls(
            kind=header["kind"],
            step=int(header["step"]),
            reason=header["reason"],
            rows=tuple(rows),
            starts=starts,
            routes=tuple(header["routes"]),
            mu=tuple(mu),
            orm=orm,
            pad_id=int(header["pad_id"]),
        )


def _array(values: Sequence[float] | Sequence[int], dtype: str) -> np.ndarray:
    return np.asarray(values, dtype=_DTYPES[dtype]).reshape(-1)
