"""Micro-batches of a train step: the rows of a step (a data-parallel rank's shard) split by a token budget,
one forward and backward each, gradients accumulated, one optimizer step (DESIGN.md §7, Memory).

Budget (`MicroBatching.tokens`, from `models.actor.micro_batch_tokens`): a micro-batch holds b rows cut to
their longest row's prompt + response length ℓ (`TrainBatch.select`: no padding beyond what its own rows
need), and b·ℓ — the positions the decoder runs over, which activation memory scales with — stays within the
budget. Rows are taken longest first (a stable sort by length), greedily: a micro-batch takes the next row
while (b + 1)·ℓ ≤ budget, ℓ being its first (longest) row's length; a row longer than the budget is a
micro-batch alone. None: the whole shard in one micro-batch (the rows kept in their order, cut likewise).

Exactness: every loss term is a per-row numerator over a count of the whole step (`mopd.normalize`), so the
engines compute the step's denominator once (`loss_denominator` of the whole shard, summed over data-parallel
ranks) and pass it to every micro-batch's loss: the micro-batches' losses and gradients sum to the step's.
Statistics combine by the data-parallel rule (`engines.data_parallel`): SUMS (`loss`, `*/loss`, `*/tokens`)
are summed; MEANS (masked means over a micro-batch's loss tokens) are averaged weighted by each micro-batch's
loss-token count — exact for means over the loss mask (`StepStats`).

Shape legend: B rows of the shard, b rows of a micro-batch, L positions, T response positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mopd_hpc.engines.batch import TrainBatch
from mopd_hpc.engines.memory.estimates import ModelShape, default_micro_batch_tokens
from mopd_hpc.mopd.normalize import loss_denominator

if TYPE_CHECKING:
    from mopd_hpc.config.models import ActorConfig
    from mopd_hpc.engines.data_parallel import DataParallel


class MicroBatchError(ValueError):
    """A micro-batch budget that is not a positive int, or statistics that disagree between micro-batches."""


@dataclass(frozen=True, slots=True)
class MicroBatching:
    """How a train engine runs a step.

    Attributes:
        tokens: the budget of one micro-batch in positions (rows × padded length, module docstring), ≥ 1;
            None = on CPU the whole shard in one micro-batch, on CUDA a budget derived at each step from the
            free GPU memory and the model's shape (`step_budget`).
        activation_checkpointing: recompute each decoder layer's activations in the backward (torch:
            transformers' gradient checkpointing, non-reentrant; megatron: full recompute, uniform, one
            layer per unit).

    Raises:
        MicroBatchError: tokens neither None nor an int ≥ 1.
    """

    tokens: int | None = None
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        t = self.tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise MicroBatchError(
                f"micro_batch_tokens is {t!r}; expected an int >= 1 (positions per micro-batch) or null"
            )

    @classmethod
    def from_actor(cls, actor: ActorConfig) -> MicroBatching:
        """`models.actor.micro_batch_tokens` and `models.actor.activation_checkpointing`."""
        return cls(actor.micro_batch_tokens, actor.activation_checkpointing)


def step_budget(
    micro: MicroBatching,
    device: torch.device,
    shape: ModelShape | None,
    dtype: str,
    engine: str,
    still_to_allocate: int = 0,
) -> int | None:
    """This step's micro-batch budget: `micro.tokens` when set; else, on CUDA with a known shape,
    `memory.estimates.default_micro_batch_tokens` of what the GPU has free now (the driver's free memory plus
    what this process's caching allocator holds unused) less `still_to_allocate` (state the step will still
    allocate: gradients, a first step's optimizer moments); else None (the whole shard: CPU, or a model
    config the estimate cannot read)."""
    if micro.tokens is not None:
        return micro.tokens
    if device.type != "cuda" or shape is None:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return default_micro_batch_tokens(
        shape, dtype, engine, free - still_to_allocate, micro.activation_checkpointing
    )


def release_activations(device: torch.device) -> None:
    """At the end of a train step on CUDA: the caching allocator's unused blocks (the step's activations,
    logits and their gradients) go back to the device, so that the children sharing the GPU (teachers, the
    rollout engine) have them in the other phases, as the memory plan counts activations in `train` only
    (`plan/memory_plan.py`; measured on an H200 at 64 x 4 x 1024 with the ipc sync, where nothing else
    released them: the actor kept 49.8 GiB reserved through the teacher phase, 1 % over the plan). The next
    step allocates them again. No-op off CUDA."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_tokens(
    mask: torch.Tensor, normalizer: str, dp: DataParallel
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A train step's counts, once before its micro-batches (module docstring, Exactness), from this rank's
    response mask [B, T]: (local_tokens, 0-d int64: this rank's loss tokens; denominator, 0-d: the step's
    loss denominator, `loss_denominator(mask, normalizer)` summed over the data-parallel ranks, given to every
    micro-batch's loss; tokens, float: the step's loss tokens summed over the ranks). One all-reduce."""
    local_tokens = mask.sum(dtype=torch.int64)
    counts = torch.stack([loss_denominator(mask, normalizer), local_tokens])
    dp.all_reduce_sum(counts)
    return local_tokens, counts[0], float(counts[1])


def plan_rows(lengths: Sequence[int], budget: int | None) -> list[list[int]]:
    """Row indices of each micro-batch (module docstring's rule), in the order they run.

    Args:
        lengths: each row's prompt + response length, ≥ 1.
        budget: positions per micro-batch, ≥ 1; None = one micro-batch of every row in order.

    Returns:
        A partition of range(len(lengths)); [] for no rows.
    """
    if not lengths:
        return []
    if budget is None:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plan: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            plan.append(current)
            current = []
        current.append(i)
    plan.append(current)
    return plan


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch: `index` [b] int64, its rows in the shard (on the batch's device), and `batch`, those
    rows cut to what they need (`TrainBatch.select`)."""

    index: torch.Tensor
    batch: TrainBatch


def split_rows(batch: TrainBatch, budget: int | None) -> list[MicroBatch]:
    """The shard `batch` (B ≥ 1) as micro-batches (`plan_rows` of its rows' lengths). Each keeps at least one
    response position (width ≥ 1 when T ≥ 1) so that every loss term sees a [b, T'] tensor."""
    tokens = batch.tokens
    lengths = tokens.attention_mask.sum(dim=1).tolist()
    responses = tokens.response_lengths.tolist()
    out = []
    for rows in plan_rows(lengths, budget):
        index = torch.tensor(rows, dtype=torch.int64, device=tokens.input_ids.device)
        length = max(lengths[i] for i in rows)
        width = min(tokens.response_width, max(1, max(responses[i] for i in rows)))
        out.append(MicroBatch(index, batch.select(index, length, width)))
    return out


def is_additive(key: str) -> bool:
    """True for a statistic that is a share of the step's total (`loss`, a term's `*/loss`, `*/tokens`):
    summed over micro-batches and ranks; every other one is a masked mean over loss tokens."""
    return key == "loss" or key.endswith(("/loss", "/tokens"))


class StepStats:
    """The statistics of a step's micro-batches, combined exactly (module docstring). Kept as device
    tensors (float64) until `result`, which synchronizes once."""

    def __init__(self) -> None:
        self._keys: tuple[str, ...] | None = None
        self._rows: list[torch.Tensor] = []

    def add(self, stats: Mapping[str, torch.Tensor], tokens: torch.Tensor) -> None:
        """One micro-batch's statistics (0-d tensors) and its loss-token count n_i (0-d).

        Raises:
            MicroBatchError: the names differ from the first micro-batch's.
        """
        keys = tuple(sorted(stats))
        if self._keys is None:
            self._keys = keys
        elif keys != self._keys:
            raise MicroBatchError(
                f"a micro-batch's statistics are {list(keys)}; the first one's were {list(self._keys)}"
            )
        n = tokens.detach().to(torch.float64)
        values = torch.stack([stats[k].detach().to(torch.float64).reshape(()) for k in keys])
        self._rows.append(torch.cat([values * n, values, n.reshape(1)]))

    @property
    def count(self) -> int:
        """Micro-batches added."""
        return len(self._rows)

    def result(self) -> dict[str, float]:
        """name → Σ_i x_i for additive names, Σ_i n_i·x_i / Σ_i n_i for means (the plain mean over
        micro-batches when no micro-batch has a loss token); {} before any `add`."""
        if self._keys is None:
            return {}
        total = torch.stack(self._rows).sum(dim=0).tolist()
        k, weight = len(self._keys), total[-1]
        out = {}
        for i, key in enumerate(self._keys):
            if is_additive(key):
                out[key] = total[k + i]
            else:
                out[key] = total[i] / weight if weight > 0 else total[k + i] / len(self._rows)
        return out

    def step_result(
        self, observed: Mapping[str, float], dp: DataParallel, local_tokens: float, device: torch.device
    ) -> dict[str, float]:
        """The train step's statistics, as both train engines report them: `result()` with `observed` (the
        `observe` function's values) added, then reduced over `dp` (`DataParallel.all_reduce_stats`):
        additive names summed over ranks, `observed`'s and every other one the mean weighted by each rank's
        `local_tokens` (its loss-token count). At DP = 1 the combined values, unreduced.

        Raises:
            DataParallelError: the ranks' names differ.
        """
        out = self.result() | dict(observed)
        if not dp.distributed:
            return out
        sums = {k: v for k, v in out.items() if is_additive(k) and k not in observed}
        means = {k: v for k, v in out.items() if k not in sums}
        return dp.all_reduce_stats(means, sums, float(local_tokens), device)

    def finish(
        self,
        observed: Mapping[str, float],
        dp: DataParallel,
        local_tokens: float,
        device: torch.device,
        *,
        grad_norm: float,
        skipped: bool,
        lr: float,
        tokens: float,
        micro_batches: int,
        spans: Mapping[str, float],
        grad_clip_coef: float | None = None,
    ) -> dict[str, float]:
        """What both train engines' `train_step` returns: `step_result`, then this rank's optimizer step
        (grad_norm, grad_clip_coef where the engine clips itself, step_skipped 1.0/0.0, its lr, the step's
        loss `tokens`, `micro_batches`) and the step's `time/train/*` seconds (`spans`). The step's
        activations then go back to the device (`release_activations`)."""
        out = self.step_result(observed, dp, local_tokens, device)
        out["grad_norm"] = grad_norm
        if grad_clip_coef is not None:
            out["grad_clip_coef"] = grad_clip_coef
        out |= {"step_skipped": 1.0 if skipped else 0.0, "lr": lr, "tokens": tokens}
        out["micro_batches"] = float(micro_batches)
        release_activations(device)
        return out | dict(spans)
