"""The torch train/scoring engines on micro Qwen3 models built in seconds (real transformers forward passes).

Oracles: a naive full-sequence forward + float64 log_softmax + gather; the exact per-position reverse KL
over the whole vocabulary; `grpo_policy_loss` on the engine's own log-probs; AdamW's first-step algebra.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_qwen3

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import BatchError, TokenBatch, TrainBatch
from mopd_hpc.engines.protocol import EngineError, ScoringEngine, TrainEngine
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.engines.torch.scoring import TorchScoringEngine
from mopd_hpc.mopd.targets import aggregate_teacher_targets

VOCAB = 32
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
OUTPUTS = [[11, 12, 13, 14], [15], [16, 17], [18, 19, 20]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("micro")
    return {
        "student": save_micro_qwen3(root / "student", 0, vocab_size=VOCAB, initializer_range=0.2),
        "teacher": save_micro_qwen3(root / "teacher", 1, vocab_size=VOCAB, initializer_range=0.2),
    }


def make_engine(
    path: Path, lr: float = 1e-2, grad_clip: float | None = 1.0, **loss: object
) -> TorchTrainEngine:
    return TorchTrainEngine.from_pretrained(
        path,
        dtype="float32",
        device="cpu",
        optimizer=OptimizerConfig(lr=lr, grad_clip=grad_clip),
        loss=LossConfig(**loss),
    )


def naive_logprobs(model: torch.nn.Module, prompts, outputs) -> list[list[float]]:
    """One row at a time, no padding: log_softmax(full logits, float64) gathered at the response tokens."""
    rows = []
    with torch.no_grad():
        for p, o in zip(prompts, outputs, strict=True):
            ids = torch.tensor([p + o])
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            rows.append([float(logp[len(p) - 1 + t, tok]) for t, tok in enumerate(o)])
    return rows


def exact_reverse_kl(student: TorchTrainEngine, teacher: TorchScoringEngine, tokens: TokenBatch) -> float:
    """Mean over response positions of KL(π_θ(·|s_t) ‖ π_T(·|s_t)), full vocabulary, float64."""
    with torch.no_grad():
        ls = torch.log_softmax(student.forward.response_logits(tokens).double(), -1)
        lt = torch.log_softmax(teacher.forward.response_logits(tokens).double(), -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    return float((kl * tokens.response_mask).sum() / tokens.response_mask.sum())


def test_token_batch_layout():
    tb = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    assert tb.input_ids.shape == (4, 7) and tb.response_ids.shape == (4, 4)
    assert tb.input_ids[1].tolist() == [4, 5, 15, 0, 0, 0, 0]
    assert tb.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert tb.response_ids[3].tolist() == [18, 19, 20, 0]
    assert tb.response_mask.sum(1).tolist() == [4, 1, 2, 3]
    assert tb.logit_positions[0].tolist() == [2, 3, 4, 5]
    assert tb.logit_positions[3].tolist() == [0, 1, 2, 3]
    assert tb.unpad_response_values(tb.pad_response_values([[1.0] * len(o) for o in OUTPUTS])) == [
        [1.0] * len(o) for o in OUTPUTS
    ]
    with pytest.raises(BatchError, match=r"response_start\[0\] is 0"):
        TokenBatch.from_rows([[1, 2]], [0], pad_id=0)
    with pytest.raises(BatchError, match="behavior_logprobs has shape"):
        TrainBatch.create(tb, torch.zeros(4, 3))


def test_logprobs_equal_naive_log_softmax_gather(models):
    engine = make_engine(models["student"])
    scorer = TorchScoringEngine.from_pretrained(models["student"], max_batch_rows=3)
    assert isinstance(engine, TrainEngine) and isinstance(scorer, ScoringEngine)
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    want = naive_logprobs(engine.model, PROMPTS, OUTPUTS)
    got = engine.logprobs(tokens)
    assert got.dtype == torch.float32 and got.shape == (4, 4)
    for b, row in enumerate(want):
        torch.testing.assert_close(
            got[b, : len(row)].double(), torch.tensor(row, dtype=torch.float64), atol=1e-5, rtol=0
        )
        assert got[b, len(row) :].abs().sum() == 0
    # The scoring engine (micro-batched by 3 rows, inference mode) gives the same numbers.
    torch.testing.assert_close(scorer.logprobs(tokens), got, atol=1e-6, rtol=0)
    top = scorer.topk(tokens, 5)
    assert top.indices.shape == (4, 4, 5)
    full = torch.log_softmax(scorer.forward.response_logits(tokens).double(), -1)
    torch.testing.assert_close(top.logprobs.double(), full.topk(5, -1).values, atol=1e-5, rtol=0)


def sample_batch(engine: TorchTrainEngine, n_per_prompt: int = 8, length: int = 4) -> TokenBatch:
    """Responses sampled from the student itself (on-policy), seeded."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3]] * n_per_prompt + [[4, 5]] * n_per_prompt
    outputs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(length):
                probs = torch.softmax(engine.model(torch.tensor([ids])).logits[0, -1], -1)
                ids.append(int(torch.multinomial(probs, 1, generator=gen)))
            outputs.append(ids[len(p) :])
    return TokenBatch.from_samples(prompts, outputs, pad_id=0)


def test_sampled_mopd_moves_student_toward_teacher(models):
    engine = make_engine(models["student"])
    teacher = TorchScoringEngine.from_pretrained(models["teacher"])
    tokens = sample_batch(engine)
    mu = engine.logprobs(tokens).clone()
    teacher_lp = teacher.logprobs(tokens)
    targets = aggregate_teacher_targets({"t": teacher_lp}, [{"t": 1.0}] * tokens.batch_size)
    batch = TrainBatch.create(tokens, mu, targets=targets)
    mask = tokens.response_mask

    def gap() -> float:
        return float(((engine.logprobs(tokens) - teacher_lp).abs() * mask).sum() / mask.sum())

    kl0, gap0 = exact_reverse_kl(engine, teacher, tokens), gap()
    stats = [engine.train_step(batch) for _ in range(20)]
    kl20, gap20 = exact_reverse_kl(engine, teacher, tokens), gap()
    assert kl20 < 0.8 * kl0, (kl0, kl20)
    assert gap20 < 0.5 * gap0, (gap0, gap20)
    first = stats[0]
    assert first["mopd/rho_mean"] == pytest.approx(1.0) and first["tokens"] == float(mask.sum())
    # Step 1 is on-policy: the k1 estimate is the batch mean of log π_θ − log π_T.
    assert first["mopd/reverse_kl"] == pytest.approx(
        float(((mu - teacher_lp) * mask).sum() / mask.sum()), abs=1e-5
    )
    assert not any(k.startswith(("grpo/", "topk/")) for k in first)


def test_topk_with_k_at_least_vocab_is_exact_reverse_kl(models):
    engine = make_engine(models["student"], estimator="topk", topk=VOCAB)
    teacher = TorchScoringEngine.from_pretrained(models["teacher"])
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    top = teacher.topk(tokens, 2 * VOCAB)
    assert top.indices.shape[-1] == VOCAB
    batch = TrainBatch.create(
        tokens, torch.zeros(4, 4), teacher_topk={"t": top}, teacher_weights={"t": torch.ones(4)}
    )
    loss, _, stats = engine.compute_loss(batch)
    loss.backward()
    got = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    engine.model.zero_grad(set_to_none=True)
    # Oracle: the exact per-position reverse KL over the whole vocabulary, token-mean.
    ls = torch.log_softmax(engine.forward.response_logits(tokens).float(), -1)
    with torch.no_grad():
        lt = torch.log_softmax(teacher.forward.response_logits(tokens).float(), -1)
    mask = tokens.response_mask
    exact = ((ls.exp() * (ls - lt)).sum(-1) * mask).sum() / mask.sum()
    exact.backward()
    assert float(loss.detach()) == pytest.approx(float(exact.detach()), abs=1e-5)
    assert float(stats["topk/teacher_mass"]) == pytest.approx(1.0, abs=1e-5)
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-4)
    # And training on it lowers the exact reverse KL.
    kl0 = exact_reverse_kl(engine, teacher, tokens)
    for _ in range(10):
        engine.train_step(batch)
    assert exact_reverse_kl(engine, teacher, tokens) < 0.5 * kl0


def test_grpo_only_when_distillation_coefficient_is_zero(models):
    engine = make_engine(models["student"], distillation_coefficient=0.0, rl_coefficient=1.0)
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    mu = engine.logprobs(tokens).clone()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    stats = engine.train_step(TrainBatch.create(tokens, mu, orm_advantages=adv))  # no teacher targets at all
    lengths = tokens.response_mask.sum(1).float()
    # On-policy (μ = π_θ): ratio 1, so L = −Σ_b A_b·|y_b| / Σ_b |y_b| (token-mean).
    assert stats["loss"] == pytest.approx(float(-(adv * lengths).sum() / lengths.sum()), abs=1e-6)
    assert stats["grpo/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert not any(k.startswith(("mopd/", "topk/")) for k in stats)
    assert any(not torch.equal(before[n], p) for n, p in engine.model.named_parameters())
    with pytest.raises(EngineError, match="orm_advantages"):
        engine.train_step(TrainBatch.create(tokens, mu))


def test_grad_clip_is_honoured(models):
    clip, lr = 1e-3, 1e-2
    engine = make_engine(models["student"], lr=lr, grad_clip=clip)
    teacher = TorchScoringEngine.from_pretrained(models["teacher"])
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    mu = engine.logprobs(tokens).clone()
    targets = aggregate_teacher_targets({"t": teacher.logprobs(tokens)}, [{"t": 1.0}] * 4)
    batch = TrainBatch.create(tokens, mu, targets=targets)
    # Oracle of the pre-clip norm: the same loss, backward, no step.
    loss, _, _ = engine.compute_loss(batch)
    loss.backward()
    want_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in engine.model.parameters())))
    engine.model.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    stats = engine.train_step(batch)
    assert stats["grad_norm"] == pytest.approx(want_norm, rel=1e-5) and want_norm > 100 * clip
    assert stats["grad_clip_coef"] == pytest.approx(clip / want_norm, rel=1e-3)
    # AdamW step 1: exp_avg = (1 − β1)·g_clipped, so its norm is (1 − β1)·clip; each |Δθ| ≤ lr.
    exp_avg = [engine.optimizer.state[p]["exp_avg"] for p in engine.model.parameters()]
    applied = float(torch.sqrt(sum((m.double() ** 2).sum() for m in exp_avg))) / 0.1
    assert applied == pytest.approx(clip, rel=1e-4)
    delta = max(float((p.detach() - before[n]).abs().max()) for n, p in engine.model.named_parameters())
    assert 0 < delta <= lr * (1 + 1e-6)


def test_engine_rejects_what_it_cannot_apply(models):
    with pytest.raises(ValueError, match="loss.orm_alpha 0.5 with loss.estimator 'topk'"):
        LossConfig(estimator="topk", orm_alpha=0.5)  # --check refuses it; the engine guards a built one
    unchecked = LossConfig().model_copy(update={"estimator": "topk", "orm_alpha": 0.5, "correction": "none"})
    with pytest.raises(EngineError, match="orm_alpha"):
        TorchTrainEngine.from_pretrained(
            models["student"],
            dtype="float32",
            device="cpu",
            optimizer=OptimizerConfig(lr=1e-2),
            loss=unchecked,
        )
    with pytest.raises(EngineError, match="dtype"):
        TorchScoringEngine.from_pretrained(models["teacher"], dtype="float64")
    engine = make_engine(models["student"])
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    with pytest.raises(EngineError, match="needs batch.targets"):
        engine.train_step(TrainBatch.create(tokens, torch.zeros(4, 4)))


def test_cpu_residency_is_a_logged_noop_and_export_round_trips(models, tmp_path, caplog):
    engine = make_engine(models["student"])
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    before = engine.logprobs(tokens)
    with caplog.at_level("INFO", logger="mopd_hpc.engines.memory.residency"):
        off = engine.offload()
    assert (off.action, off.moved, off.bytes_moved, off.device) == ("offload", False, 0, "cpu")
    assert "no-op" in caplog.text
    assert engine.onload().moved is False
    torch.testing.assert_close(engine.logprobs(tokens), before)
    names = dict(engine.named_weights())
    assert "model.embed_tokens.weight" in names and names["model.embed_tokens.weight"].shape == (VOCAB, 32)
    engine.save_pretrained(tmp_path / "export")
    reloaded = TorchScoringEngine.from_pretrained(tmp_path / "export")
    torch.testing.assert_close(reloaded.logprobs(tokens), before, atol=1e-6, rtol=0)


@pytest.mark.gpu
def test_gpu_logprobs_residency_and_bf16_step(models):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = TorchTrainEngine.from_pretrained(
        models["student"],
        dtype="float32",
        device="cuda",
        optimizer=OptimizerConfig(lr=1e-2),
        loss=LossConfig(),
    )
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    cpu_model = TorchScoringEngine.from_pretrained(models["student"]).model
    mu = engine.logprobs(tokens).cpu()
    for b, row in enumerate(naive_logprobs(cpu_model, PROMPTS, OUTPUTS)):
        torch.testing.assert_close(
            mu[b, : len(row)].double(), torch.tensor(row, dtype=torch.float64), atol=1e-5, rtol=0
        )
    targets = aggregate_teacher_targets({"t": mu - 0.5}, [{"t": 1.0}] * 4)
    batch = TrainBatch.create(tokens, mu.clone(), targets=targets)
    engine.train_step(batch)
    allocated = torch.cuda.memory_allocated()
    off = engine.offload()
    assert off.moved and off.bytes_moved > 0
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    assert all(s["exp_avg"].device.type == "cpu" for s in engine.optimizer.state.values())
    assert torch.cuda.memory_allocated() < allocated
    with pytest.raises(EngineError, match="offloaded"):
        engine.train_step(batch)
    assert engine.onload().moved
    assert all(s["exp_avg"].device.type == "cuda" for s in engine.optimizer.state.values())
    assert all(s["step"].device.type == "cpu" for s in engine.optimizer.state.values())
    assert engine.train_step(batch)["step_skipped"] == 0.0
    # A teacher's scoring engine offloads for real too; a bf16 student trains with finite statistics.
    scorer = TorchScoringEngine.from_pretrained(models["teacher"], device="cuda", dtype="bfloat16")
    assert scorer.offload().moved and scorer.onload().moved
    assert scorer.logprobs(tokens).dtype == torch.float32
    bf16 = TorchTrainEngine.from_pretrained(
        models["student"],
        dtype="bfloat16",
        device="cuda",
        optimizer=OptimizerConfig(lr=1e-3),
        loss=LossConfig(),
    )
    stats = bf16.train_step(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values()), stats


def teacher_batch(engine: TorchTrainEngine, teacher_path: Path) -> TrainBatch:
    """PROMPTS/OUTPUTS with μ = the engine's log-probs and the teacher's sampled-token targets."""
    teacher = TorchScoringEngine.from_pretrained(teacher_path)
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    targets = aggregate_teacher_targets({"t": teacher.logprobs(tokens)}, [{"t": 1.0}] * 4)
    return TrainBatch.create(tokens, engine.logprobs(tokens).clone(), targets=targets)


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [
        # transformers' schedules: warm-up 0, lr/2, then lr; cosine: 0.1 + 0.9·½(1 + cos(π·(s − 2)/4))
        ("constant", 2, [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
        (
            "cosine",
            2,
            [
                0.0,
                0.5,
                1.0,
                0.1 + 0.9 * math.cos(math.pi / 8) ** 2,
                0.55,
                0.1 + 0.9 * math.sin(math.pi / 8) ** 2,
            ],
        ),
    ],
)
def test_lr_schedule_per_step_and_across_resume(models, schedule, warmup, expected):
    """The lr each step used follows the schedule, and a reloaded engine continues it (not restarts it)."""
    opt = OptimizerConfig(lr=1e-2, schedule=schedule, warmup_ratio=warmup / 6, min_lr_ratio=0.1)

    def engine() -> TorchTrainEngine:
        return TorchTrainEngine.from_pretrained(
            models["student"], dtype="float32", device="cpu", optimizer=opt, loss=LossConfig(), total_steps=6
        )

    first = engine()
    batch = teacher_batch(first, models["teacher"])
    lrs = [first.train_step(batch)["lr"] for _ in range(3)]
    second = engine()
    second.load_state_dict(first.state_dict())
    lrs += [second.train_step(batch)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([1e-2 * f for f in expected], abs=1e-9)


def test_schedule_needs_a_run_length(models):
    with pytest.raises(EngineError, match="total_steps=0: expected >= 1"):
        TorchTrainEngine.from_pretrained(
            models["student"],
            dtype="float32",
            device="cpu",
            optimizer=OptimizerConfig(lr=1e-2),
            loss=LossConfig(),
            total_steps=0,
        )


def test_observe_sees_the_step_logprobs_before_the_update(models):
    """`observe` gets the log-probs the loss used (= a no-grad forward before the step), detached."""
    engine = make_engine(models["student"])
    batch = teacher_batch(engine, models["teacher"])
    before = engine.logprobs(batch.tokens)
    seen: list[torch.Tensor] = []

    def observe(lp: torch.Tensor) -> dict[str, float]:
        seen.append(lp)
        return {"probe/mean": float(lp.sum())}

    stats = engine.train_step(batch, observe=observe)
    assert not seen[0].requires_grad
    torch.testing.assert_close(seen[0], before, rtol=1e-5, atol=1e-6)
    assert stats["probe/mean"] == pytest.approx(float(before.sum()), rel=1e-5)
    assert not torch.equal(engine.logprobs(batch.tokens), before)  # the step changed the weights


def test_train_step_reports_the_seconds_of_its_parts(models):
    """`time/train/forward_backward_s` and `time/train/optimizer_s` are seconds of disjoint parts of the call:
    finite, > 0 (both do real work), and with `observe`'s 50 ms (between them, in neither) their sum stays
    under the call's wall time less those 50 ms."""
    import time

    engine = make_engine(models["student"])
    batch = teacher_batch(engine, models["teacher"])
    pause = 0.05
    t0 = time.perf_counter()
    stats = engine.train_step(batch, observe=lambda lp: time.sleep(pause) or {})
    wall = time.perf_counter() - t0
    fb, opt = stats["time/train/forward_backward_s"], stats["time/train/optimizer_s"]
    assert all(math.isfinite(s) and s > 0 for s in (fb, opt)), (fb, opt)
    assert fb + opt <= wall - pause, (fb, opt, wall)
