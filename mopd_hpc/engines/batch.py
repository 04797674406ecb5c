"""Batches of the train/scoring engines: the padded token layout and the per-sample tensors of a step.

Layout (`TokenBatch`): row b is prompt_b ++ output_b, right padded to L = max_b(|prompt_b| + |output_b|).
The response token t of row b (0 ≤ t < |output_b|) sits at input position response_start[b] + t and is
predicted by the logits at position response_start[b] + t − 1, so every log-prob an engine returns is
[B, T] over response positions, T = max_b |output_b|, with `response_mask` marking the real ones.

A batch carries only per-sample tensors (token ids, behavior log-probs μ, teacher targets, route weights,
advantages); static configuration (the loss section, k of top-k, dtypes) is bound to the engine once.

Shape legend: B rows (samples), L prompt + response positions, T response positions, K top-k tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from mopd_hpc.mopd.targets import TeacherTargets
from mopd_hpc.mopd.topk import TeacherTopK


class BatchError(ValueError):
    """A batch is malformed: ragged or empty inputs, out-of-range offsets, or tensors of the wrong shape."""


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise BatchError(f"{name} has shape {list(tensor.shape)}; expected {list(shape)}")


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Prompt + response rows in the right-padded layout (module docstring). Build with `from_samples`
    or `from_rows`.

    Attributes:
        input_ids: [B, L] int64, prompt then response, `pad_id` after the row's end.
        attention_mask: [B, L] int64, 1 on real tokens.
        response_ids: [B, T] int64, the response tokens y_t (`pad_id` where `response_mask` is False).
        response_mask: [B, T] bool, True on real response tokens.
        response_start: [B] int64, index in `input_ids` of each row's first response token (≥ 1).
        pad_id: the padding token id.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    response_start: torch.Tensor
    pad_id: int

    @classmethod
    def from_samples(
        cls, prompt_ids_list: Sequence[Sequence[int]], output_ids_list: Sequence[Sequence[int]], pad_id: int
    ) -> TokenBatch:
        """Rows prompt_b ++ output_b. Every prompt needs ≥ 1 token (the first response token is predicted
        from the last prompt position); outputs may be empty.

        Raises:
            BatchError: no samples, the two lists differ in length, an empty prompt, or a negative id.
        """
        if len(prompt_ids_list) != len(output_ids_list):
            raise BatchError(
                f"prompt_ids_list has {len(prompt_ids_list)} rows but output_ids_list has "
                f"{len(output_ids_list)}; expected one output per prompt"
            )
        rows = [list(p) + list(o) for p, o in zip(prompt_ids_list, output_ids_list, strict=True)]
        return cls.from_rows(rows, [len(p) for p in prompt_ids_list], pad_id)

    @classmethod
    def from_rows(
        cls, input_ids: Sequence[Sequence[int]], response_start: Sequence[int], pad_id: int
    ) -> TokenBatch:
        """Rows given whole (prompt + response), with the index where each row's response begins.

        Raises:
            BatchError: no rows, a length mismatch, response_start[b] outside [1, len(row b)], or a
                negative token id or pad_id.
        """
        if not input_ids:
            raise BatchError("input_ids is empty; expected at least one row")
        if len(response_start) != len(input_ids):
            raise BatchError(
                f"response_start has {len(response_start)} entries; expected one per row ({len(input_ids)})"
            )
        if pad_id < 0:
            raise BatchError(f"pad_id is {pad_id}; expected a token id >= 0")
        for b, (row, start) in enumerate(zip(input_ids, response_start, strict=True)):
            if not 1 <= start <= len(row):
                raise BatchError(
                    f"response_start[{b}] is {start}; expected in [1, {len(row)}] (row {b} has {len(row)} "
                    "tokens and needs at least one prompt token)"
                )
            if row and min(row) < 0:
                raise BatchError(f"input_ids[{b}] holds a negative token id {min(row)}")
        lengths = [len(r) for r in input_ids]
        length = max(lengths)
        # one tensor from padded Python lists, the rest by masks and a gather: no per-row tensor ops (a
        # 128-row batch built row by row cost a MOPD step ~10 % of the actor's CPU)
        ids = torch.tensor(
            [[*row, *([pad_id] * (length - n))] for row, n in zip(input_ids, lengths, strict=True)],
            dtype=torch.int64,
        )
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        start_t = torch.tensor(list(response_start), dtype=torch.int64)
        attn = (torch.arange(length) < lengths_t[:, None]).to(torch.int64)
        resp_len = lengths_t - start_t
        width = int(resp_len.max())
        positions = torch.arange(width)
        mask = positions < resp_len[:, None]
        taken = ids.gather(1, (start_t[:, None] + positions).clamp(max=length - 1))
        resp = torch.where(mask, taken, torch.full_like(taken, pad_id))
        return cls(ids, attn, resp, mask, start_t, pad_id)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        """T, the padded response length."""
        return int(self.response_ids.shape[1])

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] int64, |output_b|."""
        return self.response_mask.sum(dim=1)

    @property
    def logit_positions(self) -> torch.Tensor:
        """[B, T] int64: the input position whose logits predict response token t (response_start − 1 + t),
        clamped into [0, L) at padded positions."""
        t = torch.arange(self.response_width, device=self.response_start.device)
        pos = self.response_start[:, None] - 1 + t[None, :]
        return pos.clamp(max=self.input_ids.shape[1] - 1)

    def to(self, device: torch.device | str) -> TokenBatch:
        """This batch with every tensor on `device`."""
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            response_start=self.response_start.to(device),
        )

    def rows(self, start: int, stop: int) -> TokenBatch:
        """Rows [start, stop) as a batch of the same L and T (for micro-batching)."""
        return replace(
            self,
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            response_ids=self.response_ids[start:stop],
            response_mask=self.response_mask[start:stop],
            response_start=self.response_start[start:stop],
        )

    def select(self, index: torch.Tensor, length: int, width: int) -> TokenBatch:
        """Rows `index` ([b] int64, on this batch's device) cut to their first `length` positions and
        `width` response positions: a micro-batch without the padding it does not need. Exact for the
        right-padded layout when length ≥ every chosen row's prompt + response and width ≥ its response
        (what `engines.micro_batch.split_rows` passes).

        Raises:
            BatchError: length or width outside [1, L] / [0, T].
        """
        if not 1 <= length <= self.input_ids.shape[1] or not 0 <= width <= self.response_width:
            raise BatchError(
                f"select(length={length}, width={width}); expected 1 <= length <= {self.input_ids.shape[1]} "
                f"and 0 <= width <= {self.response_width}"
            )
        return replace(
            self,
            input_ids=self.input_ids[index, :length],
            attention_mask=self.attention_mask[index, :length],
            response_ids=self.response_ids[index, :width],
            response_mask=self.response_mask[index, :width],
            response_start=self.response_start[index],
        )

    def pad_response_values(self, rows: Sequence[Sequence[float]], fill: float = 0.0) -> torch.Tensor:
        """Per-response-token values (e.g. μ from the rollout, log π_j from a teacher) as [B, T] float32.

        Raises:
            BatchError: not one row per sample, or row b's length differs from |output_b|.
        """
        lengths = self.response_lengths.tolist()
        if len(rows) != len(lengths):
            raise BatchError(f"rows has {len(rows)} entries; expected one per sample ({len(lengths)})")
        width = self.response_width
        padded = []
        for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            if len(row) != n:
                raise BatchError(f"rows[{b}] has {len(row)} values; expected {n} (one per response token)")
            padded.append([*row, *([fill] * (width - n))])
        return torch.tensor(padded, dtype=torch.float32).reshape(len(lengths), width)

    def unpad_response_values(self, values: torch.Tensor) -> list[list[float]]:
        """[B, T] → per-row lists of the real response positions (the inverse of `pad_response_values`)."""
        lengths = self.response_lengths.tolist()
        cpu = values.detach().float().cpu()
        return [cpu[b, :n].tolist() for b, n in enumerate(lengths)]


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """One training step's samples: tokens plus the per-sample tensors the bound loss reads.
    Build with `TrainBatch.create`, which checks every shape against `tokens`.

    Attributes:
        tokens: the `TokenBatch`.
        behavior_logprobs: [B, T] float32 log μ(y_t) from the rollout engine; immutable from rollout to
            loss (never replaced by a recomputed log-prob).
        targets: S and W, [B, T] each (`aggregate_teacher_targets`), for the `sampled` estimator.
        teacher_topk: teacher_id → `TeacherTopK` [B, T, K], for the `topk` estimator.
        teacher_weights: teacher_id → [B] float32 route weight w_j per sample (`topk` estimator).
        orm_advantages: [B] float32 A_ORM (e.g. `grpo_advantages` of the rewards) for the GRPO term or
            the advantage-level composition.
        ref_logprobs: [B, T] float32 reference-model log-probs (GRPO KL penalty only).
        routed_experts: [B, T, M, k] integer expert ids the rollout's router selected for each response token
            in each of the M MoE layers (at the position that predicts it; −1: not recorded), for rollout
            routing replay (`engines/moe_routing.py`).
        sft: an SFT warm-up step's batch (`loss.sft_warmup_steps`): the responses are the teachers' greedy
            answers and the loss is their cross-entropy (`mopd/sft.py`); μ and the teacher fields are not read.
    """

    tokens: TokenBatch
    behavior_logprobs: torch.Tensor
    targets: TeacherTargets | None = None
    teacher_topk: Mapping[str, TeacherTopK] = field(default_factory=lambda: MappingProxyType({}))
    teacher_weights: Mapping[str, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))
    orm_advantages: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    sft: bool = False

    @classmethod
    def create(
        cls,
        tokens: TokenBatch,
        behavior_logprobs: torch.Tensor,
        *,
        targets: TeacherTargets | None = None,
        teacher_topk: Mapping[str, TeacherTopK] | None = None,
        teacher_weights: Mapping[str, torch.Tensor] | None = None,
        orm_advantages: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        sft: bool = False,
    ) -> TrainBatch:
        """Validate shapes against `tokens` and freeze the mappings.

        Raises:
            BatchError: a [B, T] tensor of another shape, a top-k of another [B, T], a weight not [B], a
                top-k teacher without a weight, behavior_logprobs that requires grad, or routed_experts
                not an integer [B, T, M, k].
        """
        bt = (tokens.batch_size, tokens.response_width)
        _check_shape("behavior_logprobs", behavior_logprobs, bt)
        if behavior_logprobs.requires_grad:
            raise BatchError("behavior_logprobs requires grad; expected the rollout engine's constant μ(y_t)")
        if targets is not None:
            _check_shape("targets.logp_sum", targets.logp_sum, bt)
            _check_shape("targets.weight_sum", targets.weight_sum, bt)
        if ref_logprobs is not None:
            _check_shape("ref_logprobs", ref_logprobs, bt)
        if orm_advantages is not None:
            _check_shape("orm_advantages", orm_advantages, bt[:1])
        if routed_experts is not None and (
            routed_experts.dim() != 4
            or tuple(routed_experts.shape[:2]) != bt
            or routed_experts.is_floating_point()
        ):
            raise BatchError(
                f"routed_experts is {routed_experts.dtype} {list(routed_experts.shape)}; expected integer "
                f"[{bt[0]}, {bt[1]}, M, k]"
            )
        topk = dict(teacher_topk or {})
        weights = dict(teacher_weights or {})
        for tid, top in topk.items():
            if tuple(top.indices.shape[:2]) != bt or top.indices.shape != top.logprobs.shape:
                raise BatchError(
                    f"teacher_topk[{tid!r}] has indices {list(top.indices.shape)} and logprobs "
                    f"{list(top.logprobs.shape)}; expected equal [{bt[0]}, {bt[1]}, K]"
                )
            if tid not in weights:
                raise BatchError(f"teacher_topk has teacher {tid!r} but teacher_weights has no entry for it")
        for tid, w in weights.items():
            _check_shape(f"teacher_weights[{tid!r}]", w, bt[:1])
        return cls(
            tokens,
            behavior_logprobs,
            targets,
            MappingProxyType(topk),
            MappingProxyType(weights),
            orm_advantages,
            ref_logprobs,
            routed_experts,
            sft,
        )

    @property
    def batch_size(self) -> int:
        return self.tokens.batch_size

    def _map(self, tokens: TokenBatch, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """This batch with `tokens` and `fn` applied to every per-sample tensor (dim 0 = rows)."""

        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        targets = self.targets
        if targets is not None:
            targets = TeacherTargets(fn(targets.logp_sum), fn(targets.weight_sum))
        return TrainBatch(
            tokens,
            fn(self.behavior_logprobs),
            targets,
            MappingProxyType(
                {k: TeacherTopK(fn(v.indices), fn(v.logprobs)) for k, v in self.teacher_topk.items()}
            ),
            MappingProxyType({k: fn(v) for k, v in self.teacher_weights.items()}),
            opt(self.orm_advantages),
            opt(self.ref_logprobs),
            opt(self.routed_experts),
            self.sft,
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        """This batch with every tensor on `device`."""
        return self._map(self.tokens.to(device), lambda t: t.to(device))

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop) of every tensor (same L, T and K): a data-parallel shard. `start == stop` gives
        an empty shard (B = 0), which `TorchTrainEngine.train_step` accepts on a data-parallel rank."""
        return self._map(self.tokens.rows(start, stop), lambda t: t[start:stop])

    def select(self, index: torch.Tensor, length: int, width: int) -> TrainBatch:
        """Rows `index` of every tensor, positions cut to `length` and response positions to `width`
        (`TokenBatch.select`): a micro-batch. [B] tensors (weights, A_ORM) keep their one dimension.

        Raises:
            BatchError: what `TokenBatch.select` raises.
        """
        tokens = self.tokens.select(index, length, width)

        def per_token(t: torch.Tensor) -> torch.Tensor:
            return t[index, :width]

        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t[index] if t.dim() == 1 else per_token(t)

        targets = self.targets
        if targets is not None:
            targets = TeacherTargets(per_token(targets.logp_sum), per_token(targets.weight_sum))
        return TrainBatch(
            tokens,
            per_token(self.behavior_logprobs),
            targets,
            MappingProxyType(
                {
                    k: TeacherTopK(per_token(v.indices), per_token(v.logprobs))
                    for k, v in self.teacher_topk.items()
                }
            ),
            MappingProxyType({k: v[index] for k, v in self.teacher_weights.items()}),
            opt(self.orm_advantages),
            opt(self.ref_logprobs),
            opt(self.routed_experts),
            self.sft,
        )

    def stand_in(self) -> TrainBatch:
        """One row shaped like this batch (same T, K, dtypes, device, and the same optional fields) with an
        all-False response mask: every loss term reads it and gives 0 with a zero gradient. What an empty
        data-parallel shard runs in place of its rows, so that its rank still takes part in the step's
        forward, backward and gradient all-reduce."""
        tok = self.tokens
        width = tok.response_width
        dev = tok.input_ids.device
        ids = torch.full((1, width + 1), tok.pad_id, dtype=tok.input_ids.dtype, device=dev)
        tokens = TokenBatch(
            input_ids=ids,
            attention_mask=torch.ones_like(ids, dtype=tok.attention_mask.dtype),
            response_ids=ids[:, 1:].clone(),
            response_mask=torch.zeros((1, width), dtype=torch.bool, device=dev),
            response_start=torch.ones(1, dtype=tok.response_start.dtype, device=dev),
            pad_id=tok.pad_id,
        )
        return self._map(tokens, lambda t: torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=t.device))
