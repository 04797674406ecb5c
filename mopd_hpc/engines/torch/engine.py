"""The torch backend: transformers causal LMs as the actor's train engine and as teachers' scoring engines.

Log-probs of the response tokens are computed from the logits of the response positions only: the
decoder runs over [B, L], its hidden states are gathered at the T positions that predict response tokens,
and the LM head gives [B, T, V] logits in the model's dtype; `mopd.token_logprobs` turns them into float32
log-probs without a float32 [B, T, V] copy (fused Triton on CUDA, chunked on CPU). No [B, L, V] logits exist
(`engines/torch/hf_model.py`: loading and that forward pass; `engines/lr_schedule.py`: the actor's lr schedule;
`engines/torch/scoring.py`: the teachers' `TorchScoringEngine`).

The train step (DESIGN.md §3; the loss section is bound once, at construction):

    L = c_rl·L_GRPO + c_d·L_MOPD          (`mopd.objective.Objective`, the one objective every engine calls)
    L_MOPD = `mopd_loss` (estimator sampled: S, W from the batch) or `topk_reverse_kl` (estimator topk: the
             student's log-probs of the teachers' top-k ids from the [B, T, V] logits, `token_logprobs`)
    g = ∇L; grad_norm = ‖g‖₂ before clipping; g ← g·min(1, grad_clip/grad_norm); AdamW step

A step whose gradient norm is not finite is skipped (no parameter changes; `step_skipped` = 1).

A mixture-of-experts actor (Qwen3-MoE; `engines/moe_routing.py`) adds its router losses to L:
L += c_lb·L_lb + c_z·L_z over every position of the rows (c_lb `loss.router_aux_loss_coefficient`, default the
model config's `router_aux_loss_coef`; c_z `loss.router_z_loss_coefficient`), each micro-batch's terms
weighted by its share of the step's response tokens (Megatron-LM computes them per micro-batch too); with
`routed_experts` in the batch (rollout routing replay) the forward routes each response position to the
recorded experts (`RouterHooks`).

Micro-batches (`MicroBatching`, `engines/micro_batch.py`): the shard's rows run in micro-batches of at most
`micro_batch_tokens` positions each (rows × their padded length), one forward and backward each, the
gradients accumulated before the one clip and AdamW step; every micro-batch's loss is its per-token sum over
the denominator of the WHOLE step (computed once, all-reduced at DP > 1), so the accumulated gradient is the
one-batch gradient; statistics combine as sums and token-weighted means. Under DDP all but the last
micro-batch run in `no_sync()` (one gradient all-reduce per step). `micro_batch_tokens` null: on CUDA a
budget derived at each step from the free GPU memory and the model's shape (`micro_batch.step_budget`,
`memory/estimates.py`), on CPU the whole shard. `activation_checkpointing` turns on
transformers' gradient checkpointing (non-reentrant): each decoder layer's activations are recomputed in the
backward.

Data parallelism (`DataParallel`, DESIGN.md §7): at size n > 1 every rank trains on its shard of the step's
rows and the model runs under `torch.nn.parallel.DistributedDataParallel` over the record's group (the
caller's: gloo on CPU, NCCL on GPU, whose device_ids is the engine's device) for the train step's forward and
backward (logprobs, topk and evaluation run the bare model: no collective); `self.model` stays the unwrapped HF module (its
state_dict, named_weights, save_pretrained and evaluation keys do not change). The rank's loss is its shard's
per-token numerator over the WHOLE step's denominator N (`loss_denominator`, all-reduced): L_r = Σ_{shard r}
/ N, so Σ_r L_r = L of the step at DP = 1. DDP AVERAGES gradients over ranks, so the backward runs on n·L_r:
(1/n)·Σ_r ∇(n·L_r) = ∇L (Megatron-LM multiplies its loss by the context-parallel size for the same reason;
with `calculate_per_token_loss` it sums gradients instead and divides by the global token count). Gradients are
synced before clipping, so grad_norm, the clip and the AdamW step are the same on every rank and the replicas
stay identical. An empty shard (B = 0) runs `TrainBatch.stand_in()` (one fully masked row: loss 0, zero
gradient), so its rank still takes part in the forward, backward and all-reduce.

Shape legend: B rows, L prompt + response positions, T response positions, V vocabulary, H hidden, K top-k.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.lr_schedule import lr_scheduler
from mopd_hpc.engines.memory.estimates import dtype_bytes
from mopd_hpc.engines.memory.residency import Residency
from mopd_hpc.engines.micro_batch import (
    MicroBatching,
    StepStats,
    split_rows,
    step_budget,
    step_tokens,
)
from mopd_hpc.engines.moe_routing import RouterHooks, load_balancing_loss, replay_ids, z_loss
from mopd_hpc.engines.protocol import EngineError, ResidencyReport, refuse_loss
from mopd_hpc.engines.span_clock import SpanClock
from mopd_hpc.engines.torch.checkpoint_state import TorchCheckpointState
from mopd_hpc.engines.torch.ddp import distributed_module
from mopd_hpc.engines.torch.hf_model import (
    CausalLMForward,
    enable_activation_checkpointing,
    load_causal_lm,
    memory_shape,
    resolve_device,
)
from mopd_hpc.engines.train_objective import batch_objective, bind_objective
from mopd_hpc.mopd.logprobs import Backend, token_logprobs
from mopd_hpc.mopd.topk import TeacherTopK
from mopd_hpc.records.metrics_schema import TRAIN_FORWARD_BACKWARD_KEY, TRAIN_OPTIMIZER_KEY

log = logging.getLogger(__name__)


class TorchTrainEngine(TorchCheckpointState):
    """The actor's engine: transformers model + AdamW (+ its lr schedule over `total_steps`) + the bound
    loss section, on one rank of `data_parallel` (module docstring). Build with `from_pretrained`; its
    checkpoint methods: `checkpoint_state.TorchCheckpointState`."""

    def __init__(
        self,
        model: torch.nn.Module,
        path: str,
        device: torch.device,
        optimizer: OptimizerConfig,
        loss: LossConfig,
        backend: Backend = "auto",
        total_steps: int = 1,
        data_parallel: DataParallel = DataParallel.single(),
        micro_batching: MicroBatching = MicroBatching(),
    ) -> None:
        refuse_loss("torch", loss)  # what config/capabilities.py declares the torch engine computes
        #: The composed loss of the bound `loss:` section (`mopd.objective`).
        self.objective = bind_objective(loss)
        self.path = path
        self.loss_config = loss
        self.optimizer_config = optimizer
        data_parallel.check_initialized()
        self.data_parallel = data_parallel
        self.micro_batching = micro_batching
        if micro_batching.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.forward = CausalLMForward(model, device, backend)
        #: What the train step's forward runs through: the response-logits module, under DDP at size > 1.
        self.train_module = self.forward.module
        if data_parallel.distributed:
            self.train_module = distributed_module(self.forward.module, data_parallel, device)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, optimizer, total_steps)
        self.residency = Residency(model, device, self.optimizer)
        self.steps = 0
        self._router_losses(model, loss)
        #: The shape and dtype the default CUDA micro-batch budget is estimated from (None: not a shape the
        #: estimate reads; the whole shard then runs in one micro-batch).
        self.shape = memory_shape(model)
        self.dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")

    def _router_losses(self, model: torch.nn.Module, loss: LossConfig) -> None:
        """The router hooks and the router losses' coefficients (module docstring).

        Raises:
            EngineError: a router loss > 0 for a dense model (it has no router).
        """
        #: The forward hooks of the MoE routers (none for a dense model).
        self.routing = RouterHooks(model)
        aux, z = loss.router_aux_loss_coefficient, loss.router_z_loss_coefficient
        if not self.routing.moe and ((aux or 0.0) > 0 or z > 0):
            raise EngineError(
                f"loss.router_aux_loss_coefficient={aux}, loss.router_z_loss_coefficient={z}: the actor "
                f"{self.path} is a dense model (no router); expected null and 0"
            )
        config = model.config
        #: c_lb, c_z of the router losses (0 for a dense model) and the router's top k.
        self.router_aux = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if aux is None else aux
        self.router_aux = self.router_aux if self.routing.moe else 0.0
        self.router_z = z
        self.router_top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str,
        device: str,
        optimizer: OptimizerConfig,
        loss: LossConfig,
        logprob_backend: Backend = "auto",
        total_steps: int = 1,
        data_parallel: DataParallel = DataParallel.single(),
        micro_batching: MicroBatching = MicroBatching(),
    ) -> TorchTrainEngine:
        """Load the student from `path`; dtype is the parameter and compute dtype (`ActorConfig.dtype`);
        total_steps is the run's length, over which the lr schedule runs (`lr_scheduler`); data_parallel is
        this process's rank of the actor's data-parallel group (at size > 1 a collective: every rank of the
        group calls this at the same time, with torch.distributed initialized, each on its own device);
        micro_batching is the train step's token budget per micro-batch and activation recompute.

        Raises:
            EngineError: bad dtype/device, total_steps < 1, a loss section this engine cannot apply, or an
                NCCL group with a CPU device.
            DataParallelError: size > 1 but torch.distributed is not initialized or the group's rank and
                size are not the record's.
        """
        dev = resolve_device(device)
        model = load_causal_lm(path, dtype, dev)
        return cls(
            model,
            str(path),
            dev,
            optimizer,
            loss,
            logprob_backend,
            total_steps,
            data_parallel,
            micro_batching,
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.forward.model

    @property
    def device(self) -> torch.device:
        return self.forward.device

    def evaluation_model(self) -> torch.nn.Module:
        """The model greedy evaluation generates with: the actor's own transformers model (no copy; the
        caller restores nothing, `greedy_complete` puts back its train/eval mode)."""
        return self.model

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T] float32 log π_θ(y_t) (no gradient), on the engine's device."""
        self._require_resident("logprobs")
        self.model.eval()
        with torch.no_grad():
            part = batch.to(self.device)
            return self.forward.token_logprobs(self.forward.response_logits(part), part)

    def topk(self, batch: TokenBatch, k: int) -> TeacherTopK:
        """The student's own top-k per response position (no gradient)."""
        self._require_resident("topk")
        self.model.eval()
        with torch.no_grad():
            return TeacherTopK.from_logits(self.forward.response_logits(batch.to(self.device)), k)

    def compute_loss(
        self, batch: TrainBatch, denominator: torch.Tensor | None = None, share: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The bound loss of `batch` (already on the device, B ≥ 1), the [B, T] float32 log π_θ(y_t) it was
        computed from (carrying the gradient), and the terms' statistics. `denominator`: None normalizes
        over `batch`; else the whole step's count (`mopd.normalize.normalize`), for a data-parallel shard.
        `share`: the weight of the router losses (this micro-batch's share of the step's response tokens).
        At size > 1 the forward runs through DDP: every rank must then run its backward. With routing
        replay the routers replay until `self.routing.end()` (after the backward).

        Raises:
            EngineError: the batch lacks what a positive coefficient's term reads.
        """
        tokens = batch.tokens
        self.routing.start(self._replay(batch))
        logits = self.forward.response_logits(tokens, self.train_module)
        router_logits = self.routing.stop_capture()
        logprobs = self.forward.token_logprobs(logits, tokens)
        student = (lambda ids: token_logprobs(logits, ids)) if self.objective.uses_topk else None
        loss, stats = batch_objective(self.objective, batch, logprobs, student, denominator)
        if self.router_aux > 0 or self.router_z > 0:
            lb = load_balancing_loss(router_logits, self.router_top_k, tokens.attention_mask)
            lz = z_loss(router_logits, tokens.attention_mask)
            loss = loss + share * (self.router_aux * lb + self.router_z * lz)
            stats = {**stats, "router/load_balancing_loss": lb.detach(), "router/z_loss": lz.detach()}
        return loss, logprobs, stats

    def _replay(self, batch: TrainBatch) -> torch.Tensor | None:
        """[B, L, M, k] expert ids to replay at every position of `batch` (−1: the router's own choice), from
        its `routed_experts` [B, T, M, k] recorded at the positions that predict each response token
        (`logit_positions`); None without a recording.

        Raises:
            EngineError: a recording for a dense model, or of another layer count M or top k than the model's.
        """
        recorded = batch.routed_experts
        if recorded is None:
            return None
        layers, k = len(self.routing.routers), self.router_top_k
        if tuple(recorded.shape[2:]) != (layers, k):
            raise EngineError(
                f"routed_experts records {recorded.shape[2]} MoE layers × {recorded.shape[3]} experts per token; "
                f"the actor {self.path} has {layers} MoE layers routing to {k} experts"
            )
        tokens = batch.tokens
        return replay_ids(recorded, tokens.logit_positions, tokens.response_mask, tokens.input_ids.shape[1])

    def train_step(
        self,
        batch: TrainBatch,
        observe: Callable[[torch.Tensor], Mapping[str, float]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on `batch` (this rank's shard of the step; B = 0 allowed) with the bound loss
        (module docstring). Returns floats: `loss`, `grad_norm` (L2, before clipping), `grad_clip_coef`
        (≤ 1), `step_skipped`, `lr` (the one this step used), `tokens`, the terms' statistics (`mopd/*` or
        `topk/*`, `grpo/*`), `micro_batches` (this rank's count), `time/train/forward_backward_s` (seconds of
        every micro-batch's forward, loss and backward, DDP's gradient all-reduce included) and
        `time/train/optimizer_s` (seconds of the gradient clip, the AdamW step, zero_grad and the lr schedule's
        step): device time, CUDA synchronized at each boundary (`engines/span_clock.py`); and what `observe`
        returns when given the step's detached [B, T] float32 log π_θ(y_t) (before the update: monitoring
        statistics without a second forward pass; [0, T] for an empty shard).

        At data-parallel size > 1 (a collective: every rank calls it once per step, with its own shard and
        the same loss terms and `observe`), every value is the whole step's, the same on every rank: `loss`,
        each term's `*/loss`, `tokens` and `mopd/tokens` are summed over ranks (each rank's loss is its
        share of the global one); grad_norm, grad_clip_coef, step_skipped and lr come after the gradient
        all-reduce; every other statistic, `observe`'s included, is a masked mean over the rank's loss
        tokens and is reduced as the token-weighted mean Σ_r n_r·x_r / Σ_r n_r (`DataParallel.
        all_reduce_stats`: exact for means over the loss mask, approximate for a mean over a sub-mask such
        as `ratio_stats`' teacher_student_gap over W > 0 tokens). The two `time/train/*` seconds are the
        exception: this rank's own, not reduced (the metrics line carries rank 0's, as its `time/train_s`)."""
        self._require_resident("train_step")
        dp = self.data_parallel
        self.train_module.train()
        batch = batch.to(self.device)
        mask = batch.tokens.response_mask
        local_tokens, denominator, tokens = step_tokens(mask, self.loss_config.normalizer, dp)
        empty = batch.batch_size == 0
        parts = [None] if empty else split_rows(batch, self._budget())
        full_logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        combined = StepStats()
        self.optimizer.zero_grad(set_to_none=True)
        clock = SpanClock(self.device)
        clock.start()
        for i, part in enumerate(parts):
            # DDP all-reduces the gradients in the backward of the last micro-batch only.
            last = i == len(parts) - 1
            sync = self.train_module.no_sync() if dp.distributed and not last else contextlib.nullcontext()
            rows = batch.stand_in() if part is None else part.batch
            share = float(rows.tokens.response_mask.sum()) / max(tokens, 1.0)
            with sync:
                loss, logprobs, stats = self.compute_loss(rows, denominator, share)
                # DDP averages the ranks' gradients: backward on size·L_r makes the synced gradient ∇L.
                (loss * dp.size if dp.distributed else loss).backward()
            self.routing.end()
            combined.add(stats | {"loss": loss.detach()}, rows.tokens.response_mask.sum())
            if part is not None:
                width = logprobs.shape[1]
                full_logprobs[part.index, :width] = logprobs.detach().float()
        clock.lap(TRAIN_FORWARD_BACKWARD_KEY)
        observed = dict(observe(full_logprobs)) if observe is not None else {}
        clock.skip()
        clip = self.optimizer_config.grad_clip
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm=math.inf if clip is None else clip))
        finite = math.isfinite(grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        clock.lap(TRAIN_OPTIMIZER_KEY)
        self.steps += 1
        coef = min(1.0, clip / (grad_norm + 1e-6)) if clip is not None and finite else 1.0
        return combined.finish(observed, dp, float(local_tokens), self.device, grad_norm=grad_norm,
                               skipped=not finite, lr=lr, tokens=tokens, micro_batches=len(parts),
                               spans=clock.spans, grad_clip_coef=coef)  # fmt: skip

    def _budget(self) -> int | None:
        """This step's micro-batch budget (`step_budget`): gradients are allocated anew each step, the AdamW
        moments at the first."""
        if self.micro_batching.tokens is not None or self.device.type != "cuda" or self.shape is None:
            return self.micro_batching.tokens
        params = sum(p.numel() for g in self.optimizer.param_groups for p in g["params"])
        pending = params * dtype_bytes(self.dtype_name) * (1 if self.optimizer.state else 3)
        budget = step_budget(self.micro_batching, self.device, self.shape, self.dtype_name, "torch", pending)
        if budget is not None and budget != getattr(self, "_last_budget", None):
            log.info("micro-batch budget of this step: %d positions (from the free GPU memory)", budget)
            self._last_budget = budget
        return budget

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, detached tensor) of every weight; tied weights appear under each of their names."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def offload(self) -> ResidencyReport:
        return self.residency.offload()

    def onload(self) -> ResidencyReport:
        return self.residency.onload()
