"""Loss normalizers shared by the MOPD and GRPO losses.

Shape legend: B sequences, T response positions.

- `token-mean`: Σ_{b,t} m·ℓ / max(1, Σ_{b,t} m) — every loss token of the batch weighs the same
  (AReaL, verl default).
- `seq-mean-token-mean`: mean over sequences with at least one loss token of Σ_t m·ℓ / Σ_t m — the
  1/|y| of MiMo-V2-Flash eq. 7, then the mean over sequences. Sequences with no loss token are left out
  of the outer mean (verl `seq-mean-token-mean`).

`m` is the loss mask (response tokens), never a mismatch-correction mask: tokens dropped by the IcePop
mask keep counting here (MiMo eq. 7 divides by |y|; AReaL keeps the pre-rejection mask).
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


def normalize(per_token: torch.Tensor, mask: torch.Tensor, normalizer: Normalizer) -> torch.Tensor:
    """Reduce a [B, T] per-token loss (already 0 where `mask` is False) to a scalar.

    Args:
        per_token: [B, T] float; must be exactly 0 at masked positions.
        mask: [B, T] bool loss mask (the denominator's mask).
        normalizer: "token-mean" or "seq-mean-token-mean" (see the module docstring).

    Returns:
        0-d tensor, per_token's dtype. An all-masked batch gives 0 with a zero gradient.
    """
    count = mask.sum(dtype=per_token.dtype)
    if normalizer == "token-mean":
        return per_token.sum() / count.clamp(min=1)
    if normalizer == "seq-mean-token-mean":
        per_seq_count = mask.sum(dim=-1, dtype=per_token.dtype)
        seq_mean = per_token.sum(dim=-1) / per_seq_count.clamp(min=1)
        n_seq = (per_seq_count > 0).sum(dtype=per_token.dtype)
        return seq_mean.sum() / n_seq.clamp(min=1)
    raise LossInputError(f"normalizer is {normalizer!r}; expected 'token-mean' or 'seq-mean-token-mean'")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over `mask` (0 when the mask is empty), detached, float32 0-d tensor."""
    values = values.detach().float()
    count = mask.sum(dtype=torch.float32)
    return torch.where(mask, values, 0.0).sum() / count.clamp(min=1)
