"""The reference model of the KL penalty (`engines/reference.py`) on CPU, real parts: micro Qwen3 checkpoints,
the torch train engine, the reference's own scoring engine.

- its log-probs equal a direct transformers forward of the starting checkpoint (fp32, ≤ 1e-6), and stay those
  of the checkpoint after the actor's weights change or a checkpoint is loaded into the actor;
- step 1 (π_θ = π_ref): the k3 KL term is exactly 0 and the loss equals the kl_coefficient = 0 loss, bit for bit;
- after some steps the KL is > 0, and the statistic and the loss equal a float64 recomputation from the
  engine's weights and the starting checkpoint;
- the step's plan: a KL penalty without teachers still has TEACHER and DRAIN (the reference is drained there),
  and `ShardStep` refuses a reference missing for, or given to, the wrong plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_dp import OUTPUTS, PROMPTS
from helpers_models import save_micro_qwen3
from transformers import AutoModelForCausalLM

from mopd_hpc.config import load_run_config
from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.reference import ReferenceModel
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.mopd.grpo import grpo_advantages, grpo_policy_loss
from mopd_hpc.mopd.phases import PhaseMachine
from mopd_hpc.mopd.plan import ExecutionPlan, Phase
from mopd_hpc.roles.actor import build_reference
from mopd_hpc.trainer.group import SoloGroup
from mopd_hpc.trainer.rank_step import ShardStep

BETA = 0.5
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return save_micro_qwen3(tmp_path_factory.mktemp("ref") / "student", 0, initializer_range=0.2)


@pytest.fixture(scope="module")
def tokens() -> TokenBatch:
    return TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)


def direct_logprobs(path, tokens: TokenBatch, dtype: torch.dtype) -> torch.Tensor:
    """[B, T] log π(y_t) from a plain transformers forward over [B, L] (full logits, log_softmax in `dtype`)."""
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(dtype).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits.to(dtype)
    logp = torch.log_softmax(logits, dim=-1)
    index = tokens.logit_positions
    rows = torch.arange(tokens.batch_size)[:, None].expand_as(index)
    picked = logp[rows, index].gather(-1, tokens.response_ids[..., None]).squeeze(-1)
    return torch.where(tokens.response_mask, picked, 0.0)


def loss_config(kl: float) -> LossConfig:
    return LossConfig(
        estimator="sampled", correction="none", distillation_coefficient=0.0, rl_coefficient=1.0,
        kl_coefficient=kl,
    )  # fmt: skip


def engine(path, kl: float) -> TorchTrainEngine:
    return TorchTrainEngine.from_pretrained(
        path, dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=2e-2, grad_clip=None),
        loss=loss_config(kl), total_steps=10,
    )  # fmt: skip


def batch_of(tokens: TokenBatch, behavior: torch.Tensor, ref: torch.Tensor | None) -> TrainBatch:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.0, 1.0])
    return TrainBatch.create(tokens, behavior, orm_advantages=grpo_advantages(rewards, 4), ref_logprobs=ref)


def test_reference_logprobs_equal_a_direct_forward_of_the_starting_weights(student, tokens):
    reference = ReferenceModel.load("torch", student, dtype="float32", device="cpu")
    got = reference.logprobs(tokens)
    want = direct_logprobs(student, tokens, torch.float32)
    assert got.dtype == torch.float32 and got.shape == tokens.response_ids.shape
    assert float((got - want).abs().max()) <= 1e-6
    assert float((got.double() - direct_logprobs(student, tokens, torch.float64)).abs().max()) <= 1e-5
    assert reference.on_device and reference.last_seconds > 0  # CPU: nothing moves
    assert reference.logprobs(tokens.rows(0, 0)).shape == (0, tokens.response_width)


def test_the_reference_is_not_the_actor_weights_after_training_or_a_checkpoint(student, tokens):
    actor = engine(student, BETA)
    reference = ReferenceModel.load("torch", student, dtype="float32", device="cpu")
    start = reference.logprobs(tokens)
    ref0 = start.clone()
    for _ in range(2):
        actor.train_step(batch_of(tokens, actor.logprobs(tokens).cpu(), ref0))
    moved = actor.logprobs(tokens).cpu()
    assert float((moved - start).abs().max()) > 1e-3  # the actor changed
    resumed = engine(student, BETA)
    resumed.load_state_dict(actor.state_dict())  # what the controller's resume does
    assert torch.equal(resumed.logprobs(tokens).cpu(), moved)
    assert torch.equal(reference.logprobs(tokens), start)  # still the starting weights
    # the actor role's builder after that resume: models.actor.path, not the resumed engine's weights
    sets = [f"models.actor.path={student}", "loss.rl_coefficient=1.0", "loss.kl_coefficient=0.5"]
    cfg = load_run_config(
        str(REPO / "configs" / "local_cpu.yaml"), [*sets, "data.samples_per_prompt=2"], False
    )
    assert torch.equal(build_reference(cfg, "torch", resumed).logprobs(tokens), start)
    assert (
        float((reference.logprobs(tokens) - direct_logprobs(student, tokens, torch.float32)).abs().max())
        <= 1e-6
    )


def test_step_one_kl_is_exactly_zero_and_the_loss_is_the_unpenalized_loss(student, tokens):
    reference = ReferenceModel.load("torch", student, dtype="float32", device="cpu")
    with_kl, without_kl = engine(student, BETA), engine(student, 0.0)
    ref = reference.logprobs(tokens)
    behavior = with_kl.logprobs(tokens).cpu()
    assert torch.equal(behavior, ref)  # π_θ = π_ref at step 1, bit for bit
    a = with_kl.train_step(batch_of(tokens, behavior, ref))
    b = without_kl.train_step(batch_of(tokens, behavior, None))
    assert a["grpo/kl_ref"] == 0.0
    assert a["loss"] == b["loss"] and a["grpo/loss"] == b["grpo/loss"]
    assert a["grad_norm"] == b["grad_norm"]
    for p, q in zip(with_kl.model.parameters(), without_kl.model.parameters(), strict=True):
        assert torch.equal(p, q)  # the same update


def test_kl_after_some_steps_equals_a_float64_recomputation(student, tokens):
    reference = ReferenceModel.load("torch", student, dtype="float32", device="cpu")
    actor = engine(student, BETA)
    ref = reference.logprobs(tokens)
    behavior = actor.logprobs(tokens).cpu()  # the first rollout's μ, kept: an off-policy batch later
    for _ in range(3):
        actor.train_step(batch_of(tokens, behavior, ref))
    # float64: the engine's current weights and the starting checkpoint, recomputed from scratch
    policy64 = AutoModelForCausalLM.from_pretrained(student, torch_dtype=torch.float32).double().eval()
    policy64.load_state_dict({k: v.double() for k, v in actor.model.state_dict().items()})
    with torch.no_grad():
        logits = policy64(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits
    index = tokens.logit_positions
    rows = torch.arange(tokens.batch_size)[:, None].expand_as(index)
    lp64 = torch.log_softmax(logits, -1)[rows, index].gather(-1, tokens.response_ids[..., None]).squeeze(-1)
    lp64 = torch.where(tokens.response_mask, lp64, 0.0)
    ref64 = direct_logprobs(student, tokens, torch.float64)
    mask = tokens.response_mask
    delta = torch.where(mask, ref64 - lp64, 0.0)
    kl64 = float(torch.where(mask, delta.exp() - delta - 1, 0.0).sum() / mask.sum())
    batch = batch_of(tokens, behavior, ref)
    loss64, _ = grpo_policy_loss(
        lp64, behavior.double(), batch.orm_advantages.double(), mask, loss_config(BETA), ref_logprobs=ref64
    )
    stats = actor.train_step(batch)
    assert kl64 > 1e-4
    assert stats["grpo/kl_ref"] == pytest.approx(kl64, rel=1e-4, abs=1e-9)
    # the loss is a difference of O(1) surrogate terms (advantages sum to 0 per group): absolute bound
    assert stats["loss"] == pytest.approx(float(loss64), abs=1e-6)


def test_a_kl_penalty_without_teachers_has_a_teacher_phase_and_needs_its_reference(student):
    plan = ExecutionPlan.from_config(loss_config(BETA), teachers=("t",))
    assert plan.requires_reference and not plan.requires_teacher_scoring and plan.scores_before_train
    assert plan.step_phases == (Phase.ROLLOUT, Phase.TEACHER, Phase.DRAIN, Phase.TRAIN, Phase.SYNC)
    machine = PhaseMachine.from_plan(plan, consumers=("actor-0",))
    assert machine.pending_consumers == {"actor-0"}
    off = ExecutionPlan.from_config(loss_config(0.0), teachers=("t",))
    assert off.step_phases == (Phase.ROLLOUT, Phase.TRAIN, Phase.SYNC) and not off.scores_before_train
    actor = engine(student, BETA)
    with pytest.raises(ValueError, match="requires_reference is True.*None"):
        ShardStep(actor, {}, plan, loss_config(BETA), {}, SoloGroup())
    reference = ReferenceModel.load("torch", student, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="requires_reference is False.*given"):
        ShardStep(actor, {}, off, loss_config(0.0), {}, SoloGroup(), reference)
    with pytest.raises(ValueError, match="expected 'torch' or 'megatron'"):
        ReferenceModel.load("jax", student, dtype="float32", device="cpu")


def test_the_memory_plan_holds_the_reference_on_the_actor_gpu_in_the_teacher_phase() -> None:
    from helpers_models import QWEN3_0_6B
    from test_memory_plan import holdings, plan_of

    from mopd_hpc.engines.memory.estimates import ModelShape

    kl = ["loss.rl_coefficient=1.0", "loss.kl_coefficient=0.1", "data.samples_per_prompt=2"]
    _, (gpu,) = plan_of(kl)
    h = holdings(gpu)
    p = ModelShape.from_hf_config(QWEN3_0_6B).params
    weights = h["actor 0", "reference model weights"]
    assert (weights.bytes, weights.phase) == (2 * p, "teacher")  # bf16, the actor's dtype
    assert h["actor 0", "reference model scoring buffers"].phase == "teacher"
    actor = next(c for c in gpu.children if c.label == "actor 0")
    _, (plain,) = plan_of(kl[:1] + kl[2:])  # the same run without the KL penalty
    before = next(c for c in plain.children if c.label == "actor 0")
    assert actor.in_phase("train") == before.in_phase("train")  # offloaded before TRAIN
    assert actor.in_phase("teacher") > before.in_phase("teacher")


@pytest.mark.gpu
def test_on_a_gpu_the_torch_reference_holds_device_memory_only_while_it_scores(student, tokens) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    reference = ReferenceModel.load("torch", student, dtype="float32", device="cuda:0")
    torch.cuda.synchronize()
    assert not reference.on_device and torch.cuda.memory_allocated() == m0
    got = reference.logprobs(tokens)
    torch.cuda.synchronize()
    assert not reference.on_device and torch.cuda.memory_allocated() == m0 and got.device.type == "cpu"
    assert float((got - direct_logprobs(student, tokens, torch.float32)).abs().max()) <= 1e-5
