"""The teacher's /score request and answer as frames (`engines/frames/codec.py`): what `TeacherServer` and `TeacherClient`
send when the client asks for binary transport (the JSON shapes are in `http_app.py`).

Rows are packed back to back (no padding on the wire). Shape legend: B rows, L = Σ_b |row_b| input tokens,
N = Σ_b |response_b| response tokens, K top-k entries per position.

Request frame (Content-Type application/x-mopd-tensors):
    input_ids       [L] int32 or int64   the rows' tokens, row after row
    row_lengths     [B] int64            |row_b|
    response_start  [B] int64            index in row b of its first response token (≥ 1)
    meta            {"top_k": int | null}
Answer frame:
    lengths         [B] int64            |response_b| = |row_b| − response_start[b]
    logprobs        [N] float32          log π(y_t) of each response token, row after row
    topk_ids        [N, K] int32         (only when top_k was given) token ids, most likely first (int64
                                         only for a vocabulary beyond INT32_MAX)
    topk_logprobs   [N, K] float32       their log-probs
    meta            {"teacher_id", "weight_version", "fingerprint"}

Non-finite log-probs (−inf of an impossible token) travel as `LOGPROB_FLOOR` in both encodings, JSON
and binary, so that the two give the same values bit for bit; the actor takes that floor as the teacher's
refusal of the token (mopd/targets.py). A NaN log-prob at a response position is refused by the server
(`first_nan`: a broken forward, never sent as a refusal); top-k values keep the floor for any non-finite.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mopd_hpc.engines.frames.codec import Frame, FrameLayout, Packed, WireError, encode, layout

#: What a non-finite log-prob becomes on the wire: float32(−1e30) (JSON has no −inf).
LOGPROB_FLOOR = float(torch.tensor(-1.0e30, dtype=torch.float32))


#: The largest token id an int32 holds; larger ids travel as int64.
INT32_MAX = 2**31 - 1


def floor_nonfinite(values: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `values` with every non-finite entry replaced by `LOGPROB_FLOOR` (same shape)."""
    f = LOGPROB_FLOOR
    return torch.nan_to_num(values.float(), nan=f, posinf=f, neginf=f)


def first_nan(logprobs: torch.Tensor, lengths: torch.Tensor) -> tuple[int, int, int] | None:
    """(row, response position, count) of the first NaN among the real positions of `logprobs` [B, T]
    (row b's are 0 .. lengths[b] − 1), or None. A NaN is a broken forward, not a refusal (−inf): the teacher
    server refuses to send it as `LOGPROB_FLOOR`, which the actor would take as a refusal (mopd/targets.py)."""
    width = logprobs.shape[-1] if logprobs.dim() == 2 else 0
    real = torch.arange(width)[None, :] < lengths.reshape(-1, 1).to("cpu")
    nan = torch.isnan(logprobs.detach().to("cpu")) & real
    if not bool(nan.any()):
        return None
    b, t = (int(i) for i in nan.nonzero()[0])
    return b, t, int(nan.sum())


def encode_score_request(
    input_ids: Sequence[Sequence[int]], response_start: Sequence[int], top_k: int | None
) -> memoryview:
    """The request frame of /score (module docstring). Rows may be lists of ints or 1-d int tensors."""
    lengths = [len(r) for r in input_ids]
    if all(isinstance(r, torch.Tensor) for r in input_ids):
        flat: torch.Tensor | Packed = Packed(tuple(r.reshape(-1) for r in input_ids), torch.int64)  # type: ignore[union-attr]
    else:  # lists of ints: numpy reads them ~10x faster than torch.tensor
        chain = itertools.chain.from_iterable(input_ids)
        flat = torch.from_numpy(np.fromiter(chain, dtype=np.int64, count=sum(lengths)))
    tensors = {
        "input_ids": flat,
        "row_lengths": torch.tensor(lengths, dtype=torch.int64),
        "response_start": torch.tensor(list(response_start), dtype=torch.int64),
    }
    return encode(tensors, {"top_k": top_k})


def decode_score_request(
    frame: Frame, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
    """(input_ids [L], row_lengths [B], response_start [B], top_k) of a request frame, validated like the
    JSON body (`packed_batch.token_batch_from_packed` builds the batch).

    Raises:
        WireError: a missing tensor, a wrong dtype or rank, unknown meta fields, lengths that do not add up,
            a token id outside [0, vocab_size), a response_start outside [1, |row|], or a bad top_k; the
            message names the field as the JSON errors do (`input_ids[b]`, `response_start[b]`, `top_k`).
    """
    ids = frame.tensor("input_ids", (torch.int32, torch.int64), 1)
    lengths = frame.tensor("row_lengths", (torch.int64,), 1)
    starts = frame.tensor("response_start", (torch.int64,), 1)
    unknown = sorted(set(frame.meta) - {"top_k"})
    if unknown:
        raise WireError(f"meta: unknown fields {unknown}; expected top_k")
    top_k = frame.meta.get("top_k")
    if top_k is not None and (type(top_k) is not int or top_k < 1):
        raise WireError(f"top_k is {top_k!r}; expected null or an int >= 1")
    if lengths.numel() == 0:
        raise WireError("input_ids: expected a non-empty list of rows (row_lengths is empty)")
    if starts.numel() != lengths.numel():
        raise WireError(
            f"response_start: expected {lengths.numel()} ints (one per row); got {starts.numel()}"
        )
    if bool((lengths < 0).any()) or int(lengths.sum()) != ids.numel():
        raise WireError(f"row_lengths sum to {int(lengths.sum())}; input_ids holds {ids.numel()} tokens")
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        row = int(torch.searchsorted(lengths.cumsum(0), int(bad.nonzero()[0, 0]), right=True))
        raise WireError(f"input_ids[{row}]: expected token ids in [0, {vocab_size})")
    wrong = (starts < 1) | (starts > lengths)
    if bool(wrong.any()):
        b = int(wrong.nonzero()[0, 0])
        raise WireError(f"response_start[{b}] is {int(starts[b])}; expected an int in [1, {int(lengths[b])}]")
    return ids, lengths, starts, top_k


@dataclass(frozen=True, slots=True)
class ScoreTensors:
    """A /score answer as tensors, rows packed back to back (module docstring for shapes and dtypes).

    Attributes:
        lengths: [B] int64 response tokens of each row; N = lengths.sum().
        logprobs: [N] float32.
        topk_ids: [N, K] int32, or None when top_k was not asked.
        topk_logprobs: [N, K] float32, or None.
        teacher_id, weight_version, fingerprint: the server's identity when it answered.
    """

    lengths: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    teacher_id: str
    weight_version: str
    fingerprint: str

    @classmethod
    def from_frame(cls, frame: Frame) -> ScoreTensors:
        """Validate an answer frame. Raises WireError: a missing tensor, dtype, rank or count mismatch."""
        lengths = frame.tensor("lengths", (torch.int64,), 1)
        logprobs = frame.tensor("logprobs", (torch.float32,), 1)
        total = int(lengths.sum())
        if bool((lengths < 0).any()) or logprobs.numel() != total:
            raise WireError(f"logprobs holds {logprobs.numel()} values; lengths sum to {total}")
        ids = vals = None
        if "topk_ids" in frame.tensors or "topk_logprobs" in frame.tensors:
            ids = frame.tensor("topk_ids", (torch.int32, torch.int64), 2)
            vals = frame.tensor("topk_logprobs", (torch.float32,), 2)
            if ids.shape != vals.shape or ids.shape[0] != total:
                raise WireError(
                    f"topk_ids {list(ids.shape)} and topk_logprobs {list(vals.shape)}: expected both [{total}, K]"
                )
        meta = frame.meta
        missing = [
            k for k in ("teacher_id", "weight_version", "fingerprint") if not isinstance(meta.get(k), str)
        ]
        if missing:
            raise WireError(f"meta: {missing} missing or not strings; expected the server's identity")
        return cls(
            lengths, logprobs, ids, vals, meta["teacher_id"], meta["weight_version"], meta["fingerprint"]
        )

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Packed [N, ...] values → one [|response_b|, ...] view per row."""
        return list(values.split(self.lengths.tolist()))

    def padded_logprobs(self, width: int | None = None, fill: float = float("nan")) -> torch.Tensor:
        """[B, width] float32 (width default max |response_b|), `fill` after each row's end.

        Raises:
            WireError: width is shorter than a row's response.
        """
        out = torch.full((self.lengths.numel(), self._width(width)), fill, dtype=torch.float32)
        self._scatter(self.logprobs, out)
        return out

    def padded_topk(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B, width, K] int64, log-probs [B, width, K] float32), zeros after each row's end.

        Raises:
            WireError: the answer holds no top-k (top_k was not asked), or width is too short.
        """
        if self.topk_ids is None or self.topk_logprobs is None:
            raise WireError("the answer holds no top-k; ask /score with top_k")
        shape = (self.lengths.numel(), self._width(width), self.topk_ids.shape[1])
        ids, vals = torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=torch.float32)
        self._scatter(self.topk_ids, ids)
        self._scatter(self.topk_logprobs, vals)
        return ids, vals

    def _width(self, width: int | None) -> int:
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if width is not None and width < longest:
            raise WireError(
                f"width={width}: a row has {longest} response tokens; expected width >= {longest}"
            )
        return longest if width is None else width

    def _scatter(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        """Row b's packed values → out[b, :|response_b|] (one copy per row, cast to out's dtype)."""
        for b, part in enumerate(self.split(packed)):
            out[b, : part.shape[0]] = part


def score_answer(
    lengths: torch.Tensor,
    logprobs: torch.Tensor,
    topk_ids: torch.Tensor | None,
    topk_logprobs: torch.Tensor | None,
    identity: Mapping[str, Any],
    vocab_size: int,
) -> FrameLayout:
    """The answer frame's layout from an engine's padded output (module docstring for the packed layout):
    `.encode()` copies each value once, from the engine's tensors to the frame; `frames.over_http.send_frame`
    sends rows already in the frame's bytes (contiguous float32 CPU rows with no non-finite value) from
    the engine's memory and copies only the others (the int64 → int32 top-k ids, floored rows).

    Args:
        lengths: [B] int, |response_b| (the real positions of row b are 0 .. |response_b| − 1).
        logprobs: [B, T] float (non-finite values become `LOGPROB_FLOOR`).
        topk_ids / topk_logprobs: [B, T, K] int and float, or both None.
        identity: {teacher_id, weight_version, fingerprint}.
        vocab_size: V; ids travel as int32 when V − 1 <= INT32_MAX, else int64.
    """
    rows, f = lengths.tolist(), LOGPROB_FLOOR
    tensors: dict[str, torch.Tensor | Packed] = {
        "lengths": lengths.to(torch.int64),
        "logprobs": Packed(tuple(logprobs[b, :n] for b, n in enumerate(rows)), torch.float32, f),
    }
    if topk_ids is not None and topk_logprobs is not None:
        ids = tuple(topk_ids[b, :n] for b, n in enumerate(rows))
        tensors["topk_ids"] = Packed(ids, torch.int32 if vocab_size - 1 <= INT32_MAX else torch.int64)
        vals = tuple(topk_logprobs[b, :n] for b, n in enumerate(rows))
        tensors["topk_logprobs"] = Packed(vals, torch.float32, f)
    return layout(tensors, identity)


@dataclass(frozen=True, slots=True)
class PackedAnswer:
    """A /score answer packed where the engine scored it and copied to the host once (`pack_answer`).

    Attributes:
        lengths: [B] int64 CPU, |response_b|; N = lengths.sum().
        logprobs: [N] float32 CPU, non-finite values already `LOGPROB_FLOOR`.
        topk_ids: [N, K] int32 CPU (int64 for a vocabulary beyond INT32_MAX), or None.
        topk_logprobs: [N, K] float32 CPU, floored, or None.
        nan: (row, response position, count) of the first NaN log-prob before flooring (`first_nan`), or None.
    """

    lengths: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    nan: tuple[int, int, int] | None

    def frame(self, identity: Mapping[str, Any]) -> FrameLayout:
        """The answer frame (module docstring), byte for byte `score_answer`'s of the same scores; every
        tensor is sent from its own memory (one contiguous CPU tensor each, nothing left to cast or floor)."""
        tensors: dict[str, torch.Tensor | Packed] = {"lengths": self.lengths, "logprobs": self.logprobs}
        if self.topk_ids is not None and self.topk_logprobs is not None:
            tensors |= {"topk_ids": self.topk_ids, "topk_logprobs": self.topk_logprobs}
        return layout(tensors, identity)

    def rows(self, values: torch.Tensor) -> list[list[Any]]:
        """Packed [N, ...] values → per-row nested lists (the JSON answer's shape)."""
        return [part.tolist() for part in values.split(self.lengths.tolist())]


def pack_answer(
    lengths: torch.Tensor,
    logprobs: torch.Tensor,
    topk_ids: torch.Tensor | None,
    topk_logprobs: torch.Tensor | None,
    vocab_size: int,
) -> PackedAnswer:
    """An engine's padded scores → the packed answer, built on the scores' device (the real positions
    gathered, non-finite values floored, ids cast) and copied to the host in ONE device→host copy of one
    byte buffer, with no host sync before it and no per-row work.

    Args:
        lengths: [B] int (any device), |response_b| ≤ T.
        logprobs: [B, T] float, on the engine's device; topk_ids / topk_logprobs: [B, T, K] int and float
            on the same device, or both None.
        vocab_size: V; ids are int32 when V − 1 <= INT32_MAX, else int64 (as `score_answer`).
    """
    device, (rows, width) = logprobs.device, logprobs.shape
    host_lengths = lengths.to("cpu", torch.int64)
    total = int(host_lengths.sum())
    count = host_lengths.to(device)
    row = torch.repeat_interleave(torch.arange(rows, device=device), count, output_size=total)  # [N]
    first = torch.cumsum(count, 0) - count  # [B] packed index of each row's first position
    flat = row * width + torch.arange(total, device=device) - first[row]  # [N] index into [B·T]
    lp = logprobs.reshape(-1)[flat]
    nan = torch.isnan(lp)
    head = torch.stack([nan.sum(), nan.to(torch.uint8).argmax() if total else nan.sum()]).to(torch.int64)
    # head and ids (int64 or int32) first: every part starts at a multiple of its element size in the buffer
    parts = {"head": head}
    if topk_ids is not None and topk_logprobs is not None:
        k = topk_ids.shape[-1]
        id_dtype = torch.int32 if vocab_size - 1 <= INT32_MAX else torch.int64
        parts["topk_ids"] = topk_ids.reshape(-1, k)[flat].to(id_dtype)
        parts["topk_logprobs"] = floor_nonfinite(topk_logprobs.reshape(-1, k)[flat])
    parts["logprobs"] = floor_nonfinite(lp)
    buffer = torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts.values()]).cpu()
    host, at = {}, 0
    for name, p in parts.items():
        size = p.numel() * p.element_size()
        host[name] = buffer[at : at + size].view(p.dtype).reshape(p.shape)
        at += size
    nan_count, nan_at = host["head"].tolist()
    where = None
    if nan_count:
        b = int(torch.searchsorted(torch.cumsum(host_lengths, 0), nan_at, right=True))
        where = (b, nan_at - int(host_lengths[:b].sum()), nan_count)
    return PackedAnswer(
        host_lengths, host["logprobs"], host.get("topk_ids"), host.get("topk_logprobs"), where
    )
