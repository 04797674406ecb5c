"""The megatron engine's router losses through megatron-core's own mechanisms (issue 33;
engines/megatron/router_losses.py), on CPU (one gloo rank): megatron's MoE layers in train mode with
`MegatronRouterLosses` set on their config, a micro-batch share s, padded positions — the gradients of the
routers and experts equal a hand-written float32 reference: Σ_l (transformers' sparse MoE block output · w_l)
+ s·(c_lb·mean_l LB_l + c_z·Z), LB and Z the torch engine's functions (engines/moe_routing.py) over the real
positions. The recorded statistics equal the torch engine's (its pooled load-balancing loss with one MoE
layer; the mean of the per-layer ones with two; its z-loss). GPTModel's forward needs CUDA (RoPE): the whole
model on a GPU is tests/engines/test_megatron_moe_gpu.py; the router's gating (a CUDA move, then the same linear) is
replaced by the linear, as in tests/engines/test_megatron_convert_moe.py. And the engine's train step itself (RoPE's
CUDA move pointed at the CPU too) gives the torch engine's gradients and metrics on a one-MoE-layer model.
"""

from __future__ import annotations

import json
from pathlib import Path

import helpers_fork
import pytest
from test_megatron_convert import megatron_report

_SCRIPT = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.transformer.moe import router
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore
from mopd_hpc.engines.megatron.convert_moe import split_fused_experts
from mopd_hpc.engines.megatron.model import build_gpt_model, load_mcore_state
from mopd_hpc.engines.megatron.router_losses import MegatronRouterLosses
from mopd_hpc.engines.moe_routing import load_balancing_loss, z_loss

router.TopKRouter.gating = lambda self, x: torch.nn.functional.linear(x, self.weight)
C_LB, C_Z, SHARE, S, B, H = 0.3, 0.05, 0.4, 6, 3, 64
report = {}
for layers in (1, 2):
    torch.manual_seed(layers)
    cfg = Qwen3MoeConfig(
        vocab_size=120, hidden_size=H, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, norm_topk_prob=True, router_aux_loss_coef=0.001)
    hf = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.3)
    shape = Qwen3Shape.from_hf_config(cfg)
    model = build_gpt_model(shape, dtype="float32", cpu_init=True).train()
    load_mcore_state(model, hf_to_mcore(split_fused_experts(hf.state_dict()), shape))
    losses = MegatronRouterLosses(model, cfg.to_dict(), LossConfig(router_aux_loss_coefficient=C_LB,
                                                                   router_z_loss_coefficient=C_Z))
    mask = torch.ones(B, S, dtype=torch.int64)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    xs = [torch.randn(S, B, H) for _ in range(layers)]  # [s, b, h], megatron's layout
    ws = [torch.randn(S, B, H) for _ in range(layers)]
    main = 0.0
    for n in range(layers):
        out = model.decoder.layers[n].mlp(xs[n], padding_mask=~mask.bool())
        main = main + ((out[0] if isinstance(out, tuple) else out) * ws[n]).sum()
    losses.scale(SHARE, 1)
    main.backward()
    stats = {k: v.item() for k, v in losses.collect(torch.device("cpu")).items()}

    # the hand-written reference: transformers' blocks, the torch engine's router losses
    ref, logits, per_layer = 0.0, [], []
    for n in range(layers):
        block = hf.model.layers[n].mlp
        x = xs[n].transpose(0, 1).contiguous()  # [b, s, h]
        ref = ref + (block(x) * ws[n].transpose(0, 1)).sum()
        logits.append(x.reshape(-1, H) @ block.gate.weight.T)
        per_layer.append(load_balancing_loss(logits[-1:], 2, mask))
    lb, lz = torch.stack(per_layer).mean(), z_loss(logits, mask)
    gates = [layer.mlp.gate.weight for layer in hf.model.layers]
    terms = torch.autograd.grad(SHARE * (C_LB * lb + C_Z * lz), gates, retain_graph=True)
    (ref + SHARE * (C_LB * lb + C_Z * lz)).backward()
    err, aux_part, scale = 0.0, 0.0, 0.0
    for n in range(layers):
        mine = model.decoder.layers[n].mlp
        gate = hf.model.layers[n].mlp.gate.weight.grad
        err = max(err, (mine.router.weight.grad - gate).abs().max().item())
        scale = max(scale, gate.abs().max().item())
        for e in range(8):
            down = hf.model.layers[n].mlp.experts.down_proj.grad[e]
            err = max(err, (mine.experts.local_experts[e].linear_fc2.weight.grad - down).abs().max().item())
    for n in range(layers):  # the same input again: the next step's statistics, not the sum of both steps
        out = model.decoder.layers[n].mlp(xs[n], padding_mask=~mask.bool())
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    again = {k: v.item() for k, v in losses.collect(torch.device("cpu")).items()}
    report[str(layers)] = {
        "again": again,
        "err": err, "scale": scale, "stats": stats, "terms": max(t.abs().max().item() for t in terms),
        "lb_torch_pooled": load_balancing_loss(logits, 2, mask).item(), "lb_torch_mean": lb.item(),
        "z_torch": lz.item(),
        "coeff": model.config.moe_aux_loss_coeff, "z_coeff": model.config.moe_z_loss_coeff,
    }
print(json.dumps(report))
"""


def test_megatron_router_losses_equal_a_hand_written_reference(tmp_path: Path) -> None:
    """Gradients within 1e-6 (float32) of the reference, load-balancing and z-loss included; the recorded
    statistics equal the torch engine's functions within 1e-6 relative, and a second step of the same input
    records the same (not their sum); per-layer coefficients c_lb·k/M and c_z/M."""
    report = megatron_report(_SCRIPT, tmp_path)
    for layers, r in report.items():
        m = int(layers)
        assert r["err"] < 1e-6 and r["scale"] > 1e-3 and r["terms"] > 1e-3, report  # the terms do count
        assert r["coeff"] == pytest.approx(0.3 * 2 / m) and r["z_coeff"] == pytest.approx(0.05 / m)
        assert r["stats"]["router/load_balancing_loss"] == pytest.approx(r["lb_torch_mean"], rel=1e-6)
        assert r["stats"]["router/z_loss"] == pytest.approx(r["z_torch"], rel=1e-6)
        # the tracker is cleared after each collect (megatron-core's clear_aux_losses_tracker)
        assert r["again"] == pytest.approx(r["stats"], rel=1e-6), report
    # one MoE layer: the torch engine's (pooled) load-balancing loss itself
    one = report["1"]
    assert one["stats"]["router/load_balancing_loss"] == pytest.approx(one["lb_torch_pooled"], rel=1e-6)


_STEP_SCRIPT = """
import contextlib, json, sys, warnings
from types import SimpleNamespace
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
import megatron.core.distributed as mcore_distributed
from megatron.core.transformer.moe import router
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.megatron import engine as megatron_engine
from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore
from mopd_hpc.engines.megatron.convert_moe import split_fused_experts
from mopd_hpc.engines.megatron.model import build_gpt_model, load_mcore_state
from mopd_hpc.engines.megatron.router_losses import MegatronRouterLosses
from mopd_hpc.engines.micro_batch import MicroBatching
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.mopd.targets import TeacherTargets

# GPTModel's CUDA moves, pointed at the CPU: the router's gating weight and RoPE's inv_freq
router.TopKRouter.gating = lambda self, x: torch.nn.functional.linear(x, self.weight)
torch.cuda.current_device = lambda: "cpu"
mcore_distributed.finalize_model_grads = lambda models: None  # one rank, no DDP: nothing to reduce
torch.manual_seed(0)
cfg = Qwen3MoeConfig(
    vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
    num_experts_per_tok=2, num_hidden_layers=2, mlp_only_layers=[1], num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, router_aux_loss_coef=0.2)
hf = Qwen3MoeForCausalLM(cfg)
with torch.no_grad():
    hf.model.layers[0].mlp.gate.weight.normal_(0.0, 0.3)
hf.save_pretrained(sys.argv[2])
loss = LossConfig(router_z_loss_coefficient=0.01)  # c_lb: null, the checkpoint's 0.2
budget = MicroBatching(tokens=int(sys.argv[3]))

rows = [[1, 2, 3, 11, 12, 13], [4, 5, 15], [6, 7, 8, 9, 16, 17, 18, 19], [3, 9, 10, 11, 12]]
tokens = TokenBatch.from_rows(rows, [3, 2, 4, 1], pad_id=0)
g = torch.Generator().manual_seed(3)
width = tokens.response_width
targets = TeacherTargets(-torch.rand(4, width, generator=g) * 3, torch.ones(4, width))
batch = TrainBatch.create(tokens, -torch.rand(4, width, generator=g) * 3, targets=targets)

torch_engine = TorchTrainEngine.from_pretrained(
    sys.argv[2], dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=1e-5, grad_clip=None), loss=loss,
    micro_batching=budget)
grads = {}  # the torch engine's step gradients, captured after each accumulation (the last: the step's)
for p in torch_engine.model.parameters():
    p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(p, p.grad.clone()))
want = torch_engine.train_step(batch)

shape = Qwen3Shape.from_hf_config(cfg)
model = build_gpt_model(shape, dtype="float32", cpu_init=True, rope_theta=float(cfg.rope_parameters["rope_theta"]))
load_mcore_state(model, hf_to_mcore(split_fused_experts(hf.state_dict()), shape))
actor = object.__new__(megatron_engine.MegatronTrainEngine)  # no DDP / Megatron optimizer: those need CUDA
actor.device, actor.loss_config, actor.steps, actor.shape = torch.device("cpu"), loss, 0, shape
actor.ddp = SimpleNamespace(train=model.train, zero_grad_buffer=lambda: None, no_sync=contextlib.nullcontext)
actor.micro_batching = budget
actor.optimizer = SimpleNamespace(zero_grad=lambda: None, step=lambda: (True, 0.5, None), param_groups=[{"lr": 1e-5}])
actor.scheduler = SimpleNamespace(step=lambda increment: None)
actor.router_losses = MegatronRouterLosses(model, cfg.to_dict(), loss)
actor.forward = megatron_engine.MegatronForward(model, actor.device, padding=actor.router_losses.active)
actor.residency = SimpleNamespace(on_device=True)
actor.data_parallel = DataParallel.single()
got = actor.train_step(batch)

mine, ref = model.decoder.layers[0].mlp, torch_engine.model.model.layers[0].mlp
pairs = [(mine.router.weight.grad, grads[ref.gate.weight])]
pairs += [(mine.experts.local_experts[e].linear_fc2.weight.grad, grads[ref.experts.down_proj][e]) for e in range(8)]
attn = torch_engine.model.model.layers[0].self_attn
qkv = sum(grads[w].abs().sum() for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
pairs.append((model.decoder.layers[0].self_attention.linear_qkv.weight.grad.abs().sum() / qkv, torch.ones(())))
print(json.dumps({
    "grad_err": max(float((a - b).abs().max()) for a, b in pairs),
    "router_grad": float(grads[ref.gate.weight].abs().max()),
    "got": {k: got[k] for k in ("router/load_balancing_loss", "router/z_loss", "loss", "micro_batches")},
    "want": {k: want[k] for k in ("router/load_balancing_loss", "router/z_loss", "loss", "micro_batches")},
}))
"""


@pytest.mark.parametrize("budget", [64, 12])
def test_megatron_moe_train_step_equals_the_torch_engines(tmp_path: Path, budget: int) -> None:
    """`MegatronTrainEngine.train_step` (its real loop: the micro-batches' token shares on the autoscaler,
    GPTModel's padding mask, the statistics from megatron's tracker; DDP and the Megatron optimizer, which
    need CUDA, are stand-ins) on a Qwen3-MoE with one MoE layer gives the torch engine's gradients of the same
    weights and batch (router, experts, attention; within 1e-5, float32) with c_lb the checkpoint's 0.2 and
    c_z 0.01, and records the torch engine's router statistics and loss (router terms included); in one
    micro-batch and in several (1.2e-7 measured)."""

    from test_megatron_convert import REPO

    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    proc = helpers_fork.run(
        ["-c", _STEP_SCRIPT, str(tmp_path / "pg"), str(tmp_path / "ckpt"), str(budget)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["grad_err"] < 1e-5 and r["router_grad"] > 1e-4, r
    assert r["got"]["micro_batches"] == r["want"]["micro_batches"] == (1 if budget == 64 else 3), r
    for key in ("router/load_balancing_loss", "router/z_loss", "loss"):
        assert r["got"][key] == pytest.approx(r["want"][key], rel=1e-5), r
