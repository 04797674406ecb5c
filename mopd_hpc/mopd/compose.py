"""Composition of distillation with RL: at loss level and at advantage level.

- Loss level (AReaL feature/mopd `compose_mopd_loss`): L = c_rl·L_RL + c_d·L_MOPD. A zero coefficient
  skips its term entirely: the term is not evaluated (a callable is not called, so a c_d = 0 run never
  asks a teacher) and not multiplied (0·NaN would be NaN).
- Advantage level (MiMo-V2-Flash eq. 9): A_t + α·A_ORM, A_ORM a sequence-level advantage (GRPO
  group-normalized outcome reward) broadcast over the tokens of its sequence.

Shape legend: B sequences, T response positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mopd_hpc.config.loss import LossConfig

#: A loss term: a scalar tensor, a thunk that computes it on demand, or None when not computed.
LossTerm = torch.Tensor | Callable[[], torch.Tensor] | None


class CompositionError(ValueError):
    """A loss term is missing for a positive coefficient, or advantages have incompatible shapes."""


def _term(name: str, coefficient: float, term: LossTerm) -> torch.Tensor | None:
    if coefficient == 0:
        return None
    if term is None:
        raise CompositionError(
            f"{name} is {coefficient} but its loss term is None; compute it or set {name} to 0"
        )
    value = term() if callable(term) else term
    if value.dim() != 0:
        raise CompositionError(f"{name} loss has shape {list(value.shape)}; expected a 0-d tensor")
    return coefficient * value


def compose_loss(config: LossConfig, *, rl: LossTerm, distill: LossTerm) -> torch.Tensor:
    """L = c_rl·L_RL + c_d·L_MOPD with `config.rl_coefficient` and `config.distillation_coefficient`.

    Args:
        config: the `loss:` section.
        rl: L_RL (e.g. `grpo_policy_loss(...)[0]`), a thunk returning it, or None when c_rl = 0.
        distill: L_MOPD (e.g. `mopd_loss(...)[0]`), a thunk, or None when c_d = 0.

    Returns:
        0-d tensor. A term whose coefficient is 0 is neither evaluated nor added (NaN in it is ignored).

    Raises:
        CompositionError: a positive coefficient's term is None or not 0-d; both coefficients are 0.
    """
    terms = [
        t
        for t in (
            _term("rl_coefficient", config.rl_coefficient, rl),
            _term("distillation_coefficient", config.distillation_coefficient, distill),
        )
        if t is not None
    ]
    if not terms:
        raise CompositionError("rl_coefficient and distillation_coefficient are both 0: nothing to train")
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def compose_advantages(
    token_advantages: torch.Tensor, orm_advantages: torch.Tensor, alpha: float
) -> torch.Tensor:
    """A_t + α·A_ORM (MiMo-V2-Flash eq. 9).

    Args:
        token_advantages: [B, T] per-token advantages (e.g. the distillation advantage).
        orm_advantages: [B] sequence-level advantages (broadcast over T) or [B, T].
        alpha: α ≥ 0; 0 returns `token_advantages` unchanged (A_ORM is not read).

    Returns:
        [B, T] tensor, dtype of `token_advantages`.
    """
    if alpha == 0:
        return token_advantages
    batch = token_advantages.shape[0]
    if orm_advantages.dim() == 1 and orm_advantages.shape[0] == batch:
        orm = orm_advantages[:, None]
    elif orm_advantages.shape == token_advantages.shape:
        orm = orm_advantages
    else:
        raise CompositionError(
            f"orm_advantages has shape {list(orm_advantages.shape)}; expected [{batch}] or "
            f"{list(token_advantages.shape)}"
        )
    return token_advantages + alpha * orm.to(token_advantages.dtype)
