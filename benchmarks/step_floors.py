"""The floor of each phase of one MOPD step on one GPU (issue 22): the seconds it could not go below, from the
model's shape, the step's token counts, and the GPU's HBM bandwidth and bf16 matmul peak. Pure arithmetic:
`benchmarks/gpu_step_roles.py` measures the GPU and the step, tests/plan/test_gpu_step_floors.py checks the sums.

Units: bytes, FLOPs, seconds; bandwidth in GB/s (10^9 bytes/s) and peak in TFLOP/s (10^12 FLOP/s).
`hbm_gbps` is HBM traffic, bytes read plus bytes written per second: a device-to-device copy of n bytes
moves 2n of it (its "copy rate", n per second, is what benchmarks/weight_sync.py calls `copy_gbps`).

Per phase (P = the model's parameters, W = its weight bytes, FLOPs as 2·P per token per forward: every
parameter is in one matmul, the tied embedding once, as the lm_head; attention's score FLOPs left out):

- rollout: decode, n = max_new_tokens steps, each reading the weights once (those in a matmul: the tied
  embedding as the lm_head) and every row's KV cache at its context (the prompt plus the tokens sampled so
  far: the mean over the steps is prompt + (n − 1)/2), as a roofline max(bytes / HBM, 2·P·rows / peak)
  summed over the steps; plus the prefill, 2·P per distinct prompt token (a prompt prefilled once for its
  samples) / peak;
- teacher: one forward over every row's prompt and response tokens, 2·P_teacher·tokens / peak;
- train: forward and backward, 6·P·tokens / peak (the megatron train step computes log π_θ inside its one
  forward: the sampled estimator's labels path; `extra_forward` adds a separate log-prob forward, 2·P·tokens);
- sync: one device copy of the weights, 2·W / HBM;
- drain: 0 (its seconds are reported as they are; a ratio to 0 is left out).

A mixture-of-experts shape (Qwen3-MoE) computes with its active parameters: P in every FLOP count above is
the parameters one token uses (k of the E experts of each MoE layer, the router whole), while W (the sync)
holds every expert and a decode step reads the experts its rows can reach, min(E, rows·k) per MoE layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Bytes of one bf16 value (the weights and the KV cache).
BF16_BYTES = 2
#: FLOPs per parameter per token: a forward (one multiply-add), forward + backward (three).
FORWARD_FLOPS_PER_PARAM = 2
TRAIN_FLOPS_PER_PARAM = 6
#: The phases of the step, in order (trainer/step.py PHASE_TIME_KEYS).
PHASES = ("rollout", "teacher", "drain", "train", "sync")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Qwen3 shape (no biases; q/k norms), dense or Qwen3-MoE (experts E, expert_intermediate f_e,
    experts_per_token k, moe_layers of the layers), from its HF config.json."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype_bytes: int = BF16_BYTES
    experts: int = 0
    expert_intermediate: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """From a Qwen3 config.json's fields. Raises ValueError naming a missing field."""
        keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size")  # fmt: skip
        missing = [k for k in keys if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {missing}; expected a Qwen3 config with {list(keys)}")
        heads = int(cfg["num_attention_heads"])
        moe = {}
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes the latter
        if experts:
            layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
            dense = set(cfg.get("mlp_only_layers") or ())
            moe = {
                "experts": int(experts),
                "expert_intermediate": int(cfg["moe_intermediate_size"]),
                "experts_per_token": int(cfg["num_experts_per_tok"]),
                "moe_layers": sum(1 for n in range(layers) if n not in dense and (n + 1) % step == 0),
            }
        return cls(
            **moe,
            layers=int(cfg["num_hidden_layers"]),
            hidden=int(cfg["hidden_size"]),
            intermediate=int(cfg["intermediate_size"]),
            heads=heads,
            kv_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def params(self) -> int:
        """Every parameter: per layer q, k, v, o, the q/k norms, two layer norms, the SwiGLU MLP (an MoE
        layer: the router and every expert); the embedding (and an untied lm_head); the final norm."""
        return self._params(self.experts)

    def _params(self, experts: int) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 2 * d
        layer = attention + 3 * h * self.intermediate + 2 * h
        moe = attention + experts * 3 * h * self.expert_intermediate + self.experts * h + 2 * h
        embeddings = self.vocab * h * (1 if self.tied else 2)
        return (self.layers - self.moe_layers) * layer + self.moe_layers * moe + embeddings + h

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: k of the E experts per MoE layer (`params` when dense)."""
        return self._params(self.experts_per_token)

    @property
    def matmul_params(self) -> int:
        """Active parameters in a matmul per token (the FLOPs' P): all but an untied input embedding (a
        lookup)."""
        return self.active_params - (0 if self.tied else self.vocab * self.hidden)

    def read_params(self, rows: int) -> int:
        """Matmul parameters a decode step of `rows` rows reads: min(E, rows·k) experts per MoE layer."""
        reached = min(self.experts, rows * self.experts_per_token)
        return self._params(reached) - (0 if self.tied else self.vocab * self.hidden)

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Device:
    """What one GPU was measured to do: `hbm_gbps` HBM traffic (read + write) GB/s, `peak_tflops` bf16."""

    hbm_gbps: float
    peak_tflops: float

    def __post_init__(self) -> None:
        if not (self.hbm_gbps > 0 and self.peak_tflops > 0):
            raise ValueError(
                f"Device: hbm_gbps ({self.hbm_gbps}) and peak_tflops ({self.peak_tflops}) must be > 0"
            )

    def read_s(self, nbytes: float) -> float:
        return nbytes / (self.hbm_gbps * 1e9)

    def compute_s(self, flops: float) -> float:
        return flops / (self.peak_tflops * 1e12)


@dataclass(frozen=True, slots=True)
class StepTokens:
    """One step's shape: `rows` = prompts · samples_per_prompt sequences, `new_tokens` decode steps (the
    longest response), `prompt_tokens` and `response_tokens` summed over the rows."""

    rows: int
    samples_per_prompt: int
    new_tokens: int
    prompt_tokens: int
    response_tokens: int

    def __post_init__(self) -> None:
        if (
            min(self.rows, self.samples_per_prompt, self.new_tokens) < 1
            or self.rows % self.samples_per_prompt
        ):
            raise ValueError(
                f"StepTokens: rows ({self.rows}) must be a positive multiple of samples_per_prompt "
                f"({self.samples_per_prompt}), new_tokens ({self.new_tokens}) ≥ 1"
            )

    @property
    def tokens(self) -> int:
        """Tokens of one forward over the step's rows (prompt and response)."""
        return self.prompt_tokens + self.response_tokens

    @property
    def mean_decode_context(self) -> float:
        """Mean KV entries a row reads per decode step: its prompt plus the (n − 1)/2 tokens before."""
        return self.prompt_tokens / self.rows + (self.new_tokens - 1) / 2


def decode_floor_s(model: ModelShape, step: StepTokens, device: Device) -> float:
    """Σ over the decode steps of max(weights + KV cache read / HBM, 2·P·rows / peak)."""
    weights = model.read_params(step.rows) * model.dtype_bytes  # an untied input embedding: a lookup
    read = weights + step.rows * step.mean_decode_context * model.kv_bytes_per_token
    compute = FORWARD_FLOPS_PER_PARAM * model.matmul_params * step.rows
    return step.new_tokens * max(device.read_s(read), device.compute_s(compute))


def prefill_floor_s(model: ModelShape, step: StepTokens, device: Device) -> float:
    """2·P per distinct prompt token (prompt_tokens / samples_per_prompt) / peak."""
    distinct = step.prompt_tokens / step.samples_per_prompt
    return device.compute_s(FORWARD_FLOPS_PER_PARAM * model.matmul_params * distinct)


def phase_floors(
    student: ModelShape, teacher: ModelShape, step: StepTokens, device: Device, extra_forward: bool = False
) -> dict[str, float]:
    """Seconds per phase (module docstring), keyed by PHASES."""
    train_flops = (TRAIN_FLOPS_PER_PARAM + (FORWARD_FLOPS_PER_PARAM if extra_forward else 0)) * (
        student.matmul_params * step.tokens
    )
    return {
        "rollout": decode_floor_s(student, step, device) + prefill_floor_s(student, step, device),
        "teacher": device.compute_s(FORWARD_FLOPS_PER_PARAM * teacher.matmul_params * step.tokens),
        "drain": 0.0,
        "train": device.compute_s(train_flops),
        "sync": device.read_s(2 * student.weight_bytes),
    }


def floor_ratios(seconds: Mapping[str, float], floors: Mapping[str, float]) -> dict[str, Any]:
    """`phase_floor_ratio` (seconds / floor per phase; None where the floor is 0: drain) and
    `step_floor_ratio` (Σ seconds over every phase, drain included / Σ floors)."""
    per_phase = {ph: (seconds[ph] / floors[ph] if floors[ph] > 0 else None) for ph in PHASES}
    total = sum(floors[ph] for ph in PHASES)
    return {
        "phase_floor_ratio": per_phase,
        "step_floor_ratio": sum(seconds[ph] for ph in PHASES) / total if total > 0 else None,
    }
