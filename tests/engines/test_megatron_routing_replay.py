"""Rollout routing replay in the megatron actor's forward (issue 33; engines/megatron/routing_replay.py), on
CPU (one gloo rank): a megatron-core GPTModel of a Qwen3-MoE (2 MoE layers, 8 experts, top 2) with the
rollout's recorded experts forced — each response position's two LEAST likely experts per layer, never the
router's own — gives the log-probs of a reference forward that uses those experts (transformers' model with
every MoE block written out by hand, tests/engines/test_torch_engine_moe.py `hand_moe_forward`), within 2e-5 in
float32; without the replay the log-probs differ (> 5e-3; measured 1.2e-2, against an error of 5e-7); the routers get a gradient through the replayed
forward. The model is the torch engine's replay test. GPTModel's CUDA moves (the router's gating weight, RoPE's
inv_freq) are pointed at the CPU, which the forward then runs on (its logits equal transformers' to ~1e-7).
"""

from __future__ import annotations

from pathlib import Path

from test_megatron_convert import megatron_report

_SCRIPT = """
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = ["tests", "tests/engines"]
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.transformer.moe import router
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore
from mopd_hpc.engines.megatron.convert_moe import split_fused_experts
from mopd_hpc.engines.megatron.engine import MegatronForward
from mopd_hpc.engines.megatron.model import build_gpt_model, load_mcore_state
from mopd_hpc.engines.megatron.routing_replay import MegatronRoutingReplay
from test_torch_engine_moe import OUTPUTS, PROMPTS, TOP_K, hand_moe_forward, least_likely_routes

# GPTModel's CUDA moves, pointed at the CPU: the router's gating weight and RoPE's inv_freq
router.TopKRouter.gating = lambda self, x: torch.nn.functional.linear(x, self.weight)
torch.cuda.current_device = lambda: "cpu"
torch.manual_seed(0)
cfg = Qwen3MoeConfig(
    vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
    num_experts_per_tok=TOP_K, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    norm_topk_prob=True)
ref = Qwen3MoeForCausalLM(cfg).eval()
with torch.no_grad():
    for layer in ref.model.layers:
        layer.mlp.gate.weight.normal_(0.0, 0.3)
shape = Qwen3Shape.from_hf_config(cfg)
model = build_gpt_model(shape, dtype="float32", cpu_init=True, rope_theta=float(cfg.rope_parameters["rope_theta"]))
load_mcore_state(model, hf_to_mcore(split_fused_experts(ref.state_dict()), shape))
model.train()
replay = MegatronRoutingReplay(model)
forward = MegatronForward(model, torch.device("cpu"))

tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
mask = tokens.response_mask
b, n = tokens.input_ids.shape
routed, forced = least_likely_routes(ref, tokens)  # each response position's k least likely experts
at = torch.arange(b)[:, None].expand_as(mask)
batch = TrainBatch.create(tokens, torch.zeros(mask.shape), routed_experts=routed)
with torch.no_grad():
    plain_ref = ref(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits
for index, layer in enumerate(ref.model.layers):
    layer.mlp.forward = hand_moe_forward(layer.mlp, forced[:, :, index].reshape(-1, TOP_K))
with torch.no_grad():
    logits = ref(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits
def at_responses(logits):
    lp = torch.log_softmax(logits.double(), -1).gather(-1, tokens.input_ids[..., None].roll(-1, 1))[..., 0]
    return torch.where(mask, lp[at, tokens.logit_positions], 0.0)
expected, plain_expected = at_responses(logits), at_responses(plain_ref)

replay.start_batch(batch)
replayed = forward.token_logprobs(tokens)
replayed.sum().backward()
replay.end()
with torch.no_grad():
    plain = forward.token_logprobs(tokens)
grads = [float(layer.mlp.router.weight.grad.abs().sum()) for layer in model.decoder.layers]
print(json.dumps({
    "err": float(((replayed.double() - expected).abs() * mask).max()),
    "plain_err": float(((plain.double() - plain_expected).abs() * mask).max()),
    "moved": float(((plain - replayed.detach()).abs() * mask).max()),
    "router_grads": grads,
}))
"""


def test_megatron_replays_the_recorded_experts(tmp_path: Path) -> None:
    report = megatron_report(_SCRIPT, tmp_path)
    assert report["err"] < 2e-5, report  # the forced experts' log-probs
    assert report["plain_err"] < 2e-5, report  # without replay: the router's own choice, as transformers'
    assert report["moved"] > 5e-3, report  # the forced experts are not the router's own
    assert all(g > 0 for g in report["router_grads"]), report  # gate weights from the current router
