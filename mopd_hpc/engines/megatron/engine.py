"""The megatron backend's engines (DESIGN.md §5): a forward-only scoring engine (teachers) and the actor's
train engine, on megatron-core GPTModel with the fused-attention local spec (`model.py`). GPU only.

Process setup (`initialize_parallel`): NCCL default process group (a gloo default group with a CUDA model
segfaulted in the first train step, algo_awex.md §4.1; world size 1 rendezvouses in an in-memory HashStore,
no TCP port), `initialize_model_parallel(tp, 1)`, the CUDA RNG tracker. Arguments are explicit (from
RankTopology at the edge), never read from the environment here.

Log-probs: GPTModel's `labels` path gives the per-position loss −log π(label_p | ≤ p) through megatron's
vocab-parallel cross entropy (fp32), so tensor parallelism needs no full-vocabulary gather. With
labels_p = input_ids_{p+1}, the log-prob of response token t of row b sits at position
response_start[b] + t − 1 (`TokenBatch.logit_positions`). Rows are right-padded: causal attention alone is exact.

Top-k (a teacher at tensor_parallel 1, `MegatronScoringEngine.score(batch, k)`): GPTModel's forward without
labels gives the full [B, L, V'] logits; the response positions are gathered, ids ≥ V (megatron's vocabulary
padding, if any) dropped, and the log-probs and the top-k come from one float32 log-softmax. At tensor
parallel > 1 each rank holds a vocabulary shard only: top-k is refused there.

The train step (sampled estimator; loss bound at construction, `mopd.loss.mopd_loss`):
    zero DDP grad buffers → loss → backward → finalize_model_grads → MegatronOptimizer.step()
(`finalize_model_grads` = DDP's finish_grad_sync plus the tensor-parallel all-reduce of replicated
weights whose gradients differ per TP rank: q/k layernorm, each rank seeing its own heads; with only
finish_grad_sync, TP ranks drifted apart after one step — seen on 2 H200s, issue 8.)
(clipping to optimizer.grad_clip and the norm are the optimizer's: `clip_grad`, returned grad_norm).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.megatron.convert import Qwen3Shape, gather_tp, hf_to_mcore, mcore_to_hf, shard_tp
from mopd_hpc.engines.megatron.model import DTYPES, build_gpt_model, load_mcore_state
from mopd_hpc.engines.megatron.residency import DDPResidency, scoring_residency
from mopd_hpc.engines.protocol import EngineError, ResidencyReport
from mopd_hpc.mopd.loss import mopd_loss
from mopd_hpc.mopd.topk import TeacherTopK


def initialize_parallel(
    *,
    rank: int,
    world_size: int,
    tensor_parallel: int,
    device_index: int,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    seed: int = 0,
) -> torch.device:
    """NCCL default group + megatron parallel state (TP `tensor_parallel`, PP 1) + CUDA RNG; returns the device.

    world_size 1 (a TP-1 teacher, a one-GPU actor) rendezvouses in memory (`dist.HashStore`): no TCP port.
    world_size > 1 uses `tcp://master_addr:master_port`. The NCCL group is bound to `cuda:device_index`
    (eager init). Idempotent: an initialized default group or parallel state is kept.

    Raises:
        EngineError: tensor_parallel does not divide world_size, rank is not in [0, world_size), or
            master_port is None with world_size > 1.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if world_size % tensor_parallel:
        raise EngineError(f"tensor_parallel={tensor_parallel} does not divide world_size={world_size}")
    if not 0 <= rank < world_size:
        raise EngineError(f"rank={rank}: expected in [0, world_size={world_size})")
    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    if not dist.is_initialized():
        if world_size == 1:
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        else:
            if master_port is None:
                raise EngineError(f"master_port is None with world_size={world_size}; expected a TCP port")
            dist.init_process_group(
                "nccl", init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size,
                device_id=device,
            )  # fmt: skip
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel, 1)
    model_parallel_cuda_manual_seed(seed)
    return device


def read_hf_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, the state dict from every *.safetensors file) of an HF checkpoint directory."""
    from safetensors.torch import load_file

    root = Path(path)
    config = json.loads((root / "config.json").read_text())
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{root}: no *.safetensors files; expected an HF checkpoint")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return config, state


def _tp_info() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def build_from_hf(
    path: str | Path | None, hf_config: Mapping[str, Any], dtype: str, device: torch.device
) -> tuple[torch.nn.Module, Qwen3Shape]:
    """This TP rank's GPTModel on `device`, with the checkpoint's weights (path None: random init)."""
    tp, rank, _ = _tp_info()
    shape = Qwen3Shape.from_hf_config(hf_config)
    if shape.vocab_size % tp:
        raise EngineError(f"vocab_size={shape.vocab_size} is not divisible by tensor_parallel={tp}")
    eps = float(hf_config.get("rms_norm_eps", 1e-6))
    theta = rope_theta(hf_config)
    model = build_gpt_model(shape, dtype, tp, rope_theta=theta, layernorm_epsilon=eps).to(device)
    if path is not None:
        _, hf = read_hf_checkpoint(path)
        load_mcore_state(
            model,
            {k: v.to(DTYPES[dtype]) for k, v in shard_tp(hf_to_mcore(hf, shape), shape, tp, rank).items()},
        )
    return model, shape


def rope_theta(hf_config: Mapping[str, Any]) -> float:
    """RoPE base of an HF config: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (4.x)."""
    params = hf_config.get("rope_parameters") or {}
    return float(params.get("rope_theta") or hf_config.get("rope_theta") or 1_000_000.0)


class MegatronForward:
    """Response log-probs of a `TokenBatch` through a GPTModel (module docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T] float32 log π(y_t); 0 at padded response positions. Carries the graph when grads are on."""
        ids = batch.input_ids.to(self.device)
        labels = torch.roll(ids, shifts=-1, dims=1)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        per_position = -self.model(ids, positions, None, labels=labels)  # [B, L] fp32
        mask = batch.response_mask.to(self.device)
        out = per_position.gather(1, batch.logit_positions.to(self.device))
        return torch.where(mask, out, torch.zeros_like(out))


class MegatronScoringEngine:
    """A teacher's forward-only engine on megatron-core: no optimizer state, no DDP wrapper; residency is
    parameters only. The teacher server's surface, as `TorchScoringEngine`: `score`, `vocab_size`,
    `load_weights`, `offload`/`onload`, `residency`, `path`, `pad_token_id`, `device`. Build with
    `from_pretrained` after `initialize_parallel`.

    Every CUDA call runs under `torch.cuda.device(self.device)`: the server calls the engine from worker
    threads, whose current CUDA device is not the one `initialize_parallel` set (megatron allocates on the
    current device).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        hf_config: Mapping[str, Any],
        *,
        path: str | Path | None = None,
        max_batch_rows: int = 16,
    ) -> None:
        if max_batch_rows < 1:
            raise EngineError(f"max_batch_rows={max_batch_rows}: expected >= 1")
        model.eval().requires_grad_(False)
        self.model, self.device, self.max_batch_rows = model, device, max_batch_rows
        self.hf_config = dict(hf_config)
        self.shape = Qwen3Shape.from_hf_config(self.hf_config)
        self.path = None if path is None else str(path)
        self.forward = MegatronForward(model, device)
        self.residency = scoring_residency(model, device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "bfloat16",
        device: torch.device | str,
        max_batch_rows: int = 16,
    ) -> MegatronScoringEngine:
        """This TP rank's shard of the HF checkpoint at `path`, in `dtype`, on CUDA `device`.

        Raises:
            EngineError: dtype not one of `DTYPES`, a non-CUDA device, or a checkpoint without safetensors.
            OSError: no config.json at `path`.
        """
        if dtype not in DTYPES:
            raise EngineError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise EngineError(
                f"device={str(dev)!r}: the megatron engine runs on CUDA only; expected 'cuda:N'"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        config = json.loads((Path(path) / "config.json").read_text())
        with torch.cuda.device(dev):
            model, _ = build_from_hf(path, config, dtype, dev)
        return cls(model, dev, config, path=path, max_batch_rows=max_batch_rows)

    @property
    def vocab_size(self) -> int:
        """V of the HF checkpoint (never megatron's padded V'): token ids and top-k ids are in [0, V)."""
        return self.shape.vocab_size

    @property
    def pad_token_id(self) -> int | None:
        """The checkpoint config's `pad_token_id` (None when it names none)."""
        pad = self.hf_config.get("pad_token_id")
        return None if pad is None else int(pad)

    def _require_resident(self, what: str) -> None:
        if not self.residency.on_device:
            raise EngineError(f"{what}: the teacher's weights are offloaded; onload() first")

    def _device_scope(self) -> contextlib.AbstractContextManager[Any]:
        """`torch.cuda.device(self.device)` (the calling thread's current device), or nothing off CUDA."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T] float32 log π(y_t) on the CPU, through GPTModel's labels path (vocab-parallel cross
        entropy: any tensor_parallel); 0 at padded positions. Raises EngineError when offloaded."""
        self._require_resident("logprobs")
        with self._device_scope(), torch.inference_mode():
            parts = [
                self.forward.token_logprobs(batch.rows(i, min(i + self.max_batch_rows, batch.batch_size)))
                for i in range(0, batch.batch_size, self.max_batch_rows)
            ]
            return torch.cat(parts, dim=0).float().cpu()

    def _response_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T, V] float32 log-softmax at the positions predicting each response token (tensor_parallel 1:
        GPTModel's forward without labels gives the full [B, L, V'] logits; padding ids ≥ V are dropped)."""
        ids = batch.input_ids
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        logits = self.model(ids, positions, None)  # [B, L, V'] (megatron transposes [s, b] back)
        index = batch.logit_positions[..., None].expand(-1, -1, logits.shape[-1])
        logits = logits.gather(1, index)[..., : self.vocab_size]
        return torch.log_softmax(logits.float(), dim=-1)

    def score(self, batch: TokenBatch, k: int | None = None) -> tuple[torch.Tensor, TeacherTopK | None]:
        """([B, T] float32 log-probs of the response tokens, top-k [B, T, min(k, V)] or None), on the CPU.

        Without k: the labels path (`logprobs`). With k (tensor_parallel 1 only): one forward without labels,
        log-probs and top-k from the same float32 log-softmax (`TeacherTopK.from_logits`' arithmetic) at
        the same response positions. Rows are scored `max_batch_rows` at a time.

        Raises:
            EngineError: the weights are offloaded, k < 1, or k given at tensor_parallel > 1 (the logits
                are vocab-parallel: no rank holds the full distribution).
        """
        self._require_resident("score")
        if k is not None and k < 1:
            raise EngineError(f"k={k}: expected >= 1 (or None for no top-k)")
        if k is None:
            return self.logprobs(batch), None
        tp = _tp_info()[0]
        if tp > 1:
            raise EngineError(
                f"top-k scoring at tensor_parallel={tp}: the megatron teacher's logits are vocab-parallel; "
                "expected tensor_parallel 1, or loss.estimator: sampled (no top-k)"
            )
        lps, ids, vals = [], [], []
        with self._device_scope(), torch.inference_mode():
            for start in range(0, batch.batch_size, self.max_batch_rows):
                part = batch.rows(start, start + self.max_batch_rows).to(self.device)
                logp = self._response_logprobs(part)
                mask = part.response_mask
                token = torch.where(mask, part.response_ids, 0)
                lp = logp.gather(-1, token[..., None]).squeeze(-1)
                lps.append(torch.where(mask, lp, 0.0).cpu())
                values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
                ids.append(indices.cpu())
                vals.append(values.cpu())
                del logp
        return torch.cat(lps), TeacherTopK(torch.cat(ids), torch.cat(vals))

    def topk(self, batch: TokenBatch, k: int) -> TeacherTopK:
        """The teacher's top-k per response position (tensor_parallel 1; see `score`)."""
        top = self.score(batch, k)[1]
        assert top is not None
        return top

    def load_weights(self, path: str | Path) -> None:
        """Replace the weights by those of the HF checkpoint at `path` (same Qwen3 shape), in place: the
        parameters keep their dtype and device (host memory while offloaded).

        Raises:
            EngineError: the checkpoint's shape differs from the loaded model's, or it holds no safetensors.
        """
        config, hf = read_hf_checkpoint(path)
        shape = Qwen3Shape.from_hf_config(config)
        if shape != self.shape:
            raise EngineError(
                f"checkpoint {path} has shape {shape}; expected the loaded model's {self.shape}"
            )
        tp, rank, _ = _tp_info()
        with self._device_scope(), torch.no_grad():
            try:
                load_mcore_state(self.model, shard_tp(hf_to_mcore(hf, shape), shape, tp, rank))
            except ValueError as err:  # ConversionError, or names that do not fit
                raise EngineError(f"checkpoint {path}: {err}") from None
        self.hf_config = dict(config)
        self.path = str(path)

    def offload(self) -> ResidencyReport:
        with self._device_scope():
            return self.residency.offload()

    def onload(self) -> ResidencyReport:
        with self._device_scope():
            return self.residency.onload()


class MegatronTrainEngine:
    """The actor on megatron-core: DDP (distributed optimizer) + Megatron Adam, the MOPD loss bound once."""

    def __init__(
        self, model: torch.nn.Module, shape: Qwen3Shape, hf_config: Mapping[str, Any], loss: LossConfig,
        optimizer: OptimizerConfig, device: torch.device, dtype: str = "bfloat16",
    ) -> None:  # fmt: skip
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        if loss.estimator != "sampled" or loss.rl_coefficient > 0:
            raise EngineError(
                f"the megatron engine supports loss.estimator 'sampled' without an RL term; got "
                f"estimator={loss.estimator!r}, rl_coefficient={loss.rl_coefficient}"
            )
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        self.ddp = DistributedDataParallel(model.config, ddp_cfg, model)
        opt_cfg = MegatronOptimizerConfig(
            optimizer="adam", lr=optimizer.lr, weight_decay=optimizer.weight_decay,
            clip_grad=optimizer.grad_clip or 0.0, bf16=dtype == "bfloat16", params_dtype=DTYPES[dtype],
            use_distributed_optimizer=True,
        )  # fmt: skip
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.ddp])
        self.model, self.shape, self.hf_config, self.device = model, shape, dict(hf_config), device
        self.loss_config = loss
        self.forward = MegatronForward(self.ddp, device)
        self.residency = DDPResidency(self.ddp, self.optimizer, device)
        self.steps = 0

    def _require_resident(self, what: str) -> None:
        if not self.residency.on_device:
            raise EngineError(f"{what}: the actor is offloaded; onload() first")

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        self._require_resident("logprobs")
        self.ddp.eval()
        return self.forward.token_logprobs(batch).float().cpu()

    def topk(self, batch: TokenBatch, k: int) -> Any:
        raise EngineError(
            "the megatron engine has no top-k scoring (vocab-parallel); use loss.estimator: sampled"
        )

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One step: zero grad buffers, MOPD loss, backward, grad sync, Megatron optimizer step."""
        from megatron.core.distributed import finalize_model_grads

        self._require_resident("train_step")
        if batch.targets is None:
            raise EngineError("estimator 'sampled' needs batch.targets (S, W); got None")
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        batch = batch.to(self.device)
        tokens = batch.tokens
        logprobs = self.forward.token_logprobs(tokens)
        loss, stats = mopd_loss(
            logprobs, batch.behavior_logprobs, batch.targets.logp_sum, batch.targets.weight_sum,
            tokens.response_mask, self.loss_config, orm_advantages=batch.orm_advantages,
        )  # fmt: skip
        loss.backward()
        finalize_model_grads([self.ddp])
        ok, grad_norm, _ = self.optimizer.step()
        self.steps += 1
        out = {name: float(value) for name, value in stats.items()}
        return out | {
            "loss": float(loss.detach()),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "step_skipped": 0.0 if ok else 1.0,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "tokens": float(tokens.response_mask.sum()),
        }

    def full_mcore_state(self) -> dict[str, torch.Tensor]:
        """The whole model's megatron state dict (TP shards all-gathered over the TP group), on device."""
        tp, _, group = _tp_info()
        local = {k: v.detach() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        if tp == 1:
            return local
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            for r in range(tp):
                shards[r][name] = parts[r]
        return gather_tp(shards, self.shape)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight, for weight sync (a collective over the TP group)."""
        self._require_resident("named_weights")
        yield from mcore_to_hf(self.full_mcore_state(), self.shape).items()

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._require_resident("load_state_dict")
        load_mcore_state(self.model, dict(state["model"]))
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))

    def save_pretrained(self, directory: str | Path) -> None:
        """config.json + model.safetensors (HF names), written by TP rank 0."""
        from safetensors.torch import save_file

        weights = {k: v.cpu().contiguous() for k, v in self.named_weights()}
        if _tp_info()[1] == 0:
            out = Path(directory)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(self.hf_config, indent=2))
            save_file(weights, str(out / "model.safetensors"))

    def offload(self) -> ResidencyReport:
        return self.residency.offload()

    def onload(self) -> ResidencyReport:
        return self.residency.onload()
