"""A `TokenBatch` from rows packed back to back: what the teachers' binary scoring transport carries
(`engines/teacher/score_frames.py`), built without Python lists."""

from __future__ import annotations

import torch

from mopd_hpc.engines.batch import BatchError, TokenBatch


def token_batch_from_packed(
    input_ids: torch.Tensor, row_lengths: torch.Tensor, response_start: torch.Tensor, pad_id: int
) -> TokenBatch:
    """`TokenBatch.from_rows` of rows packed back to back (what binary transport carries), without Python lists.

    Args:
        input_ids: [Σ_b |row_b|] int, the rows' tokens, row after row.
        row_lengths: [B] int, |row_b|.
        response_start: [B] int, as in `TokenBatch.from_rows`.
    Raises:
        BatchError: as `TokenBatch.from_rows`, or row_lengths that do not add up to input_ids.
    """
    lengths = row_lengths.to(torch.int64)
    starts = response_start.to(torch.int64)
    if lengths.dim() != 1 or lengths.numel() == 0:
        raise BatchError("row_lengths is empty; expected at least one row")
    if starts.shape != lengths.shape:
        raise BatchError(
            f"response_start has {starts.numel()} entries; expected one per row ({lengths.numel()})"
        )
    if bool((lengths < 0).any()) or int(lengths.sum()) != input_ids.numel():
        raise BatchError(f"row_lengths sum to {int(lengths.sum())}; input_ids holds {input_ids.numel()}")
    if pad_id < 0:
        raise BatchError(f"pad_id is {pad_id}; expected a token id >= 0")
    wrong = (starts < 1) | (starts > lengths)
    if bool(wrong.any()):
        b = int(wrong.nonzero()[0, 0])
        raise BatchError(f"response_start[{b}] is {int(starts[b])}; expected in [1, {int(lengths[b])}]")
    if input_ids.numel() and int(input_ids.min()) < 0:
        raise BatchError(f"input_ids holds a negative token id {int(input_ids.min())}")
    rows, length = lengths.tolist(), int(lengths.max())
    resp_len = (lengths - starts).tolist()
    width = max(resp_len)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    resp = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    pos = torch.arange(length)
    attn = (pos[None, :] < lengths[:, None]).to(torch.int64)
    mask = torch.arange(width)[None, :] < (lengths - starts)[:, None]
    at = 0
    for b, (n, s) in enumerate(zip(rows, starts.tolist(), strict=True)):
        ids[b, :n] = input_ids[at : at + n]
        resp[b, : n - s] = input_ids[at + s : at + n]
        at += n
    return TokenBatch(ids, attn, resp, mask, starts.clone(), pad_id)
