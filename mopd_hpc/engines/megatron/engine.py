"""The megatron backend's train engine (DESIGN.md §5): the actor's `MegatronTrainEngine` and the labels-path
forward `MegatronForward` the teachers' forward-only scoring engine (`scoring.py`) shares, on megatron-core
GPTModel with the fused-attention local spec (`model.py`). GPU only. Process setup (`initialize_parallel`,
`tp_info`, `megatron_data_parallel`) is `parallel.py`; the model build/load path (`build_from_hf`) `build.py`.

Log-probs: GPTModel's `labels` path gives the per-position loss −log π(label_p | ≤ p) through megatron's
vocab-parallel cross entropy (fp32), so tensor parallelism needs no full-vocabulary gather. With
labels_p = input_ids_{p+1}, the log-prob of response token t of row b sits at position
response_start[b] + t − 1 (`TokenBatch.logit_positions`). Rows are right-padded: causal attention alone is exact.

The train step (the loss section bound at construction as `mopd.objective.Objective`: either estimator,
GRPO at loss level c_rl, α·A_ORM at advantage level; `compute_loss`):
    zero DDP grad buffers → per micro-batch: loss → backward → finalize_model_grads → MegatronOptimizer.step()
Estimator topk reads the vocab-parallel logits (GPTModel without labels) through
`mopd.vocab_parallel.VocabParallelLogprobs`: per-shard logsumexp all-reduced over the TP group, each top-k id
read on the rank owning it; no rank holds a [tokens × vocabulary] float32 tensor (the model-dtype local
logits [B, L, V'/tp], their response rows and gradient, and one float32 block of rows).
Micro-batches (`engines/micro_batch.py`, `models.actor.micro_batch_tokens`): the rows split by the token
budget, each micro-batch's loss its per-token sum over the WHOLE step's denominator (`loss_denominator`,
computed once), its backward accumulating into DDP's fp32 main-grad buffers; all but the last run under the
DDP's `no_sync()` (the bucket groups' `is_last_microbatch` = False: no grad reduce is started, which matters
with `overlap_grad_reduce`), and `finalize_model_grads` reduces once. Statistics combine as sums and
token-weighted means (`StepStats`); `micro_batch_tokens` null derives a budget from the free GPU memory
(`micro_batch.step_budget`). `activation_checkpointing`: full recompute of each layer
(`model.enable_full_recompute`). MoE router losses: megatron-core's own, weighted per micro-batch as the torch
engine's (`router_losses.py`).
(`finalize_model_grads` = DDP's finish_grad_sync plus the tensor-parallel all-reduce of replicated weights
whose gradients differ per TP rank: q/k layernorm, each rank seeing its own heads; with only finish_grad_sync,
TP ranks drifted apart after one step — seen on 2 H200s, issue 8.) (clipping to optimizer.grad_clip and the
norm are the optimizer's: `clip_grad`, returned grad_norm).
The lr schedule (`models.actor.optimizer.schedule`, warm-up, min_lr_ratio over `total_steps`) is
megatron-core's `OptimizerParamScheduler` (engines/lr_schedule.py `megatron_scheduler_args`), stepped after
each successful update, its state in the checkpoint (`state_dict()["scheduler"]`).
Data parallel (megatron's DP group, `megatron_data_parallel`): the denominator and token count are summed over
the DP ranks, each rank backpropagates DP·L_r (megatron's DDP averages over DP), statistics are reduced as the
torch engine's (engines/data_parallel.py). Tensor parallel > 1: `named_weights` (weight sync, evaluation, the
HF export) gathers one HF tensor at a time over the TP group (`shard_plan.py`, `tp_gather.py`), a collective
the other ranks of that TP group join (`join_weight_gather`).
Expert parallel > 1 (`expert_parallel.py`, tensor_parallel 1): each rank holds E/EP experts of each MoE layer,
megatron's DDP reduces their gradients over the expert-data-parallel group; `named_weights` and the
checkpoint's model all-gather every expert over the EP group (the other ranks of rank 0's EP group join
rank 0's gathers: `in_rank0_expert_group`); every forward is a collective over the EP group (the token
dispatch: alltoall on GPUs; allgather on CPU, which needs the same [B, L] on each EP rank), so the EP ranks of
a step run as many micro-batches (`_expert_group_micro_batches`), and call `logprobs` / `topk` together.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.lr_schedule import megatron_scheduler_args
from mopd_hpc.engines.megatron import parallel
from mopd_hpc.engines.megatron.checkpoint_state import MegatronCheckpointState
from mopd_hpc.engines.megatron.convert import Qwen3Shape, gather_tp, mcore_to_hf
from mopd_hpc.engines.megatron.expert_parallel import ep_info, gather_experts, group_max
from mopd_hpc.engines.megatron.hf_model import hf_model_from_weights
from mopd_hpc.engines.megatron.model import DTYPES, enable_full_recompute
from mopd_hpc.engines.megatron.residency import DDPResidency
from mopd_hpc.engines.megatron.router_losses import MegatronRouterLosses, padding_kwargs
from mopd_hpc.engines.megatron.routing_replay import MegatronRoutingReplay
from mopd_hpc.engines.megatron.shard_plan import ShardPlan
from mopd_hpc.engines.megatron.tp_gather import gathered_hf_weights
from mopd_hpc.engines.memory.estimates import MemoryModelError, ModelShape, train_state
from mopd_hpc.engines.micro_batch import (
    MicroBatching,
    StepStats,
    split_rows,
    step_budget,
    step_tokens,
)
from mopd_hpc.engines.protocol import ResidencyReport, refuse_loss
from mopd_hpc.engines.span_clock import SpanClock
from mopd_hpc.engines.train_objective import batch_objective, bind_objective
from mopd_hpc.mopd.objective import Objective
from mopd_hpc.mopd.topk import TeacherTopK
from mopd_hpc.mopd.vocab_parallel import (
    AllReduce,
    VocabParallelLogprobs,
    process_group_all_gather,
    process_group_all_reduce,
    vocab_parallel_topk,
)
from mopd_hpc.records.metrics_schema import TRAIN_FORWARD_BACKWARD_KEY, TRAIN_OPTIMIZER_KEY


class MegatronForward:
    """Response log-probs of a `TokenBatch` through a GPTModel (module docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, padding: bool = False) -> None:
        self.model, self.device, self.padding = model, device, padding  # padding: GPTModel's padding_mask

    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T] float32 log π(y_t); 0 at padded response positions. Carries the graph when grads are on."""
        ids = batch.input_ids.to(self.device)
        labels = torch.roll(ids, shifts=-1, dims=1)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        pad = padding_kwargs(batch, self.padding, self.device)
        per_position = -self.model(ids, positions, None, labels=labels, **pad)  # [B, L] fp32
        mask = batch.response_mask.to(self.device)
        out = per_position.gather(1, batch.logit_positions.to(self.device))
        return torch.where(mask, out, torch.zeros_like(out))

    def response_logits(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T, V_r] this TP rank's vocab-parallel logits (model dtype; V_r = V'/tp columns starting at
        rank·V_r) at the positions predicting each response token; carries the graph when grads are on.
        GPTModel's forward without labels gives [B, L, V_r] (`parallel_output`: no vocabulary gather)."""
        ids = batch.input_ids.to(self.device)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        logits = self.model(ids, positions, None, **padding_kwargs(batch, self.padding, self.device))
        index = batch.logit_positions.to(self.device)[..., None].expand(-1, -1, logits.shape[-1])
        return logits.gather(1, index)


class MegatronTrainEngine(MegatronCheckpointState):
    """The actor on megatron-core: DDP (distributed optimizer) + Megatron Adam, the MOPD loss bound once (its
    checkpoint methods: `checkpoint_state.MegatronCheckpointState`)."""

    router_losses = MegatronRouterLosses.INERT  # set in __init__ (megatron-core's own router losses)
    routing_replay = MegatronRoutingReplay.NONE  # set in __init__ (megatron-core's RouterReplay)
    expert_parallel: tuple[int, int, Any] = (1, 0, None)  # set in __init__ (megatron's EP group)

    def __init__(
        self, model: torch.nn.Module, shape: Qwen3Shape, hf_config: Mapping[str, Any], loss: LossConfig,
        optimizer: OptimizerConfig, device: torch.device, dtype: str = "bfloat16",
        micro_batching: MicroBatching = MicroBatching(), total_steps: int = 1,
    ) -> None:  # fmt: skip
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        refuse_loss("megatron", loss)  # what config/capabilities.py declares the megatron engine computes
        bind_objective(loss)  # refuses a loss section no engine can apply (see `objective`)
        self.micro_batching = micro_batching
        if micro_batching.activation_checkpointing:
            enable_full_recompute(model)
        self.router_losses = MegatronRouterLosses(model, hf_config, loss)  # megatron-core's own
        self.routing_replay = MegatronRoutingReplay(model)  # replays batch.routed_experts (compute_loss)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        self.ddp = DistributedDataParallel(model.config, ddp_cfg, model)
        schedule = megatron_scheduler_args(optimizer, total_steps)  # engines/lr_schedule.py
        opt_cfg = MegatronOptimizerConfig(
            optimizer="adam", lr=optimizer.lr, min_lr=schedule["min_lr"], weight_decay=optimizer.weight_decay,
            clip_grad=optimizer.grad_clip or 0.0, bf16=dtype == "bfloat16", params_dtype=DTYPES[dtype],
            use_distributed_optimizer=True,
        )  # fmt: skip
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.ddp])
        #: the lr schedule: megatron-core's own scheduler, stepped once after each optimizer step
        self.scheduler = OptimizerParamScheduler(self.optimizer, **schedule)
        self.model, self.shape, self.hf_config, self.device = model, shape, dict(hf_config), device
        self.loss_config, self.dtype = loss, dtype
        self.forward = MegatronForward(self.ddp, device, padding=self.router_losses.active)
        self.residency = DDPResidency(self.ddp, self.optimizer, device)
        self.steps = 0
        #: megatron's DP group: the step's token count and statistics are reduced over it (`train_step`).
        self.data_parallel = parallel.megatron_data_parallel()
        #: Which slice of each HF tensor this TP rank holds (weight sync and export gather per HF tensor).
        self.shard_plan = ShardPlan.create(shape, parallel.tp_info()[0])
        #: This rank's place in its TP group (names its file of the optimizer state at tensor_parallel > 1).
        self.tp_rank = parallel.tp_info()[1]
        self.expert_parallel = ep_info()  # (size, rank, group): expert_parallel.py; size 1: every expert
        try:  # what the default micro-batch budget is estimated from (None: the whole batch in one)
            self.memory_shape: ModelShape | None = ModelShape.from_hf_config(hf_config)
        except MemoryModelError:
            self.memory_shape = None

    @property
    def objective(self) -> Objective:
        """The composed loss of the bound `loss:` section (`mopd.objective`; built from `loss_config`)."""
        return Objective(self.loss_config)

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        self._require_resident("logprobs")
        self.ddp.eval()
        return self.forward.token_logprobs(batch).float().cpu()

    @torch.no_grad()
    def topk(self, batch: TokenBatch, k: int) -> TeacherTopK:
        """The student's own top-min(k, V) per response position (no gradient), on the CPU: per-shard top-k
        of the vocab-parallel logits, then the top-k of the TP group's candidates
        (`vocab_parallel.vocab_parallel_topk`; a collective over the TP group at tensor_parallel > 1)."""
        self._require_resident("topk")
        self.ddp.eval()
        logits = self.forward.response_logits(batch)
        tp, rank, group = parallel.tp_info()
        gather = None if tp == 1 else process_group_all_gather(group)
        ids, values = vocab_parallel_topk(
            logits, rank * logits.shape[-1], self.shape.vocab_size, k, gather, self._tp_all_reduce()
        )
        return TeacherTopK(ids.cpu(), values.cpu())

    def _tp_all_reduce(self) -> AllReduce | None:
        """The TP group's all-reduce (None at tensor_parallel 1: one shard, no collective)."""
        tp, _, group = parallel.tp_info()
        return None if tp == 1 else process_group_all_reduce(group)

    def compute_loss(
        self, batch: TrainBatch, denominator: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The bound objective of `batch` (on the device, B ≥ 1): (loss, the [B, T] float32 log π_θ(y_t) it
        was computed from, carrying the gradient, the terms' statistics). Estimator sampled: the labels
        path (vocab-parallel cross entropy). Estimator topk: one forward without labels, the sampled tokens'
        and the teachers' top-k ids' log-probs from the vocab-parallel logits (`VocabParallelLogprobs`:
        per-shard logsumexp all-reduced over the TP group, no vocabulary gather).

        Raises:
            EngineError: the batch lacks what a positive coefficient's term reads, or its routed experts do
                not fit the model.
        """
        tokens = batch.tokens
        self.routing_replay.start_batch(batch)  # the rollout's routed experts, if recorded, until end()
        mask = tokens.response_mask
        student = None
        if self.objective.uses_topk:
            logits = self.forward.response_logits(tokens)
            rank = parallel.tp_info()[1]
            student = VocabParallelLogprobs(
                logits, rank * logits.shape[-1], self.shape.vocab_size, self._tp_all_reduce()
            )
            sampled = student(torch.where(mask, tokens.response_ids, 0)[..., None]).squeeze(-1)
            logprobs = torch.where(mask, sampled, 0.0)
        else:
            logprobs = self.forward.token_logprobs(tokens)
        loss, stats = batch_objective(self.objective, batch, logprobs, student, denominator)
        return loss, logprobs, stats

    def train_step(
        self,
        batch: TrainBatch,
        observe: Callable[[torch.Tensor], Mapping[str, float]] | None = None,
    ) -> dict[str, float]:
        """One step: zero grad buffers, per micro-batch MOPD loss and backward, grad sync, Megatron optimizer
        step (module docstring).

        Returns floats: `loss`, `grad_norm` (the optimizer's, before clipping), `step_skipped`, `lr`,
        `tokens`, `micro_batches`, the loss's `mopd/*` statistics (combined over micro-batches),
        `time/train/forward_backward_s` (seconds of every micro-batch's forward, loss and backward) and
        `time/train/optimizer_s` (seconds of `finalize_model_grads`, the DP gradient reduce and TP all-reduce,
        and the optimizer's step, its clip included): device time, CUDA synchronized at each boundary
        (`engines/span_clock.py`); and what `observe` returns when given the step's detached [B, T] float32
        log π_θ(y_t) (before the update; as `TorchTrainEngine.train_step`). At megatron data-parallel size > 1
        (a collective over the DP group), the token count is the whole step's and the statistics are reduced
        as `TorchTrainEngine.train_step`'s (`DataParallel.all_reduce_stats`): the DP = n update is the DP = 1
        update; the two `time/train/*` seconds are this rank's own, not reduced (the metrics line carries
        rank 0's).

        Raises:
            EngineError: the actor is offloaded, or the batch lacks what a positive coefficient's term reads.
        """
        from megatron.core.distributed import finalize_model_grads

        self._require_resident("train_step")
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        batch = batch.to(self.device)
        mask = batch.tokens.response_mask
        dp = self.data_parallel
        local_tokens, denominator, tokens = step_tokens(mask, self.loss_config.normalizer, dp)
        parts: list[Any] = [None] if batch.batch_size == 0 else split_rows(batch, self._budget())
        parts += [None] * (self._expert_group_micro_batches(len(parts)) - len(parts))  # stand-ins, EP > 1
        full_logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        combined = StepStats()
        clock = SpanClock(self.device)
        clock.start()
        for i, part in enumerate(parts):
            rows = batch.stand_in() if part is None else part.batch
            sync = contextlib.nullcontext() if i == len(parts) - 1 else self.ddp.no_sync()
            with sync:
                loss, logprobs, stats = self.compute_loss(rows, denominator)
                # megatron's DDP averages the DP ranks' gradients (gradient_scaling_factor 1/DP): backward on
                # DP·L_r makes the reduced gradient ∇L of the whole step, the DP = 1 update
                share = float(rows.tokens.response_mask.sum()) / max(tokens, 1.0)  # of the router losses
                self.router_losses.scale(share, dp.size)
                (loss * dp.size if dp.distributed else loss).backward()
            stats |= self.router_losses.collect(self.device)  # after the backward: recompute computes them
            loss = loss.detach() + self.router_losses.weighted(stats, share)  # the loss as the torch engine's
            self.routing_replay.end()
            combined.add(stats | {"loss": loss.detach()}, rows.tokens.response_mask.sum())
            if part is not None:
                full_logprobs[part.index, : logprobs.shape[1]] = logprobs.detach().float()
        clock.lap(TRAIN_FORWARD_BACKWARD_KEY)
        observed = dict(observe(full_logprobs)) if observe is not None else {}
        clock.skip()
        finalize_model_grads([self.ddp])
        lr = float(self.optimizer.param_groups[0]["lr"])  # this step's (the torch engine reports the same)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:  # as Megatron-LM's training loop: a skipped update (fp16 loss scaling) does not advance it
            self.scheduler.step(1)
        clock.lap(TRAIN_OPTIMIZER_KEY)
        self.steps += 1
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        return combined.finish(observed, dp, float(local_tokens), self.device, grad_norm=norm, skipped=not ok,
                               lr=lr, tokens=tokens, micro_batches=len(parts), spans=clock.spans)  # fmt: skip

    def _expert_group_micro_batches(self, count: int) -> int:
        """The most micro-batches of a rank of this EP group (`count` at EP 1; module docstring): a rank with
        fewer runs its batch's stand-ins (`TrainBatch.stand_in`: no loss token), counted in `micro_batches`."""
        ep, _, group = self.expert_parallel
        return count if ep == 1 else group_max(count, group, self.device)

    def _budget(self) -> int | None:
        """This step's micro-batch budget (`micro_batch.step_budget`; the grad buffers exist already, Adam's
        moments are allocated at the first step)."""
        if self.micro_batching.tokens is not None or self.device.type != "cuda" or self.memory_shape is None:
            return self.micro_batching.tokens
        pending = 0 if self.steps else train_state(self.memory_shape, self.dtype, "megatron").optimizer
        return step_budget(
            self.micro_batching, self.device, self.memory_shape, self.dtype, "megatron", pending
        )

    def full_mcore_state(self) -> dict[str, torch.Tensor]:
        """The whole model's megatron state dict, on device: TP shards all-gathered over the TP group, or at
        expert_parallel > 1 (tensor_parallel 1) every expert all-gathered over the EP group, named by its global
        index (`expert_parallel.gather_experts`); a collective over that group."""
        tp, _, group = parallel.tp_info()
        local = {k: v.detach() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        if tp == 1:
            ep, _, ep_group = self.expert_parallel
            return local if ep == 1 else gather_experts(local, self.shape.num_experts, ep, ep_group)
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            for r in range(tp):
                shards[r][name] = parts[r]
        return gather_tp(shards, self.shape)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight, every expert included, for weight sync (a collective over the TP
        group, or over the EP group at expert_parallel > 1)."""
        self._require_resident("named_weights")
        if self.shard_plan.tp == 1:
            yield from mcore_to_hf(self.full_mcore_state(), self.shape).items()
            return
        # TP > 1: one HF tensor at a time over the TP group (engines/megatron/tp_gather.py); every rank of
        # the group must iterate to the end (a follower does on rank 0's "weights" record)
        local = {k: v.detach() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        yield from gathered_hf_weights(self.shard_plan, local, parallel.tp_info()[2])

    @property
    def gathers_over_tp(self) -> bool:
        """True when `named_weights` is a collective over the TP group (tensor_parallel > 1): the other ranks
        of rank 0's TP group must join every gather rank 0 makes (`join_weight_gather`)."""
        return self.shard_plan.tp > 1

    @property
    def gathers_over_ep(self) -> bool:
        """True when `named_weights` is a collective over the EP group (expert_parallel > 1)."""
        return self.expert_parallel[0] > 1

    @property
    def in_rank0_expert_group(self) -> bool:
        """True on a rank > 0 of global rank 0's EP group at expert_parallel > 1 (it joins rank 0's gathers)."""
        ep, _, group = self.expert_parallel
        return ep > 1 and dist.get_rank() != 0 and 0 in dist.get_process_group_ranks(group)

    def join_weight_gather(self) -> int:
        """A TP (or EP) rank > 0's part in a gather rank 0 makes (sync, evaluation, export): iterate `named_weights`
        and drop the tensors. Returns the number of HF tensors."""
        return sum(1 for _ in self.named_weights())

    def save_pretrained(self, directory: str | Path) -> None:
        """config.json + model.safetensors (HF names), gathered over the TP group, written by global rank 0."""
        from safetensors.torch import save_file

        weights = {k: v.cpu().contiguous() for k, v in self.named_weights()}
        if not dist.is_initialized() or dist.get_rank() == 0:  # one writer, whatever the DP size
            out = Path(directory)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(self.hf_config, indent=2))
            save_file(weights, str(out / "model.safetensors"))

    def evaluation_model(self) -> torch.nn.Module:
        """A transformers causal LM with the actor's current weights, on the actor's device, in eval mode:
        built from `hf_config` and `named_weights()` on each call (the caller drops it after use; nothing
        here keeps a reference; per-expert names fill transformers' fused experts: `hf_model.py`). Tied
        embeddings: lm_head shares embed_tokens, as the HF config says.

        Raises:
            EngineError: the actor is offloaded, or the weights do not fit the config's model.
        """
        return hf_model_from_weights(self.hf_config, self.named_weights(), self.device, DTYPES[self.dtype])

    def offload(self) -> ResidencyReport:
        return self.residency.offload()

    def onload(self) -> ResidencyReport:
        return self.residency.onload()
