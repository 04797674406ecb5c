"""A batch's rows on the HF rollout engine (`hf_engine.HFRolloutEngine.generate`): one row's request, what the
row produced, and the gate asked between decoding steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mopd_hpc.engines.rollout.protocol import DEFAULT_WEIGHT_VERSION, SamplingParams


class StepGate(Protocol):
    """Asked between decoding steps; False ends the batch with finish_reason abort."""

    def between_steps(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class RowRequest:
    """One row of a batch: a prompt and one copy's sampling parameters and seed."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_routed_experts: bool = False


@dataclass(slots=True)
class RowResult:
    """What one row produced. finish: SGLang's finish_reason object ({type: stop|length|abort, ...}).

    output_logprobs[t]: log μ(output_ids[t]), float. input_logprobs: one entry per prompt position from
    logprob_start_len, None at position 0 (nothing predicts the first token). *_top: per position, the
    top_logprobs_num (logprob, token_id) pairs of the same distribution. routed_experts[t]: [M, k] int16
    expert ids the M MoE layers' routers selected at the position whose logits gave output_ids[t]
    (`return_routed_experts`, an MoE model).
    """

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish: dict[str, Any] = field(default_factory=dict)
    weight_version: str = DEFAULT_WEIGHT_VERSION
    routed_experts: list[torch.Tensor] = field(default_factory=list)
