"""Numerical edges of a step, each defined: a teacher's −inf (refusal), a NaN teacher forward, a non-finite
μ, empty responses, a route whose rows are all empty, a step with no response token.

The choices (docstrings of mopd/targets.py, trainer/rollout_phase.py `check_behavior_finite`,
engines/teacher/score_frames.py `first_nan`, trainer/teacher_phase.py): a refusal enters S as REFUSED_LOGPROB (a
bounded advantage, counted); NaN from a teacher and a non-finite μ are errors naming the row and position
(and the step, where the phase knows it); an empty response is masked (not sent to a teacher); a step with no
response token is an error naming the step.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.rollout.generate_wire import GeneratedBatch
from mopd_hpc.engines.teacher.client import ScoreResponse
from mopd_hpc.engines.teacher.score_frames import LOGPROB_FLOOR, ScoreTensors, first_nan
from mopd_hpc.mopd.loss import mopd_loss
from mopd_hpc.mopd.routing import RoutedSample
from mopd_hpc.mopd.targets import REFUSED_LOGPROB, aggregate_teacher_targets
from mopd_hpc.trainer import rollout_phase
from mopd_hpc.trainer.rollout_phase import RolloutPhaseError, check_behavior_finite
from mopd_hpc.trainer.teacher_phase import score_teachers


def loss_config(**overrides: object) -> LossConfig:
    base = {"estimator": "sampled", "correction": "none", "advantage_clip": None, "normalizer": "token-mean"}
    return LossConfig.model_validate(base | overrides)


# ------------------------------------------------------------------------- a teacher's refusal (−inf)


def test_refusal_floor_is_float32s_smallest_normal_log() -> None:
    assert REFUSED_LOGPROB == pytest.approx(-87.33654475055310, abs=1e-12)
    assert math.isfinite(math.exp(REFUSED_LOGPROB)) and math.exp(REFUSED_LOGPROB) > 0


@pytest.mark.parametrize("refusal", [float("-inf"), LOGPROB_FLOOR], ids=["-inf", "wire-floor-1e30"])
def test_a_refused_token_enters_s_at_the_floor_and_is_counted(refusal: float) -> None:
    a = torch.tensor([[-1.0, refusal, -2.0], [-0.5, -0.5, float("nan")]])
    b = torch.tensor([[-3.0, -3.0, -3.0], [float("nan")] * 3])  # row 1: b unused (weight 0), NaN never read
    targets = aggregate_teacher_targets({"a": a, "b": b}, [{"a": 0.5, "b": 2.0}, {"a": 1.0}])
    expected = torch.tensor([[0.5 * -1 - 6, 0.5 * REFUSED_LOGPROB - 6, 0.5 * -2 - 6], [-0.5, -0.5, math.nan]])
    torch.testing.assert_close(targets.logp_sum, expected, equal_nan=True, rtol=0, atol=1e-5)
    assert targets.refused_tokens == 1


def test_a_refusal_gives_a_bounded_advantage_not_1e30() -> None:
    """The loss with a refusal equals the loss computed with the floor in its place (to 1e-6), and stays
    small: ~1e30 before this choice."""
    teacher = torch.tensor([[-1.0, LOGPROB_FLOOR, -2.0]])
    lp = torch.tensor([[-0.7, -1.2, -0.3]], requires_grad=True)
    mu = torch.tensor([[-0.7, -1.2, -0.3]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    targets = aggregate_teacher_targets({"a": teacher}, [{"a": 1.0}])
    loss, stats = mopd_loss(lp, mu, targets.logp_sum, targets.weight_sum, mask, loss_config())
    loss.backward()
    # reference: A = S − W·lp with S at the floor; L = −mean(A·lp)
    s = torch.tensor([-1.0, REFUSED_LOGPROB, -2.0])
    lpd = torch.tensor([-0.7, -1.2, -0.3])
    reference = -((s - lpd) * lpd).mean()
    assert float(loss.detach()) == pytest.approx(float(reference), rel=1e-6)
    assert abs(float(loss.detach())) < 100 and torch.isfinite(lp.grad).all()
    torch.testing.assert_close(lp.grad, -(s - lpd)[None] / 3)
    clipped, _ = mopd_loss(
        lp.detach(), mu, targets.logp_sum, targets.weight_sum, mask, loss_config(advantage_clip=5.0)
    )
    assert float(clipped) == pytest.approx(float(-(s - lpd).clamp(-5, 5).mul(lpd).mean()), rel=1e-6)


# ------------------------------------------------------------------ a teacher's NaN: a broken forward


def test_a_nan_teacher_logprob_is_found_at_real_positions_only() -> None:
    lp = torch.tensor([[-1.0, -2.0, float("nan")], [-1.0, float("nan"), -3.0]])
    assert first_nan(lp, torch.tensor([2, 3])) == (1, 1, 1)  # row 0's NaN is padding (length 2)
    assert first_nan(lp, torch.tensor([2, 1])) is None
    assert first_nan(torch.full((2, 0), 0.0), torch.tensor([0, 0])) is None


# --------------------------------------------------------------------------------- NaN/inf in μ


def draws(n: int) -> list[RoutedSample]:
    return [
        RoutedSample(route="chain" if b % 2 == 0 else "legs", source=f"s{b % 2}", index=b, sample=None)
        for b in range(n)
    ]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_a_non_finite_mu_is_refused_naming_step_row_and_position(bad: float) -> None:
    mu = torch.tensor([[-0.1, -0.2, 0.0], [-0.3, bad, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    with pytest.raises(RolloutPhaseError) as err:
        check_behavior_finite(mu, mask, 7, draws(2))
    message = str(err.value)
    assert message.startswith(
        "step 7, row 1 (source 's1', route 'legs'): the behavior log-prob μ at response "
    )
    assert f"position 1 is {bad} (1 non-finite in the step)" in message


def test_a_non_finite_mu_at_padding_is_no_error() -> None:
    mu = torch.tensor([[-0.1, float("nan")]])
    check_behavior_finite(mu, torch.tensor([[True, False]]), 1, draws(1))


class FakeRollout:
    """A rollout client answering SGLang-shaped items with the given outputs and log-probs."""

    base_url = "http://fake"

    def __init__(self, outputs: list[list[int]], logprobs: list[list[float]]) -> None:
        self.outputs, self.logprobs = outputs, logprobs

    async def generate_raw(self, body: dict) -> list[dict]:
        items = []
        for ids, lps in zip(self.outputs, self.logprobs, strict=True):
            triples = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
            meta = {"output_token_logprobs": triples, "finish_reason": {"type": "stop"}, "id": "x"}
            items.append({"text": "", "output_ids": ids, "meta_info": meta})
        return items

    async def generate_batch(self, body: dict) -> GeneratedBatch:
        return GeneratedBatch.from_sglang(await self.generate_raw(body))


class Tok:
    def __call__(self, texts: list[str]) -> dict:
        return {"input_ids": [[1, 5] for _ in texts]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class Src:
    def score(self, sample: object, text: str) -> float:
        return 0.0


def collect(outputs: list[list[int]], logprobs: list[list[float]], step: int = 3):
    class S:  # a raw prompt (data/chat.py encodes it as it is)
        text = "q"
        chat = None

    routed = [RoutedSample(route="chain", source="s", index=i, sample=S()) for i in range(len(outputs))]
    sampling = type("Sampling", (), {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0})()
    return asyncio.run(
        rollout_phase.collect_rollouts(
            [FakeRollout(outputs, logprobs)],
            routed,
            tokenizer=Tok(),
            sources={"s": Src()},
            sampling=sampling,
            samples_per_prompt=1,
            max_prompt_tokens=8,
            seed=0,
            step=step,
            pad_id=0,
        )
    )


def test_the_rollout_phase_refuses_a_nan_mu_from_any_engine() -> None:
    with pytest.raises(
        RolloutPhaseError, match=r"^step 3, row 1 \(source 's', route 'chain'\).* position 0 is nan"
    ):
        collect([[7, 2], [8]], [[-0.5, -0.1], [float("nan")]])


def test_a_step_with_no_response_token_is_refused_naming_it() -> None:
    with pytest.raises(RolloutPhaseError, match=r"^step 9: all 2 responses are empty \(0 tokens\)"):
        collect([[], []], [[], []], step=9)


def test_empty_responses_among_others_are_masked() -> None:
    rollouts = collect([[7, 2], [], [9]], [[-0.5, -0.1], [], [-0.2]])
    assert rollouts.tokens.response_lengths.tolist() == [2, 0, 1]
    assert rollouts.response_tokens == 3


# ---------------------------------------------- empty responses and a route whose rows are all empty


def packed(answer: ScoreResponse) -> ScoreTensors:
    """A stand-in's list answer as the binary transport's tensors (what `score_tensors` returns)."""
    ids = vals = None
    if answer.topk_ids is not None:
        ids = torch.tensor([p for row in answer.topk_ids for p in row], dtype=torch.int32)
        vals = torch.tensor([p for row in answer.topk_logprobs for p in row], dtype=torch.float32)
    return ScoreTensors(
        torch.tensor([len(r) for r in answer.logprobs], dtype=torch.int64),
        torch.tensor([x for r in answer.logprobs for x in r], dtype=torch.float32),
        ids,
        vals,
        "t",
        answer.weight_version,
        answer.fingerprint,
    )


class Tensors:
    """`score_tensors` of a stand-in that answers `score` with lists."""

    async def score_tensors(self, rows, starts, top_k):
        return packed(await self.score(rows, starts, top_k))


class FakeTeacher(Tensors):
    """A teacher client: log-prob −(t + 1)·scale at response position t; records what it was sent."""

    def __init__(self, scale: float) -> None:
        self.scale, self.calls = scale, []

    async def score(self, rows, starts, top_k):
        self.calls.append([len(r) - s for r, s in zip(rows, starts, strict=True)])
        logprobs = [
            [-(t + 1) * self.scale for t in range(len(r) - s)] for r, s in zip(rows, starts, strict=True)
        ]
        return ScoreResponse(logprobs, None, None, "0", "f")


def test_a_route_whose_rows_are_all_empty_calls_no_teacher_and_masks_its_rows() -> None:
    rows = [(1, 5, 7, 8), (1, 5), (1, 6, 9), (1, 6)]  # rows 1 and 3 (route legs) have empty responses
    starts = [2, 2, 2, 2]
    routes = ["chain", "legs", "chain", "legs"]
    weights = {"chain": {"a": 1.0}, "legs": {"b": 1.0}}
    tokens = TokenBatch.from_rows(rows, starts, 0)
    a, b = FakeTeacher(1.0), FakeTeacher(10.0)
    scores = asyncio.run(score_teachers({"a": a, "b": b}, rows, starts, tokens, routes, weights, top_k=None))
    assert a.calls == [[2, 1]] and b.calls == []  # the legs teacher is never called; empty rows never sent
    assert scores.rows_scored == {"a": 2}
    mask = tokens.response_mask
    s = scores.targets.logp_sum
    assert torch.isfinite(s[mask]).all() and s[0].tolist() == [-1.0, -2.0] and s[2, 0].item() == -1.0
    # the loss of the batch with its empty rows equals the loss of the non-empty rows alone
    lp = torch.tensor([[-0.2, -0.4], [0.0, 0.0], [-0.3, 0.0], [0.0, 0.0]])
    for normalizer in ("token-mean", "seq-mean-token-mean"):
        cfg = loss_config(normalizer=normalizer)
        full, _ = mopd_loss(lp, lp.clone(), s, scores.targets.weight_sum, mask, cfg)
        keep = [0, 2]
        alone, _ = mopd_loss(
            lp[keep], lp[keep].clone(), s[keep], scores.targets.weight_sum[keep], mask[keep], cfg
        )
        assert torch.isfinite(full) and float(full) == pytest.approx(float(alone), rel=1e-6)


class NanEngine:
    """A scoring engine whose forward gives a NaN at row 1, response position 0 (and −inf at row 0's)."""

    vocab_size = 16

    def score(self, batch: TokenBatch, top_k: int | None, *, host: bool = True):  # CPU: host either way
        lp = torch.full((batch.batch_size, batch.response_width), -0.5)
        lp[0, 0] = float("-inf")
        if batch.batch_size > 1:
            lp[1, 0] = float("nan")
        return lp, None


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_the_teacher_server_refuses_a_nan_forward_naming_row_and_position(tmp_path, binary: bool) -> None:
    from aiohttp.test_utils import TestServer

    from mopd_hpc.engines.teacher.client import TeacherClient, TeacherClientError
    from mopd_hpc.engines.teacher.http_app import TeacherServer

    (tmp_path / "config.json").write_text("{}")
    server = TeacherServer(NanEngine(), "legs", str(tmp_path))

    async def go(rows):
        async with TestServer(server.app()) as http:
            async with TeacherClient(str(http.make_url("")), binary=binary) as client:
                return await client.score(rows, [2] * len(rows))

    with pytest.raises(TeacherClientError) as err:
        asyncio.run(go([[1, 2, 3], [1, 2, 4, 5]]))
    assert err.value.status == 500
    assert "teacher 'legs': its log-prob of row 1's response token 0 is NaN (1 NaN in the batch)" in str(
        err.value
    )
    # the −inf alone is a refusal: sent as the floor, taken as REFUSED_LOGPROB by the actor
    answer = asyncio.run(go([[1, 2, 3]]))
    assert answer.logprobs == [[LOGPROB_FLOOR]]


class TopKTeacher(Tensors):
    """Answers top-2 at each position, the second a refusal (the wire's floor)."""

    async def score(self, rows, starts, top_k):
        n = [len(r) - s for r, s in zip(rows, starts, strict=True)]
        return ScoreResponse(
            [[-0.1] * k for k in n],
            [[[3, 4]] * k for k in n],
            [[[-0.1, LOGPROB_FLOOR]] * k for k in n],
            "0",
            "f",
        )


def test_a_refused_top_k_entry_is_floored_too() -> None:
    from mopd_hpc.mopd.topk import topk_reverse_kl_loss

    rows, starts = [(1, 5, 7, 8)], [2]
    tokens = TokenBatch.from_rows(rows, starts, 0)
    scores = asyncio.run(
        score_teachers({"a": TopKTeacher()}, rows, starts, tokens, ["chain"], {"chain": {"a": 1.0}}, top_k=2)
    )
    assert scores.topk["a"].logprobs[0, :, 1].tolist() == [pytest.approx(REFUSED_LOGPROB)] * 2
    logits = torch.zeros(1, 2, 16, requires_grad=True)
    loss, _ = topk_reverse_kl_loss(
        logits, scores.topk, scores.weights, tokens.response_mask, loss_config(estimator="topk")
    )
    loss.backward()
    # reference: p uniform over 16 tokens; D = Σ_{v∈K} p(log p − log q) − p + q per position
    p, lq = 1 / 16, torch.tensor([-0.1, REFUSED_LOGPROB], dtype=torch.float64)
    d = (p * (math.log(p) - lq) - p + lq.exp()).sum()
    assert float(loss.detach()) == pytest.approx(float(d), rel=1e-5) and float(loss.detach()) < 10
    assert torch.isfinite(logits.grad).all()
