"""The evaluation model of a megatron mixture-of-experts actor (issue 33; engines/megatron/hf_model.py): the
megatron actor's weights, HF-named as its `named_weights` gives them (a layer's experts one by one, as the
checkpoint files name them: the HF → megatron → HF conversion of a Qwen3-MoE), load into transformers' model,
whose experts are fused, and its logits equal those of the HF model they came from bitwise (float32, CPU).
The actor is built without DDP or an optimizer (those need CUDA), as tests/engines/test_actor_engine_choice.py does.
"""

from __future__ import annotations

import pytest
import torch
from test_megatron_convert_moe import micro_moe

from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore, mcore_to_hf
from mopd_hpc.engines.megatron.convert_moe import split_fused_experts
from mopd_hpc.engines.protocol import EngineError


@pytest.mark.parametrize("tie", [False, True])
def test_megatron_moe_evaluation_model_gives_the_hf_models_logits(tie: bool) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from mopd_hpc.engines.megatron import engine as megatron_engine
    from mopd_hpc.engines.megatron import hf_model as megatron_hf_model

    reference = micro_moe(tie=tie).eval()
    shape = Qwen3Shape.from_hf_config(reference.config, padded_vocab_size=128)
    weights = mcore_to_hf(hf_to_mcore(split_fused_experts(reference.state_dict()), shape), shape)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in weights  # per-expert, as the actor sends them
    actor = object.__new__(megatron_engine.MegatronTrainEngine)
    actor.hf_config, actor.device, actor.dtype = reference.config.to_dict(), torch.device("cpu"), "float32"
    actor.named_weights = lambda: iter(weights.items())
    model = actor.evaluation_model()
    ids = torch.tensor([[3, 17, 42, 99, 7, 64, 1, 118]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    # an expert left out: its layer's fused tensor is named missing
    partial = {k: v for k, v in weights.items() if k != "model.layers.2.mlp.experts.1.up_proj.weight"}
    with pytest.raises(
        EngineError, match=r"missing \['model.layers.2.mlp.experts.gate_up_proj'\], unexpected \[\]"
    ):
        megatron_hf_model.hf_model_from_weights(
            actor.hf_config, iter(partial.items()), torch.device("cpu"), torch.float32
        )
