"""The megatron engine's router losses through megatron-core's own mechanisms (issue 33;
engines/megatron/router_losses.py), on CPU (one gloo rank): megatron's MoE layers in train mode with
`MegatronRouterLosses` set on their config, a micro-batch share s, padded positions — the gradients of the
routers and experts equal a hand-written float32 reference: Σ_l (transformers' sparse MoE block output · w_l)
+ s·(c_lb·mean_l LB_l + c_z·Z), LB and Z the torch engine's functions (engines/moe_routing.py) over the real
positions. The recorded statistics equal the torch engine's (its pooled load-balancing loss with one MoE
layer; the mean of the per-layer ones with two; its z-loss). GPTModel's forward needs CUDA (RoPE): the whole
model on a GPU is tests/test_megatron_moe_gpu.py; the router's gating (a CUDA move, then the same linear) is
replaced by the linear, as in tests/test_megatron_convert_moe.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_megatron_convert_moe import _megatron_report

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
    report[str(layers)] = {
        "err": err, "scale": scale, "stats": stats, "terms": max(t.abs().max().item() for t in terms),
        "lb_torch_pooled": load_balancing_loss(logits, 2, mask).item(), "lb_torch_mean": lb.item(),
        "z_torch": lz.item(),
        "coeff": model.config.moe_aux_loss_coeff, "z_coeff": model.config.moe_z_loss_coeff,
    }
print(json.dumps(report))
"""


def test_megatron_router_losses_equal_a_hand_written_reference(tmp_path: Path) -> None:
    """Gradients within 1e-6 (float32) of the reference, load-balancing and z-loss included; the recorded
    statistics equal the torch engine's functions within 1e-6 relative; per-layer coefficients c_lb·k/M and c_z/M."""
    report = _megatron_report(_SCRIPT, tmp_path)
    for layers, r in report.items():
        m = int(layers)
        assert r["err"] < 1e-6 and r["scale"] > 1e-3 and r["terms"] > 1e-3, report  # the terms do count
        assert r["coeff"] == pytest.approx(0.3 * 2 / m) and r["z_coeff"] == pytest.approx(0.05 / m)
        assert r["stats"]["router/load_balancing_loss"] == pytest.approx(r["lb_torch_mean"], rel=1e-6)
        assert r["stats"]["router/z_loss"] == pytest.approx(r["z_torch"], rel=1e-6)
    # one MoE layer: the torch engine's (pooled) load-balancing loss itself
    one = report["1"]
    assert one["stats"]["router/load_balancing_loss"] == pytest.approx(one["lb_torch_pooled"], rel=1e-6)
