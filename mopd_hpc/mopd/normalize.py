"""Loss normalizers shared by the MOPD and GRPO losses.

Shape legend: B sequences, T response positions.

- `token-mean`: Σ_{b,t} m·ℓ / max(1, Σ_{b,t} m) — every loss token of the batch weighs the same
  (AReaL, verl default).
- `seq-mean-token-mean`: mean over sequences with at least one loss token of Σ_t m·ℓ / Σ_t m — the
  1/|y| of MiMo-V2-Flash eq. 7, then the mean over sequences. Sequences with no loss token are left out
  of the outer mean (verl `seq-mean-token-mean`).

`m` is the loss mask (response tokens), never a mismatch-correction mask: tokens dropped by the IcePop
mask keep counting here (MiMo eq. 7 divides by |y|; AReaL keeps the pre-rejection mask).

Global normalization (data parallelism): both normalizers are a per-row numerator summed over rows,
divided by a count over rows (`loss_denominator`: Σ m for token-mean, the number of rows with Σ_t m > 0
for seq-mean-token-mean; a row's inner mean Σ_t m·ℓ / Σ_t m stays local to that row). So when a step's rows
are split into shards, each shard divides its own numerator by the denominator of the WHOLE step (the sum of
the shards' `loss_denominator`s, e.g. an all-reduce over the data-parallel group) and the shards' losses sum
to the loss of the whole step, and so do their gradients (Megatron-LM `calculate_per_token_loss` does the
same for token-mean). Engine-agnostic: `normalize` only takes the number.
"""

from __future__ import annotations

from typing import Literal

import torch

Normalizer = Literal["token-mean", "seq-mean-token-mean"]


class LossInputError(ValueError):
    """A loss input has the wrong shape, dtype, device or gradient state."""


def as_bool_mask(loss_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Return `loss_mask` ([B, T], bool or 0/1) as a bool tensor; raise `LossInputError` otherwise."""
    if loss_mask.shape != shape:
        raise LossInputError(f"loss_mask has shape {list(loss_mask.shape)}; expected {list(shape)}")
    if loss_mask.dtype == torch.bool:
        return loss_mask
    if bool(((loss_mask != 0) & (loss_mask != 1)).any()):
        raise LossInputError(f"loss_mask (dtype {loss_mask.dtype}) holds values other than 0 and 1")
    return loss_mask != 0


def _check_normalizer(normalizer: str) -> None:
    if normalizer not in ("token-mean", "seq-mean-token-mean"):
        raise LossInputError(f"normalizer is {normalizer!r}; expected 'token-mean' or 'seq-mean-token-mean'")


def loss_denominator(mask: torch.Tensor, normalizer: Normalizer) -> torch.Tensor:
    """The count `normalize` divides by, of this batch alone (module docstring).

    Args:
        mask: [B, T] bool loss mask (B may be 0).
        normalizer: "token-mean" → Σ_{b,t} m (loss tokens); "seq-mean-token-mean" → the number of rows with
            at least one loss token.

    Returns:
        0-d int64 tensor on mask's device (an exact count: sum it over shards, e.g. with
        `torch.distributed.all_reduce`, to get the denominator of the whole step).

    Raises:
        LossInputError: mask not [B, T] bool, or an unknown normalizer.
    """
    _check_normalizer(normalizer)
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise LossInputError(
            f"mask has shape {list(mask.shape)} and dtype {mask.dtype}; expected [B, T] bool"
        )
    if normalizer == "token-mean":
        return mask.sum(dtype=torch.int64)
    return (mask.sum(dim=-1) > 0).sum(dtype=torch.int64)


def normalize(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    normalizer: Normalizer,
    denominator: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss (already 0 where `mask` is False) to a scalar.

    Args:
        per_token: [B, T] float; must be exactly 0 at masked positions.
        mask: [B, T] bool loss mask (the denominator's mask).
        normalizer: "token-mean" or "seq-mean-token-mean" (see the module docstring).
        denominator: None → this batch's own count (`loss_denominator(mask, normalizer)`). Otherwise the
            count of the whole step this batch is a shard of (0-d tensor or int, ≥ this batch's own count;
            the sum of every shard's `loss_denominator`); the result is this shard's share of the step's
            loss: the shards' results sum to the loss of the whole step.

    Returns:
        0-d tensor, per_token's dtype. An all-masked batch gives 0 with a zero gradient; a denominator of 0
        is treated as 1 (as the batch's own count is).

    Raises:
        LossInputError: an unknown normalizer, a denominator that is not 0-d, or one smaller than this
            batch's own count (a shard's local count passed where the step's global one belongs).
    """
    _check_normalizer(normalizer)
    if denominator is None:
        count = mask.sum(dtype=per_token.dtype)
        if normalizer == "token-mean":
            return per_token.sum() / count.clamp(min=1)
        per_seq_count = mask.sum(dim=-1, dtype=per_token.dtype)
        seq_mean = per_token.sum(dim=-1) / per_seq_count.clamp(min=1)
        n_seq = (per_seq_count > 0).sum(dtype=per_token.dtype)
        return seq_mean.sum() / n_seq.clamp(min=1)
    total = torch.as_tensor(denominator, device=per_token.device)
    if total.dim() != 0:
        raise LossInputError(f"denominator has shape {list(total.shape)}; expected a 0-d count")
    own = loss_denominator(mask, normalizer)
    if bool(total < own):
        raise LossInputError(
            f"denominator is {float(total):g} but this batch alone counts {int(own)} ({normalizer}); expected "
            "the whole step's count (the sum of every shard's loss_denominator), not less"
        )
    total = total.to(per_token.dtype).clamp(min=1)
    if normalizer == "token-mean":
        return per_token.sum() / total
    per_seq_count = mask.sum(dim=-1, dtype=per_token.dtype)
    return (per_token.sum(dim=-1) / per_seq_count.clamp(min=1)).sum() / total


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over `mask` (0 when the mask is empty), detached, float32 0-d tensor."""
    values = values.detach().float()
    count = mask.sum(dtype=torch.float32)
    return torch.where(mask, values, 0.0).sum() / count.clamp(min=1)
