"""The control records rank 0 of the actor group sends to every rank, as binary buffers.

Kinds (`ControlRecord.kind`):

    start   before the first step: `step` = the step the run resumes from (0 for a fresh run); every rank
            loads that checkpoint (trainer/actor_group.py)
    step    one step's rollouts: `step`, the rows (prompt + response token ids), where each response starts,
            each row's route, the behavior log-probs μ of every response token (as the rollout engine gave
            them: kept immutable up to the loss, DESIGN.md §3), the GRPO advantages A_ORM of the whole step
            (group normalization needs every row, so rank 0 computes them; absent when no loss term reads
            them), the pad id, and with rollout routing replay the experts each response token was routed
            to in the rollout (every MoE layer's k ids)
    stop    the run ends: `step` = steps done, `reason` "finished" or "checkpoint_signal"
    weights rank 0 is about to gather the actor's HF weights over its TP group (`reason` "sync", "evaluate"
            or "export"; only sent when the engine's `gathers_over_tp`): the other ranks of that TP group
            join the gather (trainer/follower.py)
    checkpoint  rank 0 saves the checkpoint of `step`: every rank of its TP group writes its weight shards
            (trainer/sharded_checkpoint.py; sent when the engine's `sharded_checkpoint`) and/or every
            rank joins rank 0's `state_dict` gather (sent when the engine's `collective_state_dict`)

Wire format (DESIGN.md §7: tensors as raw bytes with a header, never JSON lists of floats): one frame of
engines/frames/codec.py (byte for byte a safetensors file) with the tensors `tokens` int32 (every row concatenated),
`row_lengths` int32 [B], `starts` int32 [B], `mu` float32 (every response token, rows concatenated), `orm`
float32 [B] (when present), `experts` int16 [N, M, k] (N response tokens, rows concatenated; when present),
and `meta` {"kind", "step", "reason", "routes", "pad_id"}.

`from_bytes(to_bytes(r)) == r` bit for bit (tested). A step record of B rows × L tokens is about
4·(B·L + B·T) bytes: 256 rows of 2,048 tokens is ~3 MB; the teachers' top-k is never in it (each DP rank
fetches its own rows' scores from the teacher servers).

Shape legend: B rows, T response positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.frames import codec as wire

KINDS = ("start", "step", "stop", "weights", "checkpoint")
STOP_REASONS = ("finished", "checkpoint_signal")
WEIGHTS_REASONS = ("sync", "evaluate", "export")


class RecordError(ValueError):
    """A control record that is inconsistent (lengths, kind, reason) or bytes that are not one."""


@dataclass(frozen=True, slots=True)
class ControlRecord:
    """One control message of the actor group (module docstring). Build with `start`, `stop` or
    `from_rows` (or `weights`, `checkpoint`); rows, starts, routes, mu and orm are empty but for `step`.

    Attributes:
        kind: one of KINDS. step: the step (see kinds). reason: the stop's or the gather's reason, else "".
        rows: prompt + response token ids of each row. starts: index in row b where its response begins.
        routes: each row's route. mu: each row's behavior log-probs (float32 values), one per response token.
        orm: [B] A_ORM as float32 values, or None. pad_id: the padding token id.
        experts: [N, M, k] int16 routed expert ids of every response token (rows concatenated, N = Σ
            response lengths), or None (no routing replay); not part of `==` (a tensor).
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
    experts: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RecordError(f"kind={self.kind!r}: expected one of {KINDS}")
        if self.step < 0:
            raise RecordError(f"step={self.step}: expected >= 0")
        if self.kind == "stop" and self.reason not in STOP_REASONS:
            raise RecordError(f"stop reason={self.reason!r}: expected one of {STOP_REASONS}")
        if self.kind == "weights" and self.reason not in WEIGHTS_REASONS:
            raise RecordError(f"weights reason={self.reason!r}: expected one of {WEIGHTS_REASONS}")
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
        if self.experts is not None and (
            self.experts.dim() != 3 or self.experts.shape[0] != sum(len(m) for m in self.mu)
        ):
            raise RecordError(
                f"step {self.step}: experts {list(self.experts.shape)} for {sum(len(m) for m in self.mu)} "
                "response tokens; expected [N, M, k]"
            )
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
    def weights(cls, step: int, reason: str) -> ControlRecord:
        return cls("weights", step, reason)

    @classmethod
    def checkpoint(cls, step: int) -> ControlRecord:
        return cls("checkpoint", step)

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
        routed_experts: torch.Tensor | None = None,
    ) -> ControlRecord:
        """A step record from rank 0's rollouts: behavior_logprobs [B, T] float32 (padding dropped),
        orm [B] float32 or None, routed_experts [B, T, M, k] integer or None (padding dropped)."""
        lengths = [len(r) - s for r, s in zip(rows, starts, strict=True)]
        mu = behavior_logprobs.detach().float().cpu()
        experts = None
        if routed_experts is not None:
            routed = routed_experts.cpu().to(torch.int16)
            experts = torch.cat([routed[b, :n] for b, n in enumerate(lengths)])
        return cls(
            kind="step",
            step=step,
            rows=tuple(tuple(int(t) for t in r) for r in rows),
            starts=tuple(int(s) for s in starts),
            routes=tuple(routes),
            mu=tuple(tuple(mu[b, :n].tolist()) for b, n in enumerate(lengths)),
            orm=None if orm is None else tuple(orm.detach().float().cpu().tolist()),
            pad_id=pad_id,
            experts=experts,
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

    def routed_experts(self, tokens: TokenBatch, start: int, stop: int) -> torch.Tensor | None:
        """[b, T, M, k] int16 routed experts of rows [start, stop), padded like `tokens` with −1; None
        without them."""
        if self.experts is None:
            return None
        lengths = self.response_lengths
        offsets = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        out = torch.full(
            (stop - start, tokens.response_width, *self.experts.shape[1:]), -1, dtype=self.experts.dtype
        )
        for b, row in enumerate(range(start, stop)):
            out[b, : lengths[row]] = self.experts[offsets[row] : offsets[row + 1]]
        return out

    def orm_advantages(self, start: int, stop: int) -> torch.Tensor | None:
        """[b] float32 A_ORM of rows [start, stop), or None."""
        return None if self.orm is None else torch.tensor(self.orm[start:stop], dtype=torch.float32)

    # ------------------------------------------------------------------------------- the wire

    def to_bytes(self) -> bytes:
        """The wire format of the module docstring (one engines/frames/codec.py frame)."""
        tensors = {
            "tokens": _tensor([t for r in self.rows for t in r], torch.int32),
            "row_lengths": _tensor([len(r) for r in self.rows], torch.int32),
            "starts": _tensor(self.starts, torch.int32),
            "mu": _tensor([x for m in self.mu for x in m], torch.float32),
        }
        if self.orm is not None:
            tensors["orm"] = _tensor(self.orm, torch.float32)
        if self.experts is not None:
            tensors["experts"] = self.experts.contiguous()
        meta = {
            "kind": self.kind,
            "step": self.step,
            "reason": self.reason,
            "routes": list(self.routes),
            "pad_id": self.pad_id,
        }
        return bytes(wire.encode(tensors, meta))

    @classmethod
    def from_bytes(cls, data: bytes) -> ControlRecord:
        """Parse `to_bytes`' output.

        Raises:
            RecordError: truncated or malformed bytes, or a record that fails its own checks.
        """
        try:
            frame = wire.decode(data)
            tensors = {
                name: frame.tensor(name, (dtype,), 1).tolist()
                for name, dtype in _BUFFERS.items()
                if name != "orm" or "orm" in frame.tensors
            }
            header = frame.meta
            kind, step, reason = header["kind"], int(header["step"]), header["reason"]
            routes, pad_id = tuple(header["routes"]), int(header["pad_id"])
            experts = (
                frame.tensor("experts", (torch.int16,), 3).clone() if "experts" in frame.tensors else None
            )
        except (wire.WireError, KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"not a control record ({len(data)} bytes): {exc}") from None
        starts = tuple(tensors["starts"])
        flat, mu_flat = tensors["tokens"], tensors["mu"]
        rows, mu, at, at_mu = [], [], 0, 0
        for length, start in zip(tensors["row_lengths"], starts, strict=True):
            rows.append(tuple(flat[at : at + length]))
            mu.append(tuple(mu_flat[at_mu : at_mu + length - start]))
            at, at_mu = at + length, at_mu + length - start
        if at != len(flat) or at_mu != len(mu_flat):
            raise RecordError(f"step {step}: the row lengths do not tile the {len(flat)} tokens")
        orm = tuple(tensors["orm"]) if "orm" in tensors else None
        return cls(kind, step, reason, tuple(rows), starts, routes, tuple(mu), orm, pad_id, experts)


#: The frame's tensors and their dtypes (`orm` only when the record has A_ORM).
_BUFFERS = {
    "tokens": torch.int32,
    "row_lengths": torch.int32,
    "starts": torch.int32,
    "mu": torch.float32,
    "orm": torch.float32,
}


def _tensor(values: Sequence[float] | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(list(values), dtype=dtype).reshape(-1)
