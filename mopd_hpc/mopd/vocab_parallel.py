"""Log-probs and top-k over vocab-parallel logits, without gathering the vocabulary.

Tensor-parallel rank r of R holds the logits of the vocabulary columns [o_r, o_r + V_r) only (megatron's
`ColumnParallelLinear` output layer, `parallel_output=True`; o_r = r·V'/R). Of those, the columns < V (the
checkpoint's vocabulary; V' ≥ V is megatron's padded one) are real. Per position (Megatron-LM's
`VocabParallelCrossEntropy` uses the same reduction):

    ℓ_r = logsumexp_{v ∈ shard r, v < V} x_v          local, float32 (blocks of rows: no float32 [N, V_r])
    M   = max_r ℓ_r                                  all-reduce MAX over the group, detached
    lse = M + log Σ_r exp(ℓ_r − M)                   all-reduce SUM (identity backward)
    log π(v) = x_v − lse                             x_v read on the rank owning v, all-reduce SUM of the
                                                     owners' values (0 elsewhere; identity backward)

Every rank then holds the same [N, K] log-probs, computes the same loss, and back-propagates into its own
shard: the all-reduce SUM's backward is the identity (each rank's summand enters the loss once, Megatron's
`reduce_from_tensor_model_parallel_region`), so ∂L/∂x_u = ∂L/∂log π(u)·1[u ∈ K] − softmax(x)_u·Σ_K ∂L/∂log π
exactly, on the owning rank. The max is detached: lse does not depend on it.

Memory per rank: the local logits [N, V_r] in the model's dtype (the output layer's result) and their
gradient, one float32 block of rows at a time (`chunk_bytes`), and [N]- and [N, K]-sized float32 tensors;
no float32 [N, V_r] tensor and nothing of size V.

Top-k across shards (`shard_topk`, `merge_topk`): each rank's top-k of its real columns (global ids), the
candidates gathered ([N, R·k]) and their top-k taken: the global top-k, since each of the k largest values
is among its shard's k largest. The top-k is taken in the logits' own dtype (bf16 → float32 is exact and
monotone: the same ids and values as a float32 top-k) and only the [N, k] result is cast: no float32
[N, V_r] copy. `vocab_parallel_score` is what a vocab-parallel teacher answers (megatron's scoring engine
calls it at every tensor_parallel): the sampled tokens' log-probs and the top-k, from one logsumexp.

`AllReduce` is an in-place callable `(tensor, op)` with op "sum" or "max": `process_group_all_reduce(group)`
wraps torch.distributed; `AllGather` is tensor → every rank's tensor of the same shape, in rank order
(`process_group_all_gather(group)`). None is the one-shard group (TP = 1: no collective). Shape legend: N positions
(any leading shape ... flattened), V_r local columns, K ids per position, R ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from mopd_hpc.mopd.logprobs import DEFAULT_CHUNK_BYTES, LogprobError

AllReduce = Callable[[torch.Tensor, Literal["sum", "max"]], None]
AllGather = Callable[[torch.Tensor], list[torch.Tensor]]


def process_group_all_reduce(group: Any = None) -> AllReduce:
    """An `AllReduce` over a torch.distributed process group (None: WORLD), in place."""
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def all_reduce(tensor: torch.Tensor, op: Literal["sum", "max"]) -> None:
        dist.all_reduce(tensor, op=ops[op], group=group)

    return all_reduce


def process_group_all_gather(group: Any = None) -> AllGather:
    """An `AllGather` over a torch.distributed process group (None: WORLD): every rank's tensor, rank order."""
    import torch.distributed as dist

    def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts

    return all_gather


def _reduce(tensor: torch.Tensor, op: Literal["sum", "max"], all_reduce: AllReduce | None) -> torch.Tensor:
    out = tensor.clone()
    if all_reduce is not None:
        all_reduce(out, op)
    return out


class _AllReduceSum(torch.autograd.Function):
    """Σ over the group in the forward, the identity in the backward (module docstring)."""

    @staticmethod
    def forward(ctx, tensor, all_reduce):  # type: ignore[override]
        return _reduce(tensor, "sum", all_reduce)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class _ShardLogsumexp(torch.autograd.Function):
    """logits [N, V_r] (any float dtype) → float32 [N] logsumexp (float64 for float64), in row blocks."""

    @staticmethod
    def forward(ctx, logits, chunk_bytes):  # type: ignore[override]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        n_rows, n_cols = logits.shape
        step = max(1, chunk_bytes // (4 * max(1, n_cols)))
        lse = torch.empty(n_rows, dtype=dtype, device=logits.device)
        for start in range(0, n_rows, step):
            lse[start : start + step] = torch.logsumexp(logits[start : start + step].to(dtype), dim=-1)
        ctx.save_for_backward(logits, lse)
        ctx.step = step
        return lse

    @staticmethod
    def backward(ctx, grad_lse):  # type: ignore[override]
        logits, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.step):
            stop = start + ctx.step
            block = torch.exp(logits[start:stop].to(lse.dtype) - lse[start:stop, None])
            grad[start:stop] = block.mul_(grad_lse[start:stop, None].to(lse.dtype))
        return grad, None


def real_columns(local_width: int, vocab_start: int, vocab_size: int) -> int:
    """How many of a shard's columns [vocab_start, vocab_start + local_width) are < vocab_size."""
    return max(0, min(local_width, vocab_size - vocab_start))


class VocabParallelLogprobs:
    """log π(v) of chosen ids from one rank's vocabulary shard (module docstring's formulas).

    Build once per forward (one logsumexp pass and two [N] all-reduces), then call for each set of ids
    (the sampled tokens, each teacher's top-k): every call is one [N, K] all-reduce.

    Args:
        local_logits: [..., V_r] this rank's logits, any float dtype; carries the gradient.
        vocab_start: o_r, the global id of local column 0.
        vocab_size: V, the real vocabulary: columns with global id ≥ V (padding) are excluded.
        all_reduce: the tensor-parallel group's `AllReduce` (None: one shard, TP = 1). Every rank of the
            group must build this object and make the same calls in the same order (collectives).
        chunk_bytes: float32 bytes per row block of the local logsumexp.

    Raises:
        LogprobError: logits not float [..., V_r], or vocab_start outside [0, V).
    """

    def __init__(
        self,
        local_logits: torch.Tensor,
        vocab_start: int,
        vocab_size: int,
        all_reduce: AllReduce | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if local_logits.dim() < 1 or not local_logits.is_floating_point():
            raise LogprobError(
                f"local_logits has shape {list(local_logits.shape)} dtype {local_logits.dtype}; "
                "expected float [..., V_r]"
            )
        if not 0 <= vocab_start < vocab_size:
            raise LogprobError(f"vocab_start is {vocab_start}; expected in [0, vocab_size={vocab_size})")
        self.logits, self.vocab_start, self.all_reduce = local_logits, vocab_start, all_reduce
        self.dtype = torch.promote_types(local_logits.dtype, torch.float32)
        self.lead = local_logits.shape[:-1]
        self.n_real = real_columns(local_logits.shape[-1], vocab_start, vocab_size)
        flat = local_logits.reshape(-1, local_logits.shape[-1])
        if self.n_real:
            local_lse = _ShardLogsumexp.apply(flat[:, : self.n_real], chunk_bytes)
        else:  # a shard of padding only
            local_lse = torch.full(flat.shape[:1], float("-inf"), dtype=self.dtype, device=flat.device)
        top = _reduce(local_lse.detach(), "max", all_reduce)
        total = _AllReduceSum.apply(torch.exp(local_lse - top), all_reduce)
        #: [...] float32 logsumexp over the whole real vocabulary (same on every rank).
        self.lse = (top + torch.log(total)).reshape(self.lead)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """[..., K] int64 global ids in [0, V) → [..., K] log π (float32; float64 for float64 logits)."""
        if ids.shape[:-1] != self.lead:
            raise LogprobError(f"ids has shape {list(ids.shape)}; expected {list(self.lead)} + [K]")
        local = ids.long() - self.vocab_start
        owned = (local >= 0) & (local < self.n_real)
        x = self.logits.gather(-1, torch.where(owned, local, 0)).to(self.dtype)
        x = _AllReduceSum.apply(torch.where(owned, x, 0.0), self.all_reduce)
        return x - self.lse[..., None]


def shard_topk(
    local_logits: torch.Tensor, vocab_start: int, vocab_size: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's top-min(k, V_r) logits (float32, no gradient) and their GLOBAL ids, [..., min(k, V_r)] each.

    Values are raw logits; subtract the global logsumexp (`VocabParallelLogprobs.lse`) for log-probs. A shard
    with fewer than min(k, V_r) real columns (megatron's padding) fills the rest with −inf at id vocab_start,
    so that every shard of a group gives the same shape (what an all-gather needs); −inf is never chosen
    while the group has k real columns."""
    width = min(k, local_logits.shape[-1])
    n_real = real_columns(local_logits.shape[-1], vocab_start, vocab_size)
    values, idx = local_logits.detach()[..., :n_real].topk(
        min(width, n_real), dim=-1
    )  # own dtype: no fp32 copy
    values = values.float()
    if values.shape[-1] < width:
        fill = (*values.shape[:-1], width - values.shape[-1])
        values = torch.cat([values, values.new_full(fill, float("-inf"))], dim=-1)
        idx = torch.cat([idx, idx.new_zeros(fill)], dim=-1)
    return values, idx + vocab_start


def merge_topk(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of candidates [..., C] (the shards' `shard_topk` concatenated along the last axis): values
    [..., min(k, C)] in descending order and their ids."""
    top, where = values.topk(min(k, values.shape[-1]), dim=-1)
    return top, ids.gather(-1, where)


def vocab_parallel_topk(
    local_logits: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    k: int,
    all_gather: AllGather | None = None,
    all_reduce: AllReduce | None = None,
    *,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(global top-min(k, V) ids [..., K] int64, their float32 log π [..., K]) of vocab-parallel logits, no
    gradient. Every rank of the group must make the same call (collectives); every rank gets the same result.

    Args:
        all_gather: the group's `AllGather` (None: one shard); every shard contributes [..., min(k, V_r)]
            (`shard_topk`).
        all_reduce: the group's `AllReduce`, for the global logsumexp.
        lse: [...] the global logsumexp when the caller has it already (`VocabParallelLogprobs.lse`): then
            no all-reduce here.
    """
    k = min(k, vocab_size)  # never a padding column's −inf in the answer
    with torch.no_grad():
        if lse is None:
            lse = VocabParallelLogprobs(local_logits.detach(), vocab_start, vocab_size, all_reduce).lse
        values, ids = shard_topk(local_logits, vocab_start, vocab_size, k)
        if all_gather is not None:
            values = torch.cat(all_gather(values.contiguous()), dim=-1)
            ids = torch.cat(all_gather(ids.contiguous()), dim=-1)
        top, top_ids = merge_topk(values, ids, k)
        return top_ids, top - lse.detach()[..., None].float()


def vocab_parallel_score(
    local_logits: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    token_ids: torch.Tensor,
    k: int,
    all_gather: AllGather | None = None,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A vocab-parallel teacher's answer, no gradient: (log π of `token_ids` [...] float32, top-min(k, V) ids
    [..., K] int64, their log π [..., K] float32), all from one global logsumexp. What megatron's scoring
    engine calls at every tensor_parallel (None, None: TP = 1, no collective).

    Collectives, in order (every rank of the group makes the same call): all-reduce MAX [N] and SUM [N] (the
    logsumexp), SUM [N, 1] (the tokens' logits on their owning ranks), two all-gathers [N, min(k, V_r)] (the
    candidates' values and ids). Memory: the local logits (model dtype), one float32 block of rows, [N, R·k].

    Args:
        local_logits: [..., V_r] this rank's logits, any float dtype.
        vocab_start, vocab_size: as `VocabParallelLogprobs`.
        token_ids: [...] int64 ids in [0, V) (padded positions: any valid id; the caller masks them).

    Raises:
        LogprobError: as `VocabParallelLogprobs`.
    """
    with torch.no_grad():
        logprobs = VocabParallelLogprobs(local_logits.detach(), vocab_start, vocab_size, all_reduce)
        token = logprobs(token_ids[..., None]).squeeze(-1).float()
        ids, values = vocab_parallel_topk(
            local_logits, vocab_start, vocab_size, k, all_gather, all_reduce, lse=logprobs.lse
        )
        return token, ids, values
