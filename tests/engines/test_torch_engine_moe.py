"""The torch train engine on a micro Qwen3-MoE student (real transformers forward passes): the router losses in
the train step, and rollout routing replay.

Oracles: a reference step computed by hand on a second copy of the model — the MOPD gradient (the engine with
its router losses off) plus the gradient of c_lb·(transformers' own `aux_loss`, Switch Transformer) + c_z·(the
ST-MoE z-loss written out from the `router_logits` transformers returns), then torch's AdamW; for replay, a
forward of transformers' MoE blocks written out token by token with the selection forced.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_models import MOE_EXPERTS as EXPERTS
from helpers_models import MOE_TOP_K as TOP_K
from helpers_models import save_micro_moe
from transformers import Qwen3MoeForCausalLM

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.mopd.targets import aggregate_teacher_targets

VOCAB = 32
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
OUTPUTS = [[11, 12, 13, 14], [15], [16, 17]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return save_micro_moe(tmp_path_factory.mktemp("moe") / "student")


def make_engine(path: Path, **loss: object) -> TorchTrainEngine:
    return TorchTrainEngine.from_pretrained(
        path, dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=1e-2, grad_clip=None),
        loss=LossConfig(**loss),
    )  # fmt: skip


def train_batch(engine: TorchTrainEngine) -> TrainBatch:
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    mu = engine.logprobs(tokens)
    teacher = torch.where(tokens.response_mask, mu - 0.3 * torch.arange(4.0), 0.0)
    targets = aggregate_teacher_targets({"t": teacher}, [{"t": 1.0}] * tokens.batch_size)
    return TrainBatch.create(tokens, mu.clone(), targets=targets)


def test_moe_train_step_equals_a_reference_step_by_hand(moe: Path) -> None:
    engine = make_engine(moe, router_z_loss_coefficient=0.01)  # c_lb: the config's router_aux_loss_coef
    assert (engine.router_aux, engine.router_z, engine.router_top_k) == (0.05, 0.01, TOP_K)
    batch = train_batch(engine)
    tokens = batch.tokens

    # the MOPD term's gradient: the same engine without router losses
    plain = make_engine(moe, router_aux_loss_coefficient=0.0)
    mopd_loss, _, _ = plain.compute_loss(batch)
    mopd_loss.backward()
    grads = {n: p.grad.clone() for n, p in plain.model.named_parameters()}

    # the router losses by hand, on transformers' own forward of a second copy
    ref = Qwen3MoeForCausalLM.from_pretrained(str(moe), dtype=torch.float32)
    out = ref(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_router_logits=True)
    mask = tokens.attention_mask.reshape(-1).float()
    z = sum((torch.logsumexp(r, -1) ** 2 * mask).sum() for r in out.router_logits) / (2 * mask.sum())
    router = 0.05 * out.aux_loss + 0.01 * z
    router.backward()
    for n, p in ref.named_parameters():
        p.grad = p.grad + grads[n] if p.grad is not None else grads[n]
    adam = torch.optim.AdamW(
        list(ref.parameters()), lr=1e-2, weight_decay=OptimizerConfig(lr=1.0).weight_decay
    )
    adam.step()

    stats = engine.train_step(batch)
    assert stats["router/load_balancing_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    assert stats["router/z_loss"] == pytest.approx(float(z.detach()), rel=1e-5)
    assert stats["loss"] == pytest.approx(float((mopd_loss + router).detach()), rel=1e-5)
    assert 1.0 < float(out.aux_loss.detach()) < EXPERTS  # routing is not balanced: the term has a gradient
    moved = 0
    for (name, p), q in zip(engine.model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6, msg=name)
        moved += int("mlp.gate" in name and not torch.equal(p, saved_weight(moe, name)))
    assert moved == 2  # both routers were trained


def saved_weight(path: Path, name: str) -> torch.Tensor:
    """The weight `name` of the checkpoint at `path` (a router's: stored under the same name)."""
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))[name]


def test_router_losses_are_refused_for_a_dense_model(tmp_path: Path) -> None:
    from helpers_models import save_micro_qwen3

    dense = save_micro_qwen3(tmp_path / "dense", 0, vocab_size=VOCAB)
    engine = make_engine(dense)
    assert (engine.router_aux, engine.routing.moe) == (0.0, False)
    with pytest.raises(EngineError, match="router_z_loss_coefficient=0.5: the actor .* is a dense model"):
        make_engine(dense, router_z_loss_coefficient=0.5)


def hand_moe_forward(block: torch.nn.Module, forced: torch.Tensor):
    """A transformers Qwen3-MoE block's forward written out token by token: the experts `forced` [N, k] where
    ≥ 0, else the router's own top k; the weights the router's softmax at those experts, renormalized."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        b, n, h = hidden.shape
        flat = hidden.reshape(-1, h)
        probs = torch.softmax(flat @ block.gate.weight.T, dim=-1, dtype=torch.float32)
        own = probs.topk(TOP_K, dim=-1).indices
        ids = torch.where(forced >= 0, forced, own)
        rows = []
        for i in range(flat.shape[0]):
            w = probs[i, ids[i]] / probs[i, ids[i]].sum()
            out = torch.zeros(h)
            for slot, e in enumerate(ids[i].tolist()):
                gate, up = (block.experts.gate_up_proj[e] @ flat[i]).chunk(2)
                out = out + w[slot] * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
            rows.append(out)
        return torch.stack(rows).reshape(b, n, h)

    return forward


def least_likely_routes(ref: torch.nn.Module, tokens: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts to force: each response position's k least likely ones per MoE layer of the transformers
    model `ref` (never the router's own), as the rollout records them ([B, T, M, k] int16, −1 off the
    responses) and at every position ([B, L, M, k] int64, −1: the router's own choice)."""
    mask = tokens.response_mask
    b, n = tokens.input_ids.shape
    with torch.no_grad():
        own = ref(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_router_logits=True)
    layers = len(own.router_logits)
    least = torch.stack([r.topk(TOP_K, dim=-1, largest=False).indices for r in own.router_logits], dim=1)
    least = least.reshape(b, n, layers, TOP_K)  # [B, L, M, k]
    routed = torch.full((b, tokens.response_width, layers, TOP_K), -1, dtype=torch.int16)
    at = torch.arange(b)[:, None].expand_as(mask)
    routed[mask] = least[at[mask], tokens.logit_positions[mask]].to(torch.int16)
    forced = torch.full((b, n, layers, TOP_K), -1, dtype=torch.int64)
    forced[at[mask], tokens.logit_positions[mask]] = routed[mask].long()
    return routed, forced


def test_replayed_experts_give_the_log_probs_of_a_forward_with_those_experts(moe: Path) -> None:
    engine = make_engine(moe, router_aux_loss_coefficient=0.0)
    batch = train_batch(engine)
    tokens = batch.tokens
    mask = tokens.response_mask
    b, n = tokens.input_ids.shape

    ref = Qwen3MoeForCausalLM.from_pretrained(str(moe), dtype=torch.float32)
    routed, forced = least_likely_routes(ref, tokens)
    at = torch.arange(b)[:, None].expand_as(mask)
    replayed = TrainBatch.create(
        tokens, batch.behavior_logprobs, targets=batch.targets, routed_experts=routed
    )

    # the reference: transformers' model with every MoE block's forward written out with the forced experts
    for index, layer in enumerate(ref.model.layers):
        layer.mlp.forward = hand_moe_forward(layer.mlp, forced[:, :, index].reshape(-1, TOP_K))
    logits = ref(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits
    expected = torch.log_softmax(logits.double(), -1).gather(-1, tokens.input_ids[..., None].roll(-1, 1))[
        ..., 0
    ]
    expected = torch.where(mask, expected[at, tokens.logit_positions], 0.0)

    engine.train_module.train()
    _, logprobs, _ = engine.compute_loss(replayed)
    torch.testing.assert_close(logprobs.double(), expected.detach(), rtol=0, atol=2e-5)
    # the gate weights come from the current router: its weights get a gradient through the replayed forward
    logprobs.sum().backward()
    engine.routing.end()
    for layer in engine.model.model.layers:
        assert float(layer.mlp.gate.weight.grad.abs().sum()) > 0
    plain = engine.logprobs(tokens)  # the router's own choice
    assert float(((plain - logprobs.detach()).abs() * mask).max()) > 1e-2
    with pytest.raises(EngineError, match="routed_experts records 3 MoE layers × 2 experts per token"):
        engine._replay(
            TrainBatch.create(
                tokens, batch.behavior_logprobs, routed_experts=routed.repeat(1, 1, 2, 1)[:, :, :3]
            )
        )


def test_a_moe_teacher_scores_the_log_probs_of_transformers_own_forward(moe: Path) -> None:
    """A Qwen3-MoE teacher through the torch scoring engine: its log-probs are transformers' full forward's."""
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine

    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    scorer = TorchScoringEngine.from_pretrained(moe, dtype="float32", device="cpu")
    ref = Qwen3MoeForCausalLM.from_pretrained(str(moe), dtype=torch.float32)
    for b, (prompt, output) in enumerate(zip(PROMPTS, OUTPUTS, strict=True)):
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=torch.tensor([prompt + output])).logits[0].double(), -1)
        want = torch.tensor(
            [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(output)], dtype=torch.float64
        )
        got = scorer.logprobs(tokens)[b, : len(output)].double()
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
