"""The torch backend: transformers causal LMs as the actor's train engine and as teachers' scoring engines.

Log-probs of the response tokens are computed from the logits of the response positions only: the
decoder runs over [B, L], its hidden states are gathered at the T positions that predict response tokens,
and the LM head gives [B, T, V] logits in the model's dtype; `mopd.token_logprobs` turns them into float32
log-probs without a float32 [B, T, V] copy (fused Triton on CUDA, chunked on CPU). No [B, L, V] logits exist
(`engines/hf_model.py`: loading and that forward pass; `engines/lr_schedule.py`: the actor's lr schedule).

The train step (DESIGN.md §3; the loss section is bound once, at construction):

    L = c_rl·L_GRPO + c_d·L_MOPD          (`compose_loss`; a zero coefficient's term is never computed)
    L_MOPD = `mopd_loss` (estimator sampled: S, W from the batch) or `topk_reverse_kl_loss` (estimator topk)
    g = ∇L; grad_norm = ‖g‖₂ before clipping; g ← g·min(1, grad_clip/grad_norm); AdamW step

A step whose gradient norm is not finite is skipped (no parameter changes; `step_skipped` = 1).

Shape legend: B rows, L prompt + response positions, T response positions, V vocabulary, H hidden, K top-k.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.hf_model import TOKENIZER_FILES, CausalLMForward, load_causal_lm, resolve_device
from mopd_hpc.engines.lr_schedule import lr_scheduler
from mopd_hpc.engines.protocol import EngineError, ResidencyReport
from mopd_hpc.engines.residency import Residency
from mopd_hpc.mopd.compose import compose_loss
from mopd_hpc.mopd.grpo import grpo_policy_loss
from mopd_hpc.mopd.logprobs import Backend
from mopd_hpc.mopd.loss import mopd_loss
from mopd_hpc.mopd.topk import TeacherTopK, topk_reverse_kl_loss


class TorchScoringEngine:
    """A teacher's forward-only engine: no optimizer, no gradient (`torch.inference_mode`), batched by
    rows. Build with `from_pretrained`."""

    def __init__(
        self, model: torch.nn.Module, path: str, device: torch.device, max_batch_rows: int, backend: Backend
    ) -> None:
        if max_batch_rows < 1:
            raise EngineError(f"max_batch_rows={max_batch_rows}: expected >= 1")
        model.eval().requires_grad_(False)
        self.path = path
        self.max_batch_rows = max_batch_rows
        self.forward = CausalLMForward(model, device, backend)
        self.residency = Residency(model, device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_rows: int = 64,
        logprob_backend: Backend = "auto",
    ) -> TorchScoringEngine:
        """Load the checkpoint at `path` once. Raises EngineError (dtype, device) or OSError (path)."""
        dev = resolve_device(device)
        return cls(load_causal_lm(path, dtype, dev), str(path), dev, max_batch_rows, logprob_backend)

    @property
    def model(self) -> torch.nn.Module:
        return self.forward.model

    @property
    def device(self) -> torch.device:
        return self.forward.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def score(self, batch: TokenBatch, k: int | None = None) -> tuple[torch.Tensor, TeacherTopK | None]:
        """One forward: ([B, T] float32 log-probs of the response tokens, top-k [B, T, min(k, V)] or None).

        Rows are scored `max_batch_rows` at a time; results are on the CPU.
        Raises:
            EngineError: the weights are offloaded, or k < 1.
        """
        if not self.residency.on_device:
            raise EngineError("weights are offloaded; onload() before scoring")
        if k is not None and k < 1:
            raise EngineError(f"k={k}: expected >= 1 (or None for no top-k)")
        lps, ids, vals = [], [], []
        with torch.inference_mode():
            for start in range(0, batch.batch_size, self.max_batch_rows):
                part = batch.rows(start, start + self.max_batch_rows).to(self.device)
                logits = self.forward.response_logits(part)
                lps.append(self.forward.token_logprobs(logits, part).cpu())
                if k is not None:
                    top = TeacherTopK.from_logits(logits, k)
                    ids.append(top.indices.cpu())
                    vals.append(top.logprobs.float().cpu())
        topk = TeacherTopK(torch.cat(ids), torch.cat(vals)) if k is not None else None
        return torch.cat(lps), topk

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        return self.score(batch)[0]

    def topk(self, batch: TokenBatch, k: int) -> TeacherTopK:
        top = self.score(batch, k)[1]
        assert top is not None
        return top

    def load_weights(self, path: str | Path) -> None:
        """Replace the weights by those of the checkpoint at `path` (same architecture and shapes)."""
        fresh = load_causal_lm(path, "float32", torch.device("cpu"))
        own = self.model.state_dict()
        theirs = fresh.state_dict()
        if set(own) != set(theirs) or any(own[n].shape != theirs[n].shape for n in own):
            raise EngineError(f"checkpoint {path} does not match the loaded model's names and shapes")
        with torch.no_grad():
            for name, tensor in theirs.items():
                own[name].copy_(tensor)
        self.path = str(path)

    def offload(self) -> ResidencyReport:
        return self.residency.offload()

    def onload(self) -> ResidencyReport:
        return self.residency.onload()


class TorchTrainEngine:
    """The actor's engine: transformers model + AdamW (+ its lr schedule over `total_steps`) + the bound
    loss section. Build with `from_pretrained`."""

    def __init__(
        self,
        model: torch.nn.Module,
        path: str,
        device: torch.device,
        optimizer: OptimizerConfig,
        loss: LossConfig,
        backend: Backend = "auto",
        total_steps: int = 1,
    ) -> None:
        if loss.estimator == "topk" and loss.orm_alpha > 0:
            raise EngineError(
                f"loss.orm_alpha={loss.orm_alpha} with estimator 'topk': the advantage-level composition "
                "needs the sampled estimator's advantage; use rl_coefficient with 'topk', or estimator 'sampled'"
            )
        self.path = path
        self.loss_config = loss
        self.optimizer_config = optimizer
        self.forward = CausalLMForward(model, device, backend)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, optimizer, total_steps)
        self.residency = Residency(model, device, self.optimizer)
        self.steps = 0

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
    ) -> TorchTrainEngine:
        """Load the student from `path`; dtype is the parameter and compute dtype (`ActorConfig.dtype`);
        total_steps is the run's length, over which the lr schedule runs (`lr_scheduler`).

        Raises:
            EngineError: bad dtype/device, total_steps < 1, or a loss section this engine cannot apply.
        """
        dev = resolve_device(device)
        model = load_causal_lm(path, dtype, dev)
        return cls(model, str(path), dev, optimizer, loss, logprob_backend, total_steps)

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

    def _require_resident(self, what: str) -> None:
        if not self.residency.on_device:
            raise EngineError(f"{what}: the actor is offloaded; onload() first")

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

    def compute_loss(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The bound loss of `batch` (already on the device), the [B, T] float32 log π_θ(y_t) it was
        computed from (carrying the gradient), and the terms' statistics.

        Raises:
            EngineError: the batch lacks what a positive coefficient's term reads.
        """
        cfg = self.loss_config
        tokens = batch.tokens
        logits = self.forward.response_logits(tokens)
        logprobs = self.forward.token_logprobs(logits, tokens)
        mask = tokens.response_mask
        stats: dict[str, torch.Tensor] = {}

        def distill() -> torch.Tensor:
            if cfg.estimator == "topk":
                if not batch.teacher_topk:
                    raise EngineError(
                        "estimator 'topk' needs batch.teacher_topk and teacher_weights; got none"
                    )
                value, s = topk_reverse_kl_loss(logits, batch.teacher_topk, batch.teacher_weights, mask, cfg)
            else:
                if batch.targets is None:
                    raise EngineError("estimator 'sampled' needs batch.targets (S, W); got None")
                value, s = mopd_loss(
                    logprobs,
                    batch.behavior_logprobs,
                    batch.targets.logp_sum,
                    batch.targets.weight_sum,
                    mask,
                    cfg,
                    orm_advantages=batch.orm_advantages,
                )
            stats.update(s)
            return value

        def rl() -> torch.Tensor:
            if batch.orm_advantages is None:
                raise EngineError(f"rl_coefficient={cfg.rl_coefficient} needs batch.orm_advantages; got None")
            value, s = grpo_policy_loss(
                logprobs,
                batch.behavior_logprobs,
                batch.orm_advantages,
                mask,
                cfg,
                ref_logprobs=batch.ref_logprobs,
            )
            stats.update(s)
            return value

        return compose_loss(cfg, rl=rl, distill=distill), logprobs, stats

    def train_step(
        self,
        batch: TrainBatch,
        observe: Callable[[torch.Tensor], Mapping[str, float]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on `batch` with the bound loss (module docstring). Returns floats: `loss`,
        `grad_norm` (L2, before clipping), `grad_clip_coef` (≤ 1), `step_skipped`, `lr` (the one this
        step used), `tokens`, the terms' statistics (`mopd/*` or `topk/*`, `grpo/*`), and what
        `observe` returns when given the step's detached [B, T] float32 log π_θ(y_t) (before the update:
        monitoring statistics without a second forward pass)."""
        self._require_resident("train_step")
        self.model.train()
        batch = batch.to(self.device)
        loss, logprobs, stats = self.compute_loss(batch)
        observed = dict(observe(logprobs.detach())) if observe is not None else {}
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = self.optimizer_config.grad_clip
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm=math.inf if clip is None else clip))
        finite = math.isfinite(grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.steps += 1
        out = {name: float(value) for name, value in stats.items()} | observed
        out |= {
            "loss": float(loss.detach()),
            "grad_norm": grad_norm,
            "grad_clip_coef": min(1.0, clip / (grad_norm + 1e-6)) if clip is not None and finite else 1.0,
            "step_skipped": 0.0 if finite else 1.0,
            "lr": lr,
            "tokens": float(batch.tokens.response_mask.sum()),
        }
        return out

    def state_dict(self) -> dict[str, Any]:
        """{"model": model state_dict, "optimizer": AdamW state_dict, "scheduler": its lr schedule's state,
        "steps": int}."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._require_resident("load_state_dict")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, detached tensor) of every weight; tied weights appear under each of their names."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the student as an HF checkpoint (config.json, safetensors) plus the source's tokenizer
        files, so the directory can be served and scored as is."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(out))
        for name in TOKENIZER_FILES:
            src = Path(self.path) / name
            if src.is_file() and not (out / name).exists():
                shutil.copyfile(src, out / name)

    def offload(self) -> ResidencyReport:
        return self.residency.offload()

    def onload(self) -> ResidencyReport:
        return self.residency.onload()
