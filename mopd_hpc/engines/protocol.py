"""The train and scoring engine protocols (DESIGN.md §5), apart from their implementations.

Backends: `torch/` (transformers models, CPU or GPU) and megatron (megatron-core, GPU only).
The loss configuration is bound to a train engine ONCE, when it is built: `train_step(batch)` applies
that bound loss (the `loss` of DESIGN.md §5's `train_step(batch, loss)`), and a batch carries only
per-sample tensors.

Shape legend: B rows, T response positions, K top-k tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from mopd_hpc.config.actor_refusals import loss_refusals
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.mopd.topk import TeacherTopK


class EngineError(ValueError):
    """An engine was asked for something its configuration or state cannot give (bad device or dtype,
    a batch missing what the bound loss reads, weights offloaded)."""


def refuse_loss(engine: str, loss: Any) -> None:
    """Re-check at construction what `mopd-submit --check` checked: the `loss:` terms the actor engine `engine`
    computes (`config/capabilities.py` `loss_refusals(engine_only=True)`, one declaration for both).

    Raises:
        EngineError: one line per refused field, e.g. `loss.estimator: ... (got 'topk'; loss.estimator: ...)`.
    """
    if problems := loss_refusals(engine, loss, engine_only=True):
        raise EngineError("; ".join(p.render() for p in problems))


@dataclass(frozen=True, slots=True)
class ResidencyReport:
    """What an offload/onload did: `action` ("offload" | "onload"), `moved` (False for the CPU no-op),
    `bytes_moved` (parameters + gradients + optimizer state), `device` the engine's compute device,
    and a human `message` (also logged)."""

    action: str
    moved: bool
    bytes_moved: int
    device: str
    message: str


@runtime_checkable
class ScoringEngine(Protocol):
    """Forward-only engine of a teacher (or reference model): no optimizer state, no gradient."""

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T] float32 log π(y_t) of the response tokens; 0 at padded positions."""
        ...

    def topk(self, batch: TokenBatch, k: int) -> TeacherTopK:
        """The k most likely tokens at each response position: [B, T, min(k, V)]."""
        ...

    def offload(self) -> ResidencyReport:
        """Move weights to host memory (a real move on GPU; a logged no-op on CPU)."""
        ...

    def onload(self) -> ResidencyReport:
        """Move weights back onto the compute device."""
        ...


class Resident(Protocol):
    """Where an engine's weights are: `on_device` False while any of them is offloaded."""

    on_device: bool


@runtime_checkable
class TrainEngine(ScoringEngine, Protocol):
    """The actor's engine: a scoring engine plus one optimizer step with the bound loss, as the controller
    and the actor group's ranks call it (trainer/controller.py, trainer/rank_step.py).

    Attributes:
        residency: where the weights are (the controller onloads the engine when `on_device` is False).
    """

    residency: Resident

    def train_step(
        self,
        batch: TrainBatch,
        observe: Callable[[torch.Tensor], Mapping[str, float]] | None = None,
    ) -> dict[str, float]:
        """Forward, loss (bound at construction), backward, gradient clipping, optimizer step, on this
        rank's rows of the step (the loss normalized over the whole step when the engine is data parallel).

        observe: called once with the step's detached [B, T] float32 log π_θ(y_t) before the update (monitoring
        statistics without a second forward pass); what it returns is merged into the result.
        Returns floats: `loss`, `grad_norm` (before clipping), the loss terms' statistics (`mopd/*`,
        `topk/*`, `grpo/*`), `tokens`, and the seconds of its parts `time/train/forward_backward_s` (every
        micro-batch's forward, loss, backward) and `time/train/optimizer_s` (gradient finalize/clip and the
        optimizer step): device time, this rank's own (not reduced over data-parallel ranks;
        `records/metrics_schema.py`).
        """
        ...

    def evaluation_model(self) -> torch.nn.Module:
        """A transformers causal LM with the current weights, for in-process greedy evaluation (the engine's
        own model or a copy the caller drops after use). The run does not call it: the student is evaluated
        on the rollout engines (trainer/evaluate.py); benchmarks/fidelity.py and tests do."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """{"model": ..., "optimizer": ...}: what a checkpoint needs to resume bit-for-bit."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output (tensors may be on CPU)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF state_dict name, tensor) of every weight, for weight sync to the rollout engines."""
        ...

    def save_pretrained(self, directory: str) -> None:
        """Export the student as an HF checkpoint (config.json + safetensors)."""
        ...
